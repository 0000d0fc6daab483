"""What the objective takes, without PyTorch: its options, their names, and the loss modes by name.

Every layer shares these definitions (this module imports only the standard library, so the
configuration, which must not import PyTorch, uses them too):

* :class:`LossOptions`: the options of the FlashREINFORCE objective and of the PPO comparison,
  frozen and validated once. The public loss functions check their keyword options by building
  one; the learner's loss modes receive one; the trainer's flags map onto one
  (:data:`OPTION_FLAGS` names the flag of each field).
* :data:`LOSS_AGGREGATIONS`: the loss aggregations (``loss_agg``, ``actor.flash_loss_agg``).
* :data:`LOSS_MODE_REGISTRY`: the learner's loss modes (``actor.loss_mode``) by name, each a
  :class:`LossModeConfig` (after prime-rl's per-variant loss configurations): the flags and options
  the mode owns, the advantage estimator it goes with, its own rules, and where its implementation
  lives (``"module:Class"``, imported on first use; :func:`flashreinforce.ops.loss_modes.register_loss_mode`
  adds more). The configuration, the published settings and the learner ask the selected mode; none
  of them names one. This module and :mod:`flashreinforce.ops.loss_modes` are the only ones that do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any, Mapping

__all__ = ["DEFAULT_LOSS_MODE", "GATE_METRICS", "LOSS_AGGREGATIONS", "LOSS_MODE_REGISTRY", "OPTION_FLAGS", "LossModeConfig",
           "LossOptions", "advantage_estimators", "loss_mode_config", "loss_mode_names", "owned_flags"]

#: Supported values of ``loss_agg``: mean over each trajectory's policy tokens then over B (the
#: method); one mean over all policy tokens of the batch; each trajectory's sum divided by the
#: constant ``loss_scale_factor``, then the mean over B.
LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")

#: Supported values of ``gate_metric`` (``actor.gate_metric``), the per-token divergence whose mean over a
#: trajectory's policy tokens the trust gate compares with ``delta``: the clamped Bernoulli KL (the
#: method); the larger of the forward and reverse Bernoulli KL; the k3 estimator ``e^d - 1 - d``;
#: ``|d|`` (``d = log_prob - behavior_log_prob``). docs/semantics.md defines them.
GATE_METRICS = ("binary_kl", "kpop", "k3", "log_ratio")

def loss_mode_names() -> tuple[str, ...]:
    """The registered loss modes' names, in registration order."""
    return tuple(LOSS_MODE_REGISTRY)


def loss_mode_config(name: str) -> "LossModeConfig":
    """The registered mode ``name``'s configuration; ``ValueError`` listing the known names otherwise."""
    config = LOSS_MODE_REGISTRY.get(name) if isinstance(name, str) else None
    if config is None:
        raise ValueError(f"actor.loss_mode must be one of {sorted(LOSS_MODE_REGISTRY)}, got {name!r}")
    return config


def advantage_estimators() -> tuple[str, ...]:
    """The advantage estimators (``algo.advantage.estimator``) the registered modes go with."""
    return tuple(dict.fromkeys(c.estimator for c in LOSS_MODE_REGISTRY.values() if c.estimator))


