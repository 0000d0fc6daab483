"""The OpenAI-compatible endpoint of a rollout worker: FastAPI served by uvicorn in a thread.

Routes (``EP`` is an episode's id; each episode's ``base_url`` is ``http://HOST:PORT/episodes/EP/v1``):

* ``POST /episodes/EP/v1/chat/completions`` and ``POST /episodes/EP/v1/completions``;
* ``GET /v1/models`` and ``GET /episodes/EP/v1/models``: the policy, by the name the server was given.

The server does not sample: a checked request goes into :attr:`AgentServer.calls` (a thread-safe
queue) as a :class:`PendingCall`, and the rollout worker that owns the engine answers it from its
own thread (batching the calls of all its episodes into ``generate`` calls). Errors come back in
OpenAI's format (``{"error": {"message", "type", "param", "code"}}``) with their status code, for
unknown routes and malformed JSON too. The server listens on 127.0.0.1 unless told otherwise.

Who may call (docs/security.md): each episode has an id (in its URL, not secret: URLs get logged) and
a token (:meth:`AgentServer.open_episode`, 256 random bits) that the agent's client sends as its API
key (``Authorization: Bearer TOKEN``). A call for an episode is checked in this order, before its
body is read: an unknown id is 404; a missing or wrong token 401; an episode that has ended 409.
Limits: at most ``max_connections`` connections at once (one more is closed at once, before it
holds anything), ``header_timeout_s`` for a new connection to send its first request's headers and
for a request's body to arrive, ``max_body_bytes`` per body (413), and JSON that is strict (no
``NaN``/``Infinity``) and not nested past Python's recursion limit (400).
"""

import asyncio
import collections
import hmac
import json
import logging
import queue
import resource
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flashreinforce.agents.protocol import (APIError, CallRequest, chat_request, chat_stream_events, completion_request,
                                           error_body, models_body)

__all__ = ["AgentServer", "PendingCall", "connection_limit", "loads_strict", "require_server_packages"]

log = logging.getLogger(__name__)


def require_server_packages() -> None:
    """``ImportError`` naming the install line when FastAPI, uvicorn or openai (the agents' client) is missing."""
    missing = []
    for name in ("fastapi", "uvicorn", "openai"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"the agent endpoint needs {', '.join(missing)}: pip install -e '.[agents]' "
                          "(or pip install fastapi uvicorn openai)")


@dataclass
class PendingCall:
    """A request waiting for the worker: its episode id, the checked request, and ``answer(status,
    body)`` (callable from any thread, once; later answers are ignored)."""

    episode: str
    request: CallRequest
    answer: Callable[[int, dict[str, Any]], None]
    arrived: float = field(default_factory=time.monotonic)

    def fail(self, err: APIError) -> None:
        self.answer(err.status, error_body(err))


#: Hosts that mean every interface: the server warns, and agents are handed a loopback address.
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
#: Ended episodes remembered (their calls get 409, not 404): the most recent ones, oldest dropped first.
ENDED_REMEMBERED = 16384


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(data: bytes | str) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON) with ``ValueError``,
    and JSON nested past Python's recursion limit with ``RecursionError``."""
    return json.loads(data, parse_constant=_strict_constant)


