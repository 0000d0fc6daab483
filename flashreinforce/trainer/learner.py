"""The learner: one optimizer step per batch of trajectories, then the batch is discarded.

For a batch of B trajectories (FlashREINFORCE: one per prompt; GRPO: groups of samples):

1. pack them into micro-batches (:func:`flashreinforce.trainer.packing.micro_batches`);
2. per micro-batch, one forward pass of the model body gives the last hidden states; the current
   log-probability of every action token (and its entropy when the entropy filter or bonus needs it)
   comes from :func:`flashreinforce.ops.logprobs.sampled_token_logprobs` on the hidden state before it and
   the output projection, without ``[tokens, vocab]`` logits;
3. the loss: the fused FlashREINFORCE op (``flashreinforce.flashreinforce_loss_packed``) with the
   batch-global reward baseline and B, or the clipped PPO loss of :mod:`flashreinforce.ops.ppo` on group
   advantages; backward per micro-batch (the micro-batch losses add up to the batch loss);
4. gradient-norm clipping, one AdamW step, one scheduler step; the version goes up by one.

The model forward is either *packed* (one row, ``position_ids`` restarting per trajectory, attention
kept inside each trajectory by the model's packed-sequence support) or *padded* (rows padded to the
longest trajectory of the micro-batch, then gathered back to the packed order). Both give the same
numbers; packed saves the padding on GPUs with variable-length attention, padded avoids the
quadratic block-diagonal mask on CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

import flashreinforce
from flashreinforce.ops.logprobs import sampled_token_logprobs
from flashreinforce.trainer.packing import PackedBatch, micro_batches, pack, to_padded
from flashreinforce.ops.ppo import group_advantages, ppo_clipped_loss_packed
from flashreinforce.trainer.trajectory import Trajectory

__all__ = ["BatchTotals", "Learner", "LearnerSettings", "PolicyLogProbs", "lr_factor", "token_log_probs"]

LOSS_MODES = ("flash_reinforce", "ppo")
SCHEDULERS = ("cosine_with_min_lr", "constant", "constant_with_warmup")
PARAM_DTYPES = {"fp32": None, "float32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                "fp16": torch.float16, "float16": torch.float16}


@dataclass
class LearnerSettings:
    """Learner configuration (the Molt flag each field comes from in brackets).

    loss_mode: ``flash_reinforce`` or ``ppo`` [actor.loss_mode]. delta [actor.flash_gate_delta],
    neg_topq [actor.flash_neg_topq], loss_agg [actor.flash_loss_agg], loss_scale_factor
    [actor.loss_scale_factor], no_is [actor.flash_no_is]; eps_clip [actor.eps_clip_low_high] and
    whiten (= not algo.advantage.no_whiten) for ppo. lr, weight_decay, betas [actor.adam.*];
    scheduler [actor.lr_scheduler], warmup_ratio [actor.lr_warmup_ratio], min_lr_ratio
    [actor.min_lr_ratio], total_steps (optimizer steps of the run); max_norm [actor.max_norm, <= 0:
    no clipping]; entropy_coef [actor.entropy_coef]; temperature: the sampling temperature the
    log-probabilities are computed at [rollout.temperature]; micro_batch_trajectories
    [train.micro_batch_size] and micro_batch_tokens (0: no limit); packed_forward
    [fsdp.packing_samples]; param_dtype [fsdp.param_dtype] (autocast dtype; master weights stay
    float32); gradient_checkpointing [actor.gradient_checkpoint].
    """

    loss_mode: str = "flash_reinforce"
    delta: float = 3e-3
    neg_topq: float = 1.0
    loss_agg: str = "seq-mean-token-mean"
    loss_scale_factor: float | None = None
    no_is: bool = False
    eps_clip: tuple[float, float] = (0.2, 0.2)
    whiten: bool = False
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    scheduler: str = "constant"
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.1
    total_steps: int = 1
    max_norm: float = 1.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    micro_batch_trajectories: int = 0
    micro_batch_tokens: int = 0
    packed_forward: bool = True
    param_dtype: str = "fp32"
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.loss_mode not in LOSS_MODES:
            raise ValueError(f"actor.loss_mode must be one of {LOSS_MODES}, got {self.loss_mode!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"actor.lr_scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"fsdp.param_dtype must be one of {sorted(PARAM_DTYPES)}, got {self.param_dtype!r}")
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


def lr_factor(step: int, settings: LearnerSettings) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based).

    ``cosine_with_min_lr``: linear warmup over ``ceil(warmup_ratio * total_steps)`` steps, then a
    half cosine from 1 down to ``min_lr_ratio`` at ``total_steps``. ``constant``: 1 (warmup ignored,
    as in Hugging Face's ``constant``). ``constant_with_warmup``: linear warmup, then 1.
    """
    warmup = math.ceil(settings.warmup_ratio * settings.total_steps)
    if settings.scheduler == "constant":
        return 1.0
    if step < warmup:
        return (step + 1) / warmup
    if settings.scheduler == "constant_with_warmup":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, settings.total_steps - warmup))
    return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _body(model: torch.nn.Module) -> torch.nn.Module:
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if body is None or body is model:
        raise ValueError(f"{type(model).__name__}: cannot find the model body (base_model_prefix)")
    return body


