"""Environment calls with a timeout: :class:`EnvCalls`.

It runs a worker's environment calls with a per-call timeout. Python cannot stop a thread, so a call
that does not return in time is abandoned: it keeps running in a daemon thread that owns the
environment instance; the worker never touches that instance again (it builds a new one) and goes on
with its other episodes on a fresh thread. When the stuck call returns, its thread closes the
instance and ends.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Hashable, Mapping, Sequence

from flashreinforce.trainer.errors import StopRequested

__all__ = ["EnvCalls"]


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
