"""What the objective takes, without PyTorch: its options, their names, and the loss modes by name.

Every layer shares these definitions (this module imports only the standard library, so the
configuration, which must not import PyTorch, uses them too):

* :class:`LossOptions`: the options of the FlashREINFORCE objective and of the PPO comparison,
  frozen and validated once. The public loss functions check their keyword options by building
  one; the learner's loss modes receive one; the trainer's flags map onto one
  (:data:`OPTION_FLAGS` names the flag of each field).
* :data:`LOSS_AGGREGATIONS`: the loss aggregations (``loss_agg``, ``actor.flash_loss_agg``).
* :data:`LOSS_MODE_REGISTRY`: the learner's loss modes (``actor.loss_mode``) by name. Each entry is
  the implementation class or, for the shipped ones, where it lives (``"module:Class"``, imported
  on first use); :func:`flashreinforce.ops.loss_modes.register_loss_mode` adds more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any

__all__ = ["LOSS_AGGREGATIONS", "LOSS_MODE_REGISTRY", "OPTION_FLAGS", "LossOptions", "loss_mode_names"]

#: Supported values of ``loss_agg``: mean over each trajectory's policy tokens then over B (the
#: method); one mean over all policy tokens of the batch; each trajectory's sum divided by the
#: constant ``loss_scale_factor``, then the mean over B.
LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")

#: The loss modes by name: the implementation class, or ``"module:Class"`` imported on first use.
LOSS_MODE_REGISTRY: dict[str, Any] = {
    "flash_reinforce": "flashreinforce.ops.loss_modes:FlashReinforceLoss",
    "ppo": "flashreinforce.ops.loss_modes:PPOClippedLoss",
}


def loss_mode_names() -> tuple[str, ...]:
    """The registered loss modes' names, in registration order."""
    return tuple(LOSS_MODE_REGISTRY)


def _is_bool(value: Any) -> bool:
    return type(value) is bool or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"))


def _real(name: str, value: Any, requirement: str) -> float:
    """A Python or NumPy real number that is not a bool (bools are flags, not numbers)."""
    if type(value) is float:
        return value
    if _is_bool(value) or not isinstance(value, Real):
        raise ValueError(f"{name} {requirement}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LossOptions:
    """The options of the objective (docs/semantics.md), validated when built.

    delta: trust threshold of the sequence Bernoulli-KL gate (``inf``: no gate).
    negative_token_fraction: q of the entropy filter; failed trajectories keep ``ceil(q * T_i)``
        policy tokens (1: the filter is off).
    loss_agg: one of :data:`LOSS_AGGREGATIONS`. loss_scale_factor: the constant divisor of
        ``seq-mean-token-sum-norm`` (required there, refused elsewhere).
    no_is: no importance correction (every ratio is 1, the gate admits everything).
    eps_clip: PPO ratio clip range ``(low, high)``; whiten: divide GRPO group advantages by the
        group's standard deviation (both only for the ``ppo`` loss mode).

    Raises ``ValueError`` naming the option for a bad value, ``TypeError`` for a flag that is not a bool.
    """

    delta: float = 3e-3
    negative_token_fraction: float = 1.0
    loss_agg: str = LOSS_AGGREGATIONS[0]
    loss_scale_factor: float | None = None
    no_is: bool = False
    eps_clip: tuple[float, float] = (0.2, 0.2)
    whiten: bool = False

    def __post_init__(self) -> None:
        delta = _real("delta", self.delta, "must be a non-negative number (inf disables the gate)")
        if not delta >= 0.0:  # NaN fails too
            raise ValueError(f"delta must be a non-negative number (inf disables the gate), got {delta!r}")
        q = _real("negative_token_fraction", self.negative_token_fraction, "must be a number in [0, 1]")
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"negative_token_fraction must be a number in [0, 1], got {q!r}")
        agg = self.loss_agg
        if type(agg) is not str or agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {agg!r}")
        lsf = self.loss_scale_factor
        if agg == "seq-mean-token-sum-norm":
            if lsf is None:
                raise ValueError(f"loss_scale_factor must be a positive finite number for {agg}, got None")
            lsf = _real("loss_scale_factor", lsf, f"must be a positive finite number for {agg}")
            if not (math.isfinite(lsf) and lsf > 0.0):
                raise ValueError(f"loss_scale_factor must be a positive finite number for {agg}, got {lsf!r}")
        elif lsf is not None:
            raise ValueError(f"loss_scale_factor is only used with loss_agg='seq-mean-token-sum-norm', not {agg!r}")
        if not _is_bool(self.no_is):
            raise TypeError(f"no_is must be a bool, got {self.no_is!r}")
        if not _is_bool(self.whiten):
            raise TypeError(f"whiten must be a bool, got {self.whiten!r}")
        pair = self.eps_clip
        if isinstance(pair, str) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise ValueError(f"eps_clip must hold two numbers (low, high), got {pair!r}")
        low, high = (_real("eps_clip", x, "must hold two numbers (low, high)") for x in pair)
        if not (0 <= low < 1 and high >= 0):
            raise ValueError(f"eps_clip must have 0 <= low < 1 and high >= 0, got {low} {high}")
        for name, value in (("delta", delta), ("negative_token_fraction", q), ("loss_scale_factor", lsf),
                            ("no_is", bool(self.no_is)), ("whiten", bool(self.whiten)), ("eps_clip", (low, high))):
            object.__setattr__(self, name, value)

    @property
    def entropy_filter(self) -> bool:
        """Whether the entropy filter is on (``negative_token_fraction < 1``)."""
        return self.negative_token_fraction < 1.0

    def objective_kwargs(self) -> dict[str, Any]:
        """The keyword options of the public loss functions (the objective's fields, not PPO's)."""
        return {"delta": self.delta, "negative_token_fraction": self.negative_token_fraction,
                "loss_agg": self.loss_agg, "loss_scale_factor": self.loss_scale_factor, "no_is": self.no_is}


#: The trainer flag of each :class:`LossOptions` field (``whiten`` is the negation of its flag).
OPTION_FLAGS = {"delta": "actor.flash_gate_delta", "negative_token_fraction": "actor.flash_neg_topq",
                "loss_agg": "actor.flash_loss_agg", "loss_scale_factor": "actor.loss_scale_factor",
                "no_is": "actor.flash_no_is", "eps_clip": "actor.eps_clip_low_high",
                "whiten": "algo.advantage.no_whiten"}
assert set(OPTION_FLAGS) == {f.name for f in fields(LossOptions)}
