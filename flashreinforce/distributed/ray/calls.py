"""One small mechanism for calling into Ray actors, instead of hand-written forwarding classes.

* :func:`delegate` (actor side): a class decorator that gives a Ray actor body one method per name,
  each running the same-named method (or reading the same-named property) of one of its members.
  Ray exposes them like any other actor method (``handle.take.remote(...)``).
* :class:`ActorClient` (caller side): ``client.take(...)`` is ``ray.get(handle.take.remote(...))`` for
  the names the client declares in ``remote_methods``, with errors that say which actor and call
  failed: an undeclared name is an ``AttributeError`` listing what the actor answers; a dead actor
  (its process or node died) is :class:`ActorGone`; no answer within the call's time limit is
  :class:`ActorGone` too (the usual cause is a Ray cluster that went away), never a silent hang.
  Once a client has met :class:`ActorGone`, every later call through it fails at once with that first
  error (``client.gone``): the cleanup after a lost cluster neither waits again nor tells another story.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, ClassVar, Iterable

from flashreinforce.trainer.errors import RunFailure

__all__ = ["ActorClient", "ActorGone", "DEFAULT_CALL_TIMEOUT_S", "RESUME_HINT", "delegate", "import_ray"]

#: Longest wait for one answer from an actor of the run (seconds). Every call the trainer makes is
#: short (a blocking ``take`` waits at most a second inside the actor); an actor that does not
#: answer in this time is unreachable (its node or the cluster is gone).
DEFAULT_CALL_TIMEOUT_S = 120.0

#: Held while a client records the first :class:`ActorGone` its calls met (calls run on several threads).
_FIRST_LOSS = threading.Lock()


def import_ray():
    """The ``ray`` module, or an ``ImportError`` that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("--rollout.backend ray needs Ray: pip install 'flashreinforce[ray]' "
                          "(or pip install 'ray>=2.9')") from err
    return ray


class ActorGone(RunFailure):
    """An actor of the run cannot be reached any more: its process or node died, or the cluster is gone.

    A :class:`~flashreinforce.trainer.errors.RunFailure`: when it ends a run, ``flashreinforce train``
    prints its message on one line (exit status 1). The rollout pool catches it for one worker and
    starts a replacement; only the trainer's own actors (buffer, weights) end the run with it.
    """


def delegate(member: str, names: Iterable[str]) -> Callable[[type], type]:
    """Class decorator: for each name, a method ``name(self, *args, **kwargs)`` that calls
    ``getattr(self.<member>, name)(*args, **kwargs)``, or returns the attribute itself when it is
    not callable (a property such as ``closed``). Names the class defines itself are left alone."""
    names = tuple(names)

    def make(name: str):
        def method(self, *args, **kwargs):
            value = getattr(getattr(self, member), name)
            if callable(value):
                return value(*args, **kwargs)
            if args or kwargs:
                raise TypeError(f"{type(self).__name__}.{name} is an attribute of .{member}; it takes no arguments")
            return value

        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"``self.{member}.{name}`` (forwarded)."
        return method

    def decorate(cls: type) -> type:
        for name in names:
            if name not in cls.__dict__:
                setattr(cls, name, make(name))
        cls.delegated = getattr(cls, "delegated", ()) + names
        return cls

    return decorate


class ActorClient:
    """Synchronous calls to one Ray actor.

    Subclasses declare ``remote_methods`` (the actor methods reachable as plain methods of the
    client) and ``actor_name`` (used in error messages). ``client.name(*args, **kwargs)`` waits for
    the answer at most ``call_timeout_s`` seconds; :meth:`submit` returns the ``ObjectRef`` instead.

    Args:
        handle: the actor handle.
        call_timeout_s: longest wait for one answer (``None``: no limit).

    ``gone``: the first :class:`ActorGone` a call met (``None`` while the actor answers); a call on another
    thread that fails after it raises a copy of it too, and from then on
    :meth:`call` and :meth:`result` raise a copy of it without asking Ray (the run's actors are never
    restarted, so a lost one stays lost, and a silent one has had its chance).
    """

    remote_methods: ClassVar[frozenset[str]] = frozenset()
    actor_name: ClassVar[str] = "actor"

    def __init__(self, handle, *, call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S) -> None:
        self.handle = handle
        self.call_timeout_s = call_timeout_s
        self.gone: ActorGone | None = None

    def __getattr__(self, name: str):
        # Only reached for names the instance and its class lack; private names are never forwarded
        # (pickle and copy look up __setstate__ & co. on a half-built object).
        if name.startswith("_") or name not in type(self).remote_methods:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; the {self.actor_name} answers "
                                 f"{', '.join(sorted(type(self).remote_methods)) or 'nothing'}")

        def call(*args, **kwargs):
            return self.call(name, *args, **kwargs)

        call.__name__ = name
        return call

    def submit(self, name: str, *args, **kwargs):
        """Start ``name(*args, **kwargs)`` on the actor; returns its ``ObjectRef`` without waiting."""
        if name not in type(self).remote_methods:
            raise AttributeError(f"{type(self).__name__}.submit: the {self.actor_name} does not answer {name!r}")
        return getattr(self.handle, name).remote(*args, **kwargs)

    def call(self, name: str, *args, timeout: float | None = None, **kwargs) -> Any:
        """``name(*args, **kwargs)`` on the actor, waiting at most ``timeout`` (default ``call_timeout_s``)."""
        self._raise_if_gone()
        return self.result(self.submit(name, *args, **kwargs), name, timeout=timeout)

    def result(self, ref, name: str = "call", *, timeout: float | None = None) -> Any:
        """The value of ``ref`` (a call to this actor); dead or silent actors raise :class:`ActorGone`."""
        self._raise_if_gone()
        ray = import_ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        limit = self.call_timeout_s if timeout is None else timeout
        try:
            return ray.get(ref, timeout=limit)
        except RayActorError as err:
            gone = ActorGone(f"the {self.actor_name} is gone ({name}): {_first_line(err)}; {RESUME_HINT}")
            cause = err
        except GetTimeoutError as err:
            gone = ActorGone(f"the {self.actor_name} did not answer {name} within {limit:g} s: its node or the Ray "
                             f"cluster is unreachable; {RESUME_HINT}")
            cause = err
        with _FIRST_LOSS:  # two threads meeting the loss at once keep one story: the first one recorded
            if self.gone is None:
                self.gone = gone
            first = self.gone
        if first is not gone:  # a concurrent call met it first: its error, as every later call gets
            raise ActorGone(str(first)) from first
        raise gone from cause

    def _raise_if_gone(self) -> None:
        if self.gone is not None:
            raise ActorGone(str(self.gone)) from self.gone


#: How every "an actor of the run is gone" message ends.
RESUME_HINT = ("its process, its node or the whole Ray cluster went away; once the cluster is back, continue "
                "with --resume from the last checkpoint")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
