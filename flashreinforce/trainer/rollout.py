"""Rollout workers: run environment episodes with an engine and hand finished trajectories to the buffer.

A :class:`RolloutWorker` loops: take prompts from the buffer (``acquire``; this blocks while the
staleness bound is reached), run their episodes together (every ``generate`` call samples one turn
of each live episode), ``put`` the finished groups. Before each ``generate`` call it loads the
newest published weights, so new weights arrive between turns without a restart; a trajectory
records the oldest and newest version that sampled it.

Episode layout: ``prompt tokens | action tokens | observation tokens | action tokens | ...``.
The episode ends when the environment says ``done``, after ``max_turns`` policy turns, or when the
context reaches ``max_len`` tokens (the last two set ``truncated``). An observation that would not
fit is not appended (the episode ends truncated instead). ``failed`` is the environment's label of
its last step, or ``reward <= 0`` when it gave none.

Workers run as threads (:class:`ThreadRolloutPool`, the ``local`` backend), or as Ray actors running
the same :class:`RolloutWorker` against a buffer actor (:mod:`flashreinforce.distributed.ray`).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from flashreinforce.trainer.buffer import RolloutBuffer, Ticket
from flashreinforce.engines.base import GenerationRequest, RolloutEngine, SamplingParams, WeightStore
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.trainer.trajectory import Trajectory

__all__ = ["RolloutBackend", "RolloutSettings", "RolloutWorker", "ThreadRolloutPool", "episode_seed", "fair_share"]

log = logging.getLogger(__name__)

EnvFactory = Callable[[], Environment]


def episode_seed(run_seed: int, prompt_id: int, sample_index: int, turn: int) -> int:
    """The sampling seed of one turn: a fixed function of the run seed, the prompt and the sample,
    so a rollout is reproducible whatever worker or batch it lands in."""
    x = (run_seed * 0x9E3779B1 + prompt_id) * 0x85EBCA77 + sample_index * 0xC2B2AE3D + turn * 0x27D4EB2F
    return x % (2**63 - 1)


def fair_share(batch_groups: int, async_queue_size: int, num_workers: int) -> int:
    """Prompts one worker may take in one call so that ``num_workers`` workers can all have work:
    the prompts that may be in flight at once (``batch_groups * (1 + async_queue_size)``) divided
    among the workers, rounded up (at least 1)."""
    if num_workers <= 0:
        raise ValueError(f"num_workers must be positive, got {num_workers}")
    return max(1, -(-batch_groups * (1 + async_queue_size) // num_workers))


@dataclass
class RolloutSettings:
    """How workers roll out.

    max_new_tokens: sampled tokens per turn at most. max_len: tokens per trajectory at most
    (prompt, actions and observations). max_turns: policy turns per episode at most.
    sampling: temperature / top-p / top-k and stop tokens. episodes_per_call: episodes a worker
    runs together (one ``generate`` call samples a turn of each). seed: run seed for sampling.
    """

    max_new_tokens: int
    max_len: int
    max_turns: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    episodes_per_call: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_len", "max_turns", "episodes_per_call"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RolloutSettings.{name} must be positive, got {getattr(self, name)}")


class _Episode:
    def __init__(self, ticket: Ticket, sample_index: int, env: Environment, prompt_ids: list[int]) -> None:
        self.ticket = ticket
        self.sample_index = sample_index
        self.env = env
        self.tokens = list(prompt_ids)
        self.mask = [False] * len(prompt_ids)
        self.logp = [0.0] * len(prompt_ids)
        self.reward = 0.0
        self.turns = 0
        self.vmin: int | None = None
        self.vmax: int | None = None
        self.done = False
        self.truncated = False
        self.failed_label: bool | None = None
        self.info: dict[str, Any] = {}
        self.length_finishes = 0
        self.action_tokens = 0

    def finish(self, truncated: bool = False) -> None:
        self.done = True
        self.truncated = truncated

    def trajectory(self, worker_id: int) -> Trajectory:
        failed = self.failed_label if self.failed_label is not None else self.reward <= 0
        info = dict(self.info)
        info.update(action_tokens=self.action_tokens, length_finishes=self.length_finishes)
        return Trajectory(
            token_ids=self.tokens, action_mask=self.mask, behavior_log_probs=self.logp, reward=float(self.reward),
            failed=bool(failed), truncated=self.truncated, policy_version_min=int(self.vmin if self.vmin is not None else -1),
            policy_version_max=int(self.vmax if self.vmax is not None else -1), prompt_id=self.ticket.prompt_id,
            seed=self.ticket.seed, sample_index=self.sample_index, num_turns=self.turns, worker_id=worker_id, info=info)


class RolloutWorker:
    """One rollout worker: an engine, a pool of environments, the buffer and the weight store.

    Args:
        worker_id: index used in logs and trajectory records.
        engine: this worker's engine (its own copy of the policy).
        env_factory: builds one environment instance (called lazily, instances are reused).
        tokenizer: a :class:`flashreinforce.models.tokenizers.TextTokenizer`.
        buffer: where tickets come from and trajectories go.
        weights: where new policy versions are picked up.
        settings: :class:`RolloutSettings`.
    """

    def __init__(self, worker_id: int, engine: RolloutEngine, env_factory: EnvFactory, tokenizer,
                 buffer: RolloutBuffer, weights: WeightStore, settings: RolloutSettings) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.buffer = buffer
        self.weights = weights
        self.settings = settings
        self._envs: list[Environment] = []
        self.idle_s = 0.0
        self.busy_s = 0.0
        self.episodes = 0
        self.errors = 0
        self.weight_loads = 0
        self.last_error: str | None = None
        # Set by the pool (fair_share): with a large episodes_per_call one worker would otherwise take
        # every prompt that may be in flight and leave the other engines idle.
        self.max_prompts_per_call: int | None = None

    # ------------------------------------------------------------------ episodes
    def _env(self, k: int) -> Environment:
        while len(self._envs) <= k:
            self._envs.append(self.env_factory())
        return self._envs[k]

    def run_tickets(self, tickets: Sequence[Ticket], stop: threading.Event | None = None) -> list[list[Trajectory]]:
        """Run every sample of ``tickets`` to the end; returns one list of trajectories per ticket."""
        s = self.settings
        episodes: list[_Episode] = []
        for ticket in tickets:
            for j in range(ticket.group_size):
                env = self._env(len(episodes))
                prompt = env.reset(seed=ticket.seed)
                episodes.append(_Episode(ticket, j, env, self.tokenizer.encode_prompt(prompt)))
        while True:
            if stop is not None and stop.is_set():
                raise _Stopped()
            live = [e for e in episodes if not e.done]
            for e in live:
                if len(e.tokens) >= s.max_len:
                    e.finish(truncated=True)
            live = [e for e in live if not e.done]
            if not live:
                break
            if self.weights.sync(self.engine):
                self.weight_loads += 1
            requests = [GenerationRequest(e.tokens, min(s.max_new_tokens, s.max_len - len(e.tokens)),
                                          episode_seed(s.seed, e.ticket.prompt_id, e.sample_index, e.turns))
                        for e in live]
            generations = self.engine.generate(requests, s.sampling)
            for e, g in zip(live, generations):
                self._apply(e, g)
        by_ticket: dict[int, list[Trajectory]] = {t.prompt_id: [] for t in tickets}
        for e in episodes:
            by_ticket[e.ticket.prompt_id].append(e.trajectory(self.worker_id))
        return [by_ticket[t.prompt_id] for t in tickets]

    def _apply(self, e: _Episode, g) -> None:
        s = self.settings
        if not g.token_ids:
            raise RuntimeError("the engine returned an empty generation")
        e.tokens.extend(int(t) for t in g.token_ids)
        e.mask.extend([True] * len(g.token_ids))
        e.logp.extend(float(x) for x in g.log_probs)
        e.action_tokens += len(g.token_ids)
        e.length_finishes += int(g.finish_reason == "length")
        e.vmin = g.policy_version if e.vmin is None else min(e.vmin, g.policy_version)
        e.vmax = g.policy_version if e.vmax is None else max(e.vmax, g.policy_version)
        e.turns += 1
        result = e.env.step(self.tokenizer.decode(g.token_ids))
        if not isinstance(result, StepResult):
            raise TypeError(f"{type(e.env).__name__}.step returned {type(result).__name__}, expected StepResult")
        e.reward += float(result.reward)
        if result.failed is not None:
            e.failed_label = bool(result.failed)
        for k, v in (result.info or {}).items():
            e.info[k] = v
        if result.done:
            e.finish()
            return
        if e.turns >= s.max_turns:
            e.finish(truncated=True)
            return
        obs = self.tokenizer.encode_observation(result.observation) if result.observation else []
        if len(e.tokens) + len(obs) >= s.max_len:
            e.finish(truncated=True)
            return
        e.tokens.extend(obs)
        e.mask.extend([False] * len(obs))
        e.logp.extend([0.0] * len(obs))

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event) -> None:
        """Roll out until ``stop`` is set or the buffer closes."""
        per_call = max(1, self.settings.episodes_per_call // max(1, self.buffer.group_size))
        if self.max_prompts_per_call:
            per_call = min(per_call, self.max_prompts_per_call)
        consecutive_errors = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            tickets = self.buffer.acquire_many(per_call, timeout=0.2)
            if not tickets:
                self.idle_s += time.perf_counter() - t0
                if self.buffer.closed:
                    break
                continue
            t1 = time.perf_counter()
            self.idle_s += t1 - t0
            try:
                groups = self.run_tickets(tickets, stop)
            except _Stopped:
                for t in tickets:
                    self.buffer.cancel(t)
                break
            except Exception as err:  # an environment or engine error loses only these episodes
                self.errors += 1
                consecutive_errors += 1
                self.last_error = "".join(traceback.format_exception(err))
                log.warning("worker %d: episode error (%d in a row), %d prompt(s) handed out again:\n%s",
                            self.worker_id, consecutive_errors, len(tickets), self.last_error)
                for t in tickets:
                    self.buffer.cancel(t, f"worker {self.worker_id} error: {err!r}")
                self.busy_s += time.perf_counter() - t1
                if consecutive_errors >= 5:
                    log.error("worker %d stops after %d consecutive errors", self.worker_id, consecutive_errors)
                    raise
                continue
            consecutive_errors = 0
            self.buffer.put_many(list(zip(tickets, groups)))
            self.episodes += sum(len(trajs) for trajs in groups)
            self.busy_s += time.perf_counter() - t1

    def close(self) -> None:
        for env in self._envs:
            try:
                env.close()
            except Exception:  # closing must not hide the run's own outcome
                log.exception("worker %d: env.close() failed", self.worker_id)
        self.engine.close()

    def stats(self) -> dict[str, float]:
        return {"idle_s": self.idle_s, "busy_s": self.busy_s, "episodes": self.episodes, "errors": self.errors,
                "weight_loads": self.weight_loads}


class _Stopped(Exception):
    pass


class RolloutBackend(abc.ABC):
    """A set of rollout workers running concurrently with the learner."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self, timeout: float = 30.0) -> None: ...

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``RuntimeError`` if no worker is alive any more (with the last worker error)."""

    @abc.abstractmethod
    def stats(self) -> list[dict[str, float]]: ...


class ThreadRolloutPool(RolloutBackend):
    """The ``local`` backend: each :class:`RolloutWorker` in a thread of this process."""

    def __init__(self, workers: Sequence[RolloutWorker]) -> None:
        if not workers:
            raise ValueError("ThreadRolloutPool needs at least one worker")
        self.workers = list(workers)
        for w in self.workers:
            if w.max_prompts_per_call is None and isinstance(w.buffer, RolloutBuffer):
                w.max_prompts_per_call = fair_share(w.buffer.batch_groups, w.buffer.async_queue_size,
                                                    len(self.workers))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._failures: dict[int, BaseException] = {}

    def _run(self, worker: RolloutWorker) -> None:
        try:
            worker.run(self._stop)
        except BaseException as err:  # recorded; the trainer reports it when no worker is left
            self._failures[worker.worker_id] = err
        finally:
            worker.close()

    def start(self) -> None:
        for w in self.workers:
            t = threading.Thread(target=self._run, args=(w,), name=f"rollout-worker-{w.worker_id}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for w in self.workers:
            w.buffer.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def check(self) -> None:
        if self._threads and not any(t.is_alive() for t in self._threads):
            last = next(iter(self._failures.values()), None)
            detail = "" if last is None else f": {last!r}\n" + (self.workers[0].last_error or "")
            raise RuntimeError(f"every rollout worker has stopped{detail}")

    def stats(self) -> list[dict[str, float]]:
        return [w.stats() for w in self.workers]
