"""Rollout engines by name: one :class:`EngineKind` per engine, built from the run's configuration.

The names live in :data:`flashreinforce.config.sections.ENGINE_REGISTRY` (so the configuration can
offer them as ``--rollout.engine`` choices without importing an engine): each maps to the engine's
:class:`EngineKind`, or for the shipped ones to its ``"module:attribute"``, imported on first use.
:func:`register_engine` adds a kind from Python. An engine therefore lives in its own module (the
engine and its kind) plus its line in that registry and, when it has flags, its configuration
section beside it; nothing else names it.

An :class:`EngineKind` answers what the trainer needs before and while building engines: whether
the engine's software is installed (one line naming the fix otherwise), its options from the
configuration, how many rollout workers (one engine each) a run has and how many GPUs each takes,
and whether it is built from a copy of the policy module or from its config (weights arriving with
the first weight sync).
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, Mapping

from flashreinforce.config.sections import ENGINE_REGISTRY
from flashreinforce.engines.base import RolloutEngine

__all__ = ["EngineKind", "create_engine", "engine_kind", "engine_names", "register_engine"]


class EngineKind(abc.ABC):
    """How to build one kind of rollout engine (see the module docstring).

    ``name``: the ``--rollout.engine`` value. ``takes_policy_copy``: :meth:`create` gets a copy of
    the policy module with the current weights (True), or the policy's ``transformers`` config, its
    weights then loaded by the first sync (False). ``options_accepted``: the option names
    :meth:`create` takes (others are refused, naming them).
    """

    name: str = ""
    takes_policy_copy: bool = True
    options_accepted: frozenset[str] = frozenset()

    def check_installed(self) -> None:
        """Raise ``ImportError`` with one line naming the fix when the engine cannot run here."""

    def options(self, cfg: Any, seed: int, dtype: str) -> dict[str, Any]:
        """The engine's options from the resolved configuration; ``dtype``: the engines' weight dtype
        (canonical name, ``rollout.engine_dtype`` with ``auto`` decided)."""
        return {}

    def num_workers(self, cfg: Any) -> int:
        """Rollout workers (one engine each) of a run."""
        return int(cfg.rollout.num_workers)

    def gpus_per_worker(self, cfg: Any) -> float:
        """GPUs a Ray rollout worker reserves when ``--ray.num_gpus_per_worker`` is not given."""
        return 0.0

    @abc.abstractmethod
    def create(self, model: Any, *, pad_token_id: int, version: int, options: Mapping[str, Any]) -> RolloutEngine:
        """A new engine (see ``takes_policy_copy`` for what ``model`` is)."""


def register_engine(kind: EngineKind) -> EngineKind:
    """Make ``kind`` available as ``--rollout.engine kind.name`` (replacing an earlier one of that name)."""
    if not isinstance(kind, EngineKind) or not kind.name:
        raise TypeError(f"register_engine: an EngineKind with a name is needed, got {kind!r}")
    ENGINE_REGISTRY[kind.name] = kind
    return kind


def engine_names() -> tuple[str, ...]:
    """Every engine name, in registration order (the shipped ones first)."""
    return tuple(ENGINE_REGISTRY)


def engine_kind(name: str) -> EngineKind:
    """The :class:`EngineKind` called ``name``; ``ValueError`` listing the known names otherwise."""
    target = ENGINE_REGISTRY.get(name)
    if target is None:
        raise ValueError(f"rollout engine {name!r} is not known; known engines: {', '.join(engine_names())}")
    if isinstance(target, str):
        module, _, attribute = target.partition(":")
        target = ENGINE_REGISTRY[name] = getattr(importlib.import_module(module), attribute)
    return target


def create_engine(kind: str, model: Any, *, pad_token_id: int, version: int = -1,
                  options: Mapping[str, Any] | None = None) -> RolloutEngine:
    """An engine of ``kind`` (a registered name); ``options`` are checked against its accepted names."""
    k = engine_kind(kind)
    options = dict(options or {})
    unknown = set(options) - set(k.options_accepted)
    if unknown:
        raise ValueError(f"the {kind} engine takes the options {sorted(k.options_accepted)}, got {sorted(unknown)}")
    return k.create(model, pad_token_id=pad_token_id, version=version, options=options)
