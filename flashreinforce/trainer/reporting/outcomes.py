"""How a trajectory ended, in the words the run's reports use.

:func:`failure_kind` names why a failed trajectory earned nothing. The ``metrics.jsonl`` record
counts the kinds over each batch (:mod:`.metrics`), every ``samples.jsonl`` line carries its
trajectory's kind (:mod:`.samples`), and the zero-reward-variance warning names the most common
one (:mod:`.diagnostics`). :func:`episode_means` averages what the environments report per episode
(tool calls, turns, ...) for the update records and the evaluations.
"""

from __future__ import annotations

from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["episode_means", "failure_kind"]

# Keys the rollout worker itself adds to every trajectory's info (reported elsewhere in the records).
_WORKER_KEYS = frozenset({"action_tokens", "length_finishes"})


def failure_kind(t: Trajectory) -> str | None:
    """Why trajectory ``t`` failed: its environment's ``info["failure_kind"]``; else, for reward
    functions (``--reward``, whose values are in ``info`` as ``reward/NAME``), the functions that gave
    nothing (``correct <= 0``, or ``correct <= 0, format <= 0``); else ``truncated`` (cut by the turn or
    length limit) or ``unspecified``; None when it did not fail."""
    if not t.failed:
        return None
    kind = t.info.get("failure_kind")
    if isinstance(kind, str) and kind:
        return kind
    terms = {k[len("reward/"):]: v for k, v in t.info.items()
             if k.startswith("reward/") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if terms:
        nothing = sorted(name for name, value in terms.items() if value <= 0)
        return ", ".join(f"{name} <= 0" for name in nothing) if nothing else "weighted reward <= 0"
    return "truncated" if t.truncated else "unspecified"


def episode_means(trajectories) -> dict[str, float]:
    """``env/KEY``: the mean over ``trajectories`` of each number (or bool, as a share) their
    environments put in ``info`` (over the trajectories that have the key; text is left out). For
    the Python tool: ``env/tool_calls`` per trajectory, ``env/tool_errors``, ``env/answer_from_tool``,
    ``env/turns``, ..."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for t in trajectories:
        for key, value in t.info.items():
            if key in _WORKER_KEYS or not isinstance(value, (bool, int, float)):
                continue
            try:
                number = float(value)
            except OverflowError:  # an int no float holds: left out, like text
                continue
            sums[key] = sums.get(key, 0.0) + number
            counts[key] = counts.get(key, 0) + 1
    return {f"env/{key}": sums[key] / counts[key] for key in sorted(sums)}
