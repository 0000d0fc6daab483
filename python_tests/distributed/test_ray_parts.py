"""The Ray backend's small parts: imports without Ray, the actor-call mechanism and its errors,
placement options, the address check and the exit reporter."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.distributed.ray.calls import ActorClient, delegate
from flashreinforce.distributed.ray.placement import WorkerPlacement, describe_nodes, parse_worker_resources
from flashreinforce.distributed.ray.pool import root_cause
from flashreinforce.distributed.ray.session import _check_reachable

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_importing_the_backend_does_not_import_ray():
    code = ("import json, sys, flashreinforce.distributed, flashreinforce.distributed.ray, "
            "flashreinforce.distributed.ray.session\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m == "ray" or m.startswith("ray.")] == []


# ---------------------------------------------------------------------------- delegate / ActorClient
class Inner:
    def __init__(self) -> None:
        self.calls = []
        self.flag = True

    def add(self, a, b=0):
        self.calls.append((a, b))
        return a + b

    @property
    def closed(self) -> bool:
        return self.flag


@delegate("inner", ("add", "closed", "mine"))
class Outer:
    def __init__(self) -> None:
        self.inner = Inner()

    def mine(self) -> str:  # defined here: delegate leaves it alone
        return "outer"


def test_delegate_forwards_methods_and_properties_but_keeps_the_class_own():
    o = Outer()
    assert o.add(2, b=3) == 5 and o.inner.calls == [(2, 3)]
    assert o.closed() is True  # a property of the member becomes a call on the actor
    o.inner.flag = False
    assert o.closed() is False
    assert o.mine() == "outer"
    with pytest.raises(TypeError, match="closed is an attribute of .inner"):
        o.closed(1)
    assert Outer.add.__name__ == "add" and "forwarded" in Outer.add.__doc__


class Client(ActorClient):
    remote_methods = frozenset(("sleep", "pid"))
    actor_name = "test actor"


def test_actor_client_refuses_names_the_actor_does_not_answer():
    c = Client(handle=None)
    with pytest.raises(AttributeError, match="the test actor answers pid, sleep"):
        c.take
    with pytest.raises(AttributeError):
        c._private  # never forwarded (pickle and copy probe these)
    with pytest.raises(AttributeError, match="does not answer 'take'"):
        c.submit("take")


# ---------------------------------------------------------------------------- placement
def test_worker_resources_from_flags():
    assert parse_worker_resources(None) == ()
    assert parse_worker_resources('{"node_a": 1}') == ({"node_a": 1.0},)
    assert parse_worker_resources([{"node_a": 1}, {"node_b": 0.5}]) == ({"node_a": 1.0}, {"node_b": 0.5})
    for bad, needle in [('{"CPU": 1}', "--ray.num_cpus_per_worker"), ('{"x": 0}', "positive amount"),
                        ('{"x": true}', "positive amount"), ("[1, 2]", "JSON object"), ("[]", "JSON object"),
                        ("{node_a: 1}", "not JSON")]:
        with pytest.raises(ValueError, match="--ray.worker_resources") as info:
            parse_worker_resources(bad)
        assert needle in str(info.value), (bad, str(info.value))


def test_the_flag_is_checked_with_the_configuration_without_importing_the_backend():
    code = ("import json, sys\n"
            "from flashreinforce.config import ConfigError, parse_train_args\n"
            "from flashreinforce.config.presets import PRESETS\n"
            "base = ['--preset', 'toy', '--output', 'x', '--rollout.backend', 'ray']\n"
            "cfg = parse_train_args(base + ['--ray.worker_resources', '[{\"node_a\": 1}, {\"node_b\": 2}]'], PRESETS)\n"
            "assert cfg.flags['ray.worker_resources'] == [{'node_a': 1}, {'node_b': 2}]\n"
            "try:\n"
            "    parse_train_args(base + ['--ray.worker_resources', '{\"GPU\": 1}'], PRESETS)\n"
            "except ConfigError as err:\n"
            "    print(json.dumps({'error': str(err), 'modules': sorted(sys.modules)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "--ray.worker_resources: give GPU with --ray.num_gpus_per_worker" in got["error"]
    assert [m for m in got["modules"] if m.startswith(("flashreinforce.distributed", "torch"))] == []


def test_placement_options_per_worker():
    p = WorkerPlacement(num_cpus=2, num_gpus=0.5, resources=[{"node_a": 1}, {"node_b": 1}], strategy="spread")
    assert p.options(0) == {"num_cpus": 2, "num_gpus": 0.5, "resources": {"node_a": 1.0}, "scheduling_strategy": "SPREAD"}
    assert p.options(1)["resources"] == {"node_b": 1.0} and p.options(2)["resources"] == {"node_a": 1.0}
    assert p.needs(1) == {"CPU": 2.0, "GPU": 0.5, "node_b": 1.0}
    assert p.describe(0) == "CPU 2, GPU 0.5, node_a 1 (SPREAD)"
    plain = WorkerPlacement()
    assert plain.options(0) == {"num_cpus": 1.0, "num_gpus": 0.0}
    with pytest.raises(ValueError, match="--ray.scheduling_strategy"):
        WorkerPlacement(strategy="pack")


def test_a_worker_is_unplaceable_only_when_no_live_node_has_it_all():
    nodes = [{"NodeID": "a" * 16, "NodeManagerAddress": "10.0.0.1", "Alive": True,
              "Resources": {"CPU": 4.0, "node_a": 1.0, "node:10.0.0.1": 1.0}},
             {"NodeID": "b" * 16, "NodeManagerAddress": "10.0.0.2", "Alive": False,  # dead: does not count
              "Resources": {"CPU": 4.0, "GPU": 1.0}}]
    assert not WorkerPlacement(num_cpus=4, resources={"node_a": 1}).unplaceable(0, nodes)
    assert WorkerPlacement(num_cpus=5).unplaceable(0, nodes)  # more CPUs than any node has in total
    assert WorkerPlacement(num_gpus=1).unplaceable(0, nodes)  # only the dead node had a GPU
    assert WorkerPlacement(resources=[{"node_a": 1}, {"node_b": 1}]).unplaceable(1, nodes)
    text = describe_nodes(nodes)
    assert text == "node aaaaaaaa at 10.0.0.1: CPU 4, node_a 1"  # live nodes only, no node: markers


def test_root_cause_is_the_innermost_error_line():
    text = ("The actor died because of an error raised in its creation task, ray::W.__init__() (pid=1)\n"
            "  File \"x.py\", line 3, in f\nModuleNotFoundError: No module named 'm'\n\n"
            "The above exception was the direct cause of the following exception:\n"
            "RuntimeError: rollout worker 0 on Ray node n cannot load --env 'm:E': ...\n")
    assert root_cause(RuntimeError(text)).startswith("RuntimeError: rollout worker 0 on Ray node n")
    assert root_cause(ValueError("")) == "ValueError"


# ---------------------------------------------------------------------------- the session
def test_an_address_where_nothing_listens_is_refused_quickly():
    port = free_port()
    with pytest.raises(ConnectionError, match=f"--ray.address 127.0.0.1:{port}: no Ray cluster answers"):
        _check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="expected auto, HOST:PORT"):
        _check_reachable("no-port-here")
    _check_reachable("ray://10.255.255.1:10001")  # Ray Client addresses are left to Ray


REPORTER = """
import os, sys
from flashreinforce.distributed.ray.session import _ExitReporter
r = _ExitReporter.start("HOST:1234")
if sys.argv[1] == "clean":
    r.closed()
    sys.exit(0)
