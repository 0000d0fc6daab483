"""Rollout workers: run environment episodes with an engine and hand finished trajectories to the buffer.

A :class:`RolloutWorker` loops: take prompts from the buffer (``acquire``; this blocks while the
staleness bound is reached), run their episodes together (every ``generate`` call samples one turn
of each live episode), ``put`` the finished groups. Before each ``generate`` call it loads the
newest published weights, so new weights arrive between turns without a restart; a trajectory
records the oldest and newest version that sampled it.

Episode layout: ``prompt tokens | action tokens | observation tokens | action tokens | ...``.
The episode ends when the environment says ``done``, after ``max_turns`` policy turns, or when the
context reaches ``max_len`` tokens (the last two set ``truncated``). An observation that would not
fit is not appended (the episode ends truncated instead); text longer than the room left could hold
at the tokenizer's longest token is not even tokenized. ``failed`` is the environment's label of
its last step, or ``reward <= 0`` when it gave none.

Faults stay with the episode that caused them (:mod:`~flashreinforce.trainer.rollout.fault_records`): an environment
call that raises, returns a wrong type or does not return within ``env_timeout_s``, text the
tokenizer cannot encode, a prompt that cannot fit, or an engine error on one request quarantines
that episode only: the worker hands a :class:`~flashreinforce.trainer.rollout.fault_records.QuarantinedEpisode` to
the buffer in its place (which retries the prompt a few times, then skips it) and keeps every other
episode of the call. An engine call that fails on each of its requests is retried one request at a
time; a worker whose engine failed on every request of ``MAX_ENGINE_FAILURES_IN_A_ROW`` calls in a
row stops (the trainer stops when no worker is left).

With ``episodes_in_flight`` (``rollout.episodes_in_flight``) a worker does not run its episodes call
by call: it keeps up to that many in flight, starts new prompts as others end, hands each finished
group in at once, and decodes the turns of the episodes whose environment has answered while other
episodes' tool calls still run (:mod:`~flashreinforce.trainer.rollout.stream`). Slow tools then overlap
decoding instead of stalling it.

A worker is built with :class:`~flashreinforce.trainer.rollout.settings.RolloutSettings`. Workers run
as threads (:class:`~flashreinforce.trainer.rollout.thread_pool.ThreadRolloutPool`, the ``local``
backend), or as Ray actors running the same :class:`RolloutWorker` against a buffer actor
(:mod:`flashreinforce.distributed.ray`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from flashreinforce.engines.base import Generation, GenerationRequest, RolloutEngine, SamplingParams, WeightStore
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.models.tokenizers import CharTokenizer
from flashreinforce.trainer.rollout.buffer import RolloutBuffer, Ticket
from flashreinforce.trainer.rollout.env_calls import EnvCalls
from flashreinforce.trainer.rollout.episode import Episode, EpisodeFault, check_step_result, turn_cut, turn_stop
from flashreinforce.trainer.errors import StopRequested
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode, RepeatedProblems
from flashreinforce.trainer.rollout.settings import RolloutSettings, episode_seed
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["MAX_ENGINE_FAILURES_IN_A_ROW", "RolloutWorker", "TurnSample", "max_token_chars"]

log = logging.getLogger(__name__)

EnvFactory = Callable[[], Environment]

#: A worker stops after this many engine calls in a row failed on every one of their requests.
MAX_ENGINE_FAILURES_IN_A_ROW = 10


@dataclass
class TurnSample:
    """One turn as sampled, possibly in several engine calls (in-flight weight updates): ``token_ids``,
    ``log_probs`` (nats), the weight version of every token, and the finish reason of the last call."""

    token_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish_reason: str

    @staticmethod
    def of(g: Generation) -> "TurnSample":
        n = len(g.token_ids)
        return TurnSample(list(g.token_ids), list(g.log_probs), [int(g.policy_version)] * n, g.finish_reason)

    def extend(self, g: Generation) -> None:
        self.token_ids.extend(g.token_ids)
        self.log_probs.extend(g.log_probs)
        self.versions.extend([int(g.policy_version)] * len(g.token_ids))
        self.finish_reason = g.finish_reason


def _continued_stop(stop: Callable[[Sequence[int]], bool] | None, before: list[int]):
    """The stop rule of a continuation: asked on the whole turn, ``before`` included."""
    if stop is None:
        return None
    return lambda new_ids: stop(before + list(new_ids))


def max_token_chars(tokenizer) -> int | None:
    """An upper bound on the characters one token of ``tokenizer`` stands for (``None``: unknown), so
    that text too long to fit in ``n`` tokens (more than ``n`` times the bound) is never tokenized.

    The character tokenizer: 1. A Hugging Face tokenizer: its longest vocabulary entry (byte-level and
    SentencePiece entries are at least as long as the text they decode to). Text whose normalization
    shortens it (NFKC composition) can in principle be cut although it would have fit.
    """
    bound = getattr(tokenizer, "max_token_chars", None)
    if isinstance(bound, int) and bound > 0:
        return bound
    if isinstance(tokenizer, CharTokenizer):
        return 1
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and hasattr(hf, "get_vocab"):
        try:
            return max(1, max(len(str(t)) for t in hf.get_vocab()))
        except (TypeError, ValueError):
            return None
    return None


class RolloutWorker:
    """One rollout worker: an engine, a pool of environments, the buffer and the weight store.

    Args:
        worker_id: index used in logs and trajectory records.
        engine: this worker's engine (its own copy of the policy).
        env_factory: builds one environment instance (called lazily, instances are reused; an instance
            whose call timed out is abandoned and replaced).
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
        self._envs: list[Environment | None] = []
        self._calls = EnvCalls(settings.env_timeout_s, name=f"rollout-worker-{worker_id}-env",
                               max_parallel=settings.env_parallel_calls)
        self._problems = RepeatedProblems(log, f"rollout worker {worker_id}")
        self._token_chars = max_token_chars(tokenizer)
        self._engine_call_since: tuple[str, float] | None = None  # ("engine.generate", start) during a call
        self._stop: threading.Event | None = None  # the stop event of the tickets being run
        self._last_version_check = 0.0
        self._newest_seen = -1
        self.idle_s = 0.0
        self.busy_s = 0.0
        self.paused_s = 0.0  # waited for the learner's evaluation (part of busy_s)
        self.episodes = 0
        self.errors = 0
        self.quarantined = 0
        self.weight_loads = 0
        self.weight_sync_s = 0.0  # seconds spent loading weights, all loads
        self.last_weight_sync: tuple[float, int] = (0.0, 0)  # seconds and bytes of the last load
        self.start_weight_load: tuple[float, int] = (0.0, 0)  # a load at the start (an engine without weights)
        self.inflight_pauses = 0  # engine calls continued after loading newer weights mid-turn
        self.engine_failures_in_a_row = 0
        self.last_error: str | None = None
        # Set by the pool (fair_share): with a large episodes_per_call one worker would otherwise take
        # every prompt that may be in flight and leave the other engines idle.
        self.max_prompts_per_call: int | None = None

    # ------------------------------------------------------------------ episodes
    def _env(self, k: int) -> Environment:
        while len(self._envs) <= k:
            self._envs.append(None)
        if self._envs[k] is None:
            self._envs[k] = self.env_factory()
        return self._envs[k]

    def _quarantine(self, e: Episode, kind: str, reason: str, err: BaseException | None = None,
                    retry: bool = True) -> None:
        """Take ``e`` out of the call: it is handed in as a :class:`QuarantinedEpisode`."""
        e.done = True
        e.quarantined = QuarantinedEpisode(e.ticket.prompt_id, e.sample_index, kind, reason, retry)
        self.quarantined += 1
        self.errors += 1
        detail = "".join(traceback.format_exception(err)) if err is not None and not isinstance(err, EpisodeFault) else ""
        self.last_error = f"{reason}\n{detail}" if detail else reason
        self._problems.report(kind, "worker %d: episode of prompt %d (environment seed %d) quarantined: %s%s",
                              self.worker_id, e.ticket.prompt_id, e.ticket.seed, reason,
                              f"\n{detail}" if detail else "")

    def _failed_call(self, e: Episode, what: str, status: str, value: Any) -> None:
        if status == "timeout":
            # The call still runs in an abandoned thread that owns this instance: never use it again.
            self._envs[e.slot] = None
            self._quarantine(e, f"{what} timed out", f"{what} timed out: no return within {value:g} s "
                             "(--rollout.env_timeout_s); the environment instance was abandoned")
        elif isinstance(value, EpisodeFault):
            self._quarantine(e, value.kind, value.reason, value, value.retry)
        else:
            self._quarantine(e, f"{what} raised {type(value).__name__}", f"{what} raised {type(value).__name__}: "
                             f"{value}", value)

    def _env_calls(self, calls: list[tuple[Episode, str, Callable[[], Any]]],
                   stop: threading.Event | None) -> list[tuple[Episode, str, Any]]:
        """Run each ``(episode, what, fn)``; an episode whose call raised or timed out is quarantined, the
        others come back as ``(episode, what, value)`` in the order of ``calls``."""
        serial = not all(getattr(e.env, "parallel_calls", True) for e, _, _ in calls)
        try:
            results = self._calls.run([(id(e), what, fn, e.env.close) for e, what, fn in calls], stop,
                                      max_parallel=1 if serial else None)
        except StopRequested:
            raise _Stopped() from None
        returned = []
        for e, what, _ in calls:
            status, value = results[id(e)]
            if status == "ok":
                returned.append((e, what, value))
            else:
                self._failed_call(e, what, status, value)
        return returned

    def _begin(self, episodes: list[Episode], stop: threading.Event | None) -> None:
        """Build each episode's environment, reset it and encode its prompt."""
        s = self.settings
        for e in episodes:
            try:
                e.env = self._env(e.slot)
            except Exception as err:
                self._quarantine(e, f"building the environment raised {type(err).__name__}",
                                 f"building the environment raised {type(err).__name__}: {err}", err)
        calls = [(e, "env.reset", functools.partial(e.env.reset, seed=e.ticket.seed)) for e in episodes if not e.done]
        for e, _, value in self._env_calls(calls, stop):
            try:
                if not isinstance(value, str):
                    raise EpisodeFault("env.reset returned a wrong type",
                               f"{type(e.env).__name__}.reset returned {type(value).__name__}, expected str")
                if self._token_chars is not None and len(value) > s.max_len * self._token_chars:
                    raise EpisodeFault("prompt longer than data.max_len", f"the prompt of {len(value)} characters cannot fit "
                               f"in data.max_len {s.max_len} tokens", retry=False)
                ids = self.tokenizer.encode_prompt(value)
                if len(ids) >= s.max_len:
                    raise EpisodeFault("prompt longer than data.max_len", f"the prompt of {len(ids)} tokens leaves no room for "
                               f"an action in data.max_len {s.max_len}", retry=False)
            except Exception as err:
                self._failed_call(e, "encoding the prompt", "error", err)
                continue
            e.start(ids)

    def _engine_call(self, requests: list[GenerationRequest], should_pause,
                     params: SamplingParams | None = None) -> list[Any]:
        """One ``generate`` call (``params``: the run's sampling when ``None``); where it fails as a
        whole, its requests one at a time (an exception in place of each request the engine failed on)."""
        params = self.settings.sampling if params is None else params
        kwargs = {} if should_pause is None else {"should_pause": should_pause}
        self._engine_call_since = ("engine.generate", time.monotonic())
        try:
            try:
                gens = list(self.engine.generate(requests, params, **kwargs))
                if len(gens) != len(requests):
                    raise RuntimeError(f"the engine returned {len(gens)} generations for {len(requests)} requests")
                self.engine_failures_in_a_row = 0
                return gens
            except Exception as err:
                whole = err
            out: list[Any] = [whole]
            if len(requests) > 1:  # find the request(s) that fail: one at a time
                out = []
                for r in requests:
                    try:
                        out.append(self.engine.generate([r], params, **kwargs)[0])
                    except Exception as err:
                        out.append(err)
            if all(isinstance(g, BaseException) for g in out):
                self.engine_failures_in_a_row += 1
            else:
                self.engine_failures_in_a_row = 0
            return out
        finally:
            self._engine_call_since = None

    def _newer_weights_waiting(self) -> bool:
        """Whether a version newer than the engine's is published (the store is asked at most every
        50 ms; a newer version once seen stays seen until the engine has loaded it)."""
        if self._newest_seen > self.engine.version:
            return True
        now = time.monotonic()
        if now - self._last_version_check < 0.05:
            return False
        self._last_version_check = now
        self._newest_seen = self.weights.latest_version()
        return self._newest_seen > self.engine.version

    def _start_weights(self) -> None:
        """Before the first episode. An engine built from a copy of the policy at the newest published
        version is told which published tensors it holds (:meth:`RolloutEngine.holds`), so that its first
        sync sends only what changed since: under LoRA the adapters, not the frozen base again. An engine
        built without weights (vLLM from the model's config) loads the newest version now, as part of its
        start: its first sync after an update then sends what that update changed (under LoRA, the
        adapters). A failure here is left to the first sync, which retries."""
        try:
            got = self.weights.fetch(self.engine.version - 1)
            if got is None or got[0] < 0:
                return
            version, state = got
            if version == self.engine.version:
                self.engine.holds(state, version)
            elif self.engine.version < 0:
                t0 = time.perf_counter()
                self.engine.load_weights(state, version)
                self.start_weight_load = (time.perf_counter() - t0, int(getattr(self.engine, "last_load", (0.0, 0))[1]))
                log.info("worker %d: the engine loaded version %d at its start (%.0f MiB in %.2f s)", self.worker_id,
                         version, self.start_weight_load[1] / 2**20, self.start_weight_load[0])
        except Exception as err:  # the first sync loads the weights instead
            log.warning("worker %d: loading the weights at the start failed (%s); the first sync will", self.worker_id,
                        err)

    def _sync_weights(self) -> None:
        """Load the newest published weights into the engine if it is behind (timed, for the metrics)."""
        t0 = time.perf_counter()
        if self.weights.sync(self.engine):
            self.weight_loads += 1
            seconds = time.perf_counter() - t0
            self.last_weight_sync = (seconds, int(getattr(self.engine, "last_load", (0.0, 0))[1]))
            self.weight_sync_s += seconds

    def _generate(self, live: list[Episode]) -> list[Any]:
        """One :class:`TurnSample` per live episode (an exception in place of those the engine failed
        on). With in-flight weight updates, a turn the engine paused for newer weights is continued
        under them after they are loaded, until it ends."""
        s = self.settings
        requests = [GenerationRequest(e.tokens, min(s.max_new_tokens, s.max_len - len(e.tokens)),
                                      episode_seed(s.seed, e.ticket.prompt_id, e.sample_index, e.turns),
                                      stop=turn_stop(e.env, self.tokenizer))
                    for e in live]
        return self._sample(requests)

    def _sample(self, requests: list[GenerationRequest], params: SamplingParams | None = None) -> list[Any]:
        """One :class:`TurnSample` per request (an exception in place of those the engine failed on),
        sampled with ``params`` (the run's sampling when ``None``); paused turns are continued."""
        s = self.settings
        pause = self._newer_weights_waiting if s.inflight_weight_updates and self.engine.can_pause else None
        stop = self._stop
        if stop is not None and self.engine.can_pause:  # a stopping run does not wait for a long generation
            pause = stop.is_set if pause is None else (lambda newer=pause: stop.is_set() or newer())
        out: list[Any] = [g if isinstance(g, BaseException) else TurnSample.of(g)
                          for g in self._engine_call(requests, pause, params)]
        paused = [k for k, t in enumerate(out) if isinstance(t, TurnSample) and t.finish_reason == "paused"]
        while paused:
            if stop is not None and stop.is_set():
                raise _Stopped()
            self._sync_weights()
            self.inflight_pauses += 1
            more = [GenerationRequest(list(requests[k].token_ids) + out[k].token_ids,
                                      requests[k].max_new_tokens - len(out[k].token_ids),
                                      requests[k].seed + len(out[k].token_ids),
                                      stop=_continued_stop(requests[k].stop, out[k].token_ids)) for k in paused]
            for k, g in zip(paused, self._engine_call(more, pause, params)):
                if isinstance(g, BaseException):
                    out[k] = g
                else:
                    out[k].extend(g)
            paused = [k for k in paused if isinstance(out[k], TurnSample) and out[k].finish_reason == "paused"]
        return out

    def _act(self, live: list[Episode]) -> list[tuple[Episode, str]]:
        """One generation call for the next turn of every episode in ``live``: each episode with its action
        text; one whose generation or decoding failed is quarantined instead."""
        acted: list[tuple[Episode, str]] = []
        for e, g in zip(live, self._generate(live)):
            if isinstance(g, BaseException):
                self._failed_call(e, "engine.generate", "error", g)
                continue
            try:
                acted.append((e, self._record_action(e, g)))
            except Exception as err:
                self._failed_call(e, "decoding the action", "error", err)
        return acted

    def _take_step(self, e: Episode, value: Any) -> None:
        """Apply what ``e``'s ``env.step`` returned (checked); a wrong result, or an observation that does
        not encode, quarantines it."""
        try:
            self._after_step(e, check_step_result(value, type(e.env).__name__))
        except EpisodeFault as err:
            self._failed_call(e, "env.step", "error", err)
        except Exception as err:  # the tokenizer on the observation text
            self._failed_call(e, "encoding the observation", "error", err)

    def _record_action(self, e: Episode, t: TurnSample) -> str:
        """Append the sampled turn to ``e`` (cut where its environment ends it); the action's text."""
        if not t.token_ids:
            raise EpisodeFault("the engine returned an empty generation", "the engine returned an empty generation")
        ids, logps, versions, reason = ([int(x) for x in t.token_ids], [float(x) for x in t.log_probs],
                                        [int(v) for v in t.versions], t.finish_reason)
        cut = turn_cut(e.env, self.tokenizer, ids)
        e.turn_ended = cut is not None and ids[cut - 1] not in set(self.settings.sampling.stop_token_ids)
        if cut is not None:
            ids, logps, versions, reason = ids[:cut], logps[:cut], versions[:cut], "stop"
        e.add_action(ids, logps, versions)
        e.length_finishes += int(reason == "length")
        e.turns += 1
        return self.tokenizer.decode(ids)

    def _after_step(self, e: Episode, result: StepResult) -> None:
        s = self.settings
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
        # A turn the environment ended early is closed with the end-of-turn token, as context: the
        # observation's wrapping (the chat template's next turn) follows a finished turn.
        close = [s.sampling.stop_token_ids[0]] if e.turn_ended and s.sampling.stop_token_ids else []
        room = s.max_len - len(e.tokens) - len(close)  # the observation fits when it has fewer tokens than this
        text = result.observation
        if self._token_chars is not None and len(text) >= room * self._token_chars:
            e.finish(truncated=True)  # too long for the room left: not worth tokenizing
            return
        obs = close + (self.tokenizer.encode_observation(text) if text else [])
        if len(e.tokens) + len(obs) >= s.max_len:
            e.finish(truncated=True)
            return
        e.add_context(obs)

    def run_tickets(self, tickets: Sequence[Ticket],
                    stop: threading.Event | None = None) -> list[list[Trajectory | QuarantinedEpisode]]:
        """Run every sample of ``tickets`` to the end; returns, per ticket, its trajectories (a
        :class:`QuarantinedEpisode` for each sample that could not be finished)."""
        s = self.settings
        self._stop = stop
        episodes = [Episode(ticket, j, slot) for slot, (ticket, j) in
                    enumerate((t, j) for t in tickets for j in range(t.group_size))]
        self._begin(episodes, stop)
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
            self._wait_while_paused(stop)
            self._sync_weights()
            calls = [(e, "env.step", functools.partial(e.env.step, text)) for e, text in self._act(live)]
            for e, _, value in self._env_calls(calls, stop):
                self._take_step(e, value)
        by_ticket: dict[int, list[Trajectory | QuarantinedEpisode]] = {t.prompt_id: [] for t in tickets}
        for e in episodes:
            by_ticket[e.ticket.prompt_id].append(e.result(self.worker_id))
        return [by_ticket[t.prompt_id] for t in tickets]

    def _wait_while_paused(self, stop: threading.Event | None) -> None:
        """Between engine calls: wait while the learner has paused the rollouts (an evaluation)."""
        if self.buffer is None:
            return
        t0 = time.perf_counter()
        while self.buffer.paused and not (stop is not None and stop.is_set()):
            time.sleep(0.05)
        self.paused_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event) -> None:
        """Roll out until ``stop`` is set or the buffer closes: call by call (every episode of a call to
        its end, then the next prompts), or with ``episodes_in_flight`` as
        :class:`~flashreinforce.trainer.rollout.stream.EpisodeStream` does."""
        per_call = max(1, self.settings.episodes_per_call // max(1, self.buffer.group_size))
        if self.max_prompts_per_call:
            per_call = min(per_call, self.max_prompts_per_call)
        consecutive_errors = 0
        self._start_weights()
        if self.settings.episodes_in_flight:
            if type(self).run_tickets is RolloutWorker.run_tickets:
                from flashreinforce.trainer.rollout.stream import EpisodeStream

                return EpisodeStream(self, _Stopped, MAX_ENGINE_FAILURES_IN_A_ROW).run(stop)
            if self.worker_id == 0:
                log.warning("rollout.episodes_in_flight %d has no effect on %s, which runs its episodes its own "
                            "way", self.settings.episodes_in_flight, type(self).__name__)
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
            except Exception as err:  # outside any one episode (weights, the worker itself): hand the prompts back
                self.errors += 1
                consecutive_errors += 1
                self.last_error = "".join(traceback.format_exception(err))
                log.warning("worker %d: error (%d in a row), %d prompt(s) handed out again:\n%s",
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
            self.episodes += sum(isinstance(x, Trajectory) for trajs in groups for x in trajs)
            self.busy_s += time.perf_counter() - t1
            if self.engine_failures_in_a_row >= MAX_ENGINE_FAILURES_IN_A_ROW:
                log.error("worker %d stops: its engine failed on every request of %d calls in a row; the last error: "
                          "%s", self.worker_id, self.engine_failures_in_a_row, self.last_error)
                raise RuntimeError(f"worker {self.worker_id}: the engine failed on every request of "
                                   f"{self.engine_failures_in_a_row} calls in a row; the last error: {self.last_error}")

    def close(self) -> None:
        self._calls.close()
        for env in self._envs:
            if env is None:
                continue
            try:
                env.close()
            except Exception:  # closing must not hide the run's own outcome
                log.exception("worker %d: env.close() failed", self.worker_id)
        self.engine.close()

    def stats(self) -> dict[str, Any]:
        """Counters (numbers), and the call the worker is inside now (``current_call``, ``current_call_s``)."""
        call = self._calls.current or self._engine_call_since
        return {"idle_s": self.idle_s, "busy_s": self.busy_s, "episodes": self.episodes, "errors": self.errors,
                "weight_loads": self.weight_loads, "weight_sync_s_total": self.weight_sync_s,
                "last_weight_sync_s": self.last_weight_sync[0], "last_weight_sync_bytes": self.last_weight_sync[1],
                "start_weight_load_s": self.start_weight_load[0], "start_weight_load_bytes": self.start_weight_load[1],
                "inflight_pauses": self.inflight_pauses, "quarantined_episodes": self.quarantined,
                "env_timeouts": self._calls.timeouts, "env_timeouts_by_call": dict(self._calls.timeouts_by_call),
                "engine_failure": self.engine.failure() or "", "current_call": call[0] if call else "",
                "current_call_s": time.monotonic() - call[1] if call else 0.0}


class _Stopped(Exception):
    pass
