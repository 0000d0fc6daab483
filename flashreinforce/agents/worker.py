"""Rollout workers that run agent functions: the calls they make to the worker's endpoint are sampled
by the worker's engine and recorded token for token into trajectories.

An :class:`AgentRolloutWorker` is a :class:`~flashreinforce.trainer.rollout.worker.RolloutWorker` whose
episodes are calls of the run's agent function (:mod:`flashreinforce.agents.environment`). It owns an
:class:`~flashreinforce.agents.server.AgentServer` (started at its first episode, on 127.0.0.1) and,
for each episode, hands the function a client whose ``base_url`` names that episode and whose API
key is the episode's token (every call must carry it: :mod:`flashreinforce.agents.server`). Many episodes
run at once (``rollout.env_parallel_calls``: each synchronous function in a thread of its own, each
``async def`` one as a task on the worker's event loop). The worker thread alone touches the engine:
it collects the pending calls of all its episodes and samples them in one ``generate`` call per
sampling setting, when every running episode is waiting for the model, when the oldest call has
waited ``batch_wait_s``, or when ``rollout.vllm_generate_batch_size`` calls are waiting. Newer
weights are loaded before each such call, and in-flight weight updates continue paused turns as for
environments.

Trajectories (:mod:`flashreinforce.agents.chat`): the calls that continue one conversation make one
trajectory (each call's prompt tokens not yet in it are context, its sampled tokens are actions);
an episode whose agent started another conversation or rewrote the history gives one trajectory
per conversation, each with the episode's reward (``info['history_rewrites']``). Every sampled token
is an action. ``rollout.agent_sampling`` decides how a call is sampled
(:func:`~flashreinforce.agents.episode.call_sampling`): ``run`` (the default) with the
run's settings whatever the client asked (one warning the first time a client asks for others),
``agent`` with the client's ``temperature`` and ``top_p``, its tokens trained against the
log-probabilities they were sampled with. A response's ``usage.completion_tokens`` is the number
of tokens generated for it.

Limits: the first episode a worker finishes that had a call refused for ``rollout.max_turns`` or
``data.max_len`` stops the run at once (a fatal quarantined episode whose line names the flag), and
an episode with nothing to train on says why (no model call, every call refused).

Faults stay with their episode: an agent that raises, returns something that is not a reward, makes
no model call, or spends more than ``rollout.env_timeout_s`` without calling the model or returning
is quarantined like an environment (its thread or task abandoned; any later call of it is answered
409); a request the endpoint cannot serve is answered with an OpenAI-style error the agent may catch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from flashreinforce.agents.chat import ChatRenderer, Conversations, message_text
from flashreinforce.agents.protocol import APIError, chat_response, completion_response, with_token_ids
from flashreinforce.agents.server import AgentServer, PendingCall
from flashreinforce.agents.toolcalls import get_parser
from flashreinforce.config import ConfigError
from flashreinforce.engines.base import GenerationRequest, SamplingParams
from flashreinforce.agents.environment import agent_environment, check_agent_result
from flashreinforce.agents.episode import (AgentEpisode, Call, Segment, call_sampling, no_tokens_reason,
                                                          refusal_message, sampling_warning)
from flashreinforce.trainer.rollout.buffer import Ticket
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode
from flashreinforce.trainer.rollout.settings import episode_seed
from flashreinforce.trainer.rollout.worker import RolloutWorker, _Stopped
from flashreinforce.trainer.rollout.worker_kinds import register_rollout_worker
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["AgentRolloutWorker"]

log = logging.getLogger(__name__)

#: Seconds an agent's client waits for an answer (the learner's evaluation may pause the rollouts).
CLIENT_TIMEOUT_S = 3600.0


def _text_chars(req) -> int:
    """The characters of text a request would have tokenized: its messages' contents and tool calls and
    its tools (chat), or its prompt text (completion)."""
    if req.kind != "chat":
        return len(req.prompt_text or "")
    try:
        total = len(json.dumps(req.tools)) if req.tools else 0
    except (RecursionError, TypeError, ValueError) as err:
        raise APIError(400, f"tools cannot be read as JSON ({type(err).__name__})", param="tools") from None
    for m in req.messages:
        total += len(message_text(m.get("content")))
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            total += len(str(fn.get("name", ""))) + len(str(fn.get("arguments", "")))
    return total


class AgentExit(Exception):
    """An async agent raised ``SystemExit`` or ``KeyboardInterrupt`` (``raised``): carried as an ordinary
    exception, so that it quarantines its episode instead of ending the worker's event loop."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(f"{type(raised).__name__}({raised})")
        self.raised = raised


