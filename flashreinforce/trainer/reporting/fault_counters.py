"""The fault counters of each ``metrics.jsonl`` record.

:func:`fault_metrics` gives the cumulative counters (quarantined episodes, skipped and retried
prompts, environment-call timeouts), :func:`env_timeouts_by_call` the timeouts by call kind
(:data:`ENV_CALL_KINDS`), and :class:`FaultMetrics` puts them in each record, with the environment
calls that timed out during the update by call kind, and a warning (one line, at most one a minute)
while timeouts repeat.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

__all__ = ["ENV_CALL_KINDS", "FaultMetrics", "env_timeouts_by_call", "fault_metrics"]


def fault_metrics(buffer_stats: Mapping[str, Any], worker_stats: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Cumulative fault counters of a run for its ``metrics.jsonl`` records."""
    return {"quarantined_episodes": int(buffer_stats.get("quarantined_episodes", 0)),
            "skipped_prompts": int(buffer_stats.get("skipped_prompts", 0)),
            "retried_prompts": int(buffer_stats.get("retried_prompts", 0)),
            "env_timeouts": sum(int(w.get("env_timeouts", 0)) for w in worker_stats)}


#: The environment calls that run under ``rollout.env_timeout_s``; each is a key of
#: ``env_timeouts_by_call`` in every record, 0 when none timed out.
ENV_CALL_KINDS = ("env.reset", "env.step")


def env_timeouts_by_call(worker_stats: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Environment-call timeouts so far by call kind, summed over the workers (their
    ``env_timeouts_by_call``; a worker that reports only its total counts it under ``unknown``)."""
    out = {kind: 0 for kind in ENV_CALL_KINDS}
    for w in worker_stats:
        by_call = w.get("env_timeouts_by_call")
        if isinstance(by_call, Mapping):
            for kind, n in by_call.items():
                out[str(kind)] = out.get(str(kind), 0) + int(n)
        elif int(w.get("env_timeouts", 0)):
            out["unknown"] = out.get("unknown", 0) + int(w["env_timeouts"])
    return out


class FaultMetrics:
    """The fault counters of each ``metrics.jsonl`` record (call once per update).

    A record gets the cumulative counters of :func:`fault_metrics` and ``env_timeouts_by_call``: the
    environment calls that timed out since the previous record, by call kind (``{"env.reset": 0,
    "env.step": 2}``). While timeouts repeat (any after the run's first, which the worker logs in
    full) it logs one warning line, at most one per ``warn_every_s`` seconds, counting those it
    did not warn about.
    """

    def __init__(self, logger: logging.Logger | None = None, *, warn_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger or logging.getLogger("flashreinforce.trainer")
        self.warn_every_s = float(warn_every_s)
        self.clock = clock
        self._seen: dict[str, int] = {}
        self._unwarned: dict[str, int] = {}
        self._warned_at: float | None = None

    def __call__(self, buffer_stats: Mapping[str, Any], worker_stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        record: dict[str, Any] = fault_metrics(buffer_stats, worker_stats)
        now_total = env_timeouts_by_call(worker_stats)
        update = {kind: max(0, n - self._seen.get(kind, 0)) for kind, n in now_total.items()}
        self._seen = now_total
        record["env_timeouts_by_call"] = update
        for kind, n in update.items():
            if n:
                self._unwarned[kind] = self._unwarned.get(kind, 0) + n
        self._warn_if_repeated(sum(now_total.values()))
        return record

    def _warn_if_repeated(self, total: int) -> None:
        pending = sum(self._unwarned.values())
        if not pending or total < 2:
            return
        now = self.clock()
        if self._warned_at is not None and now - self._warned_at < self.warn_every_s:
            return
        since = "" if self._warned_at is None else f" since the last warning {now - self._warned_at:.0f} s ago"
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(self._unwarned.items()) if n)
        self.logger.warning("%d environment call(s) timed out%s (%s; %d in this run): each held a rollout slot for "
                            "--rollout.env_timeout_s before its episode was quarantined", pending, since, kinds, total)
        self._warned_at = now
        self._unwarned = {}
