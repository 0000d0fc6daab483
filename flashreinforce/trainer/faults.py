"""What goes wrong during rollouts, and how a run keeps going (or stops with a clear message).

* :class:`QuarantinedEpisode`: the record a worker hands in, instead of a trajectory, for an episode
  it could not finish (the environment raised, returned a wrong type or text the tokenizer cannot
  encode, a call timed out, the engine failed on its request). The buffer counts it and retries
  the prompt a few times before skipping it; the other episodes of the same call are kept.
* :class:`RepeatedProblems`: logs the first occurrence of each kind of problem in full and then only
  counts (a line at 10, 100, 1000, ... occurrences), so a problem on every step never floods the log.
* :class:`EnvCalls`: runs environment calls with a per-call timeout. Python cannot stop a thread,
  so a call that does not return in time is abandoned: it keeps running in a daemon thread that
  owns the environment instance; the worker never touches that instance again (it builds a new
  one) and goes on with its other episodes on a fresh thread. When the stuck call returns, its
  thread closes the instance and ends.
* :class:`Watchdog`: stops a run that cannot train (:class:`RunStalled`): no trajectory arrived for
  ``train.stall_timeout_s`` while the learner waited (the message says which call of which worker is
  stuck, and for how long), or ``rollout.max_failed_episodes_in_a_row`` episodes in a row failed.
* :class:`FaultMetrics`: the fault counters of each ``metrics.jsonl`` record, with the environment
  calls that timed out during the update by call kind, and a warning (one line, at most one a
  minute) while timeouts repeat.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

__all__ = ["ENV_CALL_KINDS", "EnvCalls", "FaultMetrics", "QuarantinedEpisode", "RepeatedProblems", "RolloutFailed",
           "RunFailure", "RunStalled", "Watchdog", "env_timeouts_by_call", "fault_metrics"]


@dataclass(frozen=True)
class QuarantinedEpisode:
    """An episode a worker could not finish: handed to the buffer in place of its trajectory.

    kind: the category (``env.step raised RuntimeError``, ``env.step timed out``, ...), the key of
    the counters and of the log's once-per-kind warnings. reason: what happened, for people.
    retry: whether handing the prompt out again may help (False for a prompt that cannot fit).
    """

    prompt_id: int
    sample_index: int
    kind: str
    reason: str
    retry: bool = True


class RunFailure(RuntimeError):
    """The run cannot go on; the message says why (the CLI prints it without a traceback, exit status 1)."""


class RunStalled(RunFailure):
    """Nothing could be trained on for too long (see :class:`Watchdog`)."""


class RolloutFailed(RunFailure):
    """Every rollout worker has stopped."""


class RepeatedProblems:
    """Log a problem the first time its kind is seen; afterwards count it, with one line at 10, 100,
    1000, ... occurrences. Thread-safe. ``counts`` holds the occurrences per kind."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger = logger
        self.what = what
        self.counts: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def report(self, kind: Hashable, message: str, *args: Any) -> None:
        """Count one occurrence of ``kind``; ``message % args`` is logged only for the first."""
        with self._lock:
            n = self.counts.get(kind, 0) + 1
            self.counts[kind] = n
        if n == 1:
            self.logger.warning(message + " (further problems of this kind are counted, not logged each time)",
                                *args)
        elif n >= 10 and str(n).rstrip("0") == "1":  # 10, 100, 1000, ...
            self.logger.warning("%s: %r has happened %d times so far", self.what, kind, n)


# ---------------------------------------------------------------- environment calls with a timeout


class _Job:
    """Calls run in order by one :class:`_Caller` thread; the worker waits on ``cond``."""

    def __init__(self, calls: Sequence[tuple[Hashable, Callable[[], Any], Callable[[], None] | None]]) -> None:
        self.calls = list(calls)
        self.cond = threading.Condition()
        self.results: dict[Hashable, tuple[bool, Any]] = {}
        self.current: Hashable | None = None
        self.started = 0.0
        self.done = False
        self.abandoned = False


class _Caller:
    """A daemon thread running :class:`_Job` s one after another."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None or not self._run(job):
                return

    @staticmethod
    def _run(job: _Job) -> bool:
        """Run the job's calls; False when the job was abandoned (this thread must end)."""
        for key, fn, on_abandon in job.calls:
            with job.cond:
                if job.abandoned:
                    return False
                job.current, job.started = key, time.monotonic()
            try:
                outcome = (True, fn())
            except BaseException as err:  # handed to the worker, which quarantines the episode
                outcome = (False, err)
            with job.cond:
                if job.abandoned:
                    if on_abandon is not None:
                        try:
                            on_abandon()
                        except Exception:  # closing an abandoned environment is best effort
                            pass
                    return False
                job.results[key] = outcome
                job.current = None
                job.cond.notify_all()
        with job.cond:
            job.done = True
            job.cond.notify_all()
        return True