def owned_flags() -> dict[str, str]:
    """Each flag a registered mode owns -> the first mode that owns it."""
    owners: dict[str, str] = {}
    for config in LOSS_MODE_REGISTRY.values():
        for flag in config.flags:
            owners.setdefault(flag, config.name)
    return owners


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
    gate_metric: one of :data:`GATE_METRICS`, what the gate averages per trajectory.
    is_truncation: clip every importance ratio at this value, at least 1 (truncated IS; ``inf``: no clip).
    eps_clip: PPO ratio clip range ``(low, high)``; whiten: divide GRPO group advantages by the
        group's standard deviation (both only for the ``ppo`` loss mode).

    Raises ``ValueError`` naming the option for a bad value, ``TypeError`` for a flag that is not a bool.
    """

    delta: float = 3e-3
    negative_token_fraction: float = 1.0
    loss_agg: str = LOSS_AGGREGATIONS[0]
    loss_scale_factor: float | None = None
    no_is: bool = False
    gate_metric: str = GATE_METRICS[0]
    is_truncation: float = math.inf
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
        if type(self.gate_metric) is not str or self.gate_metric not in GATE_METRICS:
            raise ValueError(f"gate_metric must be one of {GATE_METRICS}, got {self.gate_metric!r}")
        cap = _real("is_truncation", self.is_truncation, "must be a number >= 1 (inf: no truncation)")
        if not cap >= 1.0:  # NaN fails too
            raise ValueError(f"is_truncation must be a number >= 1 (inf: no truncation), got {cap!r}")
        if not _is_bool(self.whiten):
            raise TypeError(f"whiten must be a bool, got {self.whiten!r}")
        pair = self.eps_clip
        if isinstance(pair, str) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise ValueError(f"eps_clip must hold two numbers (low, high), got {pair!r}")
        low, high = (_real("eps_clip", x, "must hold two numbers (low, high)") for x in pair)
        if not (0 <= low < 1 and high >= 0):
            raise ValueError(f"eps_clip must have 0 <= low < 1 and high >= 0, got {low} {high}")
        for name, value in (("delta", delta), ("negative_token_fraction", q), ("loss_scale_factor", lsf),
                            ("no_is", bool(self.no_is)), ("is_truncation", cap), ("whiten", bool(self.whiten)),
                            ("eps_clip", (low, high))):
            object.__setattr__(self, name, value)

    @property
    def entropy_filter(self) -> bool:
        """Whether the entropy filter is on (``negative_token_fraction < 1``)."""
        return self.negative_token_fraction < 1.0

    def objective_kwargs(self) -> dict[str, Any]:
        """The keyword options of the public loss functions (the objective's fields, not PPO's)."""
        return {"delta": self.delta, "negative_token_fraction": self.negative_token_fraction,
                "loss_agg": self.loss_agg, "loss_scale_factor": self.loss_scale_factor, "no_is": self.no_is,
                "gate_metric": self.gate_metric, "is_truncation": self.is_truncation}


#: The trainer flag of each :class:`LossOptions` field (``whiten`` is the negation of its flag).
OPTION_FLAGS = {"delta": "actor.flash_gate_delta", "negative_token_fraction": "actor.flash_neg_topq",
                "loss_agg": "actor.flash_loss_agg", "loss_scale_factor": "actor.loss_scale_factor",
                "no_is": "actor.flash_no_is", "gate_metric": "actor.gate_metric",
                "is_truncation": "actor.is_truncation", "eps_clip": "actor.eps_clip_low_high",
                "whiten": "algo.advantage.no_whiten"}
assert set(OPTION_FLAGS) == {f.name for f in fields(LossOptions)}


@dataclass(frozen=True)
class LossModeConfig:
    """What one loss mode owns on the configuration side.

    name: its ``actor.loss_mode`` value. implementation: its :class:`flashreinforce.ops.loss_modes.LossMode`
    class, or where it lives (``"module:Class"``). estimator: the ``algo.advantage.estimator`` it goes
    with (``None``: any). flags: the flags only this mode reads (recorded as inactive under another
    mode, and not allowed in a published setting of another mode). options: the :class:`LossOptions`
    fields it reads, checked by ``LossOptions`` when the mode is selected. one_sample_per_prompt: it
    needs ``rollout.n_samples_per_prompt 1``. own_behavior_correction: it corrects for the behavior
    policy itself, so ``algo.advantage.is_correction_level`` must be off.
    """

    name: str
    implementation: Any
    estimator: str | None = None
    flags: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    one_sample_per_prompt: bool = False
    own_behavior_correction: bool = False
    notes: tuple[tuple[str, str], ...] = field(default=())

    def rule_violations(self, flags: Mapping[str, Any]) -> list[str]:
        """The mode's own rules over flat dotted ``flags`` (the published settings' names): one message each."""
        errors = []
        estimator = flags.get("algo.advantage.estimator")
        if self.estimator is not None and estimator != self.estimator:
            errors.append(f"actor.loss_mode {self.name} needs algo.advantage.estimator {self.estimator}, got "
                          f"{estimator!r}")
        correction = flags.get("algo.advantage.is_correction_level")
        if self.own_behavior_correction and not (correction is None or str(correction).lower() in
                                                 ("off", "none", "false", "0", "")):
            errors.append(f"algo.advantage.is_correction_level must be off with actor.loss_mode {self.name} (the "
                          f"loss does its own behavior correction), got {correction!r}")
        samples = flags.get("rollout.n_samples_per_prompt")
        if self.one_sample_per_prompt and samples != 1:
            errors.append(f"actor.loss_mode {self.name} uses one sample per prompt; got rollout.n_samples_per_prompt "
                          f"{samples}")
        values = {opt: flags[OPTION_FLAGS[opt]] for opt in self.options if OPTION_FLAGS[opt] in flags}
        if "eps_clip" in values and values["eps_clip"] is not None:
            values["eps_clip"] = tuple(values["eps_clip"])
        values.pop("whiten", None)  # a switch of the flag's own kind, checked as a flag
        if values.get("loss_agg", LOSS_AGGREGATIONS[0]) != "seq-mean-token-sum-norm":
            values.pop("loss_scale_factor", None)  # inactive with another aggregation
        try:
            LossOptions(**values)
        except (TypeError, ValueError) as err:
            text = str(err)
            option = text.split(" ", 1)[0]
            errors.append(OPTION_FLAGS.get(option, option) + text[len(option):])
        return errors

    def inactive(self, flags: Mapping[str, Any]) -> dict[str, str]:
        """The flags without effect when this mode is selected, with the reason: the other modes' own
        flags, and this mode's ``notes`` (``(flag, condition)``: inactive unless the condition, a
        ``flag=value`` pair, holds)."""
        out = {flag: f"dropped: actor.loss_mode is {self.name} (only used by actor.loss_mode {owner})"
               for flag, owner in owned_flags().items() if flag not in self.flags}
        for flag, condition in self.notes:
            key, _, value = condition.partition("=")
            if flags.get(key) != value and flags.get(flag) is not None:
                out[flag] = f"only used by {key} {value} ({key} is {flags.get(key)})"
        return out


#: The loss mode a run uses unless ``actor.loss_mode`` says otherwise.
DEFAULT_LOSS_MODE = "flash_reinforce"

#: The loss modes by name (registration order; :func:`flashreinforce.ops.loss_modes.register_loss_mode`
#: adds more, and puts the implementation class in place of its ``"module:Class"`` on first use).
LOSS_MODE_REGISTRY: dict[str, LossModeConfig] = {
    "flash_reinforce": LossModeConfig(
        name="flash_reinforce", implementation="flashreinforce.ops.loss_modes:FlashReinforceLoss",
        estimator="flash_reinforce",
        flags=("actor.flash_gate_delta", "actor.flash_gate_level", "actor.flash_neg_topq", "actor.flash_loss_agg",
               "actor.loss_scale_factor", "actor.flash_no_is", "actor.gate_metric", "actor.is_truncation"),
        options=("delta", "negative_token_fraction", "loss_agg", "loss_scale_factor", "no_is", "gate_metric",
                 "is_truncation"),
        one_sample_per_prompt=True, own_behavior_correction=True,
        notes=(("actor.loss_scale_factor", "actor.flash_loss_agg=seq-mean-token-sum-norm"),)),
    "ppo": LossModeConfig(
        name="ppo", implementation="flashreinforce.ops.loss_modes:PPOClippedLoss", estimator="grpo",
        flags=("actor.eps_clip_low_high", "algo.advantage.no_whiten"), options=("eps_clip", "whiten")),
}
