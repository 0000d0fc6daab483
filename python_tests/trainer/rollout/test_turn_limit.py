"""One turn limit per run: rollout.max_turns, else $MAX_AGENT_TURNS, else the environment's own
default; the environment gets the same value as the rollout's cap."""

import pytest

from flashreinforce.config import ConfigError, resolve
from flashreinforce.envs.base import Environment, StepResult, resolve_max_turns
from flashreinforce.trainer.run import components

SPEC = f"{__name__}:TurnsEnv"


class TurnsEnv(Environment):
    default_max_turns = 7

    def __init__(self, max_turns: int | None = None) -> None:
        self.max_turns = resolve_max_turns(self.default_max_turns, max_turns)

    def reset(self, *, seed: int) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        return StepResult(done=True)


class NoTurnsEnv(TurnsEnv):
    def __init__(self) -> None:  # takes no max_turns: the environment ends its episodes itself
        super().__init__(None)


def _turns(monkeypatch, spec=SPEC, env_turns=None, **flags):
    cfg = resolve({"model": "tiny-qwen2", "tokenizer": "char", "env": spec, **flags,
                   **({"env.kwargs": {"max_turns": env_turns}} if env_turns is not None else {})})
    kwargs = dict(cfg.env_kwargs)
    env_cls = TurnsEnv if spec == SPEC else NoTurnsEnv
    turns = components.episode_turn_limit(cfg, env_cls, kwargs)
    return turns, kwargs.get("max_turns")


def test_the_environment_default_then_max_agent_turns_then_the_flag(monkeypatch):
    monkeypatch.delenv("MAX_AGENT_TURNS", raising=False)
    assert _turns(monkeypatch) == (7, 7)
    monkeypatch.setenv("MAX_AGENT_TURNS", "3")
    assert _turns(monkeypatch) == (3, 3)
    assert _turns(monkeypatch, **{"rollout.max_turns": 5}) == (5, 5)
    assert _turns(monkeypatch, env_turns=4) == (4, 4)  # --env.kwargs max_turns when the run sets none


def test_an_environment_without_max_turns_keeps_its_constructor(monkeypatch):
    monkeypatch.delenv("MAX_AGENT_TURNS", raising=False)
    assert _turns(monkeypatch, spec=f"{__name__}:NoTurnsEnv") == (7, None)


def test_a_bad_max_agent_turns_names_the_variable(monkeypatch):
    monkeypatch.setenv("MAX_AGENT_TURNS", "many")
    with pytest.raises(ConfigError, match="MAX_AGENT_TURNS must be a positive integer"):
        _turns(monkeypatch)
    with pytest.raises(ConfigError, match="rollout.max_turns must be positive"):
        resolve({"model": "tiny-qwen2", "env": SPEC, "rollout.max_turns": 0})


def test_the_trainer_records_the_resolved_limit(monkeypatch):
    monkeypatch.setenv("MAX_AGENT_TURNS", "2")
    cfg = resolve({"model": "tiny-qwen2", "tokenizer": "char", "env": SPEC, "train.max_steps": 1})
    policy = components.load_policy(cfg, components.device_of("cpu"))
    envs = components.load_environments(cfg, policy)
    settled = components.settled_config(cfg, policy, envs)
    assert settled.rollout.max_turns == envs.max_turns == 2 and envs.factory().max_turns == 2
    assert settled.flags["rollout.max_turns"] == 2 and cfg.rollout.max_turns is None  # derived, not edited
