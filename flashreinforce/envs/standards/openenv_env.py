"""OpenEnv environments: ``--env openenv:MODULE:CLASS``, ``--env openenv:FILE.py[:CLASS]`` or ``--env openenv:URL``.

OpenEnv (``openenv-core``, an optional extra: ``pip install -e '.[openenv]'``) serves an environment
over HTTP: a server-side ``openenv.core.Environment`` subclass with ``reset`` / ``step`` / ``state``,
typed ``Action`` and ``Observation`` models, and sessions over a WebSocket (``/ws``) that clients
such as ``GenericEnvClient`` open. :class:`OpenEnvEnvironment` plays one as a FlashREINFORCE
environment, through OpenEnv's own client:

* given a class (``MODULE:CLASS``, ``FILE.py:CLASS``, or ``FILE.py`` holding one), the run serves it
  itself with OpenEnv's ``create_fastapi_app`` under uvicorn on 127.0.0.1 (a free port), one server
  per process when the class declares ``SUPPORTS_CONCURRENT_SESSIONS`` and one per environment
  instance otherwise; ``env_kwargs`` are the class's constructor arguments. Given a URL
  (``http://HOST:PORT``), the run connects to a server already running;
* each instance keeps one session (opened at its first episode) and an episode is a ``reset`` in it:
  ``reset(seed=SEED)`` (the seed reaches the environment's ``reset`` when it takes one) gives the
  first observation, which is the prompt; each policy turn is one
  ``step``: the turn's text fills the action's text field, and the observation that comes back is
  the next turn's observation text, until the observation says ``done`` or the run's turn limit;
* the reward of the episode is the sum of the steps' rewards (a ``None`` reward counts 0);
* the action's text field: ``action_field``, else the action model's only required string field
  (``message`` of OpenEnv's echo template); the observation's text: ``observation_field``, else its
  only string field, else its fields as JSON (``reward``, ``done`` and ``metadata`` left out).

Numbers and booleans among the last observation's fields go into ``info`` (``env/NAME`` in the
metrics). Endless seeds: the evaluation plays seeds the training never does (from 10^9).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import typing
from typing import Any, Callable

from flashreinforce.config import ConfigError
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.registry import register_environment

__all__ = ["OpenEnvEnvironment", "PREFIX", "check_target", "served_class"]

PREFIX = "openenv:"
_INSTALL = "pip install -e '.[openenv]' (or pip install openenv-core)"
_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")


def _is_url(target: str) -> bool:
    return target.startswith(_URL_SCHEMES)


def _openenv(target: str):
    try:
        from openenv.core.env_server import interfaces
    except ImportError:
        raise ConfigError(f"--env openenv:{target} needs the openenv-core package, which is not installed: "
                          f"{_INSTALL}") from None
    return interfaces


def served_class(target: str) -> type:
    """The ``openenv.core.Environment`` subclass ``target`` names (``MODULE:CLASS``, ``FILE.py:CLASS``,
    ``FILE.py``); ``ConfigError`` naming ``--env`` otherwise."""
    import inspect

    from flashreinforce.envs.registry import ImportFileError, import_failure, import_file, import_module

    base = _openenv(target).Environment
    where, _, name = target.rpartition(":") if not target.endswith(".py") else (target, "", "")
    if not where:
        raise ConfigError(f"--env openenv:{target}: expected MODULE:CLASS, FILE.py[:CLASS] or a server's URL "
                          "(http://HOST:PORT)")
    try:
        module = import_file(where, "flashreinforce_openenv_") if where.endswith(".py") else import_module(where)
    except FileNotFoundError:
        raise ConfigError(f"--env openenv:{target}: {where} does not exist") from None
    except ImportFileError as err:
        raise ConfigError(f"--env openenv:{target}: {err}") from None
    except ModuleNotFoundError as err:
        raise ConfigError(f"--env openenv:{target}: cannot import {where} ({err})") from None
    except (Exception, SystemExit) as err:
        raise ConfigError(f"--env openenv:{target}: {import_failure(where, err)}") from None
    if not name:
        found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, base) and c is not base
                 and c.__module__ == module.__name__ and not inspect.isabstract(c)]
        if len(found) != 1:
            raise ConfigError(f"--env openenv:{target}: the file defines {len(found)} OpenEnv Environment classes; "
                              "name one as FILE.py:CLASS")
        return found[0]
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"--env openenv:{target}: {where}.{name} is not an openenv.core.Environment subclass")
    return cls


def check_target(target: str) -> None:
    """``ConfigError`` (one line naming ``--env``) for a target that cannot be played: openenv-core
    missing, a class that is not an OpenEnv environment or whose action and observation models
    cannot be found."""
    _openenv(target)
    if not _is_url(target):
        _models(served_class(target), {})


def _models(cls: type, kwargs: dict) -> tuple[type, type]:
    """The ``Action`` and ``Observation`` models of an environment class: its generic parameters
    (``Environment[MyAction, MyObservation, State]``), else the annotations of ``step``."""
    from openenv.core.env_server.types import Action, Observation

    for base in getattr(cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if len(args) >= 2 and all(isinstance(a, type) for a in args[:2]) and issubclass(args[0], Action) and \
                issubclass(args[1], Observation):
            return args[0], args[1]
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:
        hints = {}
    action, observation = hints.get("action"), hints.get("return")
    if isinstance(action, type) and issubclass(action, Action) and isinstance(observation, type) and \
            issubclass(observation, Observation):
        return action, observation
    raise ConfigError(f"--env openenv: {cls.__name__} names neither its Action and Observation models as generic "
                      "parameters (Environment[MyAction, MyObservation, State]) nor in step()'s annotations")


def _text_field(schema: dict, what: str, given: str | None, required_only: bool) -> str | None:
    """The one string field of a model's JSON schema (``given`` when set)."""
    if given:
        return given
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    names = [n for n, p in props.items() if p.get("type") == "string" and n not in ("metadata",)
             and (n in required or not required_only)]
    if len(names) == 1:
        return names[0]
    if required_only:
        raise ConfigError(f"--env.kwargs {what}: the action model has {len(names)} required string fields "
                          f"({', '.join(names) or 'none'}); name the one the policy's text fills")
    return None


