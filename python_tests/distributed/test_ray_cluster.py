"""The Ray backend at cluster shape, on one machine: a head node and worker nodes as separate raylets
(``ray.cluster_utils.Cluster``: each node its own raylet, object store and resources, e.g. ``node_a``
and ``node_b``), the learner on the head. Rollout workers placed on the other nodes by custom
resources or Ray's SPREAD strategy; each weight version pulled across nodes through the object store;
the toy preset learning; a node lost mid-run and a node joining later; and the errors a user meets
when no node can hold a worker or a node lacks the ``--env`` module."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray backend tests need ray (pip install 'flashreinforce[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402

from flashreinforce.config import parse_train_args  # noqa: E402
from flashreinforce.config.presets import PRESETS  # noqa: E402
from flashreinforce.distributed.ray import RayRollout, RemoteBuffer, WorkerRecipe  # noqa: E402
from flashreinforce.engines import SamplingParams  # noqa: E402
from flashreinforce.envs.registry import EnvSpec  # noqa: E402
from flashreinforce.models.loading import build_model  # noqa: E402
from flashreinforce.models.tokenizers import load_tokenizer  # noqa: E402
from flashreinforce.distributed.scale_out import DistributedScaleOut  # noqa: E402
from flashreinforce.trainer import Trainer  # noqa: E402
from flashreinforce.trainer.persistence.checkpoints import latest_checkpoint  # noqa: E402
from flashreinforce.trainer.rollout.settings import RolloutSettings  # noqa: E402
from python_tests.distributed.worker_freeze import frozen_holding  # noqa: E402

TOY = "flashreinforce.envs.toy:ToyCopyEnv"

# A node is declared dead after a few missed health checks: about 30 s with Ray's defaults, about 2 s
# here (a test setting; the defaults suit real networks).
FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_timeout_ms": 1000,
                      "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}


@dataclass
class Nodes:
    cluster: Cluster
    head: object
    a: object
    b: object


@pytest.fixture(scope="module")
def nodes():
    """A head without CPUs (the learner's node: it runs the driver, the buffer actor and the weight
    registry) and two worker nodes with 2 CPUs each and the custom resources ``node_a`` / ``node_b``."""
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    saved = {k: os.environ.get(k) for k in ("RAY_USAGE_STATS_ENABLED", "OMP_NUM_THREADS")}
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")  # inherited by the nodes' processes
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False,
                                                                _system_config=FAST_HEALTH_CHECKS))
    try:
        a = cluster.add_node(num_cpus=2, resources={"node_a": 2})
        b = cluster.add_node(num_cpus=2, resources={"node_b": 2})
        ray.init(address=cluster.address, log_to_driver=False)
        yield Nodes(cluster, cluster.head_node, a, b)
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_rollout(env_spec: EnvSpec, *, batch_groups: int = 8, async_queue_size: int = 0, per_call: int = 4):
    model, _ = build_model("tiny-qwen2", device=torch.device("cpu"), seed=0)
    tok = load_tokenizer("char")
    settings = RolloutSettings(max_new_tokens=1, max_len=24, max_turns=1,
                               sampling=SamplingParams(1.0, 1.0, 0, tok.eos_token_ids), episodes_per_call=per_call,
                               seed=0)
    rollout = RayRollout.create(address=None, buffer_kwargs=dict(batch_groups=batch_groups, group_size=1,
                                                                 async_queue_size=async_queue_size,
                                                                 vocab_size=tok.vocab_size),
                                prompt_kwargs=dict(num_prompts=None, seed=0))
    recipe = WorkerRecipe(model_config=model.config, engine="hf", tokenizer=tok, env=env_spec, settings=settings,
                          torch_threads=1)
    return model, rollout, recipe


def version_weights(base, version):
    """Distinct weights per version: the base model moved by a seeded random step."""
    g = torch.Generator().manual_seed(1000 + version)
    return {k: v + 0.3 * version * torch.randn(v.shape, generator=g) for k, v in base.state_dict().items()}


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (waited {timeout:.0f} s)")
        time.sleep(0.05)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def train_args(out, *extra: str) -> list[str]:
    return ["--preset", "toy", "--rollout.backend", "ray", "--output", str(out), "--eval.eval_at_start", "false",
            "--eval.steps", "0", "--ckpt.save_steps", "0", "--no_progress", *extra]


# ---------------------------------------------------------------------------- placement and weights
@pytest.mark.slow
def test_workers_on_other_nodes_pull_each_weight_version_through_the_object_store(nodes):
    base, rollout, recipe = make_rollout(EnvSpec(TOY, {}, {"alphabet": "abcdefgh"}))
    here = ray.get_runtime_context().get_node_id()
    # Versions until each worker has sampled with at least two of them. A batch need not hold both
    # workers' trajectories: a worker whose node answers first may fill one alone (toy episodes take
    # milliseconds), so the test asks it of the run, not of each batch; max_versions bounds the wait.
    max_versions = 8
    states = {v: version_weights(base, v) for v in range(max_versions)}
    backend = rollout.backend(recipe, 2, num_cpus=1, num_gpus=0, max_restarts=0,
                              resources=[{"node_a": 1}, {"node_b": 1}])
    got: list[list] = []
    versions_of = {0: set(), 1: set()}
    try:
        # The run's state stays on the learner's node, whatever node has free resources.
        assert here == nodes.head.node_id
        assert rollout.buffer.node() == here and ray.get(rollout.registry_actor.node.remote()) == here
        rollout.weights.publish(states[0], 0)
        backend.start()
        assert [w["node"] for w in backend.locations] == [nodes.a.node_id, nodes.b.node_id]
        for version in range(max_versions):
            batch = rollout.buffer.take(version, timeout=120)
            assert batch is not None, f"no batch from the workers on nodes a and b at version {version}"
            assert {t.worker_id for t in batch.trajectories} <= {0, 1}
            assert {t.policy_version_min for t in batch.trajectories} == {version}
            # Each worker node pulled this version into its own object store: the owner (this
            # process) lists a copy on nodes a and b besides its own. Locations are reported
            # asynchronously, hence the wait.
            wait_until(lambda: {here, nodes.a.node_id, nodes.b.node_id} <= set(rollout.weights.locations()), 30,
                       f"version {version} never showed up in the object stores of nodes a and b")
            got.append(batch.trajectories)
            for t in batch.trajectories:
                versions_of[t.worker_id].add(version)
            if min(len(v) for v in versions_of.values()) >= 2:
                break
            rollout.weights.publish(states[version + 1], version + 1)
            rollout.buffer.update_done()
    finally:
        backend.stop()
        rollout.close()
    assert all(len(v) >= 2 for v in versions_of.values()), \
        f"versions each worker sampled with, in {len(got)} batches: {versions_of}"
    # And the workers sampled with those weights: each recorded behavior log-prob equals a float64
    # recomputation with its version's weights, on either node.
    model64 = copy.deepcopy(base).double()
    for version, trajs in enumerate(got):
        model64.load_state_dict({n: x.double() for n, x in states[version].items()})
        for t in trajs:
            k = t.action_mask.index(True)
            with torch.no_grad():
                logits = model64(input_ids=torch.tensor([t.token_ids[:k]])).logits[0, -1]
            want = float(torch.log_softmax(logits, -1)[t.token_ids[k]])
            assert t.behavior_log_probs[k] == pytest.approx(want, abs=2e-5), (version, t.worker_id, t.prompt_id)


@pytest.mark.slow
def test_toy_preset_learns_with_workers_spread_over_two_nodes(nodes, tmp_path):
    out = tmp_path / "spread"
    cfg = parse_train_args(train_args(out, "--ray.address", nodes.cluster.address, "--ray.scheduling_strategy",
                                      "spread", "--train.max_steps", "150", "--rollout.vllm_generate_batch_size",
                                      "64"), PRESETS)
    trainer = Trainer(cfg, scale_out=DistributedScaleOut())
    seen: dict = {"workers": [], "weights": set()}
    done = threading.Event()

    def watch() -> None:  # where the workers run, and which nodes hold a copy of the newest weights
        while not done.is_set():
            pool = trainer.pool
            if pool is not None and getattr(pool, "locations", None):
                seen["workers"] = [w["node"] for w in pool.locations]
                try:
                    seen["weights"] |= set(trainer.weights.locations())
                except Exception:  # a version replaced (and freed) while being looked up
                    pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary = trainer.run()
    finally:
        done.set()
        watcher.join(10)
    assert summary["status"] == "completed" and summary["step"] == 150
    # Two CPUs per node: Ray's default could put both workers on one node; SPREAD puts one on each.
    assert sorted(seen["workers"]) == sorted([nodes.a.node_id, nodes.b.node_id])
    assert {nodes.a.node_id, nodes.b.node_id} <= seen["weights"]
    m = metrics(out)
    rewards = [x["reward_mean"] for x in m]
    # The thresholds of the one-node test: chance at first, then the skill.
    assert mean(rewards[:10]) < 0.1
    assert mean(rewards[-10:]) > 0.7, rewards[-10:]
    assert m[-1]["lost_trajectories"] == 0 and m[-1]["worker_restarts"] == 0
    assert summary["buffer"]["taken_trajectories"] == 150 * 128 and summary["buffer"]["late_calls"] == 0


# ---------------------------------------------------------------------------- a node lost, a node joining
@pytest.mark.slow
def test_a_lost_node_costs_only_its_prompts_and_a_new_node_gets_the_worker_back(nodes, tmp_path, monkeypatch,
                                                                                 caplog):
    caplog.set_level(logging.INFO, logger="flashreinforce.distributed.ray")
    node_c = nodes.cluster.add_node(num_cpus=1, resources={"node_c": 1})
    taken: list[list[tuple[int, int]]] = []  # per trained batch: (prompt id, worker id) of each trajectory
    real_take = RemoteBuffer.take

    def take(self, learner_version, timeout=None):
        batch = real_take(self, learner_version, timeout)
        if batch is not None:
            taken.append([(t.prompt_id, t.worker_id) for t in batch.trajectories])
        return batch

    monkeypatch.setattr(RemoteBuffer, "take", take)
    out = tmp_path / "lost"
    cfg = parse_train_args(train_args(out, "--ray.worker_resources", json.dumps([{"node_a": 1}, {"node_c": 1}]),
                                      "--train.max_steps", "100000", "--rollout.vllm_generate_batch_size", "32"),
                           PRESETS)
    trainer = Trainer(cfg, scale_out=DistributedScaleOut())
    story: dict = {}
    result: dict = {}

    def train() -> None:
        try:
            result["summary"] = trainer.run()
        except BaseException as err:  # reported by the assertions below
            result["error"] = err

    # The trainer runs in a thread: Ray adds nodes only from the main thread (signal handlers).
    runner = threading.Thread(target=train, daemon=True)
    runner.start()
    try:
        wait_until(lambda: trainer.pool is not None and trainer.step >= 5 or not runner.is_alive(), 300,
                   "training did not start")
        assert runner.is_alive(), result
        pool = trainer.pool
        pool.revive_report_after_s = 1.0  # the "still waiting" line after 1 s instead of 10
        assert pool.locations[1]["node"] == node_c.node_id
        deadline = time.monotonic() + 120
        while True:  # freeze worker 1 while it holds prompts: what it holds cannot change any more
            assert time.monotonic() < deadline, "worker 1 never held a prompt"
            pid = pool.worker_pid(1)
            held = frozen_holding(pid, lambda: pool.buffer.held_prompts(1))
            if held:
                break
            time.sleep(0.01)
        story.update(held=held, lost_at=trainer.step)
        t_lost = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # node c goes down: the worker process...
        nodes.cluster.remove_node(node_c, allow_graceful=False)  # ...its raylet and its object store
        wait_until(lambda: pool.restarts[1] == 1, 300, "the lost worker was never noticed")
        story["noticed_after_s"] = time.monotonic() - t_lost
        noticed = trainer.step
        wait_until(lambda: trainer.step >= noticed + 5, 300, "training stopped with node c gone")
        story["running_while_down"] = pool.running()
        wait_until(lambda: any("has waited" in r.getMessage() for r in caplog.records), 60,
                   "no log line about the worker waiting for a node")
        t_added = time.monotonic()
        story["new_node"] = nodes.cluster.add_node(num_cpus=1, resources={"node_c": 1})
        wait_until(lambda: pool.running() == 2, 300, "the worker did not come back on the new node")
        story["back_after_s"] = time.monotonic() - t_added
        story["back_on"] = pool.locations[1]["node"]
        n = len(taken)
        wait_until(lambda: any(w == 1 for batch in taken[n:] for _, w in batch), 300,
                   "the worker on the new node sent nothing")
    finally:
        trainer._interrupted.set()  # stop as a first Ctrl-C does: finish the update, save, return
        runner.join(120)
    print(f"node c lost at update {story['lost_at']}: noticed after {story.get('noticed_after_s', -1):.1f} s, "
          f"worker back {story.get('back_after_s', -1):.1f} s after a new node joined")
    assert not runner.is_alive() and "error" not in result, result
    summary = result["summary"]
    held = story["held"]
    assert summary["status"] == "interrupted"
    m = metrics(out)
    assert [x["step"] for x in m] == list(range(1, summary["step"] + 1))  # no update missed
    assert len(taken) == summary["step"]
    assert story["running_while_down"] == 1  # the run went on with node a's worker alone
    assert story["back_on"] == story["new_node"].node_id
    # The prompts the lost worker held, and only those, were lost, counted and handed out again.
    assert m[-1]["worker_restarts"] == 1
    assert m[-1]["lost_trajectories"] == len(held) == summary["buffer"]["lost_groups"]
    ids = [p for batch in taken for p, _ in batch]
    assert len(ids) == len(set(ids)), "a prompt was trained on twice"
    assert all(ids.count(p) == 1 for p in held)
    # Nothing silently dropped: every prompt handed out was trained on, or is in the final
    # checkpoint's list of prompts to hand out again (those in flight when the run stopped).
    prompts = json.loads((latest_checkpoint(out / "checkpoints") / "state.json").read_text())["buffer"]["prompts"]
    pending = {p for p, _ in prompts["requeued"]}
    assert not pending & set(ids)
    assert pending | set(ids) == set(range(prompts["next_id"]))
    # What the user read: the death with its node and lost prompts, the wait, the return.
    lines = [r.getMessage() for r in caplog.records]
    short = node_c.node_id[:8]
    assert any(f"rollout worker 1 on node {short}" in x and f"{len(held)} prompt(s) it held are handed out again"
               in x for x in lines), lines
    assert any("rollout worker 1 has waited" in x and "no live node has what it reserves" in x
               and "goes on with 1 of 2 workers" in x for x in lines), lines
    assert any(f"rollout worker 1 is back on node {story['new_node'].node_id[:8]}" in x for x in lines), lines


# ---------------------------------------------------------------------------- failures a user meets
@pytest.mark.slow
def test_a_worker_no_node_can_hold_is_refused_at_start(nodes):
    _, rollout, recipe = make_rollout(EnvSpec(TOY, {}, {}))
    cases = [(dict(resources={"node_x": 1}), "node_x 1"),  # a custom resource no node was started with
             (dict(num_gpus=1), "GPU 1")]  # a CPU-only cluster
    try:
        for kwargs, needs in cases:
            backend = rollout.backend(recipe, 2, num_cpus=1, num_gpus=kwargs.get("num_gpus", 0), max_restarts=0,
                                      resources=kwargs.get("resources"))
            with pytest.raises(RuntimeError, match="no node of the Ray cluster can hold rollout worker 0") as info:
                backend.start()
            msg = str(info.value)
            assert f"reserves CPU 1, {needs}" in msg
            assert "--ray.worker_resources" in msg and "--ray.num_gpus_per_worker" in msg
            # ... and lists what each live node has, so the user sees what is missing.
            assert f"node {nodes.a.node_id[:8]}" in msg and "node_a 2" in msg and "node_b 2" in msg
            assert backend.actors == []  # refused before creating anything that would wait for a node forever
    finally:
        rollout.close()


@pytest.mark.slow
def test_a_node_without_the_env_module_is_a_clear_error(nodes, tmp_path, monkeypatch):
    (tmp_path / "frx_only_here_env.py").write_text("from flashreinforce.envs.toy import ToyCopyEnv as OnlyHereEnv\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # this process (the learner) can import it; node a cannot
    spec = EnvSpec("frx_only_here_env:OnlyHereEnv", {}, {})
    spec.factory(load_tokenizer("char"))()  # builds here
    _, rollout, recipe = make_rollout(spec)
    try:
        backend = rollout.backend(recipe, 1, num_cpus=1, num_gpus=0, max_restarts=2, resources={"node_a": 1})
        with pytest.raises(RuntimeError, match="Ray rollout worker 0 could not be built") as info:
            backend.start()
    finally:
        rollout.close()
    msg = str(info.value)
    assert f"on Ray node {nodes.a.node_id}" in msg
    assert "cannot load --env 'frx_only_here_env:OnlyHereEnv'" in msg and "No module named 'frx_only_here_env'" in msg
    assert "importable on every node" in msg
