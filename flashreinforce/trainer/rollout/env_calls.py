"""Environment calls, concurrent and with a timeout: :class:`EnvCalls`.

A rollout worker plays several episodes at once, each with its own environment instance. Their
calls (``reset``, ``step``) are independent, and in an agentic task they are where the time goes
when a tool is slow (a sandboxed interpreter, a web request, a game engine): run one after another,
32 tool calls of 0.5 s each would stall the worker 16 s per turn. So each call runs in a thread of
its own, up to ``max_parallel`` at once, and the worker waits for all of them.

:meth:`EnvCalls.run` runs a set of calls and returns when every one has ended. A worker that keeps
decoding while some episodes' tools run uses :meth:`EnvCalls.submit` and :meth:`EnvCalls.take`
instead: calls start at once, and each outcome is taken when it is ready.

Each call has its own deadline, ``timeout_s`` from its start. Python cannot stop a thread, so a call
that does not return in time is abandoned: it keeps running in its daemon thread, which owns the
environment instance; the worker never touches that instance again (it builds a new one) and goes
on with its other episodes. When the stuck call returns, its thread closes the instance and ends.
Threads are reused across calls; at most :attr:`EnvCalls.MAX_STUCK` abandoned ones may be alive.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Hashable, Sequence

from flashreinforce.trainer.errors import StopRequested

__all__ = ["EnvCalls"]


class _Job:
    """One call, run by a :class:`_Caller` thread; ``cond`` is shared by the calls of one :meth:`EnvCalls.run`."""

    def __init__(self, key: Hashable, fn: Callable[[], Any], on_abandon: Callable[[], None] | None,
                 cond: threading.Condition) -> None:
        self.key, self.fn, self.on_abandon, self.cond = key, fn, on_abandon, cond
        self.started: float | None = None  # time.monotonic() when the thread began the call
        self.outcome: tuple[bool, Any] | None = None  # (returned, value or exception) once it ended
        self.abandoned = False


class _Caller:
    """A daemon thread running :class:`_Job` s one after another, until an abandoned one or ``None``."""

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
        """Run the job's call; False when it was abandoned meanwhile (this thread must then end)."""
        with job.cond:
            if job.abandoned:
                return False
            job.started = time.monotonic()
        try:
            outcome = (True, job.fn())
        except BaseException as err:  # handed to the worker, which quarantines the episode
            outcome = (False, err)
        with job.cond:
            if not job.abandoned:
                job.outcome = outcome
                job.cond.notify_all()
                return True
        if job.on_abandon is not None:
            try:
                job.on_abandon()
            except Exception:  # closing an abandoned environment is best effort
                pass
        return False