class _Server:
    """OpenEnv's FastAPI app for one environment class, served by uvicorn in a thread on 127.0.0.1."""

    def __init__(self, cls: type, kwargs: dict, sessions: int) -> None:
        import uvicorn
        from openenv.core.env_server.http_server import create_fastapi_app

        action, observation = _models(cls, kwargs)
        app = create_fastapi_app(lambda: cls(**kwargs), action, observation, max_concurrent_envs=sessions)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.action_schema = action.model_json_schema()
        self.observation_schema = observation.model_json_schema()
        # critical: OpenEnv's server logs an error for a client that closes its session first
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"openenv-{cls.__name__}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server of {cls.__name__} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


_SHARED: dict[str, _Server] = {}
_SHARED_LOCK = threading.Lock()


@register_environment("openenv:")
class OpenEnvEnvironment(Environment):
    """An OpenEnv environment played turn by turn (see the module docstring).

    Args:
        target: ``MODULE:CLASS``, ``FILE.py[:CLASS]`` or a server's URL (what follows ``openenv:``).
        env_kwargs: the class's constructor arguments (a class the run serves).
        action_field / observation_field: the text fields (see the module docstring).
        system_prompt: an instruction before the first observation (with the chat template: a system
            message); ``None``: the observation alone.
        reset_kwargs: more arguments of every ``reset``.
        max_turns: the run's turn limit (the trainer passes it).
        apply_chat_template: the trainer's chat template (the first observation as a user message).
        message_timeout_s: how long one ``reset`` or ``step`` may take on the server.
    """

    default_max_turns = 8

    def __init__(self, target: str, *, env_kwargs: dict | None = None, action_field: str | None = None,
                 observation_field: str | None = None, system_prompt: str | None = None,
                 reset_kwargs: dict | None = None, max_turns: int | None = None,
                 apply_chat_template: Callable[[list], str] | None = None, message_timeout_s: float = 60.0) -> None:
        _openenv(target)
        self.target, self.env_kwargs = target, dict(env_kwargs or {})
        self.system_prompt, self.apply_chat_template = system_prompt, apply_chat_template
        self.reset_kwargs = dict(reset_kwargs or {})
        self.max_turns = max_turns or self.default_max_turns
        self.message_timeout_s = float(message_timeout_s)
        self._own: _Server | None = None
        self._client = None
        self._cls = None if _is_url(target) else served_class(target)
        self._action_field, self._observation_field = action_field, observation_field
        self._schemas: tuple[dict, dict] | None = None
        self.turns, self.total, self.last = 0, 0.0, {}
        self._fields_cache: tuple[str, str | None] = ("", None)

    # ------------------------------------------------------------------ the server and the session
    def _url(self) -> str:
        if self._cls is None:
            return self.target
        if getattr(self._cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
            key = json.dumps([self.target, self.env_kwargs], sort_keys=True, default=str)
            with _SHARED_LOCK:
                if key not in _SHARED:
                    _SHARED[key] = _Server(self._cls, self.env_kwargs, sessions=4096)
                server = _SHARED[key]
        else:
            if self._own is None:
                self._own = _Server(self._cls, self.env_kwargs, sessions=1)
            server = self._own
        self._schemas = (server.action_schema, server.observation_schema)
        return server.url

    def _fields(self, url: str) -> tuple[str, str | None]:
        if self._schemas is None:  # a server of its own: its /schema route
            import urllib.request

            with urllib.request.urlopen(f"{url}/schema", timeout=self.message_timeout_s) as r:
                schema = json.loads(r.read())
            self._schemas = (schema.get("action", {}), schema.get("observation", {}))
        action = _text_field(self._schemas[0], "action_field", self._action_field, True)
        observation = _text_field(self._schemas[1], "observation_field", self._observation_field, False)
        return action, observation

    def _observation_text(self, observation: dict) -> str:
        name = self._fields_cache[1]
        if name is not None and isinstance(observation.get(name), str):
            return observation[name]
        return json.dumps(observation, sort_keys=True, default=str)

    def reset(self, *, seed: int) -> str:
        from openenv.core.generic_client import GenericEnvClient

        if self._client is None:
            url = self._url()
            self._fields_cache = self._fields(url)
            self._client = GenericEnvClient(base_url=url, message_timeout_s=self.message_timeout_s).sync()
            self._client.connect()
        result = self._client.reset(seed=int(seed), **self.reset_kwargs)
        self.turns, self.total, self.last = 0, float(result.reward or 0.0), dict(result.observation)
        text = self._observation_text(self.last)
        if self.apply_chat_template is not None:
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return self.apply_chat_template(messages + [{"role": "user", "content": text}])
        return f"{self.system_prompt}\n\n{text}" if self.system_prompt else text

    def step(self, action: str) -> StepResult:
        if self._client is None:
            raise RuntimeError("step() before reset()")
        result = self._client.step({self._fields_cache[0]: action})
        self.turns += 1
        reward = float(result.reward or 0.0)
        self.total += reward
        self.last = dict(result.observation)
        done = bool(result.done) or self.turns >= self.max_turns
        info: dict[str, Any] = {"turns": self.turns}
        if done:
            info.update({k: v for k, v in self.last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            info.update({k: float(v) for k, v in self.last.items() if isinstance(v, bool)})
            if not result.done:
                info["failure_kind"] = "truncated"
        return StepResult(observation="" if done else self._observation_text(self.last), reward=reward, done=done,
                          info=info)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing must not hide the run's own outcome
                pass
            self._client = None
        if self._own is not None:
            self._own.stop()
            self._own = None
