"""Pure-PyTorch reference of the FlashREINFORCE objective: the readable definition.

This module is the executable form of docs/semantics.md. It is written for clarity, not speed:
the fused kernel (:mod:`flashreinforce.ops.fused`, exported as
``flashreinforce.flashreinforce_loss_packed`` and ``flashreinforce.flashreinforce_loss``) computes
the same thing over packed sequences and is tested against this module and against float64
computations. Both take the same signatures and validate their arguments with the same rules and
messages (:mod:`flashreinforce.ops.contract`).

The objective, for a batch of B complete trajectories (one rollout per prompt):

1. ``T_i``: policy tokens of trajectory i (``action_mask``), before any filter.
2. ``A_i = R_i - baseline`` with the batch-mean reward as baseline (One-Batch REINFORCE).
3. Per policy token, ``p = clamp(exp(behavior), 1e-6, 1-1e-6)``, ``q = clamp(exp(current), ...)`` and the
   Bernoulli-KL proxy ``d = p (log p - log q) + (1-p) (log(1-p) - log(1-q))``.
4. ``sequence_kl_i = max(0, sum_t d / T_i)``; the trajectory is admitted when ``sequence_kl_i <= delta``
   (Sequence Trust Region: the whole trajectory is kept or dropped). ``gate_metric`` replaces ``d`` by
   another per-token divergence (:func:`gate_divergence`); ``sequence_kl`` then holds its mean.
5. Optional entropy filter (``negative_token_fraction`` q < 1): failed trajectories keep only their
   ``ceil(q T_i)`` highest-entropy policy tokens (ties: earlier position first). ``ceil(q T_i)`` is
   evaluated in floating point, ``math.ceil(q * T_i)``, as the published reference does: q = 0.07,
   T_i = 100 keeps 8 tokens (``0.07 * 100 == 7.000000000000001``).
6. Active tokens (kept, of admitted trajectories) get the detached weight ``w = exp(current - behavior) A_i``
   (the ratio clipped at ``is_truncation`` when that is finite: truncated importance sampling).
7. ``loss = -sum_i s_i sum_t w_t current_t`` with ``s_i = 1 / (T_i * num_trajectories)`` for the method's
   ``seq-mean-token-mean`` aggregation (Sample-Mean Optimization); the ablations ``token-mean`` and
   ``seq-mean-token-sum-norm`` change only ``s_i``.

Shapes: packed inputs are ``[N]`` token arrays with ``cu_seqlens [B+1]`` offsets; padded inputs are
``[B, T]``. Log-probabilities are natural-log probabilities of the sampled tokens (<= 0).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from flashreinforce.objective import GATE_METRICS
from flashreinforce.ops.contract import (LOSS_AGGREGATIONS, PROB_CLAMP, Arguments, ErrorCode, check_arguments,
                                         entry_point, error_for, make_stats)

__all__ = [
    "LOSS_AGGREGATIONS",
    "PROB_CLAMP",
    "bernoulli_kl",
    "flashreinforce_loss",
    "gate_divergence",
    "flashreinforce_loss_packed",
]


@entry_point
def flashreinforce_loss_packed(log_probs: Tensor, behavior_log_probs: Tensor, rewards: Tensor, cu_seqlens: Tensor,
                               action_mask: Optional[Tensor] = None, **keywords) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE loss over packed trajectories (reference implementation).

    Args:
        log_probs: ``[N]`` float, current-policy log-probability of each token; carries autograd.
        behavior_log_probs: ``[N]`` float, log-probability recorded by the behavior policy at sampling.
        rewards: ``[B]`` real (floating-point or integer), scalar reward per trajectory.
        cu_seqlens: ``[B+1]`` int32/int64 offsets; trajectory i owns ``[cu[i], cu[i+1])``.
        action_mask: ``[N]`` bool, True on policy tokens; ``None`` means every token is a policy token.
        entropies: ``[N]`` float, full categorical entropy per token (required when q < 1).
        failures: ``[B]`` bool, explicit failure labels (required when q < 1).
        reward_baseline: baseline subtracted from rewards; default the mean of ``rewards``. Pass the
            global batch mean when a batch is split over microbatches or ranks.
        num_trajectories: the B in the denominator, at least ``len(rewards)``; default ``len(rewards)``
            (pass the global B when split).
        num_policy_tokens: denominator of ``"token-mean"``, at least the batch's policy-token count;
            default that count.
        options: a :class:`flashreinforce.objective.LossOptions` (a run's, built once); option keywords
            given with it override its fields.

    Returns:
        ``(loss, stats)``: a 0-d loss in the compute dtype (float64 for float64 inputs, else float32)
        and detached statistics ``advantages [B]``, ``sequence_kl [B]``, ``admitted [B]`` (bool),
        ``acceptance_rate`` (0-d), ``policy_tokens [B]`` and ``retained_tokens [B]`` (int64).

    Raises:
        ValueError: invalid shapes, dtypes, devices, offsets, options or values (docs/semantics.md).
        TypeError: a flag option is not a bool, or an unknown keyword.
        FloatingPointError: an importance ratio, or a gradient element in the dtype of ``log_probs``,
            overflows on an active token.
    """
    args = check_arguments(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, padded=False,
                           caller="flashreinforce_loss_packed", **keywords)
    return _objective(args)


