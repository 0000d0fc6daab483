"""The exceptions of a run that cannot go on, and the worker's stop signal.

* :class:`RunFailure`: the run cannot go on; ``flashreinforce train`` prints its message as one line
  (no traceback, exit status 1). :class:`RunStalled` (the watchdog stopped a run that cannot train)
  and :class:`RolloutFailed` (every rollout worker has stopped) are kinds of it.
* :class:`StopRequested`: raised in a rollout worker told to stop while it waited for an environment
  call; not a failure.
"""

from __future__ import annotations

__all__ = ["RolloutFailed", "RunFailure", "RunStalled", "StopRequested"]


class RunFailure(RuntimeError):
    """The run cannot go on; the message says why (the CLI prints it without a traceback, exit status 1)."""


class RunStalled(RunFailure):
    """Nothing could be trained on for too long (see :class:`~flashreinforce.trainer.run.watchdog.Watchdog`)."""


class RolloutFailed(RunFailure):
    """Every rollout worker has stopped."""


class StopRequested(Exception):
    """The worker was told to stop while it waited for an environment call."""
