"""Callbacks: a user's own code at the points of a run (``flashreinforce.train(..., callbacks=[...])``).

A callback is any object with some of these methods (all optional; :class:`Callback` is a base
class with every one doing nothing), or a plain function, which is taken as ``on_update``:

* ``on_train_begin(info)``: before the first update; ``info`` has ``output``, ``step`` (0, or the
  step a resumed run continues from), ``max_steps``, ``num_prompts`` and ``heldout_prompts``;
* ``on_update(metrics)``: after every update, with the update's ``metrics.jsonl`` record (a copy:
  ``step``, ``reward_mean``, ``success_rate``, ``loss``, ... and the ``eval_*`` keys on evaluation
  steps). Return ``True`` to stop the run after this update;
* ``on_eval(step, metrics)``: after every evaluation (the ``eval.jsonl`` record); ``True`` stops the run;
* ``on_save(step, path)``: after a checkpoint was written to ``path``;
* ``on_train_end(summary)``: once the run has ended and its ``summary.json`` is written, whatever
  ended it (not after an exception).

A run a callback stopped ends like one that reached ``train.max_steps``, with ``status`` ``"stopped"``
and ``stop_reason`` naming the callback: checkpoint, exported model, summary. An exception raised by
a callback ends the run as a failure (a checkpoint is still written) and reaches the caller.
Callbacks run in the learner's thread, between updates: the time they take is the run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

__all__ = ["Callback", "CallbackList"]

_HOOKS = ("on_train_begin", "on_update", "on_eval", "on_save", "on_train_end")


class Callback:
    """Base class of a callback: override the methods you need (see the module docstring)."""

    def on_train_begin(self, info: Mapping[str, Any]) -> None:
        return None

    def on_update(self, metrics: Mapping[str, Any]) -> bool | None:
        return None

    def on_eval(self, step: int, metrics: Mapping[str, Any]) -> bool | None:
        return None

    def on_save(self, step: int, path: Path) -> None:
        return None

    def on_train_end(self, summary: Mapping[str, Any]) -> None:
        return None


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


class CallbackList:
    """The run's callbacks, called in the order given. ``stop_reason``: which callback asked to stop."""

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        if callable(callbacks) or isinstance(callbacks, Callback):
            callbacks = [callbacks]
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not callable(cb) and not any(callable(getattr(cb, hook, None)) for hook in _HOOKS):
                raise TypeError(f"callbacks: {_name(cb)} is neither a function nor an object with any of "
                                f"{', '.join(_HOOKS)}")
        self.stop_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _call(self, hook: str, *args: Any) -> bool:
        stop = False
        for cb in self.callbacks:
            fn: Callable | None = getattr(cb, hook, None)
            if fn is None and hook == "on_update" and callable(cb) and not isinstance(cb, Callback):
                fn = cb  # a plain function is an on_update hook
            if not callable(fn):
                continue
            if fn(*args) is True and hook in ("on_update", "on_eval"):
                stop = True
                if self.stop_reason is None:
                    self.stop_reason = f"callback {_name(cb)} ({hook})"
        return stop

    def on_train_begin(self, info: Mapping[str, Any]) -> None:
        self._call("on_train_begin", dict(info))

    def on_update(self, metrics: Mapping[str, Any]) -> bool:
        return self._call("on_update", dict(metrics))

    def on_eval(self, step: int, metrics: Mapping[str, Any]) -> bool:
        return self._call("on_eval", step, dict(metrics))

    def on_save(self, step: int, path: Path) -> None:
        self._call("on_save", step, Path(path))

    def on_train_end(self, summary: Mapping[str, Any]) -> None:
        self._call("on_train_end", dict(summary))
