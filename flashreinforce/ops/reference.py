"""Pure-PyTorch reference of the FlashREINFORCE objective: the readable definition.

This module is the executable form of ``SEMANTICS.md``. It is written for clarity, not speed:
the fused kernel (:mod:`flashreinforce.ops`, exported as ``flashreinforce.flashreinforce_loss_packed``
and ``flashreinforce.flashreinforce_loss``) computes the same thing over packed sequences and is
tested against this module and against float64 computations.

The objective, for a batch of B complete trajectories (one rollout per prompt):

1. ``T_i``: policy tokens of trajectory i (``action_mask``), before any filter.
2. ``A_i = R_i - baseline`` with the batch-mean reward as baseline (One-Batch REINFORCE).
3. Per policy token, ``p = clamp(exp(behavior), 1e-6, 1-1e-6)``, ``q = clamp(exp(current), ...)`` and the
   Bernoulli-KL proxy ``d = p (log p - log q) + (1-p) (log(1-p) - log(1-q))``.
4. ``sequence_kl_i = max(0, sum_t d / T_i)``; the trajectory is admitted when ``sequence_kl_i <= delta``
   (Sequence Trust Region: the whole trajectory is kept or dropped).
5. Optional entropy filter (``negative_token_fraction`` q < 1): failed trajectories keep only their
   ``ceil(q T_i)`` highest-entropy policy tokens (ties: earlier position first).
6. Active tokens (kept, of admitted trajectories) get the detached weight ``w = exp(current - behavior) A_i``.
7. ``loss = -sum_i s_i sum_t w_t current_t`` with ``s_i = 1 / (T_i * num_trajectories)`` for the method's
   ``seq-mean-token-mean`` aggregation (Sample-Mean Optimization); the ablations ``token-mean`` and
   ``seq-mean-token-sum-norm`` change only ``s_i``.

Shapes: packed inputs are ``[N]`` token arrays with ``cu_seqlens [B+1]`` offsets; padded inputs are
``[B, T]``. Log-probabilities are natural-log probabilities of the sampled tokens (<= 0).
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

__all__ = [
    "LOSS_AGGREGATIONS",
    "PROB_CLAMP",
    "flashreinforce_loss",
    "flashreinforce_loss_packed",
]

#: Supported values of ``loss_agg`` (Molt's ``actor.flash_loss_agg``).
LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")

#: Probabilities in the Bernoulli-KL gate are clamped to ``[PROB_CLAMP, 1 - PROB_CLAMP]``.
PROB_CLAMP = 1e-6


def flashreinforce_loss_packed(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    cu_seqlens: Tensor,
    action_mask: Tensor | None = None,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: Tensor | None = None,
    failures: Tensor | None = None,
    reward_baseline: float | Tensor | None = None,
    num_trajectories: int | None = None,
    loss_agg: str = "seq-mean-token-mean",
    loss_scale_factor: float | None = None,
    num_policy_tokens: int | None = None,
    no_is: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE loss over packed trajectories (reference implementation).

    Args:
        log_probs: ``[N]`` float, current-policy log-probability of each token; carries autograd.
        behavior_log_probs: ``[N]`` float, log-probability recorded by the behavior policy at sampling.
        rewards: ``[B]`` scalar reward per trajectory.
        cu_seqlens: ``[B+1]`` int32/int64 offsets; trajectory i owns ``[cu[i], cu[i+1])``.
        action_mask: ``[N]`` bool, True on policy tokens; ``None`` means every token is a policy token.
        delta: trust threshold on the per-trajectory Bernoulli KL (inclusive); ``inf`` disables the gate.
        negative_token_fraction: q in [0, 1]; below 1, failed trajectories keep ``ceil(q T_i)`` tokens.
        entropies: ``[N]`` float, full categorical entropy per token (required when q < 1).
        failures: ``[B]`` bool, explicit failure labels (required when q < 1).
        reward_baseline: baseline subtracted from rewards; default the mean of ``rewards``. Pass the
            global batch mean when a batch is split over microbatches or ranks.
        num_trajectories: the B in the denominator; default ``len(rewards)`` (pass the global B when split).
        loss_agg: ``"seq-mean-token-mean"`` (the method), ``"token-mean"`` or ``"seq-mean-token-sum-norm"``.
        loss_scale_factor: the constant token-sum divisor of ``"seq-mean-token-sum-norm"`` (required there).
        num_policy_tokens: denominator of ``"token-mean"``; default the batch's policy-token count.
        no_is: use the current policy as the detached denominator: ratios are 1, every trajectory admitted.

    Returns:
        ``(loss, stats)``: a 0-d loss in the compute dtype (float64 for float64 inputs, else float32)
        and detached statistics ``advantages [B]``, ``sequence_kl [B]``, ``admitted [B]`` (bool),
        ``acceptance_rate`` (0-d), ``policy_tokens [B]`` and ``retained_tokens [B]`` (int64).

    Raises:
        ValueError: invalid shapes, dtypes, devices, offsets, options or values (see SEMANTICS.md).
        FloatingPointError: an importance ratio overflows on an active token.
    """
    _check_tensor_args(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, entropies, failures)
    q_frac = _check_options(delta, negative_token_fraction, entropies, failures, loss_agg, loss_scale_factor)
    num_trajectories = _check_positive_int("num_trajectories", num_trajectories)
    num_policy_tokens = _check_positive_int("num_policy_tokens", num_policy_tokens)
    if reward_baseline is not None:
        reward_baseline = float(reward_baseline)
        if not math.isfinite(reward_baseline):
            raise ValueError(f"reward_baseline must be finite, got {reward_baseline}")

    device = log_probs.device
    batch = rewards.shape[0]
    offsets = cu_seqlens.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    segment = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
    mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask

    policy_tokens = torch.zeros(batch, dtype=torch.int64, device=device).index_add_(0, segment, mask.long())
    empty = (policy_tokens == 0).nonzero()
    if empty.numel():
        raise ValueError(f"action_mask: trajectory {int(empty[0])} has no policy token")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    _check_policy_values("log_probs", log_probs, mask)
    if not no_is:
        _check_policy_values("behavior_log_probs", behavior_log_probs, mask)
    if q_frac < 1.0:
        _check_entropies(entropies, mask)

    compute = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    # Zero non-policy slots before any arithmetic: they may hold NaN or inf and must not leak.
    current = torch.where(mask, log_probs.to(compute), 0.0)
    lengths_c = policy_tokens.to(compute)

    with torch.no_grad():
        if no_is:
            behavior = current.detach()
        else:
            behavior = torch.where(mask, behavior_log_probs.to(compute), 0.0)
        rewards_c = rewards.to(compute)
        baseline = rewards_c.mean() if reward_baseline is None else torch.tensor(reward_baseline, dtype=compute, device=device)
        advantages = rewards_c - baseline

        # The gate statistic is evaluated in float64 whatever the input precision: the two terms of the
        # Bernoulli KL cancel when p is close to q, and in float32 this textbook form would lose
        # percents of the value. (The fused kernel uses a cancellation-free form in the compute dtype.)
        # The returned statistic (compute dtype) is compared with delta in double, so "admitted" means
        # exactly "the reported sequence_kl <= delta" (inclusive), without rounding delta.
        divergence = torch.where(mask, bernoulli_kl(behavior.double(), current.detach().double()), 0.0)
        kl_sum = torch.zeros(batch, dtype=torch.float64, device=device).index_add_(0, segment, divergence)
        sequence_kl = (kl_sum / policy_tokens).clamp_min(0.0).to(compute)
        admitted = sequence_kl.double() <= delta

        kept = mask
        if q_frac < 1.0:
            kept = _entropy_filter(mask, entropies, failures, offsets, policy_tokens, q_frac)
        active = kept & admitted[segment]

        # Inactive tokens never exponentiate anything (their difference is replaced by 0).
        ratio = torch.exp(torch.where(active, current.detach() - behavior, 0.0))
        if not torch.isfinite(ratio).all():
            bad = int((~torch.isfinite(ratio)).nonzero()[0])
            raise FloatingPointError(f"importance ratio overflows on active token {bad} (log_probs - behavior_log_probs too large)")
        weights = torch.where(active, ratio * advantages[segment], 0.0)
        scale = _trajectory_scale(loss_agg, lengths_c, batch if num_trajectories is None else num_trajectories,
                                  num_policy_tokens, loss_scale_factor)

    per_trajectory = torch.zeros(batch, dtype=compute, device=device).index_add(0, segment, weights * current)
    loss = -(per_trajectory * scale).sum()
    retained = torch.zeros(batch, dtype=torch.int64, device=device).index_add_(0, segment, active.long())
    stats = {
        "advantages": advantages,
        "sequence_kl": sequence_kl,
        "admitted": admitted,
        "acceptance_rate": admitted.to(compute).mean(),
        "policy_tokens": policy_tokens,
        "retained_tokens": retained,
    }
    return loss, stats


