"""The buffer actor and its two clients: who holds which ticket, by worker and incarnation.

* :class:`OwnedBuffer`: a :class:`~flashreinforce.trainer.rollout.buffer.RolloutBuffer` whose tickets remember
  the worker *incarnation* holding them (no Ray needed; tested on its own).
* :class:`BufferActor`: the Ray actor body hosting one (threaded, ``num_cpus=0``, pinned to the
  driver's node by :class:`~flashreinforce.distributed.ray.session.RayRollout`).
* :class:`RemoteBuffer`: the learner's side, with ``RolloutBuffer``'s learner-side interface.
* :class:`WorkerBufferClient`: a rollout worker's side (``acquire`` / ``put`` / ``cancel`` as one
  incarnation); finished trajectories travel through the object store (``ray.put`` by the worker).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

from flashreinforce.distributed.ray.calls import ActorClient, delegate, import_ray
from flashreinforce.trainer.rollout.buffer import Batch, RolloutBuffer, Ticket

__all__ = ["BufferActor", "MAX_BLOCK_S", "OwnedBuffer", "RemoteBuffer", "StaleIncarnation", "WorkerBufferClient"]

log = logging.getLogger(__name__)

#: Longest single blocking call a client makes into the buffer actor (seconds); longer waits loop,
#: so no actor thread is held indefinitely by one caller.
MAX_BLOCK_S = 1.0

#: The learner-side calls the buffer actor answers by running them on its RolloutBuffer.
LEARNER_CALLS = ("take", "update_done", "close", "closed", "in_flight", "state_dict", "load_state_dict", "pause",
                 "resume", "paused", "wait_until_full")


class StaleIncarnation(RuntimeError):
    """A worker incarnation that was declared lost asked for more work (its loop must end)."""


class OwnedBuffer:
    """A :class:`~flashreinforce.trainer.rollout.buffer.RolloutBuffer` whose tickets remember who holds them.

    Workers identify themselves by ``(worker_id, incarnation)``; an incarnation is one run of a
    worker's loop (a restarted actor starts a new one). :meth:`release` hands out again every
    ticket an incarnation held and marks it dead, so that what it still sends is refused: a late
    ``put`` never lands on a ticket that was re-issued to another worker. Thread-safe.
    """

    def __init__(self, buffer: RolloutBuffer) -> None:
        self.buffer = buffer
        self._lock = threading.Lock()
        self._owner: dict[int, tuple[int, int]] = {}
        self._tickets: dict[int, Ticket] = {}
        self._dead: set[tuple[int, int]] = set()
        self.late_calls = 0

    # worker side
    def acquire_many(self, worker_id: int, incarnation: int, n: int, timeout: float | None) -> list[Ticket]:
        """Up to ``n`` tickets for the incarnation (see :meth:`RolloutBuffer.acquire_many`)."""
        with self._lock:
            if (worker_id, incarnation) in self._dead:
                self.late_calls += 1
                raise StaleIncarnation(f"worker {worker_id} incarnation {incarnation} was released")
        tickets = self.buffer.acquire_many(n, timeout=timeout)
        with self._lock:
            if (worker_id, incarnation) in self._dead:  # released while this call waited
                for ticket in tickets:
                    self.buffer.cancel(ticket, f"worker {worker_id} incarnation {incarnation} is gone", lost=True)
                self.late_calls += 1
                return []
            for ticket in tickets:
                self._owner[ticket.prompt_id] = (worker_id, incarnation)
                self._tickets[ticket.prompt_id] = ticket
        return tickets

    def put_many(self, worker_id: int, incarnation: int, groups) -> list[int]:
        """Queue the samples of each ``(ticket, trajectories)``; -1 for (and nothing queued from) a
        ticket the caller no longer holds. The lock is held across the put, so a ticket released and
        re-issued in between can never receive the old holder's samples."""
        out = []
        with self._lock:
            for ticket, trajectories in groups:
                if self._owner.get(ticket.prompt_id) != (worker_id, incarnation):
                    self.late_calls += 1
                    log.warning("dropped a put for prompt %d from worker %d incarnation %d: it no longer holds it",
                                ticket.prompt_id, worker_id, incarnation)
                    out.append(-1)
                    continue
                del self._owner[ticket.prompt_id]
                del self._tickets[ticket.prompt_id]
                out.append(self.buffer.put(ticket, trajectories))
        return out

    def cancel(self, worker_id: int, incarnation: int, ticket: Ticket, reason: str = "") -> None:
        with self._lock:
            if self._owner.get(ticket.prompt_id) != (worker_id, incarnation):
                self.late_calls += 1
                return
            del self._owner[ticket.prompt_id]
            del self._tickets[ticket.prompt_id]
            self.buffer.cancel(ticket, reason)

    def release(self, worker_id: int, incarnation: int, reason: str = "") -> int:
        """The incarnation is gone: hand its tickets out again (counted as lost); returns how many."""
        with self._lock:
            self._dead.add((worker_id, incarnation))
            held = [pid for pid, owner in self._owner.items() if owner == (worker_id, incarnation)]
            for pid in held:
                ticket = self._tickets.pop(pid)
                del self._owner[pid]
                self.buffer.cancel(ticket, reason, lost=True)
        return len(held)

    def held(self, worker_id: int) -> int:
        """Tickets any incarnation of ``worker_id`` holds now."""
        return len(self.held_prompts(worker_id))

    def held_prompts(self, worker_id: int) -> list[int]:
        """Prompt ids of the tickets any incarnation of ``worker_id`` holds now."""
        with self._lock:
            return sorted(pid for pid, (w, _) in self._owner.items() if w == worker_id)

    def stats(self) -> dict[str, int]:
        out = self.buffer.stats()
        out["late_calls"] = self.late_calls
        return out


