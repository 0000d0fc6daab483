"""What a run keeps of a fault in an episode.

* :class:`QuarantinedEpisode`: the record a worker hands in, instead of a trajectory, for an episode
  it could not finish (the environment raised, returned a wrong type or text the tokenizer cannot
  encode, a call timed out, the engine failed on its request). The buffer counts it and retries
  the prompt a few times before skipping it; the other episodes of the same call are kept.
* :class:`RepeatedProblems`: logs the first occurrence of each kind of problem in full and then only
  counts (a line at 10, 100, 1000, ... occurrences), so a problem on every step never floods the log.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Hashable

__all__ = ["QuarantinedEpisode", "RepeatedProblems"]


@dataclass(frozen=True)
class QuarantinedEpisode:
    """An episode a worker could not finish: handed to the buffer in place of its trajectory.

    kind: the category (``env.step raised RuntimeError``, ``env.step timed out``, ...), the key of
    the counters and of the log's once-per-kind warnings. reason: what happened, for people.
    retry: whether handing the prompt out again may help (False for a prompt that cannot fit).
    fatal: the run's settings cannot fit the task (an agent's first episode cut short by
    ``rollout.max_turns`` or ``data.max_len``): the run stops at once with ``reason``, which names the flag.
    """

    prompt_id: int
    sample_index: int
    kind: str
    reason: str
    retry: bool = True
    fatal: bool = False


class RepeatedProblems:
    """Log a problem the first time its kind is seen; afterwards count it, with one line at 10, 100,
    1000, ... occurrences. Thread-safe. ``counts`` holds the occurrences per kind."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger = logger
        self.what = what
        self.counts: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def report(self, kind: Hashable, message: str, *args: Any) -> None:
        """Count one occurrence of ``kind``; ``message % args`` is logged only for the first."""
        with self._lock:
            n = self.counts.get(kind, 0) + 1
            self.counts[kind] = n
        if n == 1:
            self.logger.warning(message + " (further problems of this kind are counted, not logged each time)",
                                *args)
        elif n >= 10 and str(n).rstrip("0") == "1":  # 10, 100, 1000, ...
            self.logger.warning("%s: %r has happened %d times so far", self.what, kind, n)