def flashreinforce_loss(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    action_mask: Tensor,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: Tensor | None = None,
    failures: Tensor | None = None,
    reward_baseline: float | Tensor | None = None,
    num_trajectories: int | None = None,
    loss_agg: str = "seq-mean-token-mean",
    loss_scale_factor: float | None = None,
    num_policy_tokens: int | None = None,
    no_is: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE loss over padded ``[B, T]`` trajectories (reference implementation).

    Identical to :func:`flashreinforce_loss_packed` with ``cu_seqlens[i] = i * T``; ``log_probs``,
    ``behavior_log_probs``, ``action_mask`` (bool) and ``entropies`` are ``[B, T]``; ``rewards`` and
    ``failures`` are ``[B]``. Padding slots must be False in ``action_mask``; their values are ignored.
    """
    cu_seqlens = _padded_offsets(log_probs, behavior_log_probs, rewards, action_mask, entropies)
    return flashreinforce_loss_packed(
        log_probs.reshape(-1), behavior_log_probs.reshape(-1), rewards, cu_seqlens, action_mask.reshape(-1),
        delta=delta, negative_token_fraction=negative_token_fraction,
        entropies=None if entropies is None else entropies.reshape(-1), failures=failures,
        reward_baseline=reward_baseline, num_trajectories=num_trajectories, loss_agg=loss_agg,
        loss_scale_factor=loss_scale_factor, num_policy_tokens=num_policy_tokens, no_is=no_is,
    )


def bernoulli_kl(behavior_log_probs: Tensor, log_probs: Tensor) -> Tensor:
    """Clamped Bernoulli KL proxy ``KL(Bern(p) || Bern(q))`` per token (elementwise, any shape)."""
    p = behavior_log_probs.exp().clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
    q = log_probs.exp().clamp(PROB_CLAMP, 1.0 - PROB_CLAMP)
    return p * (p.log() - q.log()) + (1.0 - p) * (torch.log1p(-p) - torch.log1p(-q))


# ----------------------------------------------------------------------------------------------
# Pieces of the computation


def _entropy_filter(mask: Tensor, entropies: Tensor, failures: Tensor, offsets: Tensor,
                    policy_tokens: Tensor, q: float) -> Tensor:
    """Keep, on each failed trajectory, its ``ceil(q T_i)`` highest-entropy policy tokens.

    Ties are broken by position (earlier first): a stable descending sort keeps the original order
    among equal entropies. Successful trajectories keep every policy token.
    """
    kept = mask.clone()
    failed = failures.nonzero().flatten().tolist()
    for i in failed:
        start, end = int(offsets[i]), int(offsets[i + 1])
        count = math.ceil(q * int(policy_tokens[i]))
        scores = torch.where(mask[start:end], entropies[start:end].to(torch.float64), -math.inf)
        order = torch.sort(scores, descending=True, stable=True).indices
        row = torch.zeros(end - start, dtype=torch.bool, device=mask.device)
        row[order[:count]] = True
        kept[start:end] = row & mask[start:end]
    return kept


def _trajectory_scale(loss_agg: str, lengths: Tensor, num_trajectories: int, num_policy_tokens: int | None,
                      loss_scale_factor: float | None) -> Tensor:
    """Per-trajectory factor ``s_i`` of ``loss = -sum_i s_i sum_t w_t log_prob_t``."""
    if loss_agg == "seq-mean-token-mean":
        return 1.0 / (lengths * num_trajectories)
    if loss_agg == "token-mean":
        total = lengths.sum() if num_policy_tokens is None else num_policy_tokens
        return torch.full_like(lengths, 1.0) / total
    return torch.full_like(lengths, 1.0 / (loss_scale_factor * num_trajectories))


# ----------------------------------------------------------------------------------------------
# Validation (errors name the argument)


def _check_tensor_args(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, entropies, failures):
    named = {"log_probs": log_probs, "behavior_log_probs": behavior_log_probs, "rewards": rewards,
             "cu_seqlens": cu_seqlens, "action_mask": action_mask, "entropies": entropies, "failures": failures}
    for name, value in named.items():
        if value is not None and not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    for name in ("log_probs", "behavior_log_probs", "entropies"):
        value = named[name]
        if value is not None and not value.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    for name in ("action_mask", "failures"):
        value = named[name]
        if value is not None and value.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor, got {value.dtype}")
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise ValueError(f"rewards must be a real-valued tensor, got {rewards.dtype}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    for name, value in named.items():
        if value is not None and value.device != log_probs.device:
            raise ValueError(f"{name} is on {value.device} but log_probs is on {log_probs.device}")

    if log_probs.dim() != 1 or log_probs.numel() == 0:
        raise ValueError(f"log_probs must be a non-empty 1-D [N] tensor, got shape {tuple(log_probs.shape)}")
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D [B] tensor, got shape {tuple(rewards.shape)}")
    num_tokens, batch = log_probs.shape[0], rewards.shape[0]
    for name in ("behavior_log_probs", "action_mask", "entropies"):
        value = named[name]
        if value is not None and tuple(value.shape) != (num_tokens,):
            raise ValueError(f"{name} must have shape [{num_tokens}] like log_probs, got {tuple(value.shape)}")
    if failures is not None and tuple(failures.shape) != (batch,):
        raise ValueError(f"failures must have shape [{batch}] like rewards, got {tuple(failures.shape)}")
    if tuple(cu_seqlens.shape) != (batch + 1,):
        raise ValueError(f"cu_seqlens must have shape [B+1] = [{batch + 1}], got {tuple(cu_seqlens.shape)}")
    offsets = cu_seqlens.to(torch.int64)
    if int(offsets[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(offsets[0])}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    if int(offsets[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must end at N = {num_tokens} (the length of log_probs), got {int(offsets[-1])}")


def _check_options(delta, q, entropies, failures, loss_agg, loss_scale_factor) -> float:
    if not isinstance(delta, Real) or math.isnan(delta) or delta < 0:
        raise ValueError(f"delta must be a non-negative number (inf disables the gate), got {delta!r}")
    if not isinstance(q, Real) or math.isnan(q) or not 0.0 <= q <= 1.0:
        raise ValueError(f"negative_token_fraction must be in [0, 1], got {q!r}")
    if q < 1.0 and (entropies is None or failures is None):
        missing = " and ".join(n for n, v in (("entropies", entropies), ("failures", failures)) if v is None)
        raise ValueError(f"negative_token_fraction < 1 needs entropies and failures; missing {missing}")
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {loss_agg!r}")
    if loss_agg == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or not math.isfinite(loss_scale_factor) or loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be a positive finite number for {loss_agg}, got {loss_scale_factor!r}")
    elif loss_scale_factor is not None:
        raise ValueError(f"loss_scale_factor is only used with loss_agg='seq-mean-token-sum-norm', not {loss_agg!r}")
    return float(q)


def _check_positive_int(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, Tensor)) or int(value) != value or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_policy_values(name: str, values: Tensor, mask: Tensor) -> None:
    policy = values[mask]
    bad = ~torch.isfinite(policy) | (policy > 0)
    if bad.any():
        index = int(mask.nonzero().flatten()[bad.nonzero()[0]])
        raise ValueError(f"{name}: policy token {index} has log probability {float(values[index])}; "
                         "policy-token log probabilities must be finite and <= 0")


def _check_entropies(entropies: Tensor, mask: Tensor) -> None:
    if not torch.isfinite(entropies[mask]).all():
        index = int(mask.nonzero().flatten()[(~torch.isfinite(entropies[mask])).nonzero()[0]])
        raise ValueError(f"entropies: policy token {index} has non-finite entropy {float(entropies[index])}")


def _padded_offsets(log_probs, behavior_log_probs, rewards, action_mask, entropies) -> Tensor:
    for name, value in (("log_probs", log_probs), ("behavior_log_probs", behavior_log_probs),
                        ("action_mask", action_mask), ("rewards", rewards)):
        if not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if log_probs.dim() != 2 or log_probs.numel() == 0:
        raise ValueError(f"log_probs must be a non-empty [B, T] tensor, got shape {tuple(log_probs.shape)}")
    for name, value in (("behavior_log_probs", behavior_log_probs), ("action_mask", action_mask),
                        ("entropies", entropies)):
        if value is not None and value.shape != log_probs.shape:
            raise ValueError(f"{name} must have shape {tuple(log_probs.shape)} like log_probs, got {tuple(value.shape)}")
    batch, width = log_probs.shape
    if tuple(rewards.shape) != (batch,):
        raise ValueError(f"rewards must have shape [{batch}], got {tuple(rewards.shape)}")
    return torch.arange(batch + 1, device=log_probs.device, dtype=torch.int64) * width
