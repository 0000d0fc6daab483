"""How rollout workers roll out (:class:`RolloutSettings`) and the sampling seed of each turn
(:func:`episode_seed`): what every worker, local or on Ray, is built with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flashreinforce.engines.base import SamplingParams

__all__ = ["RolloutSettings", "episode_seed"]


def episode_seed(run_seed: int, prompt_id: int, sample_index: int, turn: int) -> int:
    """The sampling seed of one turn: a fixed function of the run seed, the prompt and the sample,
    so a rollout is reproducible whatever worker or batch it lands in."""
    x = (run_seed * 0x9E3779B1 + prompt_id) * 0x85EBCA77 + sample_index * 0xC2B2AE3D + turn * 0x27D4EB2F
    return x % (2**63 - 1)


@dataclass
class RolloutSettings:
    """How workers roll out.

    max_new_tokens: sampled tokens per turn at most. max_len: tokens per trajectory at most
    (prompt, actions and observations). max_turns: policy turns per episode at most.
    sampling: temperature / top-p / top-k and stop tokens. episodes_per_call: episodes a worker
    runs together (one ``generate`` call samples a turn of each). seed: run seed for sampling.
    env_timeout_s: seconds one environment call (``reset``, ``step``) may take before its episode is
    quarantined and the environment instance abandoned (0: no limit). env_parallel_calls: the calls
    of a worker's episodes that run at once, each in its own thread (1: one after another; an
    environment class with ``parallel_calls = False`` is always called one after another).
    inflight_weight_updates: when newer weights are published while a turn is being sampled, an
    engine that can pause (``RolloutEngine.can_pause``) stops the turn, the worker loads the weights
    and the engine continues the turn under them; every token keeps the version that sampled it.
    agent_sampling: how agents' model calls are sampled: ``run`` (``sampling`` for every call, a
    client's own temperature and top-p ignored) or ``agent`` (the client's values; its tokens are
    still actions, trained against the log-probabilities they were sampled with).
    episodes_in_flight: 0 runs episodes call by call (``episodes_per_call`` at a time, each call's to
    its end); N > 0 keeps up to N episodes in flight as a stream, new prompts starting as others end and
    turns sampled while other episodes' environment calls run
    (:mod:`~flashreinforce.trainer.rollout.stream`).
    stream_call_min_episodes, stream_call_gather_s: in a stream, a ``generate`` call for fewer than
    ``stream_call_min_episodes`` episodes while other episodes' environment calls run first waits up to
    ``stream_call_gather_s`` seconds for an answer and as long again for others to join it (0: a call
    starts as soon as one episode can act). It makes calls larger (on ``arith_tool`` with slow tools,
    24 episodes against 16), which did not make a 2-core run reliably faster (docs/performance.md); the
    episodes' tokens do not depend on it.
    """

    max_new_tokens: int
    max_len: int
    max_turns: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    episodes_per_call: int = 1
    seed: int = 0
    env_timeout_s: float = 30.0
    env_parallel_calls: int = 32
    inflight_weight_updates: bool = False
    agent_sampling: str = "run"
    episodes_in_flight: int = 0
    stream_call_min_episodes: int = 0
    stream_call_gather_s: float = 0.3

    def __post_init__(self) -> None:
        if self.agent_sampling not in ("run", "agent"):
            raise ValueError(f"RolloutSettings.agent_sampling must be 'run' or 'agent', got {self.agent_sampling!r}")
        if self.episodes_in_flight < 0:
            raise ValueError(f"RolloutSettings.episodes_in_flight must be >= 0, got {self.episodes_in_flight}")
        if self.stream_call_min_episodes < 0:
            raise ValueError(f"RolloutSettings.stream_call_min_episodes must be >= 0, got {self.stream_call_min_episodes}")
        if not (math.isfinite(self.stream_call_gather_s) and self.stream_call_gather_s >= 0):
            raise ValueError("RolloutSettings.stream_call_gather_s must be a finite number >= 0, got "
                             f"{self.stream_call_gather_s}")
        for name in ("max_new_tokens", "max_len", "max_turns", "episodes_per_call", "env_parallel_calls"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RolloutSettings.{name} must be positive, got {getattr(self, name)}")
        if not (math.isfinite(self.env_timeout_s) and self.env_timeout_s >= 0):
            raise ValueError(f"RolloutSettings.env_timeout_s must be a finite number >= 0, got {self.env_timeout_s}")
