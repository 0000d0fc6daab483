"""Where rollout workers run: the :class:`RolloutBackend` interface every backend implements, and
how a backend's workers share the prompts in flight (:func:`fair_share`).

A :class:`RolloutBackend` starts, stops and watches a set of rollout workers running concurrently with
the learner: the ``local`` backend's threads (:mod:`.thread_pool`), or Ray actors
(:mod:`flashreinforce.distributed.ray`).
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, Sequence

from flashreinforce.trainer.errors import RolloutFailed

__all__ = ["RolloutBackend", "engine_failure", "fair_share"]


def engine_failure(worker_stats: Sequence[Mapping[str, Any]]) -> RolloutFailed | None:
    """The run's end when a worker's engine can no longer serve (its process died: the ``engine_failure``
    of the workers' statistics), as one line; ``None`` while every engine can."""
    for i, stats in enumerate(worker_stats):
        reason = stats.get("engine_failure")
        if reason:
            return RolloutFailed(f"the rollout engine of worker {i} failed: {reason}; the run cannot go on "
                                 "(a checkpoint is saved: --resume continues from it)")
    return None


def fair_share(batch_groups: int, async_queue_size: int, num_workers: int) -> int:
    """Prompts one worker may take in one call so that ``num_workers`` workers can all have work:
    the prompts that may be in flight at once (``batch_groups * (1 + async_queue_size)``) divided
    among the workers, rounded up (at least 1)."""
    if num_workers <= 0:
        raise ValueError(f"num_workers must be positive, got {num_workers}")
    return max(1, -(-batch_groups * (1 + async_queue_size) // num_workers))


class RolloutBackend(abc.ABC):
    """A set of rollout workers running concurrently with the learner."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self, timeout: float = 30.0) -> None: ...

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``RuntimeError`` if no worker is alive any more (with the last worker error), or
        :class:`RolloutFailed` once a worker's engine has failed (:func:`engine_failure`)."""

    @abc.abstractmethod
    def stats(self) -> list[dict[str, float]]: ...