@delegate("buffer", LEARNER_CALLS)
class BufferActor(OwnedBuffer):
    """Ray actor body: an :class:`OwnedBuffer` built in the actor from the buffer's and the prompt
    stream's keyword arguments, answering the worker calls (its own methods) and the learner's
    (:data:`LEARNER_CALLS`, run on its ``RolloutBuffer``). Create it threaded with :func:`ray.remote`."""

    def __init__(self, buffer_kwargs: Mapping[str, Any], prompt_kwargs: Mapping[str, Any]) -> None:
        from flashreinforce.trainer.rollout.buffer import PromptStream

        super().__init__(RolloutBuffer(**buffer_kwargs, prompts=PromptStream(**prompt_kwargs)))

    def node(self) -> str:
        """The Ray node id this actor runs on."""
        return import_ray().get_runtime_context().get_node_id()


class RemoteBuffer(ActorClient):
    """The learner's side of the buffer actor, with :class:`~flashreinforce.trainer.rollout.buffer.RolloutBuffer`'s
    learner-side interface: ``take`` waits in slices of at most :data:`MAX_BLOCK_S`; ``update_done``,
    ``close``, ``stats``, ``in_flight``, ``state_dict``, ``load_state_dict``, ``release``, ``held``,
    ``held_prompts`` are calls to the actor (:class:`~flashreinforce.distributed.ray.calls.ActorClient`)."""

    remote_methods = frozenset(LEARNER_CALLS + ("stats", "release", "held", "held_prompts", "node"))
    actor_name = "rollout buffer actor"

    def __init__(self, handle, *, batch_groups: int, group_size: int, async_queue_size: int = 1, **kwargs) -> None:
        super().__init__(handle, **kwargs)
        self.batch_groups = batch_groups
        self.group_size = group_size
        self.async_queue_size = async_queue_size

    def take(self, learner_version: int, timeout: float | None = None) -> Batch | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = MAX_BLOCK_S if deadline is None else max(0.0, min(MAX_BLOCK_S, deadline - time.monotonic()))
            batch = self.call("take", learner_version, wait)
            if batch is not None or self.closed or (deadline is not None and time.monotonic() >= deadline):
                return batch

    def wait_until_full(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = MAX_BLOCK_S if deadline is None else max(0.0, min(MAX_BLOCK_S, deadline - time.monotonic()))
            if self.call("wait_until_full", wait):
                return True
            if self.closed or (deadline is not None and time.monotonic() >= deadline):
                return False

    @property
    def closed(self) -> bool:
        return self.call("closed")

    @property
    def paused(self) -> bool:
        return self.call("paused")


class WorkerBufferClient(ActorClient):
    """A rollout worker's side of the buffer actor: ``acquire`` / ``put`` / ``cancel`` as one
    incarnation of worker ``worker_id``. Trajectories go through the object store (``ray.put``)."""

    remote_methods = frozenset(("acquire_many", "put_many", "cancel", "closed", "paused"))
    actor_name = "rollout buffer actor"

    def __init__(self, handle, worker_id: int, group_size: int, **kwargs) -> None:
        super().__init__(handle, **kwargs)
        self.worker_id = worker_id
        self.group_size = group_size
        self.incarnation = 0

    def acquire_many(self, n: int, timeout: float | None = None) -> list[Ticket]:
        """Up to ``n`` tickets in one round trip (waits in slices of at most :data:`MAX_BLOCK_S`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = MAX_BLOCK_S if deadline is None else max(0.0, min(MAX_BLOCK_S, deadline - time.monotonic()))
            tickets = self.call("acquire_many", self.worker_id, self.incarnation, int(n), wait)
            if tickets or (deadline is not None and time.monotonic() >= deadline) or self.closed:
                return tickets

    def acquire(self, timeout: float | None = None) -> Ticket | None:
        tickets = self.acquire_many(1, timeout)
        return tickets[0] if tickets else None

    def put_many(self, groups) -> list[int]:
        """All finished groups of one ``generate`` round in one object-store put and one call."""
        ref = import_ray().put([(ticket, list(trajs)) for ticket, trajs in groups])
        return self.call("put_many", self.worker_id, self.incarnation, ref)

    def put(self, ticket: Ticket, trajectories) -> int:
        return self.put_many([(ticket, trajectories)])[0]

    def cancel(self, ticket: Ticket, reason: str = "") -> None:
        self.call("cancel", self.worker_id, self.incarnation, ticket, reason)

    def close(self) -> None:
        """Workers never close the shared buffer (the learner does)."""

    @property
    def closed(self) -> bool:
        return self.call("closed")

    @property
    def paused(self) -> bool:
        return self.call("paused")