def token_log_probs(model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0,
                    with_entropy: bool = False, packed_forward: bool = True, pad_token_id: int = 0,
                    autocast_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """Current log-probabilities (and entropies) ``[N]`` float32 of ``batch``'s action tokens.

    Non-action slots hold 0 (the loss ignores them). Token t is scored from the hidden state at t-1
    of the same trajectory, at ``temperature``. Gradients flow to the model's parameters.
    """
    device = next(model.parameters()).device
    body = _body(model)
    head = model.get_output_embeddings()
    with torch.autocast(device_type=device.type, dtype=autocast_dtype or torch.float32,
                        enabled=autocast_dtype is not None):
        if packed_forward:
            out = body(input_ids=batch.input_ids.to(device)[None], position_ids=batch.position_ids.to(device)[None],
                       use_cache=False)
            hidden = out.last_hidden_state[0]
        else:
            ids, mask, index = to_padded(batch, pad_token_id)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            out = body(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                       use_cache=False)
            hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[index.to(device)]
    positions = torch.nonzero(batch.action_mask, as_tuple=True)[0].to(device)
    weight = head.weight
    rows = hidden[positions - 1].to(weight.dtype)
    logp, ent = sampled_token_logprobs(rows, weight, batch.input_ids.to(device)[positions],
                                       bias=getattr(head, "bias", None), temperature=temperature,
                                       with_entropy=with_entropy)
    n = batch.num_tokens
    full_logp = torch.zeros(n, dtype=torch.float32, device=device).index_put((positions,), logp.float())
    full_ent = None
    if ent is not None:
        full_ent = torch.zeros(n, dtype=torch.float32, device=device).index_put((positions,), ent.float())
    return full_logp, full_ent


class PolicyLogProbs(torch.nn.Module):
    """The learner's forward as one module: the model body and the sampled-token log-probabilities.

    :func:`token_log_probs` reads the output projection's weight directly (no ``[tokens, vocab]``
    logits), outside any ``forward`` of the model. Wrapping the computation in a module whose
    ``forward`` is the whole of it lets FSDP2 (``fully_shard``) treat this module as the root:
    the embedding, final norm and output projection are gathered for its forward and their
    gradients reduced after its backward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
                packed_forward: bool = True, pad_token_id: int = 0,
                autocast_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
        return token_log_probs(self.model, batch, temperature=temperature, with_entropy=with_entropy,
                               packed_forward=packed_forward, pad_token_id=pad_token_id,
                               autocast_dtype=autocast_dtype)


@dataclass
class BatchTotals:
    """Batch-global quantities that make the loss of any part of a batch a summand of the batch's loss.

    num_trajectories: B of the whole batch. reward_baseline: mean reward of the whole batch.
    policy_tokens: action tokens of the whole batch (``token-mean`` and the ppo loss divide by it).
    advantages: ``[B]`` float32 group advantages indexed by batch row (``ppo`` only, else ``None``).
    """

    num_trajectories: int
    reward_baseline: float
    policy_tokens: int
    advantages: Tensor | None = None

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory], group_ids: Sequence[int] | None,
           settings: LearnerSettings) -> "BatchTotals":
        """The totals of the whole batch ``trajectories`` (float64 mean of the rewards)."""
        b = len(trajectories)
        if b == 0:
            raise ValueError("Learner: no trajectories")
        rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float64)
        advantages = None
        if settings.loss_mode == "ppo":
            gids = torch.tensor(list(range(b)) if group_ids is None else list(group_ids), dtype=torch.int64)
            if gids.numel() != b:
                raise ValueError(f"group_ids has {gids.numel()} entries for {b} trajectories")
            advantages = group_advantages(rewards, gids, whiten=settings.whiten).to(torch.float32)
        return cls(num_trajectories=b, reward_baseline=float(rewards.mean()),
                   policy_tokens=sum(t.num_action_tokens for t in trajectories), advantages=advantages)


@dataclass
class GradientParts:
    """What :meth:`Learner.accumulate_gradient_parts` measured on its part of a batch (all detached, CPU).

    rows: batch rows of the part's trajectories. loss, entropy_sum, clip_tokens: sums over the part.
    sequence_kl, admitted, retained: per trajectory of the part, in ``rows`` order (flash_reinforce).
    error: the loss error met with ``collective_forwards`` (the passes went on with zero loss).
    """

    rows: list[int]
    loss: float = 0.0
    entropy_sum: float = 0.0
    clip_tokens: float = 0.0
    sequence_kl: Tensor | None = None
    admitted: Tensor | None = None
    retained: Tensor | None = None
    error: BaseException | None = None


def summarize_parts(parts: Sequence[GradientParts], totals: BatchTotals, settings: LearnerSettings) -> dict[str, float]:
    """The batch's loss and statistics from the parts that cover it (each row exactly once)."""
    b = totals.num_trajectories
    kl = torch.zeros(b, dtype=torch.float64)
    admitted = torch.zeros(b, dtype=torch.bool)
    retained = torch.zeros(b, dtype=torch.float64)
    seen = torch.zeros(b, dtype=torch.int64)
    for p in parts:
        if not p.rows:
            continue
        rows = torch.tensor(p.rows, dtype=torch.int64)
        seen[rows] += 1
        if p.sequence_kl is not None:
            kl[rows] = p.sequence_kl.double()
            admitted[rows] = p.admitted
            retained[rows] = p.retained.double()
    if not bool((seen == 1).all()):
        raise ValueError(f"summarize_parts: the parts do not cover rows 0..{b - 1} exactly once")
    tokens = totals.policy_tokens
    metrics = {"loss": sum(p.loss for p in parts), "reward_baseline": totals.reward_baseline, "policy_tokens": tokens}
    if settings.loss_mode == "flash_reinforce":
        metrics.update(acceptance_rate=float(admitted.double().mean()), sequence_kl_mean=float(kl.mean()),
                       sequence_kl_max=float(kl.max()),
                       retained_token_fraction=float(retained.sum()) / max(1, tokens))
    else:
        metrics.update(acceptance_rate=1.0, sequence_kl_mean=float("nan"),
                       clip_fraction=sum(p.clip_tokens for p in parts) / max(1, tokens),
                       advantage_abs_mean=float(totals.advantages.abs().mean()))
    if _needs_entropy(settings):
        metrics["entropy_mean"] = sum(p.entropy_sum for p in parts) / max(1, tokens)
    return metrics


def _needs_entropy(s: LearnerSettings) -> bool:
    return s.neg_topq < 1.0 and s.loss_mode == "flash_reinforce" or s.entropy_coef != 0.0


def _zero_backward(logp: Tensor, ent: Tensor | None) -> None:
    """A backward pass that adds exactly zero to every gradient (it still runs FSDP's reductions)."""
    zero = logp.sum() * 0.0
    if ent is not None:
        zero = zero + ent.sum() * 0.0
    zero.backward()


def _placeholder_micro_batch() -> PackedBatch:
    """Two padding tokens, the second an action: a forward that contributes exactly zero gradient."""
    return pack([Trajectory([0, 0], [False, True], [0.0, -1.0], reward=0.0, failed=False)])


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
        if getattr(model.config, "use_cache", None) is not None:
            model.config.use_cache = False
        if settings.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        model.train()
        self.scorer = PolicyLogProbs(model)
        if parallelize is not None:
            self.scorer = parallelize(self.scorer)
        self.optimizer = torch.optim.AdamW([p for p in self.scorer.parameters() if p.requires_grad], lr=settings.lr,
                                           betas=settings.betas, weight_decay=settings.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, settings))
        # The public fused op (compiled extension); importing it fails loudly when the extension is missing.
        self.loss_fn = flashreinforce.flashreinforce_loss_packed
        self.loss_impl = "fused"

    # ------------------------------------------------------------------ one update
    def step(self, trajectories: Sequence[Trajectory], group_ids: Sequence[int] | None = None) -> dict[str, float]:
        """One optimizer step on ``trajectories`` (the whole batch); returns the update's metrics.

        ``group_ids[i]``: the prompt group of trajectory i (needed by ``ppo``; default one group each).
        Raises ``FloatingPointError`` (and leaves weights and version unchanged) on a non-finite gradient.
        """
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(trajectories, group_ids)
        metrics.update(self.apply_gradients())
        metrics["learner_compute_s"] = time.perf_counter() - t0
        return metrics

    def apply_gradients(self) -> dict[str, float]:
        """Clip the accumulated gradients, make one optimizer and scheduler step, bump the version.

        Returns ``grad_norm`` (before clipping) and ``lr`` (of this step). Raises ``FloatingPointError``
        (gradients dropped, weights and version unchanged) when the gradient norm is not finite.
        """
        s = self.settings
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
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def accumulate_gradients(self, trajectories: Sequence[Trajectory],
                             group_ids: Sequence[int] | None = None) -> dict[str, float]:
        """Forward and backward over the batch in micro-batches, adding into ``p.grad``; no optimizer step.

        Returns the loss and the loss statistics of the batch.
        """
        trajectories = list(trajectories)
        totals = BatchTotals.of(trajectories, group_ids, self.settings)
        parts = self.accumulate_gradient_parts(trajectories, totals)
        return summarize_parts([parts], totals, self.settings)

    def accumulate_gradient_parts(self, trajectories: Sequence[Trajectory], totals: BatchTotals, *,
                                  rows: Sequence[int] | None = None, num_micro_batches: int | None = None,
                                  collective_forwards: bool = False) -> GradientParts:
        """Forward and backward of a part of a batch, adding into ``p.grad``.

        ``trajectories`` are the part's trajectories, ``rows`` their rows in the whole batch (default
        0..n-1), ``totals`` the whole batch's :class:`BatchTotals`: the part's loss and gradients are
        then exactly its summand of the whole batch's. The part may be empty. ``num_micro_batches``:
        run at least this many forward/backward passes, padding with passes that contribute zero
        (FSDP ranks must run the same number of forwards, since each one gathers parameters).
        ``collective_forwards``: a loss error does not stop the passes (the other ranks wait in their
        collectives): it is kept in ``error`` and the remaining passes contribute zero gradient.
        """
        s = self.settings
        trajectories = list(trajectories)
        rows = list(range(len(trajectories))) if rows is None else [int(r) for r in rows]
        if len(rows) != len(trajectories):
            raise ValueError(f"rows has {len(rows)} entries for {len(trajectories)} trajectories")
        need_entropy = _needs_entropy(s)
        autocast = PARAM_DTYPES[s.param_dtype]
        out = GradientParts(rows=rows)
        n = len(trajectories)
        if s.loss_mode == "flash_reinforce":
            out.sequence_kl = torch.zeros(n, dtype=torch.float64)
            out.admitted = torch.zeros(n, dtype=torch.bool)
            out.retained = torch.zeros(n, dtype=torch.float64)
        mbs = micro_batches(trajectories, max_tokens=s.micro_batch_tokens or None,
                            max_trajectories=s.micro_batch_trajectories or None) if trajectories else []
        for mb in mbs:
            logp, ent = self.scorer(mb, temperature=s.temperature, with_entropy=need_entropy,
                                    packed_forward=s.packed_forward, pad_token_id=self.pad_token_id,
                                    autocast_dtype=autocast)
            if out.error is not None:
                _zero_backward(logp, ent)
                continue
            try:
                loss = self._part_loss(mb, logp, ent, rows, totals, out)
            except (FloatingPointError, ValueError) as err:
                if not collective_forwards:
                    raise
                out.error = err
                _zero_backward(logp, ent)
                continue
            loss.backward()
            out.loss += float(loss.detach())
        for _ in range(len(mbs), num_micro_batches or 0):
            logp, ent = self.scorer(_placeholder_micro_batch(), temperature=s.temperature, with_entropy=need_entropy,
                                    packed_forward=s.packed_forward, pad_token_id=self.pad_token_id,
                                    autocast_dtype=autocast)
            _zero_backward(logp, ent)
        return out

    def _part_loss(self, mb: PackedBatch, logp: Tensor, ent: Tensor | None, rows: list[int], totals: BatchTotals,
                   out: GradientParts) -> Tensor:
        """The loss of micro-batch ``mb`` as a summand of the whole batch's; records its statistics in ``out``."""
        s = self.settings
        dev = logp.device
        blp = mb.behavior_log_probs.to(dev)
        cu = mb.cu_seqlens.to(dev)
        mask = mb.action_mask.to(dev)
        local = torch.tensor(mb.rows)  # indices into this part
        batch_rows = torch.tensor([rows[i] for i in mb.rows])
        if s.loss_mode == "flash_reinforce":
            loss, stats = self.loss_fn(
                logp, blp, mb.rewards.to(dev), cu, mask, delta=s.delta, negative_token_fraction=s.neg_topq,
                entropies=ent if s.neg_topq < 1.0 else None,
                failures=mb.failures.to(dev) if s.neg_topq < 1.0 else None,
                reward_baseline=totals.reward_baseline, num_trajectories=totals.num_trajectories,
                loss_agg=s.loss_agg,
                loss_scale_factor=s.loss_scale_factor if s.loss_agg == "seq-mean-token-sum-norm" else None,
                num_policy_tokens=totals.policy_tokens if s.loss_agg == "token-mean" else None, no_is=s.no_is)
            out.sequence_kl[local] = stats["sequence_kl"].detach().double().cpu()
            out.admitted[local] = stats["admitted"].detach().cpu()
            out.retained[local] = stats["retained_tokens"].detach().double().cpu()
        else:
            loss, stats = ppo_clipped_loss_packed(
                logp, blp, totals.advantages[batch_rows].to(dev), cu, mask, eps_clip_low=s.eps_clip[0],
                eps_clip_high=s.eps_clip[1], num_policy_tokens=totals.policy_tokens)
            out.clip_tokens += float(stats["clip_fraction"]) * mb.num_action_tokens
        if ent is not None:
            ent_sum = ent[mask].sum()
            out.entropy_sum += float(ent_sum.detach())
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

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])


def _local(t: Tensor) -> Tensor:
    """A DTensor's full value (FSDP2 gradients and norms), any other tensor unchanged."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
