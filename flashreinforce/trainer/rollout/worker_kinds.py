"""Which rollout worker plays an environment's episodes.

A plain :class:`~flashreinforce.trainer.rollout.worker.RolloutWorker` plays every
:class:`~flashreinforce.envs.Environment`; an environment class whose episodes need another kind of worker
names it in its ``rollout_worker`` class attribute, a name of :data:`WORKER_REGISTRY` (the agent
environments of :mod:`flashreinforce.agents` name ``"agent"``). A worker class registers itself by name
with :func:`register_rollout_worker` in its own module; a shipped one's module (:data:`SHIPPED_WORKERS`) is
imported when an environment first names it, so that the trainer imports no feature package built on it.
"""

from __future__ import annotations

import importlib
from typing import Callable

from flashreinforce.envs.registry import environment_class
from flashreinforce.trainer.rollout.worker import RolloutWorker

__all__ = ["SHIPPED_WORKERS", "WORKER_REGISTRY", "is_agent_spec", "register_rollout_worker", "worker_class",
           "worker_kind"]

#: The registered rollout worker classes by kind, filled by :func:`register_rollout_worker`.
WORKER_REGISTRY: dict[str, type[RolloutWorker]] = {}
#: The shipped worker kinds: name -> the module whose import registers the class of that name.
SHIPPED_WORKERS: dict[str, str] = {
    # Agent functions over the OpenAI chat API, served from the worker's own endpoint.
    "agent": "flashreinforce.agents.worker",
}


def register_rollout_worker(name: str) -> Callable[[type], type]:
    """Class decorator: make a :class:`RolloutWorker` subclass the worker of environments whose
    ``rollout_worker`` is ``name`` (replacing an earlier one of that name). Returns the class."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_rollout_worker: a name is needed, got {name!r}")

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, RolloutWorker)):
            raise TypeError(f"register_rollout_worker({name!r}): {cls!r} is not a RolloutWorker subclass")
        WORKER_REGISTRY[name] = cls
        return cls

    return register


def worker_kind(spec: str | None) -> str | None:
    """The ``rollout_worker`` kind the environment class of ``spec`` (an ``--env`` spec) names; None for a
    plain worker, for no spec and for a spec that names no class (the run reports that where it builds
    the environments)."""
    if spec is None:
        return None
    try:
        cls = environment_class(spec)
    except Exception:
        return None
    return getattr(cls, "rollout_worker", None)


def is_agent_spec(spec: str | None) -> bool:
    """Whether the environment spec ``spec`` names agent functions (its episodes are the agent worker's)."""
    return worker_kind(spec) == "agent"


def worker_class(env_factory: Callable) -> type[RolloutWorker]:
    """The rollout worker class for environments built by ``env_factory`` (a run's factory carries its spec
    as ``env_spec``: :class:`~flashreinforce.envs.registry.EnvSpec`)."""
    spec = getattr(getattr(env_factory, "env_spec", None), "spec", None)
    kind = worker_kind(spec)
    if kind is None:
        return RolloutWorker
    if kind not in WORKER_REGISTRY and kind in SHIPPED_WORKERS:
        importlib.import_module(SHIPPED_WORKERS[kind])
    cls = WORKER_REGISTRY.get(kind)
    if cls is None:
        raise ValueError(f"environment {spec!r} names the rollout worker {kind!r}, which is not registered (known: "
                         f"{sorted(set(WORKER_REGISTRY) | set(SHIPPED_WORKERS))})")
    return cls