@entry_point
def flashreinforce_loss(log_probs: Tensor, behavior_log_probs: Tensor, rewards: Tensor, action_mask: Tensor,
                        **keywords) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE loss over padded ``[B, T]`` trajectories (reference implementation).

    Identical to :func:`flashreinforce_loss_packed` with ``cu_seqlens[i] = i * T``; ``log_probs``,
    ``behavior_log_probs``, ``action_mask`` (bool) and ``entropies`` are ``[B, T]``; ``rewards`` and
    ``failures`` are ``[B]``. Padding slots must be False in ``action_mask``; their values are ignored.
    """
    args = check_arguments(log_probs, behavior_log_probs, rewards, None, action_mask, padded=True,
                           caller="flashreinforce_loss", **keywords)
    return _objective(args)


def gate_divergence(behavior_log_probs: Tensor, log_probs: Tensor, metric: str,
                    clamp_dtype: torch.dtype = torch.float64) -> Tensor:
    """The gate metric's per-token term (elementwise, float64 in, float64 out; docs/semantics.md).

    ``clamp_dtype`` is the compute dtype C whose probability clamp bounds the Bernoulli KL uses.
    """
    if metric == "binary_kl":
        return bernoulli_kl(behavior_log_probs, log_probs, clamp_dtype)
    if metric == "kpop":
        return torch.maximum(bernoulli_kl(behavior_log_probs, log_probs, clamp_dtype),
                             bernoulli_kl(log_probs, behavior_log_probs, clamp_dtype))
    d = log_probs - behavior_log_probs
    if metric == "k3":
        # e^d - 1 - d; below |d| = 1e-3 its series, where expm1(d) - d would cancel.
        series = d * d * (0.5 + d * (1.0 / 6 + d * (1.0 / 24 + d / 120)))
        return torch.where(d.abs() < 1e-3, series, torch.expm1(d) - d)
    if metric == "log_ratio":
        return d.abs()
    raise ValueError(f"gate_metric must be one of {GATE_METRICS}, got {metric!r}")


def bernoulli_kl(behavior_log_probs: Tensor, log_probs: Tensor, clamp_dtype: torch.dtype = torch.float64) -> Tensor:
    """Clamped Bernoulli KL proxy ``KL(Bern(p) || Bern(q))`` per token (elementwise, any shape, float64).

    ``p`` and ``q`` are clamped to ``[PROB_CLAMP, 1 - PROB_CLAMP]`` as represented in ``clamp_dtype``
    (the compute dtype C: in float32, ``1 - 1e-6`` is ``1 - 1.0133e-6``), in log space, which is the
    same clamp. The textbook form ``p log(p/q) + (1-p) log((1-p)/(1-q))`` cancels to first order when
    ``p ~ q`` (the value is of order ``(p - q)^2``), which costs float64 several digits on tokens that
    barely drifted. Adding ``q - p`` to the first term and ``p - q`` to the second splits it into two
    non-negative terms without cancellation: ``q g(d) + (1 - q) g(d2)`` with ``g(x) = x e^x - e^x + 1``,
    ``d = log p - log q`` and ``d2 = log((1 - p) / (1 - q))``.
    """
    log_lo, log_hi = _log_clamp_bounds(clamp_dtype)
    log_p = behavior_log_probs.clamp(log_lo, log_hi)
    log_q = log_probs.clamp(log_lo, log_hi)
    d = log_p - log_q
    q, one_minus_q = log_q.exp(), -torch.expm1(log_q)
    d2 = torch.log1p(-q * torch.expm1(d) / one_minus_q)  # (1 - p) / (1 - q) = 1 - q (e^d - 1) / (1 - q)
    return q * _excess(d) + one_minus_q * _excess(d2)


@functools.lru_cache(maxsize=None)
def _log_clamp_bounds(dtype: torch.dtype) -> tuple[float, float]:
    """The logs (in float64) of the clamp bounds ``PROB_CLAMP`` and ``1 - PROB_CLAMP`` represented in ``dtype``."""
    lo = torch.tensor(PROB_CLAMP, dtype=dtype)
    return math.log(float(lo)), math.log(float(1 - lo))


def _excess(x: Tensor) -> Tensor:
    """``g(x) = x e^x - (e^x - 1) >= 0``; below ``|x| = 0.01`` its series ``sum_n (n-1) x^n / n!`` (to ``x^8``)."""
    series = x * x * (1.0 / 2 + x * (1.0 / 3 + x * (1.0 / 8 + x * (1.0 / 30 + x * (1.0 / 144 + x * (1.0 / 840 + x / 5760))))))
    return torch.where(x.abs() < 0.01, series, x * x.exp() - torch.expm1(x))


# ----------------------------------------------------------------------------------------------
# The computation, on arguments checked by the contract


def _objective(a: Arguments) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss and statistics of checked arguments (either layout, flattened to ``[N]`` here).

    Data errors are raised in the order of their :class:`~flashreinforce.ops.contract.ErrorCode`
    (the fused kernel's reporting priority), with the contract's messages.
    """
    device = a.log_probs.device
    batch = a.batch
    log_probs = a.log_probs.reshape(-1)
    if a.cu_seqlens is None:  # padded [B, T]
        offsets = torch.arange(batch + 1, device=device, dtype=torch.int64) * a.padded_width
    else:
        offsets = a.cu_seqlens.to(torch.int64)
        _check_offsets(a, offsets)
    lengths = offsets[1:] - offsets[:-1]
    segment = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
    mask = torch.ones_like(log_probs, dtype=torch.bool) if a.action_mask is None else a.action_mask.reshape(-1)

    policy_tokens = torch.zeros(batch, dtype=torch.int64, device=device).index_add_(0, segment, mask.long())
    _raise_first(a, ErrorCode.NO_POLICY_TOKENS, policy_tokens == 0)
    total_policy = int(policy_tokens.sum())
    if a.num_policy_tokens is not None and a.num_policy_tokens < total_policy:
        raise error_for(ErrorCode.TOO_FEW_POLICY_TOKENS, total_policy, a)

    # Advantages: formed in float64 from the rewards' values and rounded once to the compute dtype;
    # rewards and advantages must be finite in the compute dtype (checked in float64 before rounding).
    compute = a.compute_dtype
    rewards64 = a.rewards.to(torch.float64)
    _raise_first(a, ErrorCode.NON_FINITE_REWARD, ~_finite_in(rewards64, compute))
    baseline = float(rewards64.sum()) / batch if a.reward_baseline is None else a.reward_baseline
    advantages64 = rewards64 - baseline
    _raise_first(a, ErrorCode.NON_FINITE_ADVANTAGE, ~_finite_in(advantages64, compute))
    advantages = advantages64.to(compute)

    entropies = None if a.entropies is None else a.entropies.reshape(-1)
    _raise_first(a, ErrorCode.BAD_LOG_PROB, mask & ~_valid_log_prob(log_probs))
    if not a.options.no_is:
        _raise_first(a, ErrorCode.BAD_BEHAVIOR_LOG_PROB, mask & ~_valid_log_prob(a.behavior_log_probs.reshape(-1)))
    if a.filter:
        _raise_first(a, ErrorCode.BAD_ENTROPY, mask & ~torch.isfinite(entropies))

    # Zero non-policy slots before any arithmetic: they may hold NaN or inf and must not leak.
    current = torch.where(mask, log_probs.to(compute), 0.0)

    with torch.no_grad():
        if a.options.no_is:
            behavior = current.detach()
        else:
            behavior = torch.where(mask, a.behavior_log_probs.reshape(-1).to(compute), 0.0)

        # The gate statistic is evaluated in float64 whatever the input precision (with the clamp bounds of
        # the compute dtype), in a cancellation-free form (bernoulli_kl): the textbook Bernoulli KL cancels
        # when p is close to q, losing percents of the value in float32 and digits in float64. (The fused
        # kernel does the same in the compute dtype.)
        # The returned statistic (compute dtype) is compared with delta in double, so "admitted" means
        # exactly "the reported sequence_kl <= delta" (inclusive), without rounding delta.
        divergence = torch.where(mask, gate_divergence(behavior.double(), current.detach().double(), a.options.gate_metric,
                                                       compute), 0.0)
        kl_sum = torch.zeros(batch, dtype=torch.float64, device=device).index_add_(0, segment, divergence)
        sequence_kl = (kl_sum / policy_tokens).clamp_min(0.0).to(compute)
        admitted = sequence_kl.double() <= a.options.delta

        kept = mask
        if a.filter:
            kept = _entropy_filter(mask, entropies, a.failures, offsets, policy_tokens, a.options.negative_token_fraction)
        active = kept & admitted[segment]

        # Inactive tokens never exponentiate anything (their difference is replaced by 0).
        ratio = torch.exp(torch.where(active, current.detach() - behavior, 0.0))
        ratio = ratio.clamp_max(a.options.is_truncation)  # truncated IS (inf: unchanged); an overflow becomes the cap
        _raise_first(a, ErrorCode.RATIO_OVERFLOW, ~torch.isfinite(ratio))
        # s_i in float64, and A_i s_i rounded once to the compute dtype: the gradient on an active
        # token is then exactly -ratio * (A_i s_i), the fused kernel's formula.
        scale = _trajectory_scale(a, policy_tokens)
        coef = (advantages.double() * scale).to(compute)
        weights = torch.where(active, ratio * coef[segment], 0.0)  # w_t * s_i, detached
        gradient = (-weights).to(a.log_probs.dtype)
        _raise_first(a, ErrorCode.GRADIENT_OVERFLOW, active & ~torch.isfinite(gradient))

    per_trajectory = torch.zeros(batch, dtype=compute, device=device).index_add(0, segment, weights * current)
    loss = -per_trajectory.sum()
    retained = torch.zeros(batch, dtype=torch.int64, device=device).index_add_(0, segment, active.long())
    stats = make_stats(advantages=advantages, sequence_kl=sequence_kl, admitted=admitted,
                       acceptance_rate=admitted.to(compute).mean(), policy_tokens=policy_tokens,
                       retained_tokens=retained)
    return loss, stats


