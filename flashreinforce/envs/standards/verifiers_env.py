"""Tasksets of the ``verifiers`` package by name: ``--env verifiers:MODULE`` or ``--env verifiers:FILE.py``.

``verifiers`` (an optional extra: ``pip install -e '.[verifiers]'``; version 0.4 keeps its stack in
``verifiers.v1``) describes a task set as a ``Taskset`` yielding ``Task`` objects scored by their
``@vf.reward`` methods, and runs each task as an episode of an ``Env`` (``SingleAgentEnv`` for a
plain taskset): a *harness* (an agent program) talks to the model through an OpenAI-compatible
client, calls the task's tools (MCP servers), and the task scores the trace. This module runs that
machinery unchanged, with the rollout worker's endpoint as the model:

* ``MODULE`` is an installed taskset module (it exports its ``Taskset`` subclass in ``__all__``, as
  verifiers requires; a hub id ``owner/name@version`` reads as its module ``name``), ``FILE.py`` a
  file holding one (its folder goes on ``sys.path`` and its stem is the taskset's id);
* the prompt set is the taskset's tasks (``taskset_config``: the taskset's configuration; an endless
  taskset needs ``size``); the held-out split of the run holds some of them out, unless
  ``eval_taskset`` (overrides of the taskset's configuration, e.g. ``{"split": "test"}``) defines the
  evaluation's own tasks, which are then evaluated and never trained on;
* each episode is ``Env.run_episode(task, ModelContext(model, EvalClientConfig(base_url=<the
  episode's base_url>)))``: every model call of the harness goes to the endpoint, which samples it
  with the policy and records its tokens (an agent run: :mod:`flashreinforce.agents.environment`);
* the reward is the trace's weighted sum of its rewards; each reward function's value (unweighted)
  is in ``info`` as ``reward_NAME`` and each metric as ``metric_NAME`` (``env/...`` in the metrics);
* the harness: ``harness`` (a harness id or its configuration), else the taskset's own when its
  package bundles one, else ``null``: verifiers' tool-less chat loop, which still offers the task's
  tools (verifiers' own default, ``bash``, hands the model a shell on this machine); the runtime:
  ``runtime`` (default ``{"type": "subprocess"}``: this machine; verifiers' default is a remote
  sandbox service); the harness stops after the run's turn limit (``rollout.max_turns``).

Environment modules written for verifiers before 0.4 (``load_environment(**kwargs)`` returning
``SingleTurnEnv`` / ``MultiTurnEnv`` / ``ToolEnv`` with a ``Rubric``) need those classes, which the
0.4 package no longer has: such a module is refused with a message saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from flashreinforce.config import ConfigError
from flashreinforce.agents.environment import AgentEnvironment
from flashreinforce.envs.tasks import Task
from flashreinforce.envs.registry import register_environment

__all__ = ["PREFIX", "VerifiersEnvironment", "check_taskset", "taskset_id"]

PREFIX = "verifiers:"
_INSTALL = "pip install -e '.[verifiers]' (or pip install 'verifiers>=0.4')"
#: The prefix of the environment variables verifiers reads each episode's token from (its API key).
_KEY_VARIABLE = "FLASHREINFORCE_EPISODE_API_KEY"  # verifiers keeps names with API_KEY from its child processes


def _vf(target: str):
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(f"--env verifiers:{target} needs the verifiers package (0.4 or later, its verifiers.v1 "
                          f"stack), which is not installed: {_INSTALL}") from None
    return vf


def taskset_id(target: str) -> str:
    """The taskset id of ``target``: a module as given; for ``FILE.py`` its stem, its folder put on
    ``sys.path`` so that verifiers' loader imports it by that name."""
    if not target.endswith(".py"):
        return target
    path = Path(target).resolve()
    if not path.is_file():
        raise ConfigError(f"--env verifiers:{target}: no such file")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    # verifiers runs a taskset's tool servers as ``python -m MODULE`` in child processes, which inherit this
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(path.parent) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(path.parent)] + [p for p in paths if p])
    return path.stem


def check_taskset(target: str) -> type:
    """The ``Taskset`` class ``target`` names; ``ConfigError`` (one line naming ``--env``) when verifiers
    is missing, the module cannot be imported, exports no taskset, or is a module of verifiers < 0.4."""
    _vf(target)
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.loaders import import_taskset

    ident = taskset_id(target)
    try:
        module = import_taskset(ident)
    except ModuleNotFoundError as err:
        raise ConfigError(f"--env verifiers:{target}: {err}") from None
    except Exception as err:  # the module itself raised (perhaps written for verifiers < 0.4)
        raise ConfigError(f"--env verifiers:{target}: importing {ident} raised {type(err).__name__}: {err}"
                          f"{_legacy_hint(err)}") from None
    names = getattr(module, "__all__", None) or []
    found = [getattr(module, n, None) for n in names]
    found = [c for c in found if isinstance(c, type) and issubclass(c, Taskset) and c is not Taskset]
    if len(found) == 1:
        return found[0]
    if hasattr(module, "load_environment"):
        raise ConfigError(f"--env verifiers:{target}: {ident} is an environment module of verifiers before 0.4 "
                          "(load_environment returning SingleTurnEnv/MultiTurnEnv/ToolEnv); the installed verifiers "
                          "0.4 has no such classes and they cannot be played beside it: port it to a verifiers.v1 "
                          "Taskset")
    raise ConfigError(f"--env verifiers:{target}: {ident} exports {len(found)} verifiers.v1 Taskset subclasses in "
                      "__all__; a taskset module exports exactly one")


