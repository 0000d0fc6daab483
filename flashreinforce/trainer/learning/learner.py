"""The learner: one optimizer step per batch of trajectories, then the batch is discarded.

For a batch of B trajectories (FlashREINFORCE: one per prompt; GRPO: groups of samples):

1. the batch totals, once (:func:`batch_totals`, a :class:`~flashreinforce.ops.loss_modes.BatchContext`: B,
   the float64 mean reward, the policy-token count, and the loss mode's advantages when it needs them);
2. per micro-batch (:func:`flashreinforce.trainer.learning.packing.micro_batches`): the current
   log-probabilities (:mod:`flashreinforce.trainer.learning.scoring`), the loss mode's loss as a summand of
   the batch's loss (:mod:`flashreinforce.ops.loss_modes`: the fused FlashREINFORCE op or the
   clipped PPO loss), and its backward;
3. gradient-norm clipping, one AdamW step, one scheduler step (:mod:`.schedule`); the policy
   version goes up by one.

Each update also reports the model FLOPs of its forward and backward passes, the TFLOP/s they ran
at and, where the device's peak is known, the model FLOPs utilization (:mod:`.flops`).

:class:`PolicyLearner` is the interface the training loop uses; :class:`Learner` (one process)
and :class:`flashreinforce.distributed.data_parallel.DataParallelLearner` (torchrun ranks)
implement it.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from flashreinforce.config.sections import PARAM_DTYPES
from flashreinforce.dtypes import torch_dtype
from flashreinforce.models.attention import use_document_attention
from flashreinforce.models.fused_layers import use_compiled_layers
from flashreinforce.models.lora import copy_sharing_frozen, frozen_state_names
from flashreinforce.objective import DEFAULT_LOSS_MODE, LossOptions
from flashreinforce.ops.logprobs import wide_gemm_available
from flashreinforce.ops.loss_modes import BatchContext, LossMode, MicroBatch, get_loss_mode
from flashreinforce.trainer.learning.flops import ModelFlops, causal_pairs, peak_flops_per_device, utilization
from flashreinforce.trainer.learning.forward_row import forward_row
from flashreinforce.trainer.learning.packing import PackedBatch, micro_batches, pack
from flashreinforce.trainer.learning.schedule import SCHEDULERS, apply_settings, make_scheduler
from flashreinforce.trainer.learning.scoring import PolicyLogProbs
from flashreinforce.trainer.learning.statistics import GradientParts, PendingStats
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["batch_totals", "GradientParts", "Learner", "LearnerSettings", "PolicyLearner", "summarize_parts",
           "unscored_metrics"]

@dataclass
class LearnerSettings:
    """Learner configuration (the flag each field comes from in brackets).

    loss_mode: a registered loss mode, ``flash_reinforce`` or ``ppo`` [actor.loss_mode]. loss: the
    objective's options, :class:`flashreinforce.objective.LossOptions`, built once per run from their flags
    (``TrainerConfig.loss_options``; each field's flag is in its metadata). lr,
    weight_decay, betas [actor.adam.*]; scheduler [actor.lr_scheduler], warmup_ratio
    [actor.lr_warmup_ratio], min_lr_ratio [actor.min_lr_ratio], total_steps (optimizer steps of the
    run); max_norm [actor.max_norm, <= 0: no clipping]; step_on_zero_gradient
    [actor.step_on_zero_gradient]: an update whose gradient is exactly zero still makes the optimizer step
    (AdamW's momentum and weight decay move the weights); false: it leaves the weights and the optimizer's
    state as they were (the scheduler steps and the version advances all the same); statistics_without_gradient
    [actor.statistics_without_gradient]: a batch whose every advantage is 0 still gets the forwards for its
    statistics (false: no pass, :func:`unscored_metrics`); scale_step_by_acceptance
    [actor.scale_step_by_acceptance]: each optimizer step runs at the scheduled learning rate times the
    share of the batch's trajectories the gate admitted (loss modes with a gate only); entropy_coef
    [actor.entropy_coef];
    temperature: the sampling temperature the log-probabilities are computed at [rollout.temperature];
    micro_batch_trajectories [train.micro_batch_size] and micro_batch_tokens (0: no limit);
    packed_forward [fsdp.packing_samples] (one row per micro-batch with per-document attention; else
    padded rows); share_prefixes [train.share_prefixes] (the packed forward computes a prefix that
    several trajectories of a micro-batch share once); compiled_layers [train.compiled_layers] (the
    model's RMS norms, SwiGLU activations and PEFT LoRA projections through
    :func:`flashreinforce.models.fused_layers.use_compiled_layers`); param_dtype [fsdp.param_dtype]
    (autocast dtype; master weights stay float32); gradient_checkpointing [actor.gradient_checkpoint]; peak_tflops
    [train.peak_tflops]: dense peak TFLOP/s of one learner device for ``mfu`` (0: the device table of
    :func:`flashreinforce.trainer.learning.flops.peak_flops_per_device`); head_operand_dtype
    [train.head_operand_dtype]: operands of the output projection's GEMMs (``float32``; ``bf16`` /
    ``fp16``: rounded operands, float32 accumulation and logits; ``auto``: see
    :meth:`head_operands`).
    """

    loss_mode: str = DEFAULT_LOSS_MODE
    loss: LossOptions = field(default_factory=LossOptions)
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    scheduler: str = "constant"
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.1
    total_steps: int = 1
    max_norm: float = 1.0
    step_on_zero_gradient: bool = True
    statistics_without_gradient: bool = True
    scale_step_by_acceptance: bool = False
    entropy_coef: float = 0.0
    temperature: float = 1.0
    micro_batch_trajectories: int = 0
    micro_batch_tokens: int = 0
    packed_forward: bool = True
    share_prefixes: bool = True
    compiled_layers: bool = True
    param_dtype: str = "fp32"
    gradient_checkpointing: bool = False
    peak_tflops: float = 0.0
    head_operand_dtype: str = "float32"

    def __post_init__(self) -> None:
        mode = get_loss_mode(self.loss_mode)  # raises ValueError naming the known modes
        if self.scale_step_by_acceptance and "admitted" not in mode.per_trajectory_stats:
            raise ValueError(f"actor.scale_step_by_acceptance needs a loss mode with a trust gate; actor.loss_mode "
                             f"{self.loss_mode!r} has none")
        if not isinstance(self.loss, LossOptions):
            raise TypeError(f"LearnerSettings.loss must be a flashreinforce.objective.LossOptions, got "
                            f"{type(self.loss).__name__}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"actor.lr_scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"fsdp.param_dtype must be one of {sorted(PARAM_DTYPES)}, got {self.param_dtype!r}")
        if self.head_operand_dtype != "auto" and self.head_operand_dtype not in PARAM_DTYPES:
            raise ValueError(f"train.head_operand_dtype must be 'auto' or one of {sorted(PARAM_DTYPES)}, got "
                             f"{self.head_operand_dtype!r}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"actor.adam.lr must be a finite number >= 0, got {self.lr}")
        if self.total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {self.total_steps}")
        if not (0 <= self.warmup_ratio <= 1):
            raise ValueError(f"actor.lr_warmup_ratio must lie in [0, 1], got {self.warmup_ratio}")
        if not (0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"actor.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"the learner's temperature must be positive and finite, got {self.temperature}")
        if not (self.peak_tflops >= 0 and math.isfinite(self.peak_tflops)):
            raise ValueError(f"train.peak_tflops must be a finite number >= 0 (0: look the device up), got "
                             f"{self.peak_tflops}")

    def head_operands(self, device: torch.device) -> torch.dtype | None:
        """Operand dtype of the output projection's GEMMs on ``device`` (``None``: float32).

        ``auto``: the autocast dtype on CUDA when it is bf16 / fp16 and torch has the GEMM with
        float32 results there (:func:`flashreinforce.ops.logprobs.wide_gemm_available`); float32
        elsewhere (on the CPU the rounded operands would be emulated by float32 GEMMs: no gain)."""
        if self.head_operand_dtype == "auto":
            if device.type == "cuda" and self.autocast_dtype is not None and wide_gemm_available(device):
                return self.autocast_dtype
            return None
        dtype = torch_dtype(self.head_operand_dtype, what="train.head_operand_dtype")
        return None if dtype == torch.float32 else dtype

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The learner's autocast dtype (``None``: float32, no autocast)."""
        dtype = torch_dtype(self.param_dtype, what="fsdp.param_dtype")
        return None if dtype == torch.float32 else dtype

    @property
    def needs_entropy(self) -> bool:
        """Whether the learner computes token entropies (the loss mode reads them, or the bonus is on)."""
        return get_loss_mode(self.loss_mode).needs_entropy(self.loss) or self.entropy_coef != 0.0


def batch_totals(trajectories: Sequence[Trajectory], group_ids: Sequence[int] | None,
                 settings: LearnerSettings) -> BatchContext:
    """The batch-global quantities of the whole batch ``trajectories`` (:class:`BatchContext`: B, the float64
    mean reward, the policy tokens, the loss mode's advantages); ``group_ids[i]``: the prompt group of
    trajectory i (default: one group each)."""
    return BatchContext.of([t.reward for t in trajectories], sum(t.num_action_tokens for t in trajectories),
                           group_ids, get_loss_mode(settings.loss_mode), settings.loss)


def summarize_parts(parts: Sequence[GradientParts], totals: BatchContext, settings: LearnerSettings) -> dict[str, float]:
    """The batch's loss and statistics from the parts that cover it (each row exactly once)."""
    mode = get_loss_mode(settings.loss_mode)
    b = totals.num_trajectories
    per_trajectory = {name: torch.zeros(b, dtype=torch.float64) for name in mode.per_trajectory_stats}
    sums: dict[str, float] = {}
    seen = torch.zeros(b, dtype=torch.int64)
    for p in parts:
        for key, value in p.sums.items():
            sums[key] = sums.get(key, 0.0) + value
        if not p.rows:
            continue
        rows = torch.tensor(p.rows, dtype=torch.int64)
        seen[rows] += 1
        for name in mode.per_trajectory_stats:
            per_trajectory[name][rows] = p.per_trajectory[name]
    if not bool((seen == 1).all()):
        raise ValueError(f"summarize_parts: the parts do not cover rows 0..{b - 1} exactly once")
    tokens = totals.policy_tokens
    metrics = {"loss": sum(p.loss for p in parts), "reward_baseline": totals.reward_baseline, "policy_tokens": tokens,
               "model_flops": sum(p.flops for p in parts)}
    metrics.update(mode.summarize(per_trajectory, sums, totals))
    # Per-trajectory statistics by batch row (``sequence_kl``, ``admitted``, ...), for the run's samples.
    metrics["per_trajectory"] = {name: values.tolist() for name, values in per_trajectory.items()}
    if settings.needs_entropy:
        metrics["entropy_mean"] = sum(p.entropy_sum for p in parts) / max(1, tokens)
    return metrics


def unscored_metrics(totals: BatchContext) -> dict[str, float]:
    """The update's metrics when no pass ran (every advantage 0, ``statistics_without_gradient`` false): the
    loss is exactly 0, the gate's statistics unknown (NaN), no per-trajectory statistics."""
    nan = float("nan")
    return {"loss": 0.0, "reward_baseline": totals.reward_baseline, "policy_tokens": totals.policy_tokens,
            "model_flops": 0.0, "acceptance_rate": nan, "sequence_kl_mean": nan, "per_trajectory": {}}


def _zero_backward(logp: Tensor, ent: Tensor | None) -> None:
    """A backward pass that adds exactly zero to every gradient (it still runs FSDP's reductions)."""
    zero = logp.sum() * 0.0
    if ent is not None:
        zero = zero + ent.sum() * 0.0
    zero.backward()


def _placeholder_micro_batch() -> PackedBatch:
    """Two padding tokens, the second an action: a forward that contributes exactly zero gradient."""
    return pack([Trajectory([0, 0], [False, True], [0.0, -1.0], reward=0.0, failed=False)])


@runtime_checkable
class PolicyLearner(Protocol):
    """What the training loop needs from a learner (one process or torchrun ranks).

    ``version``: the policy version (optimizer steps taken). ``sharded``: the weights are split over
    ranks (publication and exports gather them). ``loss_impl``: which loss implementation runs.
    """

    version: int
    loss_impl: str

    @property
    def sharded(self) -> bool: ...

    def step(self, trajectories: Sequence[Trajectory], group_ids: Sequence[int] | None = None) -> dict[str, float]:
        """One optimizer step on the whole batch; ``FloatingPointError`` leaves weights and version unchanged."""

    def policy_state(self) -> dict[str, Tensor]:
        """The current full weights (Hugging Face names), for publication to the rollout engines."""

    def frozen_names(self) -> set[str]:
        """Names of :meth:`policy_state` that never change (a weight store may publish them once)."""

    def full_model(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        """An unsharded copy of the current policy (float32 on ``device``), for engines and exports."""

    def state_dict(self) -> dict:
        """Optimizer, scheduler and version, for a checkpoint."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def stop(self) -> None:
        """The run is over (releases other ranks; nothing to do in one process)."""


class Learner:
    """Owns the trained model, its optimizer and scheduler, and the policy version.

    Args:
        model: a ``transformers`` causal LM (float32 master weights), already on its device.
        settings: :class:`LearnerSettings`.
        pad_token_id: padding id for the padded forward.
        parallelize: optional callable applied to the :class:`PolicyLogProbs` module before the
            optimizer is built (the data-parallel learner shards it with FSDP2 here).
    """

    def __init__(self, model: torch.nn.Module, settings: LearnerSettings, *, pad_token_id: int = 0,
                 parallelize=None) -> None:
        self.model = model
        self.settings = settings
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.version = 0
        #: Updates that made no optimizer step (a zero gradient with ``step_on_zero_gradient`` false):
        #: the optimizer's step count is ``version`` minus this.
        self.optimizer_steps_skipped = 0
        if getattr(model.config, "use_cache", None) is not None:
            model.config.use_cache = False
        if settings.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        # The engines' copies (full_model) keep the model's own attention; the learner's packed rows
        # need per-document attention.
        self._engine_attention = getattr(model.config, "_attn_implementation", None)
        if settings.packed_forward:
            use_document_attention(model)
        if settings.compiled_layers:
            use_compiled_layers(model)
        model.train()
        self.scorer = PolicyLogProbs(model)
        if parallelize is not None:
            self.scorer = parallelize(self.scorer)
        self.optimizer = torch.optim.AdamW([p for p in self.scorer.parameters() if p.requires_grad], lr=settings.lr,
                                           betas=settings.betas, weight_decay=settings.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, settings)
        self.loss_mode: LossMode = get_loss_mode(settings.loss_mode)
        self.flops = ModelFlops.of(model)  # before any sharding: the full shapes
        #: Peak FLOP/s of this learner's device at its precision (None: no MFU).
        self.peak_flops = peak_flops_per_device(self.device, settings.autocast_dtype, settings.peak_tflops)
        self.head_operand_dtype = settings.head_operands(self.device)
        self.loss_impl = self.loss_mode.implementation_name
        #: Whether the loss's value errors are read back once per step rather than once per
        #: micro-batch (each read-back waits for the device), where the loss mode's implementation can
        #: defer them: on CUDA devices, where that wait stalls the queueing of the next micro-batch; on
        #: a CPU the check costs nothing.
        self.defer_loss_errors = self.device.type == "cuda"
        self.loss_mode.prepare()  # e.g. the compiled extension: fail now, not at the first step

    @property
    def sharded(self) -> bool:
        return False

    # ------------------------------------------------------------------ one update
    def step(self, trajectories: Sequence[Trajectory], group_ids: Sequence[int] | None = None) -> dict[str, float]:
        """One optimizer step on ``trajectories`` (the whole batch); returns the update's metrics.

        ``group_ids[i]``: the prompt group of trajectory i (needed by ``ppo``; default one group each).
        Raises ``FloatingPointError`` (and leaves weights and version unchanged) on a non-finite gradient.
        """
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        trajectories = list(trajectories)
        totals = batch_totals(trajectories, group_ids, self.settings)
        vanishes = self.gradient_vanishes(trajectories, totals)
        s = self.settings
        # The step's rate needs the acceptance only where a zero gradient still steps, scaled by it.
        unscored = vanishes and not (s.statistics_without_gradient
                                     or (s.scale_step_by_acceptance and s.step_on_zero_gradient))
        if unscored:
            metrics = unscored_metrics(totals)
        else:
            parts = self.accumulate_gradient_parts(trajectories, totals, backward=not vanishes)
            metrics = summarize_parts([parts], totals, s)
        metrics["backward_skipped"] = float(vanishes)
        metrics["forward_skipped"] = float(unscored)
        if vanishes and s.step_on_zero_gradient:
            # The optimizer steps on the zero gradient the backward would have given (AdamW's moments
            # and weight decay still move the weights).
            for p in self.scorer.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        scale = metrics["acceptance_rate"] if s.scale_step_by_acceptance and not unscored else 1.0
        metrics.update(self.apply_gradients(lr_scale=scale))
        metrics["learner_compute_s"] = time.perf_counter() - t0
        metrics.update(utilization(metrics["model_flops"], metrics["learner_compute_s"], self.peak_flops))
        return metrics

    def apply_gradients(self, lr_scale: float = 1.0) -> dict[str, float]:
        """Clip the accumulated gradients, make one optimizer and scheduler step, bump the version.

        ``lr_scale`` in [0, 1]: this step runs at the scheduled learning rate times it (the schedule itself
        is unchanged; ``actor.scale_step_by_acceptance`` passes the batch's acceptance rate).
        Returns ``grad_norm`` (before clipping), ``lr`` (of this step: scheduled times ``lr_scale``) and
        ``optimizer_step_skipped`` (1 when the gradient was exactly zero and ``step_on_zero_gradient`` is
        false: weights and optimizer state unchanged, scheduler and version advanced). Raises
        ``FloatingPointError`` (gradients dropped, weights and version unchanged) when the gradient norm
        is not finite.
        """
        s = self.settings
        if not 0.0 <= lr_scale <= 1.0:
            raise ValueError(f"lr_scale must lie in [0, 1], got {lr_scale}")
        params = [p for p in self.scorer.parameters() if p.grad is not None]
        if s.max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, s.max_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([_local(p.grad).norm() for p in params])) if params else 0.0
        grad_norm = float(_local(norm)) if isinstance(norm, Tensor) else float(norm)
        if not math.isfinite(grad_norm):
            # A non-finite gradient would poison the weights: skip the step, keep the version.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at version {self.version}; step skipped")
        scheduled = [group["lr"] for group in self.optimizer.param_groups]
        lr = scheduled[0] * lr_scale
        skip = grad_norm == 0.0 and not s.step_on_zero_gradient
        if skip:
            self.optimizer_steps_skipped += 1
        else:
            for group, value in zip(self.optimizer.param_groups, scheduled):
                group["lr"] = value * lr_scale  # the schedule's own rate when lr_scale is 1
            try:
                self.optimizer.step()
            finally:
                for group, value in zip(self.optimizer.param_groups, scheduled):
                    group["lr"] = value
        with warnings.catch_warnings():
            # A run whose first updates skip the optimizer step advances the schedule before AdamW has
            # stepped, on purpose; PyTorch's warning about that order would only alarm the user.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before",
                                    category=UserWarning)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": grad_norm, "lr": lr, "optimizer_step_skipped": float(skip)}

    def gradient_vanishes(self, trajectories: Sequence[Trajectory], totals: BatchContext) -> bool:
        """Whether the batch's gradient is exactly zero whatever the current log-probabilities (every
        advantage 0, e.g. every reward equal, and no entropy bonus): known before any pass, so
        :meth:`step` runs the forwards for the statistics only and no backward. The one case where a
        backward would differ: a ratio that overflows to infinity times a zero advantage is NaN there,
        so the update would be refused as non-finite; here it is the zero it is mathematically."""
        if self.settings.entropy_coef != 0.0 or not trajectories:
            return False
        rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32)  # as pack() stores them
        return self.loss_mode.gradient_vanishes(rewards, totals, self.settings.loss)

    def accumulate_gradients(self, trajectories: Sequence[Trajectory],
                             group_ids: Sequence[int] | None = None) -> dict[str, float]:
        """Forward and backward over the batch in micro-batches, adding into ``p.grad``; no optimizer step.

        Returns the loss and the loss statistics of the batch.
        """
        trajectories = list(trajectories)
        totals = batch_totals(trajectories, group_ids, self.settings)
        parts = self.accumulate_gradient_parts(trajectories, totals)
        return summarize_parts([parts], totals, self.settings)

    def accumulate_gradient_parts(self, trajectories: Sequence[Trajectory], totals: BatchContext, *,
                                  rows: Sequence[int] | None = None, num_micro_batches: int | None = None,
                                  collective_forwards: bool = False, backward: bool = True) -> GradientParts:
        """Forward and backward of a part of a batch, adding into ``p.grad``.

        ``trajectories`` are the part's trajectories, ``rows`` their rows in the whole batch (default
        0..n-1), ``totals`` the whole batch's :class:`BatchContext` (:func:`batch_totals`): the part's loss and gradients are
        then exactly its summand of the whole batch's. The part may be empty. ``num_micro_batches``:
        run at least this many forward/backward passes, padding with passes that contribute zero
        (FSDP ranks must run the same number of forwards, since each one gathers parameters).
        ``collective_forwards``: a loss error does not stop the passes (the other ranks wait in their
        collectives): it is kept in ``error`` and the remaining passes contribute zero gradient.
        ``backward`` False: forwards without autograd for the loss and its statistics, no gradient, and
        ``flops`` counts the forwards only (for a batch whose gradient vanishes, :meth:`gradient_vanishes`).
        """
        s = self.settings
        trajectories = list(trajectories)
        rows = list(range(len(trajectories))) if rows is None else [int(r) for r in rows]
        if len(rows) != len(trajectories):
            raise ValueError(f"rows has {len(rows)} entries for {len(trajectories)} trajectories")
        need_entropy = s.needs_entropy
        out = GradientParts(rows=rows)
        n = len(trajectories)
        out.per_trajectory = {name: torch.zeros(n, dtype=torch.float64) for name in self.loss_mode.per_trajectory_stats}
        mbs = micro_batches(trajectories, max_tokens=s.micro_batch_tokens or None,
                            max_trajectories=s.micro_batch_trajectories or None) if trajectories else []
        # The statistics stay on the device until every pass has been queued: one read back per part,
        # not one per micro-batch (each read waits for the device to finish what was queued).
        pending = PendingStats()
        errors = None
        if self.defer_loss_errors:
            errors = self.loss_mode.pending_errors()
        def zero_backward(logp: Tensor, ent: Tensor | None) -> None:
            if backward:
                _zero_backward(logp, ent)

        for mb in mbs:
            row, flops = self._plan(mb, backward)
            out.flops += flops
            with torch.set_grad_enabled(backward):
                logp, ent = self.scorer(mb, row=row, **self._scoring_options(need_entropy))
                if out.error is not None:
                    zero_backward(logp, ent)
                    continue
                try:
                    loss = self._part_loss(mb, logp, ent, rows, totals, pending, errors)
                except (FloatingPointError, ValueError) as err:
                    if not collective_forwards:
                        raise
                    out.error = err
                    zero_backward(logp, ent)
                    continue
            if backward:
                loss.backward()
            pending.losses.append(loss.detach())
        for _ in range(len(mbs), num_micro_batches or 0):
            with torch.set_grad_enabled(backward):
                logp, ent = self.scorer(_placeholder_micro_batch(), **self._scoring_options(need_entropy))
            zero_backward(logp, ent)
        if errors is not None:  # the deferred loss errors: one read-back for every pass of the part
            try:
                errors.check()
            except (FloatingPointError, ValueError) as err:
                if not collective_forwards:
                    raise
                out.error = out.error or err
        pending.read_into(out)
        return out

    def _plan(self, mb: PackedBatch, backward: bool = True):
        """The packed row of ``mb`` (``None`` for the padded forward) and its model FLOPs (forward and
        backward, or the forward alone)."""
        s = self.settings
        scored = int(mb.action_mask.sum())
        count = self.flops.training if backward else self.flops.forward
        if s.packed_forward:
            row = forward_row(mb, share_prefixes=s.share_prefixes)
            return row, count(row.num_tokens, causal_pairs(row.layout), scored)
        lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
        return None, count(mb.num_tokens, sum(n * (n + 1) // 2 for n in lengths), scored)

    def _scoring_options(self, with_entropy: bool) -> dict:
        """The keyword arguments of :func:`flashreinforce.trainer.learning.scoring.token_log_probs` for this learner."""
        s = self.settings
        return {"temperature": s.temperature, "with_entropy": with_entropy, "packed_forward": s.packed_forward,
                "pad_token_id": self.pad_token_id, "autocast_dtype": s.autocast_dtype,
                "share_prefixes": s.share_prefixes, "head_operand_dtype": self.head_operand_dtype}

    def _part_loss(self, mb: PackedBatch, logp: Tensor, ent: Tensor | None, rows: list[int], totals: BatchContext,
                   pending: "PendingStats", errors=None) -> Tensor:
        """The loss of micro-batch ``mb`` as a summand of the whole batch's; its statistics go to
        ``pending``, the loss's unchecked error records to ``errors`` (the loss mode's ``pending_errors()``; ``None``:
        raised at once)."""
        s = self.settings
        dev = logp.device
        local = torch.tensor(mb.rows)  # indices into this part
        batch = MicroBatch(log_probs=logp, behavior_log_probs=mb.behavior_log_probs.to(dev), rewards=mb.rewards.to(dev),
                           cu_seqlens=mb.cu_seqlens.to(dev), action_mask=mb.action_mask.to(dev),
                           failures=mb.failures.to(dev), rows=torch.tensor([rows[i] for i in mb.rows]), entropies=ent,
                           pending_errors=errors)
        loss, per_trajectory, sums = self.loss_mode.loss(batch, totals, s.loss)
        pending.per_trajectory.append((local, {name: values.detach() for name, values in per_trajectory.items()}))
        for name, value in sums.items():
            pending.sums.setdefault(name, []).append(value.detach() if isinstance(value, Tensor) else float(value))
        if ent is not None:
            ent_sum = ent[batch.action_mask].sum()
            pending.entropy_sums.append(ent_sum.detach())
            if s.entropy_coef != 0.0:
                loss = loss - s.entropy_coef * ent_sum / totals.policy_tokens
        return loss

    def num_micro_batches(self, trajectories: Sequence[Trajectory]) -> int:
        """How many forward passes :meth:`accumulate_gradient_parts` makes for ``trajectories``."""
        s = self.settings
        if not trajectories:
            return 0
        return len(micro_batches(list(trajectories), max_tokens=s.micro_batch_tokens or None,
                                 max_trajectories=s.micro_batch_trajectories or None))

    # ------------------------------------------------------------------ weights and state
    def policy_state(self) -> dict[str, Tensor]:
        """The current weights, for publication to the rollout engines (tensors alias the model's)."""
        return self.model.state_dict()

    def frozen_names(self) -> set[str]:
        """Names of :meth:`policy_state` that never change (parameters that do not train, such as the
        base weights under LoRA): a weight store may publish them once."""
        return frozen_state_names(self.model)

    def full_model(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        """A copy of the current policy on ``device`` (for an engine or an export), with the model's
        own attention implementation. On the model's own device its frozen weights (the base under LoRA)
        share the model's storage (:func:`~flashreinforce.models.lora.copy_sharing_frozen`): an engine's copy
        then costs the adapters, not another copy of the base."""
        here = next(self.model.parameters()).device == torch.device(device)
        model = copy_sharing_frozen(self.model) if here else copy.deepcopy(self.model)
        return self.with_engine_attention(model.to(device))

    def with_engine_attention(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (a copy of the policy) switched back to the attention implementation it was built
        with: the learner's per-document attention is registered in this process only."""
        if self._engine_attention and model.config._attn_implementation != self._engine_attention:
            model.set_attn_implementation(self._engine_attention)
        return model

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "version": self.version, "optimizer_steps_skipped": self.optimizer_steps_skipped}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_settings(self.optimizer, self.scheduler, self.settings)  # a resumed run's own lr, betas, schedule
        self.version = int(state["version"])
        self.optimizer_steps_skipped = int(state.get("optimizer_steps_skipped", 0))

    def stop(self) -> None:
        """Nothing to release in one process."""


def _local(t: Tensor) -> Tensor:
    """A DTensor's full value (FSDP2 gradients and norms), any other tensor unchanged."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