def connection_limit(wanted: int) -> int:
    """``wanted``, lowered to a quarter of this process's open-file limit: connections beyond it would
    take the descriptors the run's own files need (1,100 idle connections under a limit of 1,024 ended
    a run with ``OSError: Too many open files`` while it wrote metrics.jsonl)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft // 4))


def _limited_protocol(base: type, max_connections: int, header_timeout_s: float) -> type:
    """uvicorn's HTTP protocol ``base`` that closes a connection beyond ``max_connections`` at once and a
    connection that has not sent its first request's headers within ``header_timeout_s``."""

    class Limited(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.abort()
                return
            self._first_request_due = self.loop.call_later(header_timeout_s, self._no_request_yet)

        def _no_request_yet(self) -> None:
            if getattr(self, "cycle", None) is None and not self.transport.is_closing():
                self.transport.abort()

        def connection_lost(self, exc) -> None:
            due = getattr(self, "_first_request_due", None)
            if due is not None:
                due.cancel()
            super().connection_lost(exc)

    return Limited


class AgentServer:
    """One worker's endpoint (see the module docstring). ``start()`` binds and serves; ``stop()`` ends it
    and answers every call still queued with 503.

    ``max_connections`` (lowered by :func:`connection_limit`), ``header_timeout_s`` and
    ``max_body_bytes``: the limits of the module docstring."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy",
                 max_connections: int = 256, header_timeout_s: float = 10.0, max_body_bytes: int = 8 << 20) -> None:
        require_server_packages()
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"the agent endpoint needs an address to listen on (127.0.0.1 by default), got {host!r}")
        self.host, self.requested_port, self.model_name = host, int(port), model_name
        self.max_connections = connection_limit(int(max_connections))
        self.header_timeout_s, self.max_body_bytes = float(header_timeout_s), int(max_body_bytes)
        self.port: int | None = None
        self.calls: "queue.Queue[PendingCall]" = queue.Queue()
        self._tokens: dict[str, str] = {}  # running episodes: id -> token (kept by the worker)
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._server = None
        self._thread: threading.Thread | None = None
        self.requests = 0

    # ------------------------------------------------------------------ episodes
    def open_episode(self, episode: str) -> str:
        """Serve calls for ``episode``; returns its token (the API key its agent's client sends)."""
        token = secrets.token_urlsafe(32)
        self._tokens[episode] = token
        return token

    def end_episode(self, episode: str) -> None:
        """``episode`` has ended: its calls are answered 409 from now on (for the last
        :data:`ENDED_REMEMBERED` episodes ended; older ids get 404)."""
        token = self._tokens.get(episode)
        if token is None:
            return
        self._ended[episode] = token  # before it leaves the running ones: no moment of 404
        self._tokens.pop(episode, None)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    def has_ended(self, episode: str) -> bool:
        """Whether ``episode`` ended (one of the last :data:`ENDED_REMEMBERED`)."""
        return episode in self._ended

    @property
    def live(self) -> set[str]:
        """The ids of the running episodes."""
        return set(self._tokens)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.requested_port))
        except OSError as err:
            sock.close()
            raise OSError(f"the agent endpoint cannot listen on {self.host}:{self.requested_port}: {err.strerror}") from None
        sock.listen(512)
        self.port = sock.getsockname()[1]
        if self.host in WILDCARD_HOSTS:
            log.warning("the agent endpoint listens on every interface (host %s, port %d): anyone who can reach "
                        "this machine can connect (each episode's calls still need that episode's token); give "
                        "host 127.0.0.1 unless agents call from other machines", self.host, self.port)
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=30)
        config.load()
        config.http_protocol_class = _limited_protocol(config.http_protocol_class, self.max_connections,
                                                       self.header_timeout_s)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"agent-endpoint-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint on {self.host}:{self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._server = self._thread = None
        while True:
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                break
            call.fail(APIError(503, "the rollout worker has stopped", type="server_error"))

    @property
    def root_url(self) -> str:
        """The address agents connect to (a loopback one when the server listens on every interface)."""
        host = self.host.strip("[]")
        if host in ("0.0.0.0", "::"):
            host = "::1" if host == "::" else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def base_url(self, episode: str) -> str:
        """The OpenAI ``base_url`` of one episode."""
        return f"{self.root_url}/episodes/{episode}/v1"

    # ------------------------------------------------------------------ the app
    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="flashreinforce agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def error(err: APIError) -> JSONResponse:
            return JSONResponse(error_body(err), status_code=err.status)

        @app.exception_handler(HTTPException)
        async def http_error(request, exc: HTTPException):  # unknown routes, wrong methods
            code = "not_found" if exc.status_code == 404 else None
            return error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))

        @app.get("/v1/models")
        @app.get("/episodes/{episode}/v1/models")
        async def models():
            return models_body(self.model_name)

        async def read_body(request: Request) -> bytes:
            """The body, at most ``max_body_bytes`` of it, within ``header_timeout_s`` (APIError otherwise)."""
            too_large = APIError(413, f"the request body is larger than the endpoint's limit of {self.max_body_bytes} "
                                      "bytes (--env.kwargs max_body_mb)", code="request_too_large")
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                raise too_large
            chunks, size = [], 0

            async def read() -> None:
                nonlocal size
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise too_large
                    chunks.append(chunk)

            try:
                await asyncio.wait_for(read(), self.header_timeout_s)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.header_timeout_s:g} s "
                                    "(--env.kwargs header_timeout_s)", code="request_timeout") from None
            return b"".join(chunks)

        def admit(episode: str, request: Request) -> None:
            """The episode's checks, before its body is read: known id (404), its token (401), running (409)."""
            token = self._tokens.get(episode)
            ended = token is None
            if ended:
                token = self._ended.get(episode)
            if token is None:
                raise APIError(404, "no episode has this id (the URL is not one the trainer handed out)",
                               code="episode_not_found")
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {token}".encode()):
                raise APIError(401, "this episode's calls need its API key: use the client the trainer handed the "
                                    "agent, or the api_key it was given", type="invalid_request_error",
                               code="invalid_api_key")
            if ended:
                raise APIError(409, "this episode has ended", code="episode_ended")

        async def submit(episode: str, request: Request, parse) -> JSONResponse:
            self.requests += 1
            try:
                admit(episode, request)
                raw = await read_body(request)
            except APIError as err:
                return error(err)
            try:
                body = loads_strict(raw)
            except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
                return error(APIError(400, f"the request body is not valid JSON ({err})"))
            except RecursionError:
                return error(APIError(400, "the request body is JSON nested too deeply"))
            try:
                checked = parse(body)
            except APIError as err:
                return error(err)
            except RecursionError:
                return error(APIError(400, "the request body is JSON nested too deeply"))
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def settle(status: int, payload: dict[str, Any]) -> None:
                if not future.done():
                    future.set_result((status, payload))

            def answer(status: int, payload: dict[str, Any]) -> None:
                loop.call_soon_threadsafe(settle, status, payload)

            self.calls.put(PendingCall(episode, checked, answer))
            status, payload = await future
            if checked.stream and status == 200:  # the whole answer, sampled, as chunks
                from fastapi.responses import StreamingResponse

                return StreamingResponse(iter(chat_stream_events(payload, checked.include_usage)),
                                         media_type="text/event-stream")
            return JSONResponse(payload, status_code=status)

        @app.post("/episodes/{episode}/v1/chat/completions")
        async def chat(episode: str, request: Request):
            return await submit(episode, request, chat_request)

        @app.post("/episodes/{episode}/v1/completions")
        async def completions(episode: str, request: Request):
            return await submit(episode, request, completion_request)

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def no_episode():
            return error(APIError(404, "this endpoint serves the episodes of a training run: use the base_url the "
                                       "trainer handed the agent (http://HOST:PORT/episodes/ID/v1)", code="not_found"))

        return app