@register_rollout_worker("agent")
class AgentRolloutWorker(RolloutWorker):
    """A rollout worker whose episodes are agent-function calls (see the module docstring); the worker of
    every environment whose ``rollout_worker`` is ``"agent"`` (:class:`~flashreinforce.agents.environment.
    AgentEnvironment` and its subclasses)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server: AgentServer | None = None
        self._renderer: ChatRenderer | None | bool = False  # False: not built yet (None: no chat template)
        self._live: dict[str, AgentEpisode] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self.agent_counters = {"agent_calls": 0, "tool_calls": 0, "malformed_tool_calls": 0, "history_rewrites": 0,
                               "mismatched_renderings": 0, "agent_timeouts": 0, "agent_largest_batch": 0}
        self._first_finished = False  # the first episode that returns is checked against the run's limits
        self._sampling_warned = False  # the one warning about a client's own sampling settings
        probe = agent_environment(self._env(0))
        if probe is None:
            raise TypeError("AgentRolloutWorker needs agent environments (--agent FILE.py:FUNC)")
        try:
            self._parser = get_parser(probe.tool_parser)
        except ValueError as err:
            raise ConfigError(f"--env.kwargs tool_parser: {err}") from None

    # ------------------------------------------------------------------ endpoint and functions
    def _ensure_server(self) -> AgentServer:
        if self.server is None:
            env = agent_environment(self._env(0))
            port = env.port + max(0, self.worker_id) if env.port else 0
            self.server = AgentServer(host=env.host, port=port, model_name=env.model_name,
                                      max_connections=env.max_connections, header_timeout_s=env.header_timeout_s,
                                      max_body_bytes=int(env.max_body_mb * 2**20))
            self.server.start()
            for name in ("httpx", "httpx2"):  # the agents' clients log every request at INFO
                logging.getLogger(name).setLevel(logging.WARNING)
            log.info("worker %d: agent endpoint on %s", self.worker_id, self.server.root_url)
        return self.server

    @property
    def renderer(self) -> ChatRenderer | None:
        if self._renderer is False:
            hf = getattr(self.tokenizer, "tok", None)
            try:
                self._renderer = ChatRenderer(hf, self.settings.sampling.stop_token_ids) if hf is not None else None
            except ValueError:
                self._renderer = None
        return self._renderer

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or not self._loop_thread.is_alive():  # a loop that died is replaced
            loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=loop.run_forever, name=f"agent-loop-{self.worker_id}",
                                                 daemon=True)
            self._loop_thread.start()
            self._loop = loop
        return self._loop

    def _start(self, e: AgentEpisode) -> None:
        import openai

        env = e.env
        url = self.server.base_url(e.id)
        kwargs = {**({"base_url": url} if env.takes_base_url else {}),
                  **({"api_key": e.token} if env.takes_api_key else {})}
        row = dict(env.row)
        e.last_activity = time.monotonic()
        if env.is_async:
            async def play():
                client = openai.AsyncOpenAI(base_url=url, api_key=e.token, max_retries=0, timeout=CLIENT_TIMEOUT_S)
                e.last_activity = time.monotonic()  # the client's set-up is not the agent's time
                try:
                    return await env.agent(client, row, **kwargs)
                except (SystemExit, KeyboardInterrupt) as err:  # raised on, they would end the shared event loop
                    raise AgentExit(err) from err
                finally:
                    await client.close()

            e.future = asyncio.run_coroutine_threadsafe(play(), self._event_loop())
            return
        future: concurrent.futures.Future = concurrent.futures.Future()

        def play_sync() -> None:
            client = openai.OpenAI(base_url=url, api_key=e.token, max_retries=0, timeout=CLIENT_TIMEOUT_S)
            e.last_activity = time.monotonic()  # the client's set-up (slow on a loaded machine) is not the agent's time
            try:
                outcome = (future.set_result, env.agent(client, row, **kwargs))
            except BaseException as err:  # handed to the worker, which quarantines the episode
                outcome = (future.set_exception, err)
            finally:
                client.close()
            try:
                outcome[0](outcome[1])
            except concurrent.futures.InvalidStateError:  # cancelled: the worker gave up on it (timeout, stop)
                pass

        e.future = future
        threading.Thread(target=play_sync, name=f"agent-{self.worker_id}-{e.ticket.prompt_id}", daemon=True).start()

    # ------------------------------------------------------------------ episode outcomes
    def _drop(self, e: AgentEpisode, kind: str, reason: str, err: BaseException | None = None,
              retry: bool = True, fatal: bool = False) -> None:
        """Quarantine ``e``: its calls still waiting are answered 409, later ones too (``fatal``: the run
        stops with ``reason``)."""
        e.done = True
        if self.server is not None:
            self.server.end_episode(e.id)
        e.quarantined = QuarantinedEpisode(e.ticket.prompt_id, e.sample_index, kind, reason, retry, fatal)
        self.quarantined += 1
        self.errors += 1
        detail = "".join(traceback.format_exception(err)) if err is not None else ""
        self.last_error = f"{reason}\n{detail}" if detail else reason
        self._problems.report(kind, "worker %d: agent episode of prompt %d quarantined: %s%s", self.worker_id,
                              e.ticket.prompt_id, reason, f"\n{detail}" if detail else "")
        for call in e.pending:
            call.fail(APIError(409, f"this episode has ended ({reason})", code="episode_ended"))
        e.pending.clear()

    def _finish(self, e: AgentEpisode) -> None:
        err = e.future.exception()
        name = e.env.agent_name
        s = self.settings
        first, self._first_finished = not self._first_finished, True
        if first and e.refusals:  # the run's limits do not fit this agent: stop now, naming the flag
            limit = "max_len" if "max_len" in e.refusals else "max_turns"
            reason = refusal_message(name, limit, e.refusals[limit], e.env.max_turns, s.max_len)
            self._drop(e, f"agent episode cut short by {limit}", reason, retry=False, fatal=True)
            return
        if err is not None:
            raised = err.raised if isinstance(err, AgentExit) else err
            self._drop(e, f"agent raised {type(raised).__name__}", f"agent {name} raised {type(raised).__name__}: "
                       f"{raised}", err)
            return
        value = e.future.result()
        try:
            if hasattr(value, "__await__"):
                raise ValueError(f"agent {name} returned an awaitable: declare the function async def")
            outcome = check_agent_result(value, name)
        except Exception as bad:  # whatever the agent returned: its episode's fault, never the run's
            self._drop(e, "agent returned a wrong type", str(bad) if isinstance(bad, ValueError) else
                       f"agent {name} returned a value that cannot be read ({type(bad).__name__}: {bad})")
            return
        segments = [seg for seg in e.segments.values() if any(seg.mask)]
        if not segments:
            reason = no_tokens_reason(name, e, e.env.max_turns, s.max_len)
            kind = "agent made no model call" if not (e.counts["agent_calls"] or e.refusals) else \
                "agent got no answer to train on"
            self._drop(e, kind, reason, retry=False)
            return
        e.done = True
        self.server.end_episode(e.id)
        for call in e.pending:  # an async agent that returned with a call still out
            call.fail(APIError(409, "this episode has ended (the agent returned)", code="episode_ended"))
        e.pending.clear()
        failed = outcome.failed if outcome.failed is not None else outcome.reward <= 0
        info = {**outcome.info, **e.counts, "trajectories_of_episode": len(segments)}
        for k, v in e.counts.items():
            if k in self.agent_counters:
                self.agent_counters[k] += v
        for seg in segments:
            sampled = [v for v, m in zip(seg.versions, seg.mask) if m]
            e.result.append(Trajectory(
                token_ids=seg.tokens, action_mask=seg.mask, behavior_log_probs=seg.logp, reward=outcome.reward,
                failed=bool(failed), truncated=e.truncated, policy_version_min=min(sampled),
                policy_version_max=max(sampled), prompt_id=e.ticket.prompt_id, seed=e.ticket.seed,
                sample_index=e.sample_index, num_turns=seg.calls, worker_id=self.worker_id,
                info={**info, "action_tokens": len(sampled)}, token_versions=list(seg.versions)))

    # ------------------------------------------------------------------ calls
    def _collect(self, timeout: float) -> None:
        """Move the endpoint's queued calls onto their episodes (waiting up to ``timeout`` for the first)."""
        q = self.server.calls
        try:
            call = q.get(timeout=timeout) if timeout > 0 else q.get_nowait()
        except Exception:  # queue.Empty
            return
        while call is not None:
            e = self._live.get(call.episode)
            if e is None and self.server.has_ended(call.episode):  # it ended while its call was queued
                call.fail(APIError(409, "this episode has ended", code="episode_ended"))
            elif e is None:
                call.fail(APIError(404, "no running episode has this id (it ended, or the URL is not one the trainer "
                                        "handed out)", code="episode_not_found"))
            elif e.done:
                call.fail(APIError(409, "this episode has ended", code="episode_ended"))
            else:
                e.pending.append(call)
            try:
                call = q.get_nowait()
            except Exception:
                call = None

    def _prepare(self, call: PendingCall, e: AgentEpisode) -> Call:
        s, req = self.settings, call.request
        if e.counts["agent_calls"] >= e.env.max_turns:
            e.truncated = True
            message = f"this episode has made its {e.env.max_turns} model calls (--rollout.max_turns)"
            e.refusals.setdefault("max_turns", message)
            raise APIError(400, message, code="max_turns_exceeded")
        chars = _text_chars(req)
        if self._token_chars is not None and chars > s.max_len * self._token_chars:  # never tokenized
            e.truncated = True
            message = f"the request holds {chars} characters of text, more than data.max_len {s.max_len} tokens can hold"
            e.refusals.setdefault("max_len", message)
            raise APIError(400, message, code="context_length_exceeded",
                           param="messages" if req.kind == "chat" else "prompt")
        try:
            if req.kind == "chat":
                if self.renderer is None:
                    raise APIError(400, "the tokenizer has no chat template: use /v1/completions")
                prompt = e.conversations.prompt_for_chat(req.messages, req.tools)
            else:
                encode = getattr(self.tokenizer, "tok", None)
                prompt = e.conversations.prompt_for_text(
                    req.prompt_text, req.prompt_ids,
                    (lambda t: list(encode(t, add_special_tokens=False)["input_ids"])) if encode is not None
                    else self.tokenizer.encode_observation)
        except APIError:
            raise
        except Exception as err:  # the template or the tokenizer on what the agent sent
            raise APIError(400, f"the messages cannot be rendered: {type(err).__name__}: {err}") from None
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt.ids):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
        if len(prompt.ids) >= s.max_len:
            e.truncated = True
            message = (f"the prompt has {len(prompt.ids)} tokens and leaves no room for an answer in "
                       f"data.max_len {s.max_len}")
            e.refusals.setdefault("max_len", message)
            raise APIError(400, message, code="context_length_exceeded", param="messages")
        max_new = min(s.max_new_tokens, s.max_len - len(prompt.ids), req.max_tokens or s.max_new_tokens)
        params, differs = call_sampling(req, s.sampling, s.agent_sampling)
        if differs:
            e.counts["off_policy_calls"] += 1
            if s.agent_sampling == "run" and not self._sampling_warned:
                self._sampling_warned = True
                log.warning("worker %d: %s", self.worker_id, sampling_warning(e.env.agent_name, req, s.sampling))
        seed = episode_seed(s.seed, e.ticket.prompt_id, e.sample_index, e.counts["agent_calls"])
        e.counts["agent_calls"] += 1
        stop = None
        if req.stop:
            decode, strings = self.tokenizer.decode, list(req.stop)
            stop = lambda ids: any(x in decode(ids) for x in strings)  # noqa: E731
        return Call(call, e, prompt, GenerationRequest(prompt.ids, max_new, seed, stop=stop), params)

    def _serve(self, episodes: list[AgentEpisode]) -> None:
        """Answer every pending call of ``episodes``: one ``generate`` call per sampling setting."""
        prepared: list[Call] = []
        for e in episodes:
            calls, e.pending = e.pending, []
            for call in calls:
                try:
                    prepared.append(self._prepare(call, e))
                except APIError as err:
                    e.counts["refused_calls"] += 1
                    e.last_activity = time.monotonic()
                    call.fail(err)
        groups: dict[SamplingParams, list[Call]] = {}
        for c in prepared:
            groups.setdefault(c.params, []).append(c)
        for params, items in groups.items():
            self.agent_counters["agent_largest_batch"] = max(self.agent_counters["agent_largest_batch"], len(items))
            results = self._sample([c.request for c in items], params)
            for c, result in zip(items, results):
                if c.episode.done:
                    c.pending.fail(APIError(409, "this episode has ended", code="episode_ended"))
                elif isinstance(result, BaseException):
                    c.pending.fail(APIError(500, f"the engine failed on this call: {type(result).__name__}: {result}",
                                            type="server_error"))
                    self._drop(c.episode, f"engine.generate raised {type(result).__name__}",
                               f"engine.generate raised {type(result).__name__}: {result}", result)
                else:
                    try:
                        self._answer(c, result)
                    except Exception as err:  # decoding what was sampled: the episode's fault, not the run's
                        c.pending.fail(APIError(500, f"the answer could not be built: {type(err).__name__}: {err}",
                                                type="server_error"))
                        self._drop(c.episode, f"building the answer raised {type(err).__name__}",
                                   f"building the answer raised {type(err).__name__}: {err}", err)

    def _answer(self, c: Call, t) -> None:
        e, req, prompt = c.episode, c.pending.request, c.prompt
        ids, logps, versions = [int(x) for x in t.token_ids], [float(x) for x in t.log_probs], [int(v) for v in t.versions]
        if not ids:
            raise ValueError("the engine returned an empty generation")
        finish = t.finish_reason
        decode = self.tokenizer.decode
        text = decode(ids)
        if req.stop:
            hits = [(text.find(x), x) for x in req.stop if x in text]
            if hits:
                lo, hi = 1, len(ids)  # the shortest prefix holding a stop string
                while lo < hi:
                    mid = (lo + hi) // 2
                    if any(x in decode(ids[:mid]) for x in req.stop):
                        hi = mid
                    else:
                        lo = mid + 1
                ids, logps, versions, finish = ids[:lo], logps[:lo], versions[:lo], "stop"
                text = text[:min(hits)[0]]
        stops = set(self.settings.sampling.stop_token_ids)
        ended_with_stop = bool(ids) and ids[-1] in stops
        if finish == "length":
            e.counts["length_finishes"] += 1
        finish_reason = "stop" if finish == "stop" else "length"
        content, tool_calls = text, []
        if req.kind == "chat" and req.parse_tools:
            e.counts["calls_with_tools"] += 1  # tools offered: the run warns when none is ever called
            parsed = self._parser(text)
            if parsed.malformed:
                e.counts["malformed_tool_calls"] += 1
            content, tool_calls = parsed.content, parsed.tool_calls
            e.counts["tool_calls"] += len(tool_calls)
            if tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        # The conversation may have moved on since this prompt was made (calls of one episode at once).
        conv = prompt.conversation
        if conv is not None and len(e.segments[conv.index].tokens) != len(prompt.ids) - len(prompt.context):
            prompt.conversation, prompt.context, prompt.rewrite = None, list(prompt.ids), True
        e.counts["history_rewrites"] += int(prompt.rewrite)
        e.counts["mismatched_renderings"] += int(prompt.mismatch)
        seg = Segment.context_only(prompt.ids) if prompt.conversation is None else e.segments[prompt.conversation.index]
        if prompt.conversation is not None:
            seg.add(prompt.context)
        seg.add(ids, logps, versions)
        seg.calls += 1
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        conv = e.conversations.answered(prompt, ids, message, text, ended_with_stop)
        e.segments[conv.index] = seg
        logprobs = None
        if req.logprobs:
            logprobs = []
            for tok, lp in zip(ids, logps):
                piece = self.tokenizer.decode([tok])
                logprobs.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")),
                                 "top_logprobs": []})
        model = req.model
        if req.kind == "chat":
            body = chat_response(model, content, tool_calls, finish_reason, len(prompt.ids), len(ids), logprobs)
        else:
            body = completion_response(model, text, finish_reason, len(prompt.ids), len(ids), logprobs)
        if req.return_token_ids:
            body = with_token_ids(body, prompt.ids, ids)
        e.last_activity = time.monotonic()
        c.pending.answer(200, body)

    # ------------------------------------------------------------------ the episodes of some tickets
    def run_tickets(self, tickets: Sequence[Ticket],
                    stop: threading.Event | None = None) -> list[list[Trajectory | QuarantinedEpisode]]:
        s = self.settings
        self._stop = stop  # a stopping run does not wait for a long generation (RolloutWorker._sample)
        self._ensure_server()
        episodes = [AgentEpisode(t, j, slot) for slot, (t, j) in
                    enumerate((t, j) for t in tickets for j in range(t.group_size))]
        for e in episodes:
            try:
                env = self._env(e.slot)
                env.reset(seed=e.ticket.seed)
                e.env = agent_environment(env)
                e.conversations = Conversations(self.renderer)
            except Exception as err:
                self._drop(e, f"preparing the agent's row raised {type(err).__name__}",
                           f"preparing the agent's row raised {type(err).__name__}: {err}", err)
        self._live = {e.id: e for e in episodes}
        for e in episodes:
            if not e.done:
                e.token = self.server.open_episode(e.id)
        to_start = [e for e in episodes if not e.done]
        running: list[AgentEpisode] = []
        try:
            while to_start or running:
                if stop is not None and stop.is_set():
                    raise _Stopped()
                while to_start and len(running) < s.env_parallel_calls:
                    e = to_start.pop(0)
                    running.append(e)
                    self._start(e)
                self._collect(0.005)
                now = time.monotonic()
                for e in list(running):
                    if e.done:
                        running.remove(e)
                    elif e.future.done():
                        self._finish(e)
                        running.remove(e)
                    elif not e.pending and s.env_timeout_s and now - e.last_activity > s.env_timeout_s:
                        e.future.cancel()  # an async agent's task; a thread is abandoned
                        self.agent_counters["agent_timeouts"] += 1
                        self._drop(e, "agent timed out", f"agent {e.env.agent_name} neither called the model nor "
                                   f"returned within {s.env_timeout_s:g} s (--rollout.env_timeout_s); abandoned")
                        running.remove(e)
                waiting = [e for e in running if e.pending]
                if not waiting:
                    continue
                oldest = min(c.arrived for e in waiting for c in e.pending)
                batch_wait = waiting[0].env.batch_wait_s
                if len(waiting) == len(running) or now - oldest >= batch_wait or \
                        sum(len(e.pending) for e in waiting) >= s.episodes_per_call:
                    self._wait_while_paused(stop)
                    self._sync_weights()
                    self._serve(waiting)
        except BaseException:  # stopped, or a fault of the worker itself: the tickets are handed back
            for e in episodes:
                if not e.done:
                    e.done = True
                    if e.future is not None:
                        e.future.cancel()
                    for call in e.pending:
                        call.fail(APIError(503, "the rollout worker stopped", type="server_error"))
                    e.pending.clear()
            raise
        finally:
            for episode in self._live:
                self.server.end_episode(episode)
            self._live = {}
        groups: dict[int, list[Trajectory | QuarantinedEpisode]] = {t.prompt_id: [] for t in tickets}
        for e in episodes:
            groups[e.ticket.prompt_id].extend([e.quarantined] if e.quarantined is not None else e.result)
        return [groups[t.prompt_id] for t in tickets]

    def close(self) -> None:
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            try:
                super().close()  # the environments first: a verifiers taskset ends its serving on the event loop
            finally:
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._loop.stop)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(self.agent_counters)
        return out