class EnvCalls:
    """Runs a worker's environment calls concurrently, each with a timeout (see the module docstring).

    Args:
        timeout_s: seconds a call may take from its start (0 or ``None``: no limit).
        name: prefix of the threads' names.
        max_parallel: calls that run at once at most (1: one after another, still with the timeout).
    """

    #: While more abandoned calls than this are still stuck, new ones are refused (RuntimeError):
    #: each holds a thread and an environment instance.
    MAX_STUCK = 64

    def __init__(self, timeout_s: float | None, name: str = "env-calls", max_parallel: int = 32) -> None:
        if int(max_parallel) < 1:
            raise ValueError(f"EnvCalls max_parallel must be >= 1, got {max_parallel}")
        self.timeout_s = float(timeout_s or 0.0)
        self.name = name
        self.max_parallel = int(max_parallel)
        self._idle: list[_Caller] = []
        self._abandoned: list[threading.Thread] = []
        self._threads_made = 0
        self.timeouts = 0
        self.timeouts_by_call: dict[str, int] = {}  # call description (env.reset, env.step) -> timeouts
        # (call description, start) of the oldest call in progress while waiting, for the watchdog
        self.current: tuple[str, float] | None = None
        # Calls started by submit(): waiting for a thread, running, and their descriptions.
        self._cond = threading.Condition()
        self._queued: deque[_Job] = deque()
        self._running: dict[Hashable, tuple[_Job, _Caller]] = {}
        self._described: dict[Hashable, str] = {}
        self._ended: dict[Hashable, tuple[str, Any]] = {}
        self._submit_limit = self.max_parallel

    @property
    def in_flight(self) -> int:
        """Calls given to :meth:`submit` whose outcome :meth:`take` has not returned yet."""
        return len(self._described)

    def submit(self, calls: Sequence[tuple[Hashable, str, Callable[[], Any], Callable[[], None] | None]],
               max_parallel: int | None = None) -> None:
        """Start ``calls`` (as :meth:`run` takes them; keys distinct from those in flight) without waiting
        for them: up to ``max_parallel`` (default: the instance's) submitted calls run at once, the rest
        start as others end. Their outcomes come from :meth:`take`."""
        with self._cond:
            self._submit_limit = self.max_parallel if max_parallel is None else max(1, int(max_parallel))
            for key, what, fn, on_abandon in calls:
                if key in self._described:
                    raise ValueError(f"EnvCalls.submit: a call with key {key!r} is already in flight")
                self._described[key] = what
                self._queued.append(_Job(key, fn, on_abandon, self._cond))
            self._start_queued()

    def _start_queued(self) -> None:
        while self._queued and len(self._running) < self._submit_limit:
            job = self._queued.popleft()
            caller = self._caller()
            self._running[job.key] = (job, caller)
            caller.jobs.put(job)

    def take(self, stop: threading.Event | None = None, wait_s: float | None = None,
             linger_s: float = 0.0) -> dict[Hashable, tuple[str, Any]]:
        """Outcomes ``{key: (status, value)}`` (as :meth:`run` gives them) of submitted calls that ended:
        waits up to ``wait_s`` seconds (``None``: as long as it takes) for the first, then up to
        ``linger_s`` more for others to join it (all of them if they all end sooner). Empty when nothing
        ended in time or nothing is in flight. Raises :class:`StopRequested` when ``stop`` is set while
        waiting (the calls still running are abandoned)."""
        start = time.monotonic()
        first: float | None = None
        try:
            with self._cond:
                while self._described:
                    self._collect(self._running, self._ended, self._described)
                    self._start_queued()
                    now = time.monotonic()
                    if self._ended and first is None:
                        first = now
                    if first is not None and (now - first >= linger_s or len(self._ended) == len(self._described)):
                        break
                    if first is None and wait_s is not None and now - start >= wait_s:
                        break
                    if stop is not None and stop.is_set():
                        raise StopRequested()
                    wait = 0.5 if first is None else max(first + linger_s - now, 0.0)
                    if first is None and wait_s is not None:
                        wait = min(wait, max(start + wait_s - now, 0.0))
                    oldest = min(((job.started, key) for key, (job, _) in self._running.items()
                                  if job.started is not None), key=lambda started_key: started_key[0], default=None)
                    if oldest is not None:
                        self.current = (self._described[oldest[1]], oldest[0])
                        if self.timeout_s:
                            wait = min(wait, max(oldest[0] + self.timeout_s - now, 0.0))
                    self._cond.wait(wait)
                out, self._ended = self._ended, {}
                for key in out:
                    del self._described[key]
                return out
        except StopRequested:
            self.abandon_in_flight()
            raise
        finally:
            self.current = None

    def run(self, calls: Sequence[tuple[Hashable, str, Callable[[], Any], Callable[[], None] | None]],
            stop: threading.Event | None = None, max_parallel: int | None = None) -> dict[Hashable, tuple[str, Any]]:
        """Run ``calls`` (``(key, description, fn, on_abandon)``, distinct keys) concurrently, at most
        ``max_parallel`` at once (default: the instance's); returns
        ``{key: (status, value)}`` with status ``ok`` (value: the result), ``error`` (value: the exception)
        or ``timeout`` (value: seconds allowed). ``on_abandon`` runs in the stuck call's thread if and when
        that call returns. Raises :class:`StopRequested` when ``stop`` is set while waiting (the calls
        still running are abandoned)."""
        described = {key: what for key, what, _, _ in calls}
        if len(described) != len(calls):
            raise ValueError("EnvCalls.run: the calls' keys must be distinct")
        limit = self.max_parallel if max_parallel is None else max(1, int(max_parallel))
        cond = threading.Condition()
        waiting = deque(_Job(key, fn, on_abandon, cond) for key, _, fn, on_abandon in calls)  # in the order given
        running: dict[Hashable, tuple[_Job, _Caller]] = {}
        out: dict[Hashable, tuple[str, Any]] = {}
        try:
            while waiting or running:
                while waiting and len(running) < limit:
                    job = waiting.popleft()
                    caller = self._caller()
                    running[job.key] = (job, caller)
                    caller.jobs.put(job)
                with cond:
                    self._collect(running, out, described)
                    if not running or (waiting and len(running) < limit):
                        continue
                    if stop is not None and stop.is_set():
                        raise StopRequested()
                    oldest = min(((job.started, key) for key, (job, _) in running.items() if job.started is not None),
                                 key=lambda started_key: started_key[0], default=None)
                    wait = 0.5
                    if oldest is not None:
                        self.current = (described[oldest[1]], oldest[0])
                        if self.timeout_s:
                            wait = min(wait, max(oldest[0] + self.timeout_s - time.monotonic(), 0.0))
                    cond.wait(wait)
        except StopRequested:
            with cond:
                for job, caller in running.values():
                    self._abandon(job, caller)
            raise
        finally:
            self.current = None
        return {key: out[key] for key in described}  # in the order given

    def abandon_in_flight(self) -> None:
        """Forget every submitted call: those running are abandoned (as a timed-out call is: their
        ``on_abandon`` runs when they return), those not started never start."""
        with self._cond:
            for job, caller in self._running.values():
                self._abandon(job, caller)
            self._running.clear()
            self._queued.clear()
            self._described.clear()
            self._ended.clear()

    def _collect(self, running: dict[Hashable, tuple[_Job, _Caller]], out: dict[Hashable, tuple[str, Any]],
                 described: dict[Hashable, str]) -> None:
        """Move ended and timed-out calls from ``running`` to ``out`` (called holding the run's lock)."""
        now = time.monotonic()
        for key, (job, caller) in list(running.items()):
            if job.outcome is not None:
                returned, value = job.outcome
                out[key] = ("ok", value) if returned else ("error", value)
                del running[key]
                self._idle.append(caller)
            elif self.timeout_s and job.started is not None and now - job.started >= self.timeout_s:
                self._abandon(job, caller)
                out[key] = ("timeout", self.timeout_s)
                del running[key]
                self.timeouts += 1
                self.timeouts_by_call[described[key]] = self.timeouts_by_call.get(described[key], 0) + 1

    def _abandon(self, job: _Job, caller: _Caller) -> None:
        job.abandoned = True
        self._abandoned.append(caller.thread)

    def _caller(self) -> _Caller:
        if self._idle:
            return self._idle.pop()
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        if len(self._abandoned) >= self.MAX_STUCK:
            raise RuntimeError(f"{len(self._abandoned)} environment calls are still stuck after their timeout; "
                               "refusing to start more threads")
        self._threads_made += 1
        return _Caller(f"{self.name}-{self._threads_made}")

    def close(self) -> None:
        """End the idle threads, and wait the moment they take to end (abandoned ones end when their
        call returns), so that no thread of a closed instance outlives it without a reason."""
        idle, self._idle = self._idle, []
        for caller in idle:
            caller.jobs.put(None)
        for caller in idle:
            caller.thread.join(timeout=1.0)
