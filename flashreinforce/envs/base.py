"""The user-facing environment interface: text in, text out, multi-turn.

An episode starts with ``reset(seed=...)``, which returns the prompt text. The policy then
answers with an action (text); ``step(action)`` returns what the environment says back. The
observation text of a step is appended to the trajectory as non-action tokens (the policy is
never trained on them), and the episode goes on until ``done`` or the trainer's turn limit.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What the environment returns after one policy action.

    observation: text appended after the action as environment tokens ("" for none).
    reward: reward earned by this step; the trajectory reward is the sum over its steps.
    done: True ends the episode.
    failed: explicit failure label of the episode (used by the entropy filter); ``None``
        lets the trainer derive it from the final reward (reward <= 0 means failed).
    info: per-step metrics, merged into the trajectory's info dict.
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = True
    failed: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """A text environment; one instance runs one episode at a time."""

    @abc.abstractmethod
    def reset(self, *, seed: int) -> str:
        """Start a new episode and return the prompt text. ``seed`` selects the task."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the policy's action text and return the environment's answer."""

    def close(self) -> None:
        """Release resources (subprocesses, files). Called once when the worker stops."""
