"""The OpenAI-compatible endpoint of a rollout worker: FastAPI served by uvicorn in a thread.

Routes (``EP`` is an episode's id; each episode's ``base_url`` is ``http://HOST:PORT/episodes/EP/v1``):

* ``POST /episodes/EP/v1/chat/completions`` and ``POST /episodes/EP/v1/completions``;
* ``GET /v1/models`` and ``GET /episodes/EP/v1/models``: the policy, by the name the server was given.

The server does not sample: a checked request goes into :attr:`AgentServer.calls` (a thread-safe
queue) as a :class:`PendingCall`, and the rollout worker that owns the engine answers it from its
own thread (batching the calls of all its episodes into ``generate`` calls). Errors come back in
OpenAI's format (``{"error": {"message", "type", "param", "code"}}``) with their status code, for
unknown routes and malformed JSON too. The server listens on 127.0.0.1 unless told otherwise.
"""

import asyncio
import json
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flashreinforce.agents.protocol import APIError, CallRequest, chat_request, completion_request, error_body, models_body

__all__ = ["AgentServer", "PendingCall", "require_server_packages"]

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


class AgentServer:
    """One worker's endpoint (see the module docstring). ``start()`` binds and serves; ``stop()`` ends it
    and answers every call still queued with 503."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy") -> None:
        require_server_packages()
        self.host, self.requested_port, self.model_name = host, int(port), model_name
        self.port: int | None = None
        self.calls: "queue.Queue[PendingCall]" = queue.Queue()
        #: The ids of the running episodes (kept by the worker): a call for any other id is answered 404 at once.
        self.live: set[str] = set()
        self._server = None
        self._thread: threading.Thread | None = None
        self.requests = 0

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
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=30)
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
        host = f"[{self.host}]" if ":" in self.host else self.host
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

        async def submit(episode: str, request: Request, parse) -> JSONResponse:
            self.requests += 1
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                return error(APIError(400, f"the request body is not valid JSON ({err})"))
            try:
                checked = parse(body)
            except APIError as err:
                return error(err)
            if episode not in self.live:
                return error(APIError(404, "no running episode has this id (it ended, or the URL is not one the "
                                           "trainer handed out)", code="episode_not_found"))
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def settle(status: int, payload: dict[str, Any]) -> None:
                if not future.done():
                    future.set_result((status, payload))

            def answer(status: int, payload: dict[str, Any]) -> None:
                loop.call_soon_threadsafe(settle, status, payload)

            self.calls.put(PendingCall(episode, checked, answer))
            status, payload = await future
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