def _legacy_hint(err: BaseException) -> str:
    text = str(err)
    if any(name in text for name in ("SingleTurnEnv", "MultiTurnEnv", "ToolEnv", "Rubric", "load_example_dataset")):
        return (" (a module written for verifiers before 0.4: the installed 0.4 has no such classes; port it to a "
                "verifiers.v1 Taskset)")
    return ""


def _plain(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"id": value}
    if not isinstance(value, dict):
        raise ConfigError(f"--env.kwargs {what}: an object of settings, got {type(value).__name__}")
    return dict(value)


class _Served:
    """A verifiers ``Env`` serving (its interception server, its shared tools) on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.env = None
        self.stack = contextlib.AsyncExitStack()
        self.ready: asyncio.Future | None = None

    async def start(self, data: dict) -> None:
        import verifiers.v1 as vf

        for name in ("verifiers", "aiohttp.access"):  # a line per rollout and per request at INFO
            if logging.getLogger(name).level < logging.WARNING:
                logging.getLogger(name).setLevel(logging.WARNING)
        self.env = vf.load_environment(vf.resolve_env_config(data))
        await self.stack.enter_async_context(self.env.serving())


# (configuration, id(loop)) -> the Env serving on that loop (one per rollout worker's event loop).
_SERVED: dict[tuple[str, int], _Served] = {}
# configuration -> (train tasks, evaluation tasks), loaded once per process.
_TASKS: dict[str, tuple[list, list]] = {}


@register_environment("verifiers:")
class VerifiersEnvironment(AgentEnvironment):
    """A verifiers taskset as the prompt set of an agent run (see the module docstring).

    Args:
        taskset: ``MODULE`` or ``FILE.py`` (what follows ``verifiers:`` in ``--env``).
        taskset_config: the taskset's configuration (``--env.taskset.*`` of verifiers' own command).
        eval_taskset: overrides of ``taskset_config`` that give the evaluation's tasks (``None``:
            rows of the prompt set are held out instead).
        harness: a harness id or its configuration (``None``: the taskset's own, else ``null``).
        runtime: where the harness runs (default ``{"type": "subprocess"}``).
        env_config: more settings of the verifiers ``Env`` (its timeouts, retries, ...).
        size: the tasks of an endless taskset that make the prompt set.
        The others as :class:`~flashreinforce.agents.environment.AgentEnvironment`.
    """

    default_max_turns = 8

    def __init__(self, taskset: str, tasks: Any = None, *, taskset_config: dict | None = None,
                 eval_taskset: dict | None = None, harness: Any = None, runtime: dict | None = None,
                 env_config: dict | None = None, size: int | None = None, tool_parser: str = "hermes",
                 host: str = "127.0.0.1", port: int = 0, batch_wait_s: float = 0.05, model_name: str = "policy",
                 max_turns: int | None = None, **endpoint: Any) -> None:
        if tasks is not None:
            raise ConfigError(f"--env verifiers:{taskset} makes its own prompt set from the taskset; give no "
                              "--data.prompt_dataset")
        cls = check_taskset(taskset)
        self.taskset_name = taskset
        ident = taskset_id(taskset)
        turns = max_turns if max_turns is not None else self.default_max_turns
        agent: dict[str, Any] = {"runtime": dict(runtime or {"type": "subprocess"}), "max_turns": turns}
        harness_config = _plain(harness, "harness")
        from verifiers.v1.utils.loaders import default_harness_id

        if harness_config:
            agent["harness"] = harness_config
        elif default_harness_id(ident) == "bash":  # no harness of its own: the chat loop, not a shell
            agent["harness"] = {"id": "null"}
        self._data = {**_plain(env_config, "env_config"), "taskset": {**_plain(taskset_config, "taskset_config"),
                                                                       "id": ident}, "agent": agent}
        self._key = json.dumps(self._data, sort_keys=True, default=str)
        train, evaluation = self._load_tasks(cls, eval_taskset, size)
        rows = [Task(prompt=t.data.prompt_text, index=i, extra={"vf_task": i}) for i, t in enumerate(train + evaluation)]
        super().__init__(self.play, rows, tool_parser=tool_parser, host=host, port=port, batch_wait_s=batch_wait_s,
                         model_name=model_name, max_turns=turns, **endpoint)
        self.agent_name = f"verifiers:{taskset}"
        self._tasks = train + evaluation
        #: the rows of the taskset's own evaluation split (``None``: the run holds rows out)
        self.evaluation_rows = tuple(range(len(train), len(train) + len(evaluation))) if evaluation else None

    def _load_tasks(self, cls: type, eval_taskset: dict | None, size: int | None) -> tuple[list, list]:
        key = json.dumps([self._key, eval_taskset, size], sort_keys=True, default=str)
        if key not in _TASKS:
            from verifiers.v1.utils.loaders import taskset_config_type

            ident = self._data["taskset"]["id"]

            def tasks_of(overrides: dict) -> list:
                config = taskset_config_type(ident).model_validate({**self._data["taskset"], **overrides})
                taskset = cls(config)
                if size is not None:
                    taskset = taskset.take(int(size))
                elif not taskset.bounded:
                    raise ConfigError(f"--env verifiers:{self.taskset_name}: the taskset is endless; give its size "
                                      "in --env.kwargs (size)")
                return list(taskset)

            try:
                train = tasks_of({})
                evaluation = tasks_of(_plain(eval_taskset, "eval_taskset")) if eval_taskset is not None else []
            except ConfigError:
                raise
            except Exception as err:  # the taskset's own validation or load()
                raise ConfigError(f"--env verifiers:{self.taskset_name}: loading its tasks raised "
                                  f"{type(err).__name__}: {err}") from None
            if not train:
                raise ConfigError(f"--env verifiers:{self.taskset_name}: the taskset has no tasks")
            _TASKS[key] = (train, evaluation)
        return _TASKS[key]

    async def _served(self) -> _Served:
        loop = asyncio.get_running_loop()
        key = (self._key, id(loop))
        entry = _SERVED.get(key)
        if entry is None:
            entry = _SERVED[key] = _Served(loop)
            entry.ready = asyncio.ensure_future(entry.start(self._data))
        await asyncio.shield(entry.ready)
        return entry

    async def play(self, client: Any, row: dict, base_url: str, api_key: str) -> dict:
        """One episode: verifiers' ``Env.run_episode`` of the row's task against this episode's endpoint.

        verifiers reads an endpoint's API key from an environment variable: the episode's token goes
        into one named after the episode for the episode's length."""
        import verifiers.v1 as vf

        served = await self._served()
        task = self._tasks[row["vf_task"]]
        variable = f"{_KEY_VARIABLE}_{secrets.token_hex(8).upper()}"
        os.environ[variable] = api_key
        try:
            context = vf.ModelContext(model=self.model_name,
                                      client=vf.EvalClientConfig(base_url=base_url, api_key_var=variable))
            episode = await served.env.run_episode(task, context)
        finally:
            os.environ.pop(variable, None)
            await _drop_client(served.env, context.client)
        return episode_outcome(episode, self.agent_name)

    def close(self) -> None:
        for key in [k for k in _SERVED if k[0] == self._key]:
            entry = _SERVED[key]
            if entry.loop.is_closed() or not entry.loop.is_running():
                continue
            _SERVED.pop(key, None)
            try:
                asyncio.run_coroutine_threadsafe(entry.stack.aclose(), entry.loop).result(timeout=60)
            except Exception:  # closing must not hide the run's own outcome
                pass


async def _drop_client(env: Any, config: Any) -> None:
    """Close the HTTP client verifiers' interception server keeps for ``config`` (one per distinct
    endpoint configuration, kept until the server stops): each episode has a base URL and a token of its
    own, so without this every episode would leave one open behind."""
    interception = getattr(env, "_interception", None)
    key = config.model_dump_json()
    for server in getattr(interception, "servers", None) or [interception]:
        clients = getattr(server, "clients", None)
        client = clients.pop(key, None) if isinstance(clients, dict) else None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


def episode_outcome(episode: Any, name: str) -> dict:
    """A verifiers ``Episode`` as an agent's result: the reward (the traces' weighted rewards), each
    reward function's and metric's value in ``info``; ``RuntimeError`` with verifiers' first error
    when the episode could not be scored."""
    traces = list(episode.traces)
    errors = list(episode.errors) + [e for t in traces for e in t.errors]
    scored = [t for t in traces if t.rewards and all(r is not None for r in t.rewards.values())]
    if not scored:
        first = errors[0] if errors else None
        detail = f"{first.type}: {first.message}" if first is not None else "no trace was scored"
        raise RuntimeError(f"{name}: the episode could not be scored ({' '.join(str(detail).split())[:500]})")
    info: dict[str, float] = {"turns": float(sum(t.num_turns for t in traces))}
    for t in scored:
        for reward_name, reward in t.rewards.items():
            info[f"reward_{reward_name}"] = float(reward.score)
        for metric, value in t.metrics.items():
            if value is not None:
                info[f"metric_{metric}"] = float(value)
    return {"reward": float(sum(t.reward for t in scored)), "info": info}
