"""The worker registry: an environment class names the kind of rollout worker that plays it, the trainer
finds the class by that name (importing a shipped kind's module on first use), and a kind nobody
registered is an error naming it."""

import subprocess
import sys

import pytest

from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.registry import EnvSpec, register_environment
from flashreinforce.trainer.rollout.worker import RolloutWorker
from flashreinforce.trainer.rollout.worker_kinds import (SHIPPED_WORKERS, WORKER_REGISTRY, is_agent_spec,
                                                         register_rollout_worker, worker_class, worker_kind)


class _Plain(Environment):
    def reset(self, *, seed):
        return "q"

    def step(self, action):
        return StepResult("", 0.0, True)


def _factory(spec):
    class Factory:
        env_spec = EnvSpec(spec, {}, {})
    return Factory


def test_a_plain_environment_gets_the_plain_worker_and_the_agent_one_the_agent_worker():
    assert worker_kind("python_tool") is None and worker_class(_factory("python_tool")) is RolloutWorker
    assert worker_class(_factory(None)) is RolloutWorker and not is_agent_spec(None)
    assert worker_kind("no_such_env_xyz") is None  # the run reports a bad spec where it builds environments
    from flashreinforce.agents.worker import AgentRolloutWorker

    assert is_agent_spec("agent") and worker_class(_factory("agent")) is AgentRolloutWorker
    assert WORKER_REGISTRY["agent"] is AgentRolloutWorker and SHIPPED_WORKERS["agent"] == AgentRolloutWorker.__module__


def test_the_agent_worker_is_imported_only_when_an_environment_names_it():
    code = ("import sys\n"
            "from flashreinforce.trainer.rollout.worker_kinds import worker_class, is_agent_spec\n"
            "class F: pass\n"
            "assert not is_agent_spec('python_tool') and is_agent_spec('agent')\n"
            "print('flashreinforce.agents.worker' in sys.modules)\n"
            "from flashreinforce.envs.registry import EnvSpec\n"
            "F.env_spec = EnvSpec('agent', {}, {})\n"
            "print(worker_class(F).__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "flashreinforce.agents.worker"]


def test_a_registered_kind_is_found_and_an_unregistered_one_is_named():
    @register_environment("test_worker_kinds_custom")
    class Custom(_Plain):
        rollout_worker = "test_custom_kind"

    @register_environment("test_worker_kinds_unknown")
    class Unknown(_Plain):
        rollout_worker = "test_unknown_kind"

    @register_rollout_worker("test_custom_kind")
    class CustomWorker(RolloutWorker):
        pass

    try:
        assert worker_class(_factory("test_worker_kinds_custom")) is CustomWorker
        with pytest.raises(ValueError, match="test_unknown_kind.*not registered"):
            worker_class(_factory("test_worker_kinds_unknown"))
        with pytest.raises(TypeError, match="not a RolloutWorker subclass"):
            register_rollout_worker("bad")(Custom)
    finally:
        WORKER_REGISTRY.pop("test_custom_kind", None)
        from flashreinforce.envs.registry import ENV_REGISTRY

        ENV_REGISTRY.pop("test_worker_kinds_custom", None)
        ENV_REGISTRY.pop("test_worker_kinds_unknown", None)