class EnvCalls:
    """Runs a worker's environment calls with a per-call timeout (see the module docstring).

    ``timeout_s`` 0 (or ``None``) runs them inline, without a thread and without a timeout.
    """

    #: While more abandoned calls than this are still stuck, new ones are refused (RuntimeError):
    #: each holds a thread and an environment instance.
    MAX_STUCK = 64

    def __init__(self, timeout_s: float | None, name: str = "env-calls") -> None:
        self.timeout_s = float(timeout_s or 0.0)
        self.name = name
        self._caller: _Caller | None = None
        self._abandoned: list[threading.Thread] = []
        self.timeouts = 0
        self.timeouts_by_call: dict[str, int] = {}  # call description (env.reset, env.step) -> timeouts
        self.current: tuple[str, float] | None = None  # (call description, start) while waiting, for the watchdog

    def run(self, calls: Sequence[tuple[Hashable, str, Callable[[], Any], Callable[[], None] | None]],
            stop: threading.Event | None = None) -> dict[Hashable, tuple[str, Any]]:
        """Run ``calls`` (``(key, description, fn, on_abandon)``) in order; returns ``{key: (status, value)}``
        with status ``ok`` (value: the result), ``error`` (value: the exception) or ``timeout`` (value:
        seconds waited). ``on_abandon`` runs in the stuck call's thread if and when that call returns.
        Raises :class:`StopRequested` when ``stop`` is set while waiting."""
        if not self.timeout_s:
            out = {}
            for key, what, fn, _ in calls:
                self.current = (what, time.monotonic())
                try:
                    out[key] = ("ok", fn())
                except Exception as err:
                    out[key] = ("error", err)
                finally:
                    self.current = None
            return out
        described = {key: what for key, what, _, _ in calls}
        pending = [(key, fn, on_abandon) for key, _, fn, on_abandon in calls]
        out: dict[Hashable, tuple[str, Any]] = {}
        while pending:
            job = _Job(pending)
            self._submit(job)
            stuck = self._wait(job, described, stop)
            for key, (ok, value) in job.results.items():
                out[key] = ("ok", value) if ok else ("error", value)
            if stuck is None:
                break
            out[stuck] = ("timeout", self.timeout_s)
            self.timeouts += 1
            self.timeouts_by_call[described[stuck]] = self.timeouts_by_call.get(described[stuck], 0) + 1
            keys_done = set(out)
            pending = [c for c in pending if c[0] not in keys_done]
        return out

    def _submit(self, job: _Job) -> None:
        if self._caller is None:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            if len(self._abandoned) >= self.MAX_STUCK:
                raise RuntimeError(f"{len(self._abandoned)} environment calls are still stuck after their timeout; "
                                   "refusing to start more threads")
            self._caller = _Caller(f"{self.name}-{len(self._abandoned)}")
        self._caller.jobs.put(job)

    def _wait(self, job: _Job, described: Mapping[Hashable, str], stop: threading.Event | None) -> Hashable | None:
        """Wait for ``job``; the key of the call abandoned after its timeout, or ``None`` when all returned."""
        with job.cond:
            while not job.done:
                now = time.monotonic()
                if job.current is not None:
                    self.current = (described[job.current], job.started)
                    remaining = job.started + self.timeout_s - now
                    if remaining <= 0:
                        job.abandoned = True
                        stuck = job.current
                        self._abandoned.append(self._caller.thread)
                        self._caller = None
                        self.current = None
                        return stuck
                else:
                    remaining = self.timeout_s
                if stop is not None and stop.is_set():
                    job.abandoned = True
                    self._caller = None
                    self.current = None
                    raise StopRequested()
                job.cond.wait(min(remaining, 0.5))
        self.current = None
        return None

    def close(self) -> None:
        """End the caller thread (abandoned ones end when their call returns)."""
        if self._caller is not None:
            self._caller.jobs.put(None)
            self._caller = None


class StopRequested(Exception):
    """The worker was told to stop while it waited for an environment call."""


# ---------------------------------------------------------------- the watchdog


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
        failed = int(buffer_stats.get("failed_in_a_row", 0))
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
