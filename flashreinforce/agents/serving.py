"""An OpenAI-compatible endpoint over a trained policy (``flashreinforce serve``), outside training.

The same wire format as the agent endpoint of training (:mod:`.protocol`), the same rendering of
``messages`` and ``tools`` into token ids (:class:`~.chat.ChatRenderer`: the model's chat template,
the Hermes tool form where the template has none) and the same tool-call parsers
(:mod:`.toolcalls`), so that an agent written against the OpenAI API runs, and can be evaluated,
with the code it was trained with. Unlike training, every call renders its messages afresh (no
conversation is kept between calls).

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
* It is the training endpoint's app (:class:`~.server.AgentServer`) serving one episode, whose calls
  the usual routes take: its API key (``Authorization: Bearer KEY``, 401 without it; the ``api_key``
  given, else a random one), its limits (connections, header and body time, body size, strict JSON)
  and its refusals (``n`` other than 1, ``stream`` on completions, penalties, ``top_logprobs``, ...);
  ``stream`` on chat completions (the whole answer as chunks) and ``return_token_ids`` as there.
* ``temperature``, ``top_p`` and ``max_tokens`` default to the served run's (``rollout.temperature``,
  ``rollout.top_p``, ``rollout.max_new_tokens``); a prompt must leave room in ``max_len`` (the run's
  ``data.max_len``). ``seed`` is ignored: each call draws its own.

:class:`ServeEndpoint` serves; a thread of its own takes the queued calls, groups those with the
same sampling and hands each group to ``sample`` (one batched generation: ``flashreinforce serve``
passes its engine's). Nothing here imports torch.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``Request``) at run time.
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from flashreinforce.agents.chat import ChatRenderer
from flashreinforce.agents.protocol import APIError, CallRequest, chat_response, completion_response, with_token_ids
from flashreinforce.agents.server import AgentServer, PendingCall
from flashreinforce.agents.toolcalls import get_parser

__all__ = ["SERVED", "Sample", "SampleRequest", "ServeEndpoint", "ServeSettings"]

#: The one episode of the training endpoint this endpoint serves: every call is one of its calls.
SERVED = "served"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    """The defaults of a call (the served run's sampling and lengths) and how calls are batched."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    max_len: int = 4096
    tool_parser: str = "hermes"
    model_name: str = "policy"
    batch_wait_s: float = 0.02
    max_batch: int = 16


@dataclass(frozen=True)
class SampleRequest:
    """One continuation to sample: the prompt's ids, at most ``max_tokens`` new ones, a seed, and the
    strings that end it (``stop``: the sampler may stop at the first token whose text holds one)."""

    prompt_ids: list[int]
    max_tokens: int
    seed: int
    stop: tuple[str, ...] = ()


@dataclass
class Sample:
    """What the sampler gives back: the new ids (a stop token kept as the last), their log-probabilities,
    and ``finish_reason`` (``stop``: a stop token; ``length``)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str


#: ``sample(requests, temperature, top_p, top_k) -> [Sample]``, one per request, in order.
Sampler = Callable[[Sequence[SampleRequest], float, float, int], Sequence[Sample]]


class ServeEndpoint(AgentServer):
    """The endpoint (see the module docstring): ``tokenizer`` a Hugging Face tokenizer with the model's chat
    template, ``stop_token_ids`` the tokens that end a turn, ``decode(ids)`` the text of sampled ids (special
    tokens left out, as in training)."""

    def __init__(self, tokenizer, stop_token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                 sample: Sampler, settings: ServeSettings = ServeSettings(), *, host: str = "127.0.0.1",
                 port: int = 8000, api_key: str | None = None) -> None:
        super().__init__(host=host, port=port, model_name=settings.model_name)
        #: What clients send as their API key (``Authorization: Bearer KEY``): ``api_key``, else a random one.
        self.api_key = self.open_episode(SERVED)
        if api_key:
            self._tokens[SERVED] = self.api_key = str(api_key)
        self.tok, self.decode, self.sample, self.settings = tokenizer, decode, sample, settings
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.parse = get_parser(settings.tool_parser)
        try:
            self.renderer: ChatRenderer | None = ChatRenderer(tokenizer, self.stop_token_ids)
        except ValueError:
            self.renderer = None  # /v1/chat/completions answers 400: no chat template
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self.served = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        super().start()
        self._stop.clear()
        self._worker = threading.Thread(target=self._serve_calls, name="serve-sampler", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join(30)
            self._worker = None
        super().stop()

    @property
    def url(self) -> str:
        """The OpenAI ``base_url`` of this endpoint (``http://HOST:PORT/v1``)."""
        return f"{self.root_url}/v1"

    # ------------------------------------------------------------------ the app
    def app(self):
        """The training endpoint's app (its request checks, limits and API-key check) with the usual routes:
        ``/v1/...`` answer as the one episode this endpoint serves, and ``GET /health``."""
        from fastapi import Request

        app = super().app()
        routes = {getattr(r, "path", None): r for r in app.router.routes}
        chat = routes["/episodes/{episode}/v1/chat/completions"].endpoint
        completions = routes["/episodes/{episode}/v1/completions"].endpoint
        app.router.routes = [r for r in app.router.routes
                             if getattr(r, "path", None) not in ("/v1/chat/completions", "/v1/completions")]

        @app.post("/v1/chat/completions")
        async def served_chat(request: Request):
            return await chat(SERVED, request)

        @app.post("/v1/completions")
        async def served_completions(request: Request):
            return await completions(SERVED, request)

        @app.get("/health")
        async def health():
            return {"status": "ok", "served": self.served}

        return app

    # ------------------------------------------------------------------ answering
    def _serve_calls(self) -> None:
        s = self.settings
        while not self._stop.is_set():
            try:
                first = self.calls.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + s.batch_wait_s
            while len(batch) < s.max_batch:
                try:
                    batch.append(self.calls.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                self.answer(batch)
            except Exception as err:  # never leave a caller waiting
                log.exception("serve: answering a batch failed")
                for call in batch:
                    call.fail(APIError(500, f"{type(err).__name__}: {err}", type="server_error"))

    def prompt_ids(self, req: CallRequest) -> list[int]:
        """A request's prompt as token ids: the chat messages (and tools) rendered as in training, or the
        completion prompt's text or ids."""
        if req.kind == "chat":
            if self.renderer is None:
                raise APIError(400, "the tokenizer has no chat template: use /v1/completions")
            try:
                return self.renderer.encode(self.renderer.render(req.messages, req.tools, True))
            except Exception as err:
                raise APIError(400, f"the messages cannot be rendered: {type(err).__name__}: {err}") from None
        if req.prompt_ids is not None:
            vocab = len(self.tok)
            if any(not 0 <= t < vocab for t in req.prompt_ids):
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
            return list(req.prompt_ids)
        return list(self.tok(req.prompt_text, add_special_tokens=False)["input_ids"])

    def answer(self, calls: Sequence[PendingCall]) -> None:
        """Answer ``calls``: one ``sample`` call per sampling setting."""
        s = self.settings
        groups: dict[tuple[float, float], list[tuple[PendingCall, list[int], SampleRequest]]] = {}
        for call in calls:
            req = call.request
            try:
                ids = self.prompt_ids(req)
                if len(ids) >= s.max_len:
                    raise APIError(400, f"the prompt has {len(ids)} tokens and leaves no room for an answer in "
                                        f"max_len {s.max_len}", code="context_length_exceeded", param="messages")
            except APIError as err:
                call.fail(err)
                continue
            max_new = min(req.max_tokens or s.max_tokens, s.max_len - len(ids))
            params = (s.temperature if req.temperature is None else req.temperature,
                      s.top_p if req.top_p is None else req.top_p)
            seed = secrets.randbits(62)
            groups.setdefault(params, []).append((call, ids, SampleRequest(ids, max_new, seed, tuple(req.stop))))
        for (temperature, top_p), items in groups.items():
            results = self.sample([r for _, _, r in items], temperature, top_p, s.top_k)
            for (call, ids, _), result in zip(items, results):
                try:
                    call.answer(200, self._response(call.request, ids, result))
                    self.served += 1
                except Exception as err:
                    call.fail(APIError(500, f"the answer could not be built: {type(err).__name__}: {err}",
                                       type="server_error"))

    def _response(self, req: CallRequest, prompt: list[int], result: Sample) -> dict[str, Any]:
        ids, logps, finish = list(result.token_ids), list(result.log_probs), result.finish_reason
        text = self.decode(ids)
        if req.stop:  # cut before the first stop string (the tokens up to the one that completed it)
            hits = [(text.find(x), x) for x in req.stop if x in text]
            if hits:
                lo, hi = 1, len(ids)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if any(x in self.decode(ids[:mid]) for x in req.stop):
                        hi = mid
                    else:
                        lo = mid + 1
                ids, logps, finish = ids[:lo], logps[:lo], "stop"
                text = text[:min(hits)[0]]
        finish_reason = "stop" if finish == "stop" else "length"
        logprobs = None
        if req.logprobs:
            logprobs = []
            for tok, lp in zip(ids, logps):
                piece = self.decode([tok])
                logprobs.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")),
                                 "top_logprobs": []})
        if req.kind != "chat":
            body = completion_response(req.model, text, finish_reason, len(prompt), len(ids), logprobs)
        else:
            content, tool_calls = text, []
            if req.parse_tools:
                parsed = self.parse(text)
                content, tool_calls = parsed.content, parsed.tool_calls
                if tool_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            body = chat_response(req.model, content, tool_calls, finish_reason, len(prompt), len(ids), logprobs)
        return with_token_ids(body, prompt, ids) if req.return_token_ids else body
