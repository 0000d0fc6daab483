"""The learner's watchdog: :class:`Watchdog` stops a run that cannot train (:class:`RunStalled`).

It stops the run when no trajectory arrived for ``train.stall_timeout_s`` while the learner waited
(the message says which call of which worker is stuck, and for how long), when
``rollout.max_failed_episodes_in_a_row`` episodes in a row failed, at once when no episode of the
first batch gave anything to train on (the last one's reason names the cause), and at once when a
worker handed in a fatal episode (an agent's first episode cut short by the run's limits).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from flashreinforce.trainer.errors import RunStalled

__all__ = ["Watchdog"]


class Watchdog:
    """Decides when a run that is waiting for rollouts cannot train any more.

    Call :meth:`start_wait` when the learner starts waiting for a batch and :meth:`check` while it
    waits, with the buffer's and the workers' statistics. Raises :class:`RunStalled` when
    ``max_failed_in_a_row`` episodes in a row were quarantined or rejected (0: never), or when no
    trajectory arrived for ``stall_timeout_s`` seconds of waiting (0: never).
    """

    def __init__(self, stall_timeout_s: float, max_failed_in_a_row: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_timeout_s = float(stall_timeout_s or 0.0)
        self.max_failed_in_a_row = int(max_failed_in_a_row or 0)
        self.clock = clock
        self._since: float | None = None
        self._marker: Any = None

    def start_wait(self) -> None:
        self._since, self._marker = self.clock(), None

    def check(self, buffer_stats: Mapping[str, Any], worker_stats: Sequence[Mapping[str, Any]]) -> None:
        if buffer_stats.get("fatal_failure"):
            raise RunStalled(str(buffer_stats["fatal_failure"]))
        failed = int(buffer_stats.get("failed_in_a_row", 0))
        first = int(buffer_stats.get("batch_episodes", 0) or 0)
        if self.max_failed_in_a_row and first and not buffer_stats.get("put_trajectories") and \
                first <= failed and first < self.max_failed_in_a_row:
            last = buffer_stats.get("last_failure") or "unknown"
            raise RunStalled(f"none of the first {failed} episodes gave a token to train on (a batch is {first}; "
                             f"--rollout.max_failed_episodes_in_a_row 0 lets a run go on); the last one: {last}")
        if self.max_failed_in_a_row and failed >= self.max_failed_in_a_row:
            last = buffer_stats.get("last_failure") or "unknown"
            raise RunStalled(f"{failed} episodes in a row could not be trained on "
                             f"(--rollout.max_failed_episodes_in_a_row {self.max_failed_in_a_row}); the last one: "
                             f"{last}. {_counts(buffer_stats)}")
        now = self.clock()
        marker = buffer_stats.get("put_trajectories", 0)
        if self._since is None or marker != self._marker:
            self._since, self._marker = now, marker
            return
        waited = now - self._since
        if self.stall_timeout_s and waited > self.stall_timeout_s:
            raise RunStalled(f"nothing to train on for {waited:.0f} s (--train.stall_timeout_s "
                             f"{self.stall_timeout_s:g}): no trajectory arrived while the learner waited; "
                             f"{_stuck(worker_stats)}. {_counts(buffer_stats)}")


def _stuck(worker_stats: Sequence[Mapping[str, Any]]) -> str:
    busy = [f"worker {i} has been in {w['current_call']} for {float(w.get('current_call_s', 0.0)):.0f} s"
            for i, w in enumerate(worker_stats) if w.get("current_call")]
    return "; ".join(busy) if busy else "no worker is inside an environment or engine call"


def _counts(buffer_stats: Mapping[str, Any]) -> str:
    return (f"So far: {buffer_stats.get('quarantined_episodes', 0)} episodes quarantined, "
            f"{buffer_stats.get('rejected_trajectories', 0)} trajectories rejected, "
            f"{buffer_stats.get('skipped_prompts', 0)} prompts skipped, "
            f"{buffer_stats.get('in_flight', 0)} prompts in flight")
