"""One episode as a rollout worker plays it, and the checks on what an environment answers.

An :class:`Episode` grows token by token (``prompt | action | observation | action | ...``): each
token's id, whether the policy sampled it, the log-probability it was sampled with, and the weight
version that sampled it (-1 on tokens the policy did not sample). :meth:`Episode.trajectory` turns it
into the :class:`~flashreinforce.trainer.rollout.trajectory.Trajectory` the buffer takes.

Where a policy turn ends when its environment ends it (:meth:`flashreinforce.envs.Environment.turn_end`):
the worker hands the engine :func:`turn_stop` (asked after each sampled token, so an engine that can
stops there) and cuts the sampled turn with :func:`turn_cut` (for an engine that could not), so both
kinds of engine give the same tokens.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.tasks import DatasetEnvironment
from flashreinforce.trainer.rollout.buffer import Ticket
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["Episode", "EpisodeFault", "check_step_result", "ends_turns", "turn_cut", "turn_stop"]


class EpisodeFault(Exception):
    """An environment or engine answer of the wrong form (quarantines the episode; no traceback)."""

    def __init__(self, kind: str, reason: str, retry: bool = True) -> None:
        super().__init__(reason)
        self.kind, self.reason, self.retry = kind, reason, retry


def _shown(x: Any) -> str:
    """A short form of a value for a message (an int too long to print whole is not printed)."""
    if isinstance(x, int) and x.bit_length() > 256:
        return f"(an int of {x.bit_length()} bits)"
    try:
        text = repr(x)
    except Exception:  # an int past the interpreter's digit limit, a broken __repr__
        return f"(a {type(x).__name__})"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_bool(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_))


def check_step_result(result: Any, env_name: str) -> StepResult:
    """``result`` if it is a well-formed :class:`StepResult`; else :class:`EpisodeFault` naming what is wrong."""
    kind = "env.step returned a wrong type"
    if not isinstance(result, StepResult):
        raise EpisodeFault(kind, f"{env_name}.step returned {type(result).__name__}, expected StepResult")
    if not isinstance(result.observation, str):
        raise EpisodeFault(kind, f"{env_name}.step: StepResult.observation is {type(result.observation).__name__}, "
                                 "expected str")
    if not isinstance(result.reward, numbers.Real) or isinstance(result.reward, (bool, np.bool_)):
        raise EpisodeFault(kind, f"{env_name}.step: StepResult.reward is {type(result.reward).__name__}, "
                                 "expected a number")
    try:
        float(result.reward)
    except (OverflowError, ValueError, TypeError):  # an int or Fraction beyond any float (10**400)
        raise EpisodeFault("reward does not fit in a float", f"{env_name}.step: StepResult.reward "
                           f"{_shown(result.reward)} does not fit in a float") from None
    if not (_is_bool(result.done) or (isinstance(result.done, int) and result.done in (0, 1))):
        raise EpisodeFault(kind, f"{env_name}.step: StepResult.done is {type(result.done).__name__}, expected bool")
    if result.failed is not None and not _is_bool(result.failed):
        raise EpisodeFault(kind, f"{env_name}.step: StepResult.failed is {type(result.failed).__name__}, "
                                 "expected bool or None")
    if result.info is not None and not isinstance(result.info, Mapping):
        raise EpisodeFault(kind, f"{env_name}.step: StepResult.info is {type(result.info).__name__}, expected a dict")
    return result


class Episode:
    """An episode in progress: its ticket, environment slot, tokens so far and outcome."""

    def __init__(self, ticket: Ticket, sample_index: int, slot: int) -> None:
        self.ticket = ticket
        self.sample_index = sample_index
        self.slot = slot  # index of its environment instance in the worker's pool
        self.env: Environment | None = None
        self.tokens: list[int] = []
        self.mask: list[bool] = []
        self.logp: list[float] = []
        self.versions: list[int] = []  # the weight version that sampled each token (-1: not sampled)
        self.reward = 0.0
        self.turns = 0
        self.done = False
        self.truncated = False
        self.failed_label: bool | None = None
        self.info: dict[str, Any] = {}
        self.length_finishes = 0
        self.action_tokens = 0
        self.turn_ended = False  # the last turn was ended by the environment (turn_end), not a stop token
        self.quarantined: QuarantinedEpisode | None = None

    def start(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids)
        self.mask = [False] * len(prompt_ids)
        self.logp = [0.0] * len(prompt_ids)
        self.versions = [-1] * len(prompt_ids)

    def add_action(self, ids: Sequence[int], log_probs: Sequence[float], versions: Sequence[int]) -> None:
        """Append sampled tokens with their log-probabilities and versions."""
        self.tokens.extend(ids)
        self.mask.extend([True] * len(ids))
        self.logp.extend(log_probs)
        self.versions.extend(versions)
        self.action_tokens += len(ids)

    def add_context(self, ids: Sequence[int]) -> None:
        """Append tokens the policy did not sample (observations, a closing stop token)."""
        self.tokens.extend(ids)
        self.mask.extend([False] * len(ids))
        self.logp.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def finish(self, truncated: bool = False) -> None:
        self.done = True
        self.truncated = truncated

    def result(self, worker_id: int) -> Trajectory | QuarantinedEpisode:
        return self.quarantined if self.quarantined is not None else self.trajectory(worker_id)

    def trajectory(self, worker_id: int) -> Trajectory:
        failed = self.failed_label if self.failed_label is not None else self.reward <= 0
        info = dict(self.info)
        info.update(action_tokens=self.action_tokens, length_finishes=self.length_finishes)
        sampled = [v for v, m in zip(self.versions, self.mask) if m]
        return Trajectory(
            token_ids=self.tokens, action_mask=self.mask, behavior_log_probs=self.logp, reward=float(self.reward),
            failed=bool(failed), truncated=self.truncated, policy_version_min=min(sampled, default=-1),
            policy_version_max=max(sampled, default=-1), prompt_id=self.ticket.prompt_id, seed=self.ticket.seed,
            sample_index=self.sample_index, num_turns=self.turns, worker_id=worker_id, info=info,
            token_versions=list(self.versions))


# ------------------------------------------------------------------ where a turn ends
def ends_turns(env: Environment | None) -> bool:
    """Whether ``env`` (or the environment a dataset wrapper serves) ends turns itself."""
    inner = env
    while isinstance(inner, DatasetEnvironment):
        inner = inner.env
    return inner is not None and type(inner).turn_end is not Environment.turn_end


def turn_stop(env: Environment | None, tokenizer) -> Callable[[Sequence[int]], bool] | None:
    """The engine's stop predicate for a turn of ``env`` (``None`` when it does not end turns)."""
    if not ends_turns(env):
        return None
    decode, turn_end = tokenizer.decode, env.turn_end
    return lambda ids: turn_end(decode(ids)) is not None


def turn_cut(env: Environment | None, tokenizer, ids: Sequence[int]) -> int | None:
    """How many of the sampled ``ids`` the turn keeps when ``env`` ends it early (``None``: all, not
    ended). A binary search over prefixes: ``turn_end`` is monotone in the text."""
    if not ends_turns(env):
        return None
    decode, turn_end = tokenizer.decode, env.turn_end
    if turn_end(decode(ids)) is None:
        return None
    lo, hi = 1, len(ids)  # the shortest prefix that has an end lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if turn_end(decode(ids[:mid])) is not None:
            hi = mid
        else:
            lo = mid + 1
    return lo
