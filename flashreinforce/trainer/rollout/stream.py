"""A rollout worker's episodes as a stream (``rollout.episodes_in_flight``): slow tools overlap decoding.

Without it a worker runs its episodes call by call: it takes ``episodes_per_call`` prompts, samples a
turn of every live episode in one ``generate`` call, waits for every environment's answer (the
slowest tool of the batch), samples the next turns, and takes new prompts only when every episode of
the call has ended. With tools that take seconds the engine then waits for the slowest call of each
turn, and the episodes that ended early wait for the last one.

:class:`EpisodeStream` keeps up to ``episodes_in_flight`` episodes in flight instead (more than a
batch, so that there is always an episode to decode while others wait). Each round:

1. new prompts start while their episodes fit (without waiting for the buffer when there is work);
2. one ``generate`` call samples the next turn of every episode whose environment has answered (with
   ``stream_call_min_episodes``, a call for fewer episodes while others' environment calls run first
   waits up to ``stream_call_gather_s`` for an answer and as long again for others to join it);
3. their actions go to the environments without waiting (:meth:`EnvCalls.submit`);
4. the answers that have come are taken (:meth:`EnvCalls.take`), waiting only when nothing else is
   left to do: for the first answer, then briefly (``linger_s``) for others to join it, so that the
   next call samples more than one episode;
5. every prompt whose episodes have all ended is handed to the buffer at once.

Episodes, faults and weight versions are the worker's own (:class:`RolloutWorker`): the same
quarantines, in-flight weight updates and per-token versions. An episode's turns keep their sampling
seeds, so its tokens do not depend on which other episodes shared its calls (up to the engine's float
rounding). An error outside any one episode hands every prompt in flight back to the buffer, as the
call-by-call loop does.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from typing import Any

from flashreinforce.trainer.errors import StopRequested
from flashreinforce.trainer.rollout.buffer import Ticket
from flashreinforce.trainer.rollout.episode import Episode
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["EpisodeStream"]

log = logging.getLogger(__name__)


class EpisodeStream:
    """The loop of :meth:`RolloutWorker.run` with ``episodes_in_flight`` (see the module docstring).

    ``linger_s``: once the first environment answer has come while nothing else is left to do, how
    long to wait for more before the next ``generate`` call. ``stopped``: the worker's exception for a run
    being stopped; ``max_failures``: engine calls failing on every request in a row that stop the worker."""

    linger_s = 0.2

    def __init__(self, worker: Any, stopped: type[BaseException], max_failures: int) -> None:
        self.w = worker
        self.stopped, self.max_failures = stopped, int(max_failures)
        self.group = max(1, worker.buffer.group_size)
        self.tickets: dict[int, tuple[Ticket, list[Episode]]] = {}  # in flight, by prompt id
        self.ready: list[Episode] = []  # episodes whose next turn can be sampled
        self.waiting: dict[int, Episode] = {}  # episodes whose env.step is running, by id
        # Environment slots (an episode's instance), reused as episodes end.
        self.free = list(range(max(worker.settings.episodes_in_flight, self.group)))[::-1]

    def run(self, stop: threading.Event) -> None:
        w = self.w
        w._stop = stop
        consecutive_errors = 0
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    self.round(stop)
                    consecutive_errors = 0
                except self.stopped:
                    raise
                except Exception as err:  # outside any one episode: hand the prompts in flight back
                    w.errors += 1
                    consecutive_errors += 1
                    w.last_error = "".join(traceback.format_exception(err))
                    log.warning("worker %d: error (%d in a row), %d prompt(s) handed out again:\n%s", w.worker_id,
                                consecutive_errors, len(self.tickets), w.last_error)
                    self.drop(f"worker {w.worker_id} error: {err!r}")
                    if consecutive_errors >= 5:
                        log.error("worker %d stops after %d consecutive errors", w.worker_id, consecutive_errors)
                        raise
                if self.tickets:
                    w.busy_s += time.perf_counter() - t0
                else:
                    w.idle_s += time.perf_counter() - t0
                    if w.buffer.closed:
                        break
                if w.engine_failures_in_a_row >= self.max_failures:
                    log.error("worker %d stops: its engine failed on every request of %d calls in a row; the last "
                              "error: %s", w.worker_id, w.engine_failures_in_a_row, w.last_error)
                    raise RuntimeError(f"worker {w.worker_id}: the engine failed on every request of "
                                       f"{w.engine_failures_in_a_row} calls in a row; the last error: {w.last_error}")
        except self.stopped:
            pass
        finally:
            self.drop("")

    def round(self, stop: threading.Event) -> None:
        """One round of the loop (module docstring, steps 1-5)."""
        w, s = self.w, self.w.settings
        while len(self.free) >= self.group:  # 1. new prompts, while their episodes fit
            got = w.buffer.acquire_many(1, timeout=0.0 if (self.ready or self.waiting) else 0.2)
            if not got:
                break
            ticket = got[0]
            episodes = [Episode(ticket, j, self.free.pop()) for j in range(ticket.group_size)]
            self.tickets[ticket.prompt_id] = (ticket, episodes)
            w._begin(episodes, stop)
            self.ready.extend(e for e in episodes if not e.done)
        acting = sum(not e.done for e in self.ready)
        if self.waiting and 0 < acting < s.stream_call_min_episodes:  # 2. a larger call, where answers come soon
            self.take_answers(stop, s.stream_call_gather_s, s.stream_call_gather_s)
        for e in self.ready:
            if not e.done and len(e.tokens) >= s.max_len:
                e.finish(truncated=True)
        live = [e for e in self.ready if not e.done]
        self.ready = []
        if live:  # 2. one call samples the next turn of every episode that can act
            w._wait_while_paused(stop)
            w._sync_weights()
            acted = w._act(live)
            # 3. the actions go to the environments; nobody waits for them here
            serial = not all(getattr(e.env, "parallel_calls", True) for e, _ in acted)
            w._calls.submit([(id(e), "env.step", functools.partial(e.env.step, text), e.env.close)
                             for e, text in acted], max_parallel=1 if serial else None)
            self.waiting.update((id(e), e) for e, _ in acted)
        if self.waiting:  # 4. the answers that have come (waiting only when there is nothing else to do)
            idle = not live
            self.take_answers(stop, 0.2 if idle else 0.0, self.linger_s if idle else 0.0)
        for pid, (ticket, episodes) in list(self.tickets.items()):  # 5. finished groups go in at once
            if all(e.done for e in episodes):
                del self.tickets[pid]
                results = [e.result(w.worker_id) for e in episodes]
                w.buffer.put_many([(ticket, results)])
                w.episodes += sum(isinstance(x, Trajectory) for x in results)
                self.free.extend(e.slot for e in episodes)

    def take_answers(self, stop: threading.Event, wait_s: float, linger_s: float) -> None:
        """The environment answers that have come (waiting up to ``wait_s`` for a first one, then up to
        ``linger_s`` for others): each applied to its episode, which joins ``ready`` unless it ended."""
        w = self.w
        try:
            results = w._calls.take(stop, wait_s=wait_s, linger_s=linger_s)
        except StopRequested:
            raise self.stopped() from None
        for key, (status, value) in results.items():
            e = self.waiting.pop(key)
            if status != "ok":
                w._failed_call(e, "env.step", status, value)
                continue
            w._take_step(e, value)
            if not e.done:
                self.ready.append(e)

    def drop(self, reason: str) -> None:
        """Hand every prompt in flight back to the buffer and forget its episodes; environment calls still
        running are abandoned (their instances are never used again)."""
        w = self.w
        if self.waiting:
            for e in self.waiting.values():
                w._envs[e.slot] = None
            w._calls.abandon_in_flight()
        for ticket, episodes in self.tickets.values():
            w.buffer.cancel(ticket, reason)
            self.free.extend(e.slot for e in episodes)
        self.tickets.clear()
        self.ready.clear()
        self.waiting.clear()
