"""The rollout engine interface and weight publication by version.

An engine turns token contexts into sampled continuations and records, for every sampled token,
the log-probability under the distribution it really sampled from (after temperature, top-k and
top-p). Engines never see text or environments; the rollout worker does that. A new engine
(vLLM, a remote server) implements :class:`RolloutEngine`; the learner publishes weights through a
:class:`WeightStore` and engines pull them by version, so neither side restarts.
"""

from __future__ import annotations

import abc
import atexit
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["Generation", "GenerationRequest", "LocalWeightStore", "RolloutEngine", "SamplingParams", "WeightStore",
           "at_exit", "run_exit_hooks"]

log = logging.getLogger(__name__)

_EXIT_HOOKS: list[Callable[[], None]] = []
_EXIT_LOCK = threading.Lock()


def at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the process ends: at interpreter exit, and when the command leaves through
    ``os._exit`` past a rollout thread still in a call (:func:`run_exit_hooks`). For what an engine
    must not leave behind (its processes, its files in shared memory); a hook runs at most once."""
    with _EXIT_LOCK:
        if not _EXIT_HOOKS:
            atexit.register(run_exit_hooks)
        _EXIT_HOOKS.append(hook)


def run_exit_hooks() -> None:
    """Run (and forget) every hook given to :func:`at_exit`, last first; a failing hook is logged."""
    while True:
        with _EXIT_LOCK:
            if not _EXIT_HOOKS:
                return
            hook = _EXIT_HOOKS.pop()
        try:
            hook()
        except Exception:  # the others still run
            log.exception("an engine's clean-up at exit failed")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature`` (0 = greedy), ``top_p`` in (0, 1], ``top_k`` (0 = off),
    and the token ids that end a turn (the stop token is kept as the turn's last action token)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class GenerationRequest:
    """One continuation to sample: the context ``token_ids``, at most ``max_new_tokens`` new tokens,
    and a ``seed`` that fixes the sampling noise of this request (reproducible rollouts).

    ``stop``: optional ``stop(new_token_ids) -> bool``, asked after each sampled token; the turn ends
    (finish reason ``"stop"``) after the first token for which it is true. An engine that cannot ask
    it mid-generation ignores it (the rollout cuts the turn afterwards, at the same token).
    """

    token_ids: Sequence[int]
    max_new_tokens: int
    seed: int
    stop: Callable[[Sequence[int]], bool] | None = None


@dataclass
class Generation:
    """A sampled continuation: ``token_ids [k]``, their sampling ``log_probs [k]`` (nats, <= 0),
    ``finish_reason`` ``"stop"`` (a stop token, included), ``"length"``, or ``"paused"`` (the engine
    stopped early because newer weights are waiting: the caller loads them and continues the request,
    see :meth:`RolloutEngine.generate`), and the engine's weight ``policy_version`` that sampled it."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    policy_version: int


class RolloutEngine(abc.ABC):
    """Samples continuations with a policy whose weights are replaced by version, without restart.

    ``can_pause``: the engine's :meth:`generate` takes ``should_pause`` (in-flight weight updates).
    ``last_load``: ``(seconds, bytes)`` of the last :meth:`load_weights`, for the run's metrics.
    """

    version: int = -1
    can_pause: bool = False
    last_load: tuple[float, int] = (0.0, 0)

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams, *,
                 should_pause: Callable[[], bool] | None = None) -> list[Generation]:
        """Sample one continuation per request (in order), all with the current weights.

        ``should_pause`` (engines with :attr:`can_pause`): asked between chunks of the decoding; once
        it returns True the engine ends every unfinished request with finish reason ``"paused"``
        (each with at least one token), so that the caller can load newer weights and continue them.
        """

    @abc.abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the policy weights by ``state_dict`` and set :attr:`version`.

        ``state_dict`` may hold a subset of the weights (those that changed since the version the
        engine holds); the others keep their values.
        """

    def holds(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Note that the engine already holds exactly the weights of ``state_dict``, the published tensors of
        ``version`` (it was built from a copy of them): it records which tensor objects those are, so that
        a later :meth:`load_weights` skips the ones published again unchanged (a frozen base under LoRA)
        and the first sync sends only what changed. Engines that keep no such record ignore it."""

    def close(self) -> None:
        """Release the engine's resources."""

    def failure(self) -> str | None:
        """Why this engine cannot serve any more (a process of its own ended), or ``None``. The trainer
        asks while it waits for rollouts and stops the run with this line."""
        return None


class WeightStore(abc.ABC):
    """Where the learner publishes policy weights and engines pick them up, by version."""

    @abc.abstractmethod
    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int,
                frozen: Iterable[str] = ()) -> None:
        """Make ``state_dict`` the weights of ``version`` (versions only grow). ``frozen``: names of
        tensors that never change (the store may keep its earlier copy of them)."""

    def advance(self, version: int) -> None:
        """Make ``version`` the newest with the very weights of the newest published one: for an update
        that left every weight as it was (a skipped optimizer step). An engine that holds those tensors
        loads nothing, so its caches of keys, values and packed weights stay valid. This default
        publishes the newest weights again (a full copy); a store that can name the same tensors for
        the new version overrides it."""
        got = self.fetch(-1)
        if got is None:
            raise ValueError(f"advance: nothing was published before version {version}")
        self.publish(got[1], version)

    @abc.abstractmethod
    def latest_version(self) -> int:
        """The newest published version (-1 before the first publication)."""

    @abc.abstractmethod
    def fetch(self, newer_than: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """``(version, state_dict)`` of the newest weights if newer than ``newer_than``, else ``None``."""

    def sync(self, engine: RolloutEngine) -> bool:
        """Load the newest weights into ``engine`` if it is behind; True when it loaded."""
        got = self.fetch(engine.version)
        if got is None:
            return False
        version, state = got
        engine.load_weights(state, version)
        return True


class LocalWeightStore(WeightStore):
    """Weights shared between threads of one process: a detached copy per published version, on the
    device of the published tensors (engines on another device copy from it when they load).

    The learner keeps training its own parameters; the copy taken at :meth:`publish` is immutable,
    so an engine can load it at any time without a lock on the learner. A ``frozen`` tensor never
    changes, so it is not copied: the store keeps the published tensor itself (the learner's own, under
    LoRA its base weights), and later versions hold the same object, which tells an engine that it has
    not changed (an engine that already holds it need not load it again).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = -1
        self._state: dict[str, torch.Tensor] = {}

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int,
                frozen: Iterable[str] = ()) -> None:
        if version <= self._version:
            raise ValueError(f"publish: version {version} is not newer than {self._version}")
        keep = set(frozen)
        old = self._state
        copy = {k: (old[k] if k in old and old[k].shape == v.shape else v.detach()) if k in keep
                else v.detach().clone() for k, v in state_dict.items()}
        with self._lock:
            self._state, self._version = copy, int(version)

    def advance(self, version: int) -> None:
        """``version`` holds the same tensor objects as the newest version: nothing is copied, and an
        engine that loaded them loads nothing (see :meth:`WeightStore.advance`)."""
        with self._lock:
            if self._version < 0:
                raise ValueError(f"advance: nothing was published before version {version}")
            if version <= self._version:
                raise ValueError(f"advance: version {version} is not newer than {self._version}")
            self._version = int(version)

    def latest_version(self) -> int:
        return self._version

    def fetch(self, newer_than: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        with self._lock:
            if self._version <= newer_than:
                return None
            return self._version, self._state
