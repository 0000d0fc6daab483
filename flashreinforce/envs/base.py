"""The user-facing environment interface: text in, text out, multi-turn.

An episode starts with ``reset(seed=...)``, which returns the prompt text. The policy then
answers with an action (text); ``step(action)`` returns what the environment says back. The
observation text of a step is appended to the trajectory as non-action tokens (the policy is
never trained on them), and the episode goes on until ``done`` or the turn limit.

The turn limit is decided in one place, :func:`resolve_max_turns`: the run's ``rollout.max_turns`` when
given, else ``$MAX_AGENT_TURNS`` (what the published launchers set per setting), else the
environment's own :attr:`Environment.default_max_turns`. The trainer hands the result to the
environment (``max_turns=``) and caps the rollout at it, so both always agree.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: The environment variable holding an agent's turn limit (set per setting by the published launchers).
MAX_AGENT_TURNS = "MAX_AGENT_TURNS"


def resolve_max_turns(default: int, given: int | None = None) -> int:
    """Policy turns per episode: ``given`` when not ``None``, else ``$MAX_AGENT_TURNS`` when set, else
    ``default``. Raises ``ValueError`` naming the source when the value is not a positive integer."""
    if given is not None:
        value, source = given, "max_turns"
    else:
        text = os.environ.get(MAX_AGENT_TURNS, "").strip()
        if not text:
            return default
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{MAX_AGENT_TURNS} must be a positive integer, got {text!r}") from None
        source = MAX_AGENT_TURNS
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source} must be a positive integer, got {value!r}")
    return value


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

    #: Policy turns per episode when neither the run (``rollout.max_turns``) nor ``$MAX_AGENT_TURNS``
    #: sets it (see :func:`resolve_max_turns`).
    default_max_turns: ClassVar[int] = 16
    #: Whether several instances of this class may run calls at the same time, each in its own thread
    #: (a rollout worker runs the ``reset`` and ``step`` calls of its episodes concurrently, up to
    #: ``rollout.env_parallel_calls``). ``False`` for an engine with process-wide state: the worker then
    #: calls its instances one after another.
    parallel_calls: ClassVar[bool] = True
    #: The kind of rollout worker that plays this class's episodes (a name of
    #: ``flashreinforce.trainer.rollout.worker_kinds.WORKER_REGISTRY``); None: the trainer's plain worker.
    rollout_worker: ClassVar[str | None] = None

    @abc.abstractmethod
    def reset(self, *, seed: int) -> str:
        """Start a new episode and return the prompt text. ``seed`` selects the task."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the policy's action text and return the environment's answer."""

    def turn_end(self, text: str) -> int | None:
        """Where the policy's turn ends in ``text`` (its sampled text so far), or ``None`` while it goes on.

        The rollout stops sampling the turn once this returns an index (the engine stops early where it
        can) and keeps the tokens up to the one that reached it; the turn is then closed with the
        tokenizer's end-of-turn token, as context (not an action), so that the next observation follows
        a finished turn. The default never ends a turn early: turns end at a stop token or the length
        limit. Must be monotone: once a prefix has an end, every longer prefix has one.
        """
        return None

    def close(self) -> None:
        """Release resources (subprocesses, files). Called once when the worker stops."""
