"""The rollout buffer between rollout workers and the learner, and the prompt stream it hands out.

Protocol (the whole interface a worker or a learner uses; a Ray actor can wrap it unchanged):

* worker: ``ticket = buffer.acquire()`` -> a prompt to roll out (``None`` once the buffer is closed);
  then ``buffer.put(ticket, trajectories)`` with its ``group_size`` samples, or ``buffer.cancel(ticket)``
  (``acquire_many`` / ``put_many``: the same for several prompts in one call, one round trip for a
  remote buffer).
* learner: ``batch = buffer.take(learner_version)`` -> the next ``batch_groups`` groups in completion
  order, each exactly once (one pass: a taken group is never returned again), then, after the
  optimizer step, ``buffer.update_done()``.

Staleness bound: prompts are handed out only while
``issued - freed <= batch_groups * (updates_done + 1 + async_queue_size)``, so ``async_queue_size``
batches may be in flight ahead of the batch the learner is working on (0 = synchronous: the next
batch starts only after the update). ``freed`` counts prompts whose group was dropped, cancelled or
entirely rejected (they are replaced). With ``max_policy_lag`` set, ``take`` drops (and counts) groups
whose oldest trajectory is more than that many versions behind the learner; their prompt is handed
out again first, so no prompt is lost.

Validation: every trajectory is checked on ``put`` (:meth:`Trajectory.diagnose`); an invalid one is
counted (``rejected_trajectories``), kept in ``buffer.quarantine`` with its reason (the last
``quarantine_size``) and never reaches the learner; training goes on with the valid ones. A group
with no valid trajectory frees its slot and its prompt is not retried (the problem is in the data).

Failed episodes: a worker hands in a :class:`~flashreinforce.trainer.rollout.fault_records.QuarantinedEpisode` in
place of a trajectory it could not finish (counted as ``quarantined_episodes``). A prompt none of
whose samples could be finished is handed out again (``retried_prompts``), at most
``max_prompt_attempts`` times in all, then skipped (``skipped_prompts``). Each kind of problem is
logged once, then counted. ``failed_in_a_row`` (in :meth:`stats`) counts the episodes quarantined or
rejected since the last valid one, for the trainer's watchdog.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode, RepeatedProblems
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["Batch", "PromptStream", "RolloutBuffer", "Ticket"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ticket:
    """Permission to roll out one prompt: ``group_size`` samples of environment seed ``seed``."""

    prompt_id: int
    seed: int
    group_size: int


@dataclass
class Batch:
    """What ``take`` returns: ``groups`` (each the samples of one prompt), in completion order."""

    groups: list[list[Trajectory]]
    learner_version: int
    wait_s: float
    dropped_groups: int = 0
    dropped_trajectories: int = 0

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]

    @property
    def group_ids(self) -> list[int]:
        return [gi for gi, g in enumerate(self.groups) for _ in g]


class PromptStream:
    """An endless, seeded stream of ``(prompt_id, env_seed)``.

    With ``num_prompts`` (a finite prompt set, e.g. a dataset), each pass is a fresh seeded
    permutation of ``range(num_prompts)`` (one pass = one episode in Molt's ``train.num_episodes``);
    without it, seeds are ``seed_offset + prompt_id`` (every prompt new). ``exclude``: rows of the
    finite set never handed out (the held-out split, :mod:`flashreinforce.trainer.reporting.heldout`); a
    pass is then a permutation of the other rows. Prompts given back with :meth:`requeue` come out first, in the order given.
    """

    def __init__(self, *, num_prompts: int | None = None, seed: int = 0, seed_offset: int = 0,
                 shuffle: bool = True, exclude: Iterable[int] = ()) -> None:
        if num_prompts is not None and num_prompts <= 0:
            raise ValueError(f"num_prompts must be positive or None, got {num_prompts}")
        excluded = set(int(r) for r in exclude)
        self._rows = None
        if excluded:
            if num_prompts is None:
                raise ValueError("exclude needs a finite prompt set (num_prompts)")
            self._rows = [r for r in range(num_prompts) if r not in excluded]
            if not self._rows:
                raise ValueError(f"exclude leaves no row of the {num_prompts} to hand out")
            num_prompts = len(self._rows)
        self.num_prompts = num_prompts
        self.seed = seed
        self.seed_offset = seed_offset
        self.shuffle = shuffle
        self.next_id = 0
        self._requeued: collections.deque[tuple[int, int]] = collections.deque()
        self._perm_epoch = -1
        self._perm: list[int] = []

    def seed_of(self, prompt_id: int) -> int:
        if self.num_prompts is None:
            return self.seed_offset + prompt_id
        epoch, pos = divmod(prompt_id, self.num_prompts)
        if epoch != self._perm_epoch:
            self._perm = list(range(self.num_prompts)) if self._rows is None else list(self._rows)
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
            self._perm_epoch = epoch
        return self._perm[pos]

    def next(self) -> tuple[int, int]:
        if self._requeued:
            return self._requeued.popleft()
        pid = self.next_id
        self.next_id += 1
        return pid, self.seed_of(pid)

    def requeue(self, prompts: Iterable[tuple[int, int]]) -> None:
        self._requeued.extend(prompts)

    def state_dict(self, outstanding: Sequence[tuple[int, int]] = ()) -> dict:
        """State to resume from; ``outstanding`` prompts (handed out, not consumed) come out first.
        The seeds that order the passes travel with it."""
        return {"next_id": self.next_id, "requeued": [list(p) for p in list(outstanding) + list(self._requeued)],
                "seed": self.seed, "seed_offset": self.seed_offset}

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved stream; its passes keep the order they were given by the saved seeds
        (a run resumed with another ``--seed`` samples differently, but the pass in progress is not
        shuffled again: no prompt of it is trained twice, none left out)."""
        self.next_id = int(state["next_id"])
        self._requeued = collections.deque((int(a), int(b)) for a, b in state["requeued"])
        for key in ("seed", "seed_offset"):
            if key in state:  # absent from checkpoints of earlier versions
                setattr(self, key, int(state[key]))
        self._perm_epoch = -1


class RolloutBuffer:
    """FIFO of finished groups with a staleness bound, validation and exactly-once ``take``.

    Args:
        batch_groups: groups (prompts) per learner batch, Molt's ``rollout.batch_size``.
        group_size: samples per prompt, ``rollout.n_samples_per_prompt``.
        async_queue_size: batches that may be in flight ahead of the learner's current one (>= 0).
        max_policy_lag: drop groups more than this many versions behind at ``take`` (``None``: never).
        prompts: the prompt stream (default: endless fresh seeds).
        vocab_size: token ids must lie in ``[0, vocab_size)`` (``None``: unchecked).
        quarantine_size: how many rejected trajectories (and quarantined episodes) to keep for inspection.
        max_prompt_attempts: times a prompt is handed out whose every sample failed before it is skipped.
    """

    def __init__(self, *, batch_groups: int, group_size: int = 1, async_queue_size: int = 1,
                 max_policy_lag: int | None = None, prompts: PromptStream | None = None,
                 vocab_size: int | None = None, quarantine_size: int = 64, max_prompt_attempts: int = 3) -> None:
        if batch_groups <= 0:
            raise ValueError(f"batch_groups must be positive, got {batch_groups}")
        if group_size <= 0:
            raise ValueError(f"group_size must be positive, got {group_size}")
        if async_queue_size < 0:
            raise ValueError(f"async_queue_size must be >= 0, got {async_queue_size}")
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0 or None, got {max_policy_lag}")
        if max_prompt_attempts < 1:
            raise ValueError(f"max_prompt_attempts must be positive, got {max_prompt_attempts}")
        self.batch_groups = batch_groups
        self.group_size = group_size
        self.async_queue_size = async_queue_size
        self.max_policy_lag = max_policy_lag
        self.prompts = prompts or PromptStream()
        self.vocab_size = vocab_size
        self.max_prompt_attempts = max_prompt_attempts
        self.quarantine: collections.deque[tuple[str, object]] = collections.deque(maxlen=quarantine_size)
        self._problems = RepeatedProblems(log, "rollout buffer")
        self._attempts: dict[int, int] = {}  # prompt id -> attempts whose every sample failed
        self._failed_in_a_row = 0
        self._last_failure = ""
        self._fatal = ""  # the reason of a fatal quarantined episode: the run stops at once

        self._cond = threading.Condition()
        self._ready: collections.deque[tuple[Ticket, list[Trajectory]]] = collections.deque()
        self._outstanding: dict[int, Ticket] = {}  # handed out, not yet consumed or freed
        self._generating: set[int] = set()  # handed out, not yet put or cancelled
        self._closed = False
        self.updates_done = 0
        self.issued = 0
        self.freed = 0
        self.counters = collections.Counter()
        self._paused = False

    # ---------------------------------------------------------------- worker side
    def _limit(self) -> int:
        return self.batch_groups * (self.updates_done + 1 + self.async_queue_size)

    def acquire(self, timeout: float | None = None) -> Ticket | None:
        """Block until a prompt may be started; ``None`` if closed or ``timeout`` seconds passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and (self._paused or self.issued - self.freed >= self._limit()):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            if self._closed:
                return None
            pid, seed = self.prompts.next()
            ticket = Ticket(pid, seed, self.group_size)
            self._outstanding[pid] = ticket
            self._generating.add(pid)
            self.issued += 1
            return ticket

    def acquire_many(self, n: int, timeout: float | None = None) -> list[Ticket]:
        """Up to ``n`` prompts: the first as :meth:`acquire` (blocking up to ``timeout``), the rest only
        if they may start at once. Empty when closed or timed out."""
        first = self.acquire(timeout=timeout)
        if first is None:
            return []
        tickets = [first]
        while len(tickets) < n:
            more = self.acquire(timeout=0)
            if more is None:
                break
            tickets.append(more)
        return tickets

    def put_many(self, groups: Sequence[tuple[Ticket, Sequence[Trajectory]]]) -> list[int]:
        """:meth:`put` for each ``(ticket, trajectories)`` in order; the valid count of each."""
        return [self.put(ticket, trajs) for ticket, trajs in groups]

    def put(self, ticket: Ticket, trajectories: Sequence[Trajectory | QuarantinedEpisode]) -> int:
        """Hand in the finished samples of ``ticket`` (a :class:`QuarantinedEpisode` for each sample the
        worker could not finish); returns how many were valid and queued."""
        valid: list[Trajectory] = []
        failed: list[str] = []
        rejected = quarantined = 0
        retry = False
        for traj in trajectories:
            if isinstance(traj, QuarantinedEpisode):
                quarantined += 1
                retry = retry or traj.retry
                failed.append(traj.reason)
                if traj.fatal and not self._fatal:
                    self._fatal = traj.reason
                self.quarantine.append((traj.reason, traj))  # the worker has logged it
                continue
            found = traj.diagnose(self.vocab_size) if isinstance(traj, Trajectory) else \
                ("not a Trajectory", f"expected a Trajectory, got {type(traj).__name__}")
            if found is None:
                valid.append(traj)
                continue
            kind, problem = found
            rejected += 1
            failed.append(problem)
            self.quarantine.append((problem, traj))
            self._problems.report(kind, "rejected a trajectory of prompt %d: %s", ticket.prompt_id, problem)
        skipped = None
        with self._cond:
            if ticket.prompt_id not in self._generating:
                raise ValueError(f"put: ticket for prompt {ticket.prompt_id} is not outstanding "
                                 "(already put, cancelled, or issued by another buffer)")
            self._generating.discard(ticket.prompt_id)
            self.counters["rejected_trajectories"] += rejected
            self.counters["quarantined_episodes"] += quarantined
            if valid:
                self._failed_in_a_row = 0
                self._attempts.pop(ticket.prompt_id, None)
                self._ready.append((ticket, valid))
                self.counters["put_trajectories"] += len(valid)
            else:
                self._failed_in_a_row += len(failed)
                self._last_failure = failed[-1] if failed else "a group without samples"
                del self._outstanding[ticket.prompt_id]
                self.freed += 1
                if quarantined:
                    # The worker could not finish any sample: perhaps a passing problem, so the prompt is
                    # handed out again (first), up to max_prompt_attempts times in all.
                    attempts = self._attempts.get(ticket.prompt_id, 0) + 1
                    if retry and attempts < self.max_prompt_attempts:
                        self._attempts[ticket.prompt_id] = attempts
                        self.counters["retried_prompts"] += 1
                        self.prompts.requeue([(ticket.prompt_id, ticket.seed)])
                    else:
                        self._attempts.pop(ticket.prompt_id, None)
                        self.counters["skipped_prompts"] += 1
                        skipped = attempts
                else:
                    # Nothing usable: the prompt is not retried (its problem is in the data, likely deterministic).
                    self.counters["rejected_groups"] += 1
            self._cond.notify_all()
        if skipped is not None:
            self._problems.report("prompt skipped", "prompt %d (environment seed %d) skipped after %d attempts "
                                  "that all failed; the last: %s", ticket.prompt_id, ticket.seed, skipped, failed[-1])
        return len(valid)

    def cancel(self, ticket: Ticket, reason: str = "", *, lost: bool = False) -> bool:
        """The worker could not finish ``ticket`` (error, shutdown): free the slot, hand the prompt out again.

        ``lost``: the worker died with the ticket (counted as ``lost_groups`` / ``lost_trajectories``,
        ``group_size`` each, instead of ``cancelled_groups``). Returns False when the ticket was not
        being generated (already put or cancelled).
        """
        with self._cond:
            if ticket.prompt_id not in self._generating:
                return False
            self._generating.discard(ticket.prompt_id)
            del self._outstanding[ticket.prompt_id]
            self.freed += 1
            if lost:
                self.counters["lost_groups"] += 1
                self.counters["lost_trajectories"] += ticket.group_size
            else:
                self.counters["cancelled_groups"] += 1
            self.prompts.requeue([(ticket.prompt_id, ticket.seed)])
            self._cond.notify_all()
        if reason:
            log.warning("prompt %d %s: %s", ticket.prompt_id, "lost" if lost else "cancelled", reason)
        return True

    # ---------------------------------------------------------------- learner side
    def take(self, learner_version: int, timeout: float | None = None) -> Batch | None:
        """The next ``batch_groups`` groups in completion order, each exactly once.

        Groups more than ``max_policy_lag`` versions behind ``learner_version`` are dropped on the way
        (counted in ``counters['dropped_stale_*']``, prompt handed out again). Returns ``None`` when
        the buffer is closed or ``timeout`` seconds pass first; groups already collected then go back
        to the front of the queue, in order.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        groups: list[tuple[Ticket, list[Trajectory]]] = []
        dropped_groups = dropped_trajs = 0
        with self._cond:
            while len(groups) < self.batch_groups:
                while not self._ready and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if not self._ready:
                    self._ready.extendleft(reversed(groups))
                    return None
                ticket, trajs = self._ready.popleft()
                lag = learner_version - min(t.policy_version_min for t in trajs)
                if self.max_policy_lag is not None and lag > self.max_policy_lag:
                    del self._outstanding[ticket.prompt_id]
                    self.freed += 1
                    self.prompts.requeue([(ticket.prompt_id, ticket.seed)])
                    dropped_groups += 1
                    dropped_trajs += len(trajs)
                    self.counters["dropped_stale_groups"] += 1
                    self.counters["dropped_stale_trajectories"] += len(trajs)
                    self._cond.notify_all()
                    continue
                groups.append((ticket, trajs))
            for ticket, _ in groups:
                del self._outstanding[ticket.prompt_id]
            self.counters["taken_groups"] += len(groups)
            self.counters["taken_trajectories"] += sum(len(g) for _, g in groups)
        return Batch([g for _, g in groups], learner_version, time.monotonic() - start, dropped_groups, dropped_trajs)

    def _full(self) -> bool:
        return not self._generating and self.issued - self.freed >= self._limit()

    def wait_until_full(self, timeout: float | None = None) -> bool:
        """Block until every prompt the staleness bound allows has been handed out and finished (none is
        being generated, and ``async_queue_size + 1`` batches beyond the consumed ones are complete or
        taken); True then, False when closed or after ``timeout`` seconds.

        A fixed policy lag (``train.fixed_policy_lag``) waits for this before each new version is
        published, so that no trajectory of the batches already allowed is sampled by the new one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and not self._full():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return not self._closed

    def pause(self) -> None:
        """Hand out no prompt until :meth:`resume` (the learner evaluates); workers also wait between
        engine calls of the episodes they hold (:attr:`paused`)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def update_done(self) -> None:
        """The learner finished an optimizer step: one more batch of prompts may be started."""
        with self._cond:
            self.updates_done += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter; ``acquire`` and ``take`` return ``None`` from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------- introspection and resume
    def in_flight(self) -> int:
        """Prompts handed out and not yet consumed or freed (being generated or waiting in the queue)."""
        with self._cond:
            return len(self._outstanding)

    def ready_groups(self) -> int:
        with self._cond:
            return len(self._ready)

    def stats(self) -> dict[str, int | str]:
        with self._cond:
            out: dict = {k: 0 for k in ("rejected_trajectories", "quarantined_episodes", "retried_prompts",
                                        "skipped_prompts")}
            out.update(self.counters)
            out.update(issued=self.issued, freed=self.freed, updates_done=self.updates_done,
                       in_flight=len(self._outstanding), ready_groups=len(self._ready),
                       failed_in_a_row=self._failed_in_a_row, last_failure=self._last_failure,
                       batch_episodes=self.batch_groups * self.group_size, fatal_failure=self._fatal)
            return out

    def state_dict(self) -> dict:
        """Counters and the prompt stream; prompts in flight are handed out again first on resume."""
        with self._cond:
            outstanding = sorted((t.prompt_id, t.seed) for t in self._outstanding.values())
            return {"updates_done": self.updates_done, "counters": dict(self.counters),
                    "prompts": self.prompts.state_dict(outstanding),
                    "prompt_attempts": {str(pid): n for pid, n in sorted(self._attempts.items())}}

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            if self.issued:
                raise RuntimeError("load_state_dict must be called before any prompt is handed out")
            self.updates_done = int(state["updates_done"])
            self.counters = collections.Counter(state["counters"])
            self.prompts.load_state_dict(state["prompts"])
            self._attempts = {int(pid): int(n) for pid, n in state.get("prompt_attempts", {}).items()}
            # The slots of the consumed batches are accounted for by updates_done.
            self.issued = self.batch_groups * self.updates_done
            self._cond.notify_all()