os._exit(1)  # as Ray's core library ends a driver whose node went away
"""


@pytest.mark.parametrize("how", ["clean", "abrupt"])
def test_exit_reporter_speaks_only_when_the_trainer_vanishes(how):
    out = subprocess.run([sys.executable, "-c", REPORTER, how], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    # run() returns once the pipe's last writer (the reporter helper) exits: no sleep needed.
    said = "ended without closing its Ray connection to HOST:1234" in out.stderr
    assert said == (how == "abrupt"), out.stderr
    if said:
        assert "--resume" in out.stderr


# ---------------------------------------------------------------------------- the workers' engine model
BUILD_FROM_CONFIG = """
import pickle, sys
import transformers
config = pickle.loads(sys.stdin.buffer.read())
print(transformers.AutoModelForCausalLM.from_config(config).config._attn_implementation)
"""


def test_a_worker_builds_its_engine_model_without_the_learners_attention():
    # The learner switches its model to per-document attention, registered in its own process only; a
    # Ray worker process builds its engine copy from that model's config.
    import pickle

    import torch

    from flashreinforce.distributed.ray.workers import engine_model_config
    from flashreinforce.models.attention import use_document_attention
    from flashreinforce.models.loading import build_model

    model, _ = build_model("tiny-qwen2", device=torch.device("cpu"), seed=0)
    use_document_attention(model)
    assert model.config._attn_implementation == "per_document"
    config = engine_model_config(model.config)
    assert model.config._attn_implementation == "per_document"  # the learner's own model is left alone
    for cfg, want in ((config, "sdpa"), (model.config, "not supported")):
        out = subprocess.run([sys.executable, "-c", BUILD_FROM_CONFIG], input=pickle.dumps(cfg), capture_output=True,
                             timeout=120, cwd=ROOT)
        text = (out.stdout + out.stderr).decode()
        assert want in text, text[-2000:]
