"""Where a policy turn ends when its environment ends it (:meth:`flashreinforce.envs.Environment.turn_end`).

The rollout hands the engine :func:`turn_stop` (asked after each sampled token, so an engine that can
stops there) and cuts the sampled turn with :func:`turn_cut` (for an engine that could not), so both
kinds of engine give the same tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

from flashreinforce.envs.base import Environment
from flashreinforce.envs.tasks import DatasetEnvironment

__all__ = ["ends_turns", "turn_cut", "turn_stop"]


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
