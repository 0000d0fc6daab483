"""Rollout engines by name: one :class:`EngineKind` per engine, registered where the engine lives.

:data:`ENGINE_REGISTRY` maps each ``--rollout.engine`` name to its kind. A kind registers itself
with the :func:`register_engine` decorator on its class, in the engine's own package; the shipped
ones (:data:`SHIPPED_ENGINES`) are imported on first use, so that the configuration can list their
names (``--rollout.engine`` choices) without importing torch or an engine. Adding an engine: its
package (the engine, its options, its kind under ``@register_engine``) and, for a shipped one, its
line in :data:`SHIPPED_ENGINES` (plus its flag section in the configuration when it has flags).

An engine never reads the run's configuration. The trainer hands its kind an :class:`EngineRun`
(the few run-wide values every engine may use, and the values of the engine's own flag section),
and the kind turns that into its typed options (a frozen dataclass, e.g. ``HFOptions``,
``VLLMOptions``), which is all the engine receives. A kind also answers whether the engine's
software is installed (one line naming the fix otherwise), how many rollout workers (one engine
each) a run has and how many GPUs each takes, and whether it is built from a copy of the policy
module or from its config (weights arriving with the first weight sync).

This module imports neither torch nor the configuration (python_tests/test_architecture.py).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from flashreinforce.engines.base import RolloutEngine

__all__ = ["ENGINE_REGISTRY", "SHIPPED_ENGINES", "EngineKind", "EngineRun", "create_engine", "engine_kind",
           "engine_names", "register_engine"]

#: The registered kinds by ``--rollout.engine`` name (filled by :func:`register_engine`).
ENGINE_REGISTRY: dict[str, EngineKind] = {}
#: The shipped engines: name -> the package whose import registers its kind.
SHIPPED_ENGINES: dict[str, str] = {"hf": "flashreinforce.engines.hf", "vllm": "flashreinforce.engines.vllm"}


@dataclass(frozen=True)
class EngineRun:
    """What a run hands an engine kind to build its options from: plain values, no configuration.

    ``seed``: the run's seed. ``dtype``: the engines' weight dtype (canonical name,
    ``rollout.engine_dtype`` with ``auto`` decided). ``num_workers``: ``rollout.num_workers``.
    ``max_len``: ``data.max_len`` (prompt and continuation). ``episodes_per_call``: episodes a worker
    samples together. ``inflight_check_tokens``: sampled tokens between two checks for newer weights.
    ``section``: the values of the engine's own flag section (``{}`` when it has none).
    """

    seed: int = 0
    dtype: str = "auto"
    num_workers: int = 1
    max_len: int | None = None
    episodes_per_call: int | None = None
    inflight_check_tokens: int = 64
    section: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NoOptions:
    """The options of an engine that takes none."""


class EngineKind(abc.ABC):
    """How to build one kind of rollout engine (see the module docstring).

    ``name``: the ``--rollout.engine`` value. ``takes_policy_copy``: :meth:`create` gets a copy of
    the policy module with the current weights (True), or the policy's ``transformers`` config, its
    weights then loaded by the first sync (False). ``options_type``: the frozen dataclass of the
    engine's options; its fields are the option names :func:`create_engine` accepts.
    """

    name: str = ""
    takes_policy_copy: bool = True
    options_type: type = NoOptions

    def check_installed(self) -> None:
        """Raise ``ImportError`` with one line naming the fix when the engine cannot run here."""

    def options(self, run: EngineRun) -> Any:
        """The engine's options (an ``options_type``) for a run."""
        return self.options_type()

    def option_names(self) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(self.options_type))

    def typed_options(self, options: Any = None) -> Any:
        """``options`` as an ``options_type``: one already, or a mapping of some of its fields (the
        others at their defaults); ``ValueError`` naming the options that are not its fields."""
        if isinstance(options, self.options_type):
            return options
        options = dict(options or {})
        unknown = set(options) - self.option_names()
        if unknown:
            raise ValueError(f"the {self.name} engine takes the options {sorted(self.option_names())}, got "
                             f"{sorted(unknown)}")
        return self.options_type(**options)

    def num_workers(self, run: EngineRun, options: Any) -> int:
        """Rollout workers (one engine each) of a run."""
        return int(run.num_workers)

    def gpus_per_worker(self, options: Any) -> float:
        """GPUs a Ray rollout worker reserves when ``--ray.num_gpus_per_worker`` is not given."""
        return 0.0

    @abc.abstractmethod
    def create(self, model: Any, *, pad_token_id: int, version: int, options: Any) -> RolloutEngine:
        """A new engine (see ``takes_policy_copy`` for what ``model`` is; ``options``: an ``options_type``)."""


def register_engine(kind: Any) -> Any:
    """Make a kind available as ``--rollout.engine kind.name`` (replacing an earlier one of that name).

    ``kind``: an :class:`EngineKind` subclass (instantiated once; use as a class decorator) or
    instance. Returns its argument."""
    instance = kind() if isinstance(kind, type) and issubclass(kind, EngineKind) else kind
    if not isinstance(instance, EngineKind) or not instance.name:
        raise TypeError(f"register_engine: an EngineKind with a name is needed, got {kind!r}")
    options_type = instance.options_type
    if not (dataclasses.is_dataclass(options_type) and options_type.__dataclass_params__.frozen):
        raise TypeError(f"register_engine: {type(instance).__name__}.options_type must be a frozen dataclass, got "
                        f"{options_type!r}")
    ENGINE_REGISTRY[instance.name] = instance
    return kind


def engine_names() -> tuple[str, ...]:
    """Every engine name: the shipped ones first, then those registered from Python (no engine is
    imported)."""
    return tuple(dict.fromkeys([*SHIPPED_ENGINES, *ENGINE_REGISTRY]))


def engine_kind(name: str) -> EngineKind:
    """The :class:`EngineKind` called ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in ENGINE_REGISTRY and name in SHIPPED_ENGINES:
        importlib.import_module(SHIPPED_ENGINES[name])  # its kind registers itself
    kind = ENGINE_REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"rollout engine {name!r} is not known; known engines: {', '.join(engine_names())}")
    return kind


def create_engine(kind: str, model: Any, *, pad_token_id: int, version: int = -1, options: Any = None) -> RolloutEngine:
    """An engine of ``kind`` (a registered name). ``options``: the kind's options (its
    ``options_type``), or a mapping of some of them (checked against its fields)."""
    k = engine_kind(kind)
    return k.create(model, pad_token_id=pad_token_id, version=version, options=k.typed_options(options))
