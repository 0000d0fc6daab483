"""What the objective takes, without PyTorch: its options, their names, and the loss modes by name.

Every layer shares these definitions (this module imports only the standard library, so the
configuration, which must not import PyTorch, uses them too):

* :class:`LossOptions`: the options of the FlashREINFORCE objective and of the PPO comparison,
  frozen and validated once. The public loss functions check their keyword options by building
  one; the learner's loss modes receive one; the trainer's flags map onto one
  (:data:`OPTION_FLAGS` names the flag of each field).
* :data:`LOSS_AGGREGATIONS`: the loss aggregations (``loss_agg``, ``actor.flash_loss_agg``).
* :data:`LOSS_MODE_REGISTRY`: the configuration side of the learner's loss modes (``actor.loss_mode``)
  by name, each a :class:`LossModeConfig` (after prime-rl's per-variant loss configurations): the flags
  and options the mode owns, the advantage estimator it goes with and its own rules. The shipped
  modes' entries are declared here, so that the configuration lists and checks them without PyTorch;
  their implementations are the classes :mod:`flashreinforce.ops.loss_modes` registers under the same
  names with its ``@register_loss_mode`` decorator (which also adds the entry of a new mode: its
  registered base class's, renamed). The configuration, the published settings and the learner ask the
  selected mode; none of them names one. This module and :mod:`flashreinforce.ops.loss_modes` are the
  only ones that do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any, Mapping

__all__ = ["DEFAULT_LOSS_MODE", "GATE_METRICS", "KERNEL_OPTIONS", "LOSS_AGGREGATIONS", "LOSS_MODE_REGISTRY",
           "OPTION_FIELDS", "OPTION_FLAGS", "LossModeConfig", "LossOptions", "config_fields", "flag_message",
           "mode_options", "options_from_flags", "advantage_estimators", "loss_mode_config", "loss_mode_names", "owned_flags"]

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


def _option(default: Any, flag: str, kind: str, help: str, *, mode: str, kernel: bool = False,
            choices: tuple[str, ...] | None = None, negated: bool = False) -> Any:
    """A :class:`LossOptions` field and its metadata: everything the other layers derive from it.

    flag: the trainer's dotted flag (``negated``: the flag is the option's negation, as
    ``algo.advantage.no_whiten`` is ``not whiten``). kind: the flag's kind (``float``, ``str``, ``bool``,
    ``float2``). help: the flag's help. mode: the loss mode that reads it (its flags are that mode's own).
    kernel: the fused op carries it to the compiled core (an entry of ``kLossOptionFields`` in
    csrc/flashreinforce/core.h, and a keyword of the public loss functions). choices: a string option's values.
    """
    meta = {"flag": flag, "kind": kind, "help": help, "mode": mode, "kernel": kernel, "choices": choices,
            "negated": negated}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class LossOptions:
    """The options of the objective (docs/semantics.md), validated when built: the one definition.

    Each field's metadata (:func:`_option`) names its trainer flag, the flag's kind and help, the loss mode that
    reads it and whether the fused op carries it to the compiled core. From it are derived: the trainer's
    flags (:func:`config_fields`, the configuration's sections), :data:`OPTION_FLAGS`, the public loss
    functions' keywords (:data:`KERNEL_OPTIONS`, :mod:`flashreinforce.ops.contract`), the op's one options
    argument, the resume rules' identity flags and each loss mode's own flags and options.

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

    delta: float = _option(3e-3, "actor.flash_gate_delta", "float", "trust threshold delta of the sequence "
                           "Bernoulli-KL gate (inf: off)", mode="flash_reinforce", kernel=True)
    negative_token_fraction: float = _option(1.0, "actor.flash_neg_topq", "float", "entropy filter q in [0, 1]: "
                                             "failed trajectories keep ceil(q T) tokens (1: off)",
                                             mode="flash_reinforce", kernel=True)
    loss_agg: str = _option(LOSS_AGGREGATIONS[0], "actor.flash_loss_agg", "str", "loss aggregation",
                            mode="flash_reinforce", kernel=True, choices=LOSS_AGGREGATIONS)
    loss_scale_factor: float | None = _option(None, "actor.loss_scale_factor", "float", "constant divisor of "
                                              "seq-mean-token-sum-norm", mode="flash_reinforce", kernel=True)
    no_is: bool = _option(False, "actor.flash_no_is", "bool", "no importance correction (ratio 1; the gate admits "
                          "everything)", mode="flash_reinforce", kernel=True)
    gate_metric: str = _option(GATE_METRICS[0], "actor.gate_metric", "str", "per-token divergence the trust gate "
                               "averages over a trajectory: binary_kl (the method), kpop (max of forward and reverse "
                               "Bernoulli KL), k3 (e^d - 1 - d) or log_ratio (|d|), d = current - behavior log-prob",
                               mode="flash_reinforce", kernel=True, choices=GATE_METRICS)
    is_truncation: float = _option(math.inf, "actor.is_truncation", "float", "clip importance ratios at this value, "
                                   ">= 1 (truncated IS; inf: no clip)", mode="flash_reinforce", kernel=True)
    eps_clip: tuple[float, float] = _option((0.2, 0.2), "actor.eps_clip_low_high", "float2", "PPO ratio clip range "
                                            "(low high), loss_mode ppo", mode="ppo")
    whiten: bool = _option(False, "algo.advantage.no_whiten", "bool", "grpo: advantages are reward minus the group "
                           "mean (true, the default, as every published grpo launcher sets it); false also divides "
                           "them by the group std + 1e-6", mode="ppo", negated=True)

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


#: The loss options' fields, in definition order, and their metadata.
OPTION_FIELDS = fields(LossOptions)
#: The trainer flag of each :class:`LossOptions` field (``whiten`` is the negation of its flag).
OPTION_FLAGS = {f.name: f.metadata["flag"] for f in OPTION_FIELDS}
#: The options the fused op carries to the compiled core (the public loss functions' option keywords).
KERNEL_OPTIONS = tuple(f.name for f in OPTION_FIELDS if f.metadata["kernel"])


def mode_options(mode: str) -> tuple[str, ...]:
    """The :class:`LossOptions` fields loss mode ``mode`` reads."""
    return tuple(f.name for f in OPTION_FIELDS if f.metadata["mode"] == mode)


def config_fields(section: str) -> tuple[tuple[str, str, Any, str, tuple[str, ...] | None], ...]:
    """The configuration fields the loss options define in ``section`` (a dotted section name, ``actor``):
    ``(attribute, kind, default, help, choices)`` each, the default in the flag's sense (negated flags too)."""
    rows = []
    for f in OPTION_FIELDS:
        owner, _, attribute = f.metadata["flag"].rpartition(".")
        if owner == section:
            default = (not f.default) if f.metadata["negated"] else f.default
            rows.append((attribute, f.metadata["kind"], default, f.metadata["help"], f.metadata["choices"]))
    return tuple(rows)


def flag_message(err: BaseException) -> str:
    """The message of a :class:`LossOptions` error, its leading option name replaced by the option's flag:
    the one place option names become flag names in messages."""
    text = str(err)
    option = text.split(" ", 1)[0]
    return OPTION_FLAGS[option] + text[len(option):] if option in OPTION_FLAGS else text


def options_from_flags(flags: Mapping[str, Any], names: tuple[str, ...] | None = None) -> LossOptions:
    """The :class:`LossOptions` of flat dotted ``flags`` (the options ``names``, default all; an absent flag:
    the option's default). ``loss_scale_factor`` is dropped unless the aggregation uses it (the configuration
    records it as inactive). Raises ``ValueError`` whose message names the flag (:func:`flag_message`)."""
    values = {}
    for f in OPTION_FIELDS:
        flag = f.metadata["flag"]
        if (names is not None and f.name not in names) or flag not in flags:
            continue
        value = flags[flag]
        if f.metadata["negated"]:
            value = value if not _is_bool(value) else not value
        if f.metadata["kind"] == "float2" and value is not None and not isinstance(value, str):
            value = tuple(value)
        values[f.name] = value
    if values.get("loss_agg", LOSS_AGGREGATIONS[0]) != "seq-mean-token-sum-norm":
        factor = values.pop("loss_scale_factor", None)  # inactive with another aggregation, but finite
        if isinstance(factor, Real) and not _is_bool(factor) and not math.isfinite(factor):
            raise ValueError(f"{OPTION_FLAGS['loss_scale_factor']} must be finite, got {factor}")
    try:
        return LossOptions(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(flag_message(err)) from None


@dataclass(frozen=True)
class LossModeConfig:
    """What one loss mode owns on the configuration side.

    name: its ``actor.loss_mode`` value (the ``name`` of its :class:`flashreinforce.ops.loss_modes.LossMode`
    class, registered under it). estimator: the ``algo.advantage.estimator`` it goes
    with (``None``: any). flags: the flags only this mode reads (recorded as inactive under another
    mode, and not allowed in a published setting of another mode). options: the :class:`LossOptions`
    fields it reads, checked by ``LossOptions`` when the mode is selected. one_sample_per_prompt: it
    needs ``rollout.n_samples_per_prompt 1``. own_behavior_correction: it corrects for the behavior
    policy itself, so ``algo.advantage.is_correction_level`` must be off.
    """

    name: str
    estimator: str | None = None
    flags: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    one_sample_per_prompt: bool = False
    own_behavior_correction: bool = False
    notes: tuple[tuple[str, str], ...] = field(default=())

    def rule_violations(self, *, estimator: Any, correction_level: Any, samples_per_prompt: Any,
                        option_values: Mapping[str, Any]) -> list[str]:
        """The mode's own rules, one message each (empty when all hold), over plain values: the advantage
        estimator (``algo.advantage.estimator``), the behavior-correction level
        (``algo.advantage.is_correction_level``), the samples per prompt (``rollout.n_samples_per_prompt``)
        and the values of this mode's option flags by flag (an absent one: the option's default). The typed
        configuration passes its fields, the published settings their flat flags."""
        errors = []
        if self.estimator is not None and estimator != self.estimator:
            errors.append(f"actor.loss_mode {self.name} needs algo.advantage.estimator {self.estimator}, got "
                          f"{estimator!r}")
        if self.own_behavior_correction and not (correction_level is None or str(correction_level).lower() in
                                                 ("off", "none", "false", "0", "")):
            errors.append(f"algo.advantage.is_correction_level must be off with actor.loss_mode {self.name} (the "
                          f"loss does its own behavior correction), got {correction_level!r}")
        if self.one_sample_per_prompt and samples_per_prompt != 1:
            errors.append(f"actor.loss_mode {self.name} uses one sample per prompt; got rollout.n_samples_per_prompt "
                          f"{samples_per_prompt}")
        try:  # whiten is a switch of the flag's own kind, checked as a flag
            options_from_flags(option_values, self.checked_options)
        except ValueError as err:
            errors.append(str(err))
        return errors

    @property
    def checked_options(self) -> tuple[str, ...]:
        """The options whose values :meth:`rule_violations` checks (the mode's, but ``whiten``)."""
        return tuple(o for o in self.options if o != "whiten")

    @property
    def note_flags(self) -> tuple[str, ...]:
        """The flags :meth:`inactive` reads: those of its notes and of their conditions."""
        return tuple(dict.fromkeys(n for flag, condition in self.notes for n in (flag, condition.partition("=")[0])))

    def inactive(self, note_values: Mapping[str, Any]) -> dict[str, str]:
        """The flags without effect when this mode is selected, with the reason: the other modes' own
        flags, and this mode's ``notes`` (``(flag, condition)``: inactive unless the condition, a
        ``flag=value`` pair, holds), judged on ``note_values``, the values of :attr:`note_flags` by flag."""
        out = {flag: f"dropped: actor.loss_mode is {self.name} (only used by actor.loss_mode {owner})"
               for flag, owner in owned_flags().items() if flag not in self.flags}
        for flag, condition in self.notes:
            key, _, value = condition.partition("=")
            if note_values.get(key) != value and note_values.get(flag) is not None:
                out[flag] = f"only used by {key} {value} ({key} is {note_values.get(key)})"
        return out


#: The loss mode a run uses unless ``actor.loss_mode`` says otherwise.
DEFAULT_LOSS_MODE = "flash_reinforce"

#: The loss modes' configurations by name, in registration order: the shipped modes' here (their classes,
#: ``FlashReinforceLoss`` and ``PPOClippedLoss``, register under these names), a new mode's added by
#: :func:`flashreinforce.ops.loss_modes.register_loss_mode`.
LOSS_MODE_REGISTRY: dict[str, LossModeConfig] = {
    "flash_reinforce": LossModeConfig(
        name="flash_reinforce", estimator="flash_reinforce",
        flags=("actor.flash_gate_delta", "actor.flash_gate_level") + tuple(
            OPTION_FLAGS[o] for o in mode_options("flash_reinforce") if o != "delta"),
        options=mode_options("flash_reinforce"),
        one_sample_per_prompt=True, own_behavior_correction=True,
        notes=(("actor.loss_scale_factor", "actor.flash_loss_agg=seq-mean-token-sum-norm"),)),
    "ppo": LossModeConfig(
        name="ppo", estimator="grpo",
        flags=tuple(OPTION_FLAGS[o] for o in mode_options("ppo")), options=mode_options("ppo")),
}