def _entropy_filter(mask: Tensor, entropies: Tensor, failures: Tensor, offsets: Tensor,
                    policy_tokens: Tensor, q: float) -> Tensor:
    """Keep, on each failed trajectory, its ``ceil(q T_i)`` highest-entropy policy tokens.

    ``ceil(q T_i)`` is ``math.ceil(q * T_i)`` in floating point (the published reference's rule,
    kept on purpose: q = 0.07, T_i = 100 keeps 8). Ties are broken by position (earlier first): a
    stable descending sort keeps the original order among equal entropies. Successful
    trajectories keep every policy token.
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


def _trajectory_scale(a: Arguments, policy_tokens: Tensor) -> Tensor:
    """Per-trajectory factor ``s_i`` (float64) of ``loss = -sum_i s_i sum_t w_t log_prob_t``."""
    lengths = policy_tokens.double()
    num_trajectories = a.batch if a.num_trajectories is None else a.num_trajectories
    if a.options.loss_agg == "seq-mean-token-mean":
        return 1.0 / (lengths * num_trajectories)
    if a.options.loss_agg == "token-mean":
        total = float(lengths.sum()) if a.num_policy_tokens is None else float(a.num_policy_tokens)
        return torch.full_like(lengths, 1.0 / total)
    return torch.full_like(lengths, 1.0 / (a.options.loss_scale_factor * num_trajectories))


# ----------------------------------------------------------------------------------------------
# Data checks (the rules and messages are the contract's)


def _raise_first(a: Arguments, code: ErrorCode, bad: Tensor) -> None:
    """Raises ``code`` at the first True index of ``bad`` (a trajectory or a token index)."""
    if bool(bad.any()):
        raise error_for(code, int(bad.nonzero()[0]), a)


def _check_offsets(a: Arguments, offsets: Tensor) -> None:
    if int(offsets[0]) != 0:
        raise error_for(ErrorCode.BAD_CU_SEQLENS, 0, a)
    decreasing = (offsets[1:] < offsets[:-1]).nonzero()
    if decreasing.numel():  # cu[i] < cu[i-1]: the record holds i
        raise error_for(ErrorCode.BAD_CU_SEQLENS, int(decreasing[0]) + 1, a)
    if int(offsets[-1]) != a.num_tokens:
        raise error_for(ErrorCode.BAD_CU_SEQLENS, a.batch, a)


def _finite_in(values64: Tensor, compute: torch.dtype) -> Tensor:
    """Elementwise: the float64 values stay finite once rounded to ``compute``."""
    return torch.isfinite(values64.to(compute))


def _valid_log_prob(values: Tensor) -> Tensor:
    """Finite and <= 0 (NaN fails both)."""
    return torch.isfinite(values) & (values <= 0)
