"""An agent function as the task: ``--agent FILE.py:FUNC`` (``--env agent``).

An agent is a program written against the OpenAI chat API: ``FUNC(client, row)`` gets an
``openai.OpenAI`` client whose ``base_url`` is the rollout worker's endpoint for this episode and one
row of the prompt dataset (a dict: the row's fields, its prompt under ``prompt``; without a dataset
``{"seed": SEED}``, so that the function can make its own problem from the seed). It calls
``client.chat.completions.create(...)`` as often as it likes, runs its tools, and returns the
reward: a number, or a dict ``{"reward": number, "failed": bool (optional), "info": {name: number}
(optional)}``. An ``async def`` function gets an ``openai.AsyncOpenAI`` client. A function that takes
a ``base_url`` parameter also gets the URL (for frameworks that build their own client).

This module holds what an environment knows of an agent: the function (loaded from its spec), the
rows, the endpoint's options and the check of what the function returned; it is ``--env agent`` in the
environment registry, and imports no torch and nothing of the trainer. The episodes are run by
:class:`flashreinforce.agents.worker.AgentRolloutWorker` (the rollout worker kind ``"agent"`` this class
names), which serves the calls with the worker's engine.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Mapping, Sequence

from flashreinforce.config import ConfigError
from flashreinforce.config.trainer_config import AGENT_ENVIRONMENT
from flashreinforce.envs.base import StepResult
from flashreinforce.envs.registry import (ImportFileError, import_failure, import_file, import_module,
                                          register_environment)
from flashreinforce.envs.tasks import Task, TaskEnvironment

__all__ = ["AgentEnvironment", "AgentOutcome", "AgentSpecError", "agent_environment", "check_agent_result",
           "load_agent", "agent_spec"]

class AgentSpecError(ConfigError):
    """An agent spec that names nothing usable (one line naming ``--agent``; a ``ValueError``)."""


def load_agent(spec: str | Callable) -> Callable:
    """The function ``spec`` names (``FILE.py:FUNC`` or ``MODULE:FUNC``), or ``spec`` itself when callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise AgentSpecError(f"--agent {spec!r}: expected FILE.py:FUNC or MODULE:FUNC")
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise AgentSpecError(f"--agent {spec!r}: expected FILE.py:FUNC or MODULE:FUNC")
    if where.endswith(".py"):
        try:
            module = import_file(where, "flashreinforce_agentfn_")
        except FileNotFoundError:
            raise AgentSpecError(f"--agent {spec}: {where} does not exist") from None
        except ImportFileError as err:
            raise AgentSpecError(f"--agent {spec}: {err}") from None
    else:
        try:
            module = import_module(where)
        except ModuleNotFoundError as err:
            raise AgentSpecError(f"--agent {spec}: cannot import {where} ({err})") from None
        except (Exception, SystemExit) as err:
            raise AgentSpecError(f"--agent {spec}: {import_failure(where, err)}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise AgentSpecError(f"--agent {spec}: {where} has no {name}")
    if not callable(fn):
        raise AgentSpecError(f"--agent {spec}: {where}.{name} is not callable")
    return fn


def agent_spec(agent: Any) -> Any:
    """How a run records an agent: a spec string as given, a module-level function as ``MODULE:FUNC``,
    anything else (a lambda, a function defined inside another) as the object itself."""
    if isinstance(agent, str):
        return agent
    qualname = getattr(agent, "__qualname__", "")
    module = getattr(agent, "__module__", None)
    if module and qualname and "<" not in qualname and module != "__main__":
        return f"{module}:{qualname}"
    return agent


class AgentOutcome:
    """A checked agent result: ``reward``, ``failed`` (``None``: ``reward <= 0``) and numeric ``info``."""

    def __init__(self, reward: float, failed: bool | None, info: Mapping[str, float]) -> None:
        self.reward, self.failed, self.info = reward, failed, dict(info)


def _number(x: Any) -> bool:
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except (OverflowError, ValueError, TypeError):  # an int or Fraction no float holds (10**400)
        return False


def _shown(x: Any) -> str:
    """A short form of a returned value for a message (never raises, never prints a huge int)."""
    if isinstance(x, int) and x.bit_length() > 256:
        return f"an int of {x.bit_length()} bits"
    try:
        text = repr(x)
    except Exception:
        return f"a {type(x).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def check_agent_result(value: Any, name: str) -> AgentOutcome:
    """``value`` as an :class:`AgentOutcome`, or ``ValueError`` saying what is wrong with it."""
    if _number(value):
        return AgentOutcome(float(value), None, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"agent {name} returned {type(value).__name__} {_shown(value)}; expected a finite "
                         "number (one a float holds) or a dict with 'reward'")
    if "reward" not in value or not _number(value["reward"]):
        raise ValueError(f"agent {name} returned a dict whose 'reward' is {_shown(value.get('reward'))}; expected "
                         "a finite number (one a float holds)")
    unknown = sorted(set(value) - {"reward", "failed", "info"})
    if unknown:
        raise ValueError(f"agent {name} returned a dict with unknown keys {unknown} (reward, failed, info)")
    failed = value.get("failed")
    if failed is not None and not isinstance(failed, bool):
        raise ValueError(f"agent {name} returned 'failed' {failed!r}; expected a bool")
    info = value.get("info") or {}
    if not isinstance(info, Mapping) or not all(isinstance(k, str) and (_number(v) or isinstance(v, bool))
                                                for k, v in info.items()):
        raise ValueError(f"agent {name} returned 'info' that is not a dict of numbers")
    return AgentOutcome(float(value["reward"]), failed, {k: float(v) for k, v in info.items()})


@register_environment("agent")
class AgentEnvironment(TaskEnvironment):
    """The rows and options of an agent run (see the module docstring); never stepped.

    Args:
        agent: the function or its spec (``FILE.py:FUNC``, ``MODULE:FUNC``).
        tasks: the rows (from ``data.prompt_dataset``); without them each episode's row is ``{"seed": SEED}``.
        tool_parser: how tool calls are read from the model's text (:mod:`flashreinforce.agents.toolcalls`).
        host, port: where each rollout worker's endpoint listens (127.0.0.1; port 0: any free port,
            else worker ``i`` listens on ``port + i``).
        batch_wait_s: how long a call may wait for the calls of other episodes to join its batch.
        model_name: the name ``/v1/models`` lists (any name is accepted in requests).
        max_turns: the model calls one episode may make; a call beyond it is refused (400) and the
            episode counts as truncated.
        max_connections: connections the endpoint keeps open at once (at most a quarter of the process's
            open-file limit); one more is closed at once.
        header_timeout_s: seconds a new connection has to send its first request's headers, and a
            request its body.
        max_body_mb: the largest request body (MiB); a larger one is answered 413 unread.

    The function gets ``base_url`` and ``api_key`` (the episode's token, which every call must carry)
    when it has parameters of those names (or ``**kwargs``), for frameworks that build their own client.
    """

    default_max_turns = 8  # model calls: tool use, not a long dialogue (--rollout.max_turns)
    rollout_worker = "agent"  # played by flashreinforce.agents.worker (trainer.rollout.worker_kinds)
    uses_label = False  # the label is one more field of the row
    needs_dataset = False  # without one, each episode's row is {"seed": SEED}

    def __init__(self, agent: str | Callable, tasks: Sequence[Task] | None = None, *, tool_parser: str = "hermes",
                 host: str = "127.0.0.1", port: int = 0, batch_wait_s: float = 0.05, model_name: str = "policy",
                 max_turns: int | None = None, max_connections: int = 256, header_timeout_s: float = 10.0,
                 max_body_mb: float = 8.0) -> None:
        super().__init__(tasks)
        self.agent = load_agent(agent)
        self.agent_name = getattr(self.agent, "__qualname__", repr(self.agent))
        self.is_async = inspect.iscoroutinefunction(self.agent) or inspect.iscoroutinefunction(
            getattr(self.agent, "__call__", None))
        try:
            params = inspect.signature(self.agent).parameters
        except (TypeError, ValueError):
            params = {}
        var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.takes_base_url = "base_url" in params or var_keyword
        self.takes_api_key = "api_key" in params or var_keyword
        if not isinstance(tool_parser, str) or not tool_parser:
            raise ValueError(f"tool_parser must be a parser's name, got {tool_parser!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        if not (isinstance(batch_wait_s, (int, float)) and 0 <= batch_wait_s <= 10):
            raise ValueError(f"batch_wait_s must be a number of seconds in [0, 10], got {batch_wait_s!r}")
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"host must be an address to listen on (127.0.0.1, the default; 0.0.0.0 for every "
                             f"interface), got {host!r}")
        if not isinstance(max_connections, int) or isinstance(max_connections, bool) or not 1 <= max_connections <= 65536:
            raise ValueError(f"max_connections must be an integer in [1, 65536], got {max_connections!r}")
        if isinstance(header_timeout_s, bool) or not (isinstance(header_timeout_s, (int, float))
                                                       and 0 < header_timeout_s <= 3600):
            raise ValueError(f"header_timeout_s must be a number of seconds in (0, 3600], got {header_timeout_s!r}")
        if isinstance(max_body_mb, bool) or not (isinstance(max_body_mb, (int, float)) and 0 < max_body_mb <= 1024):
            raise ValueError(f"max_body_mb must be a number of MiB in (0, 1024], got {max_body_mb!r}")
        self.max_connections, self.header_timeout_s = max_connections, float(header_timeout_s)
        self.max_body_mb = float(max_body_mb)
        self.tool_parser, self.host, self.port = tool_parser, host, port
        self.batch_wait_s, self.model_name = float(batch_wait_s), model_name
        self.max_turns = max_turns if max_turns is not None else self.default_max_turns
        self.row: dict[str, Any] = {}

    def reset(self, *, seed: int) -> str:
        if self._next_task is None and self.tasks is None:
            self.task = Task(prompt="", index=seed)
            self.row = {"seed": seed}
            return ""
        return super().reset(seed=seed)

    def start(self, task: Task) -> str:
        prompt = task.prompt if isinstance(task.prompt, str) else [dict(m) for m in task.prompt]
        self.row = {"prompt": prompt, **dict(task.extra)}
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)

    def step(self, action: str) -> StepResult:
        raise RuntimeError("AgentEnvironment is played by the agent function (AgentRolloutWorker), not stepped")


def agent_environment(env: Any) -> AgentEnvironment | None:
    """The :class:`AgentEnvironment` inside ``env`` (a dataset wrapper unwrapped), or ``None``."""
    while env is not None and not isinstance(env, AgentEnvironment):
        env = getattr(env, "env", None)
    return env
