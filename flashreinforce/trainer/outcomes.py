"""How a trajectory ended, in the words the run's reports use.

:func:`failure_kind` names why a failed trajectory earned nothing. The ``metrics.jsonl`` record
counts the kinds over each batch (:mod:`.metrics`), every ``samples.jsonl`` line carries its
trajectory's kind (:mod:`.samples`), and the zero-reward-variance warning names the most common
one (:mod:`.diagnostics`).
"""

from __future__ import annotations

from flashreinforce.trainer.trajectory import Trajectory

__all__ = ["failure_kind"]


def failure_kind(t: Trajectory) -> str | None:
    """Why trajectory ``t`` failed: its environment's ``info["failure_kind"]``, else ``truncated``
    (cut by the turn or length limit) or ``unspecified``; None when it did not fail."""
    if not t.failed:
        return None
    kind = t.info.get("failure_kind")
    if isinstance(kind, str) and kind:
        return kind
    return "truncated" if t.truncated else "unspecified"
