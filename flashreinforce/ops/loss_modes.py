"""Loss modes by name: how a learner batch becomes a loss, registered under ``actor.loss_mode``.

The learner knows no particular mode. For one batch of B trajectories it asks the selected
:class:`LossMode`

1. once, for the batch's advantages (:meth:`LossMode.advantages`; ``None`` when the mode computes
   them itself, as the fused FlashREINFORCE op does from the batch-mean baseline);
2. per micro-batch, for that micro-batch's loss as a summand of the whole batch's loss
   (:meth:`LossMode.loss`), with per-trajectory statistics and additive token counts;
3. once, for the batch's statistics from everything the micro-batches reported
   (:meth:`LossMode.summarize`).

Each mode also owns what the learner would otherwise have to know about it: what computes its loss
(:meth:`LossMode.implementation`, a :class:`LossImplementation` that names itself, loads its compiled
code when the learner starts, and may leave its value errors to one check per step), and, through its
:class:`flashreinforce.objective.LossModeConfig`, its flags, options and rules.

A mode is one :class:`LossMode` subclass with a ``name``, decorated with :func:`register_loss_mode` where
it is implemented (the shipped ones below); every mode has the same methods and receives the same
:class:`flashreinforce.objective.LossOptions`. :data:`LOSS_MODES` holds the registered modes by name; their
configurations (flags, options, estimator, rules) are the entries of the same names in
:data:`flashreinforce.objective.LOSS_MODE_REGISTRY`, which the configuration reads without PyTorch: the
shipped modes' are declared there, a new mode gets its registered base class's (renamed), or one that owns
no flags or options. This module works on tensors only: it imports neither the trainer nor ``transformers``.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor

from flashreinforce.objective import GATE_METRICS, LOSS_MODE_REGISTRY, LossModeConfig, LossOptions
from flashreinforce.ops.contract import compute_dtype_for
from flashreinforce.ops.ppo import group_advantages, ppo_clipped_loss_packed
from flashreinforce.ops.reference import gate_divergence

__all__ = ["LOSS_MODES", "BatchContext", "FlashReinforceLoss", "LossImplementation", "LossMode", "LossOptions",
           "MicroBatch", "PPOClippedLoss", "admitted_mask", "get_loss_mode", "register_loss_mode"]


@dataclass(frozen=True)
class LossImplementation:
    """What computes a mode's loss: a packed loss function, the name runs record it by (``loss_impl``),
    and optionally its deferred form.

    deferred: ``deferred(pending, *args, **kwargs)`` computes the same as ``function`` but leaves its
    value errors in ``pending`` (made by ``pending_errors()``), checked once per step by the learner.
    """

    name: str
    function: Callable[..., Any]
    deferred: Callable[..., Any] | None = None
    pending_errors: Callable[[], Any] | None = None


@dataclass(frozen=True)
class BatchContext:
    """Batch-global quantities that make the loss of any part of a batch (a micro-batch, a rank's share)
    a summand of the whole batch's loss; the learner computes them once per batch (:meth:`of`).

    num_trajectories: B. reward_baseline: float64 mean reward of the B trajectories.
    policy_tokens: policy tokens of the whole batch (``token-mean`` and the ppo loss divide by it).
    advantages: ``[B]`` float32 by batch row, from :meth:`LossMode.advantages` (``None`` when the mode
    needs none).
    """

    num_trajectories: int
    reward_baseline: float
    policy_tokens: int
    advantages: Tensor | None = None

    @classmethod
    def of(cls, rewards: Sequence[float], policy_tokens: int, group_ids: Sequence[int] | None, mode: "LossMode",
           options: LossOptions) -> "BatchContext":
        """The context of a whole batch: its ``rewards`` (float64 mean), its ``policy_tokens``, and the
        advantages ``mode`` computes (``group_ids[i]``: the prompt group of trajectory i; default one each)."""
        b = len(rewards)
        if b == 0:
            raise ValueError("Learner: no trajectories")
        values = torch.tensor([float(r) for r in rewards], dtype=torch.float64)
        gids = torch.tensor(list(range(b)) if group_ids is None else list(group_ids), dtype=torch.int64)
        if gids.numel() != b:
            raise ValueError(f"group_ids has {gids.numel()} entries for {b} trajectories")
        return cls(num_trajectories=b, reward_baseline=float(values.mean()), policy_tokens=policy_tokens,
                   advantages=mode.advantages(values, gids, options))


@dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch on the loss's device.

    log_probs ``[N]`` (carries autograd), behavior_log_probs ``[N]``, action_mask ``[N]`` bool,
    entropies ``[N]`` or ``None``; rewards ``[b]``, failures ``[b]`` bool, rows ``[b]`` int64 (each
    trajectory's row in the whole batch); cu_seqlens ``[b+1]``.

    pending_errors: what the mode's :meth:`LossMode.pending_errors` made when the learner checks the
    loss's value errors once per step instead of once per micro-batch; ``None``: raise them at once.
    """

    log_probs: Tensor
    behavior_log_probs: Tensor
    rewards: Tensor
    cu_seqlens: Tensor
    action_mask: Tensor
    failures: Tensor
    rows: Tensor
    entropies: Tensor | None = None
    pending_errors: Any = None

    @property
    def num_policy_tokens(self) -> int:
        return int(self.action_mask.sum())


class LossMode(abc.ABC):
    """One way of turning a batch into a loss (see the module docstring)."""

    #: The ``actor.loss_mode`` value that selects this mode.
    name: ClassVar[str]
    #: Names of the ``[b]`` statistics :meth:`loss` returns per trajectory.
    per_trajectory_stats: ClassVar[tuple[str, ...]] = ()

    def needs_entropy(self, options: LossOptions) -> bool:
        """Whether :meth:`loss` reads ``MicroBatch.entropies``."""
        return False

    def implementation(self) -> LossImplementation | Callable[..., Any] | None:
        """What computes the loss: a :class:`LossImplementation`, a plain packed loss function (which
        defers nothing), or ``None`` (:meth:`loss` computes it itself)."""
        return None

    @property
    def implementation_name(self) -> str:
        """The name runs record the loss implementation by: its own, else the mode's."""
        impl = self.implementation()
        return impl.name if isinstance(impl, LossImplementation) else self.name

    def prepare(self) -> None:
        """Load what the loss needs (a compiled extension) when the learner starts, so that a missing
        one fails then rather than at the first step."""
        self.implementation()

    def pending_errors(self) -> Any:
        """A new collector of deferred value errors (see :class:`MicroBatch`), or ``None`` when the
        implementation checks its errors at once; the learner calls its ``check()`` once per step."""
        impl = self.implementation()
        if isinstance(impl, LossImplementation) and impl.deferred is not None and impl.pending_errors is not None:
            return impl.pending_errors()
        return None

    def loss_function(self, mb: MicroBatch) -> Callable[..., Any]:
        """The packed loss function for ``mb``: the deferred form when ``mb`` carries pending errors."""
        impl = self.implementation()
        if not isinstance(impl, LossImplementation):
            return impl
        if mb.pending_errors is not None and impl.deferred is not None:
            return functools.partial(impl.deferred, mb.pending_errors)
        return impl.function

    def advantages(self, rewards: Tensor, group_ids: Tensor, options: LossOptions) -> Tensor | None:
        """``[B]`` advantages of the batch from float64 ``rewards`` and int64 ``group_ids``, or ``None``."""
        return None

    def gradient_vanishes(self, rewards: Tensor, batch: BatchContext, options: LossOptions) -> bool:
        """Whether the loss's gradient is exactly zero for the batch whatever the log-probabilities, known
        from ``rewards`` (``[B]`` float32, as the packed batch holds them) and ``batch`` before any
        forward: the learner then skips the backward. False unless the mode can prove it."""
        return False

    @abc.abstractmethod
    def loss(self, mb: MicroBatch, batch: BatchContext,
             options: LossOptions) -> tuple[Tensor, dict[str, Tensor], dict[str, float]]:
        """``(loss, per_trajectory, sums)``: the micro-batch's summand of the batch loss, its
        detached ``[b]`` statistics named in :attr:`per_trajectory_stats`, and additive counts."""

    @abc.abstractmethod
    def summarize(self, per_trajectory: dict[str, Tensor], sums: dict[str, float],
                  batch: BatchContext) -> dict[str, float]:
        """The batch's statistics from ``[B]`` float64 per-trajectory values and summed counts."""


#: name -> the mode's one instance, for every mode registered in this process.
LOSS_MODES: dict[str, LossMode] = {}


def register_loss_mode(cls: type[LossMode]) -> type[LossMode]:
    """Class decorator: register an instance of ``cls`` under ``cls.name`` (set in the class itself) in
    :data:`LOSS_MODES`. Its configuration is the entry of that name in
    :data:`flashreinforce.objective.LOSS_MODE_REGISTRY` (a shipped mode's is declared there), else that of
    its nearest registered base class (renamed), else one that owns no flags or options; registering a
    class again does nothing, another class under a registered name is a ``ValueError``."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute 'name' (its actor.loss_mode value)")
    current = LOSS_MODES.get(name)
    if current is not None:
        if type(current) is not cls:
            raise ValueError(f"loss mode {name!r} is already registered ({type(current).__name__})")
        return cls
    if name not in LOSS_MODE_REGISTRY:
        base = next((b for b in cls.__mro__[1:] if type(LOSS_MODES.get(b.__dict__.get("name"))) is b), None)
        LOSS_MODE_REGISTRY[name] = (dataclasses.replace(LOSS_MODE_REGISTRY[base.name], name=name) if base is not None
                                    else LossModeConfig(name=name))
    LOSS_MODES[name] = cls()
    return cls


def get_loss_mode(name: str) -> LossMode:
    """The registered mode ``name`` (one instance); ``ValueError`` listing the known names otherwise."""
    mode = LOSS_MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise ValueError(f"actor.loss_mode must be one of {sorted(LOSS_MODES)}, got {name!r}")
    return mode


@register_loss_mode
class FlashReinforceLoss(LossMode):
    """The method: the fused FlashREINFORCE op with the batch-global baseline and B (see docs/semantics.md)."""

    name = "flash_reinforce"

    #: Besides the gate's own statistic, each trajectory's mean of every gate metric (``drift_<metric>``,
    #: docs/semantics.md), whichever the gate uses: what a user compares ``delta`` with.
    per_trajectory_stats = ("sequence_kl", "admitted", "retained") + tuple(f"drift_{m}" for m in GATE_METRICS)

    def needs_entropy(self, options: LossOptions) -> bool:
        return options.entropy_filter

    def implementation(self) -> LossImplementation:
        """The fused op, whose value errors may wait for one check per step (a benchmark may return the
        reference instead, which has the same signature)."""
        from flashreinforce.ops import fused

        return LossImplementation("fused", fused.flashreinforce_loss_packed, deferred=fused.fused_loss_deferred,
                                  pending_errors=fused.PendingErrors)

    def gradient_vanishes(self, rewards, batch, options):
        # Every weight is rho_t * A_i with A_i = R_i - b formed in float64 from the stored float32
        # reward: all zero exactly when every stored reward equals the float64 baseline.
        return bool((rewards.double() == batch.reward_baseline).all())

    def loss(self, mb, batch, options):
        use_filter = options.entropy_filter
        function = self.loss_function(mb)
        loss, stats = function(
            mb.log_probs, mb.behavior_log_probs, mb.rewards, mb.cu_seqlens, mb.action_mask,
            entropies=mb.entropies if use_filter else None, failures=mb.failures if use_filter else None,
            reward_baseline=batch.reward_baseline, num_trajectories=batch.num_trajectories,
            num_policy_tokens=batch.policy_tokens if options.loss_agg == "token-mean" else None, options=options)
        per_trajectory = {"sequence_kl": stats["sequence_kl"], "admitted": stats["admitted"],
                          "retained": stats["retained_tokens"]}
        per_trajectory.update(_drifts(mb, stats["policy_tokens"]))
        return loss, per_trajectory, {}

    def summarize(self, per_trajectory, sums, batch):
        kl = per_trajectory["sequence_kl"]
        return {"acceptance_rate": float(admitted_mask(per_trajectory).double().mean()),
                "sequence_kl_mean": float(kl.mean()), "sequence_kl_max": float(kl.max()),
                "retained_token_fraction": float(per_trajectory["retained"].sum()) / max(1, batch.policy_tokens)}


def admitted_mask(per_trajectory: dict[str, Tensor]) -> Tensor:
    """``[b]`` bool: the trajectories a gated mode's per-trajectory statistics (``admitted``: 1.0 or 0.0)
    say the gate admitted."""
    return per_trajectory["admitted"] > 0.5


def _drifts(mb: MicroBatch, policy_tokens: Tensor) -> dict[str, Tensor]:
    """Each trajectory's mean of every gate metric's per-token term over its policy tokens (float64,
    detached; the reference's definition), ``[b]`` each."""
    with torch.no_grad():
        lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        current = mb.log_probs.detach().double()
        behavior = mb.behavior_log_probs.double()
        counts = policy_tokens.to(torch.float64).clamp_min(1.0)
        compute = compute_dtype_for(mb.log_probs.dtype)  # the gate's clamp bounds
        out = {}
        for metric in GATE_METRICS:
            term = torch.where(mb.action_mask, gate_divergence(behavior, current, metric, compute), 0.0)
            out[f"drift_{metric}"] = torch.zeros(counts.numel(), dtype=torch.float64, device=term.device).index_add_(
                0, segment, term) / counts
        return out


@register_loss_mode
class PPOClippedLoss(LossMode):
    """The GRPO comparison: group-relative advantages and the token-mean clipped PPO loss.

    With one sample per prompt every group is a single trajectory, whose group-relative advantage is 0:
    the batch is then the group (the batch-mean baseline of FlashREINFORCE), so that ``ppo`` with
    ``rollout.n_samples_per_prompt 1`` is the token-clipped counterpart of the method rather than a run
    that trains nothing."""

    name = "ppo"

    def advantages(self, rewards, group_ids, options):
        if int(torch.unique(group_ids).numel()) == int(group_ids.numel()):  # groups of one
            group_ids = torch.zeros_like(group_ids)
        return group_advantages(rewards, group_ids, whiten=options.whiten).to(torch.float32)

    def gradient_vanishes(self, rewards, batch, options):
        # Both sides of the clipped objective are ratio times advantage.
        return batch.advantages is not None and bool((batch.advantages == 0).all())

    def loss(self, mb, batch, options):
        if batch.advantages is None:
            raise ValueError("the ppo loss needs the batch's advantages (BatchContext.advantages)")
        loss, stats = ppo_clipped_loss_packed(
            mb.log_probs, mb.behavior_log_probs, batch.advantages[mb.rows.cpu()].to(mb.log_probs.device),
            mb.cu_seqlens, mb.action_mask, eps_clip_low=options.eps_clip[0], eps_clip_high=options.eps_clip[1],
            num_policy_tokens=batch.policy_tokens)
        return loss, {}, {"clip_tokens": float(stats["clip_fraction"]) * mb.num_policy_tokens}

    def summarize(self, per_trajectory, sums, batch):
        adv = batch.advantages
        return {"acceptance_rate": 1.0, "sequence_kl_mean": math.nan,
                "clip_fraction": sums.get("clip_tokens", 0.0) / max(1, batch.policy_tokens),
                "advantage_abs_mean": float(adv.abs().mean()) if adv is not None else math.nan}
