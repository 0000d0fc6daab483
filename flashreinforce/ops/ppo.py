"""The GRPO comparison of the published ablations: group-relative advantages and a clipped PPO loss.

``actor.loss_mode ppo`` with ``algo.advantage.estimator grpo``: every prompt is sampled
``rollout.n_samples_per_prompt`` times; a trajectory's advantage is its reward minus the mean
reward of its prompt's group (divided by the group's standard deviation + eps unless
``algo.advantage.no_whiten``; with one sample per prompt the loss mode takes the whole batch as the
group); the loss is the token-mean clipped PPO surrogate with the ratio
taken against the recorded behavior log-probabilities.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["group_advantages", "ppo_clipped_loss_packed"]


def group_advantages(rewards: Tensor, group_ids: Tensor, *, whiten: bool = False, eps: float = 1e-6) -> Tensor:
    """Advantages ``[B]`` (dtype of ``rewards``): ``R_i - mean(R over i's group)``, divided by
    ``std(group) + eps`` when ``whiten`` (population std, ``unbiased=False``; a single-member group
    has std 0).

    Args:
        rewards: ``[B]`` float rewards, finite.
        group_ids: ``[B]`` int group label of each trajectory (any integers).
    """
    if rewards.ndim != 1 or group_ids.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be floating point, got {rewards.dtype}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got {group_ids.dtype}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    count = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros_like(count).index_add_(0, inverse, rewards) / count
    adv = rewards - mean[inverse]
    if whiten:
        var = torch.zeros_like(count).index_add_(0, inverse, adv * adv) / count
        adv = adv / (var.sqrt()[inverse] + eps)
    return adv


def ppo_clipped_loss_packed(log_probs: Tensor, behavior_log_probs: Tensor, advantages: Tensor, cu_seqlens: Tensor,
                            action_mask: Tensor | None = None, *, eps_clip_low: float = 0.2,
                            eps_clip_high: float = 0.2, num_policy_tokens: int | None = None
                            ) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean clipped PPO loss over packed trajectories.

    ``loss = -(1/num_policy_tokens) * sum over policy tokens t of min(r_t A_i, clip(r_t, 1-eps_low, 1+eps_high) A_i)``
    with ``r_t = exp(log_probs_t - behavior_log_probs_t)`` (gradient flows through ``log_probs`` only).

    Args:
        log_probs: ``[N]`` float, current log-probabilities (autograd).
        behavior_log_probs: ``[N]`` float, recorded at sampling time.
        advantages: ``[B]`` float, one per trajectory.
        cu_seqlens: ``[B+1]`` int offsets.
        action_mask: ``[N]`` bool (``None``: all tokens are policy tokens).
        num_policy_tokens: the denominator; default the policy tokens here (pass the batch total
            when a batch is split into micro-batches, so the parts add up to the whole).

    Returns:
        ``(loss, stats)`` with stats ``clip_fraction`` (fraction of policy tokens whose clipped
        term was the minimum and differs), ``ratio_mean`` and ``policy_tokens [B]``, all detached.
    """
    n = log_probs.shape[0] if log_probs.ndim == 1 else -1
    if log_probs.ndim != 1 or behavior_log_probs.shape != log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and behavior_log_probs "
                         f"{tuple(behavior_log_probs.shape)} must be equal 1-D shapes")
    if not log_probs.is_floating_point() or not behavior_log_probs.is_floating_point():
        raise ValueError("log_probs and behavior_log_probs must be floating point")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() != advantages.numel() + 1:
        raise ValueError(f"cu_seqlens must have B+1 = {advantages.numel() + 1} entries, got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must start at 0, be non-decreasing and end at N")
    if action_mask is None:
        action_mask = torch.ones(n, dtype=torch.bool, device=log_probs.device)
    elif action_mask.dtype != torch.bool or action_mask.shape != log_probs.shape:
        raise ValueError("action_mask must be a bool tensor shaped like log_probs")
    if not (math.isfinite(eps_clip_low) and math.isfinite(eps_clip_high) and 0 <= eps_clip_low < 1 and eps_clip_high >= 0):
        raise ValueError(f"eps_clip_low must lie in [0, 1) and eps_clip_high >= 0, got {eps_clip_low}, {eps_clip_high}")
    lengths = cu[1:] - cu[:-1]
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=log_probs.device), lengths.to(log_probs.device))
    policy_tokens = torch.zeros(lengths.numel(), dtype=torch.int64, device=log_probs.device).index_add_(
        0, row, action_mask.to(torch.int64))
    total = int(policy_tokens.sum()) if num_policy_tokens is None else int(num_policy_tokens)
    if total <= 0:
        raise ValueError("num_policy_tokens must be positive (no policy token in the batch)")
    adv = advantages.to(log_probs.dtype)[row].detach()
    lp = log_probs[action_mask]
    blp = behavior_log_probs.to(log_probs.dtype)[action_mask].detach()
    a = adv[action_mask]
    ratio = torch.exp(lp - blp)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - eps_clip_low, 1.0 + eps_clip_high) * a
    surrogate = torch.minimum(unclipped, clipped)
    loss = -surrogate.sum() / total
    with torch.no_grad():
        clip_fraction = (clipped < unclipped).float().mean() if lp.numel() else torch.zeros(())
        stats = {"clip_fraction": clip_fraction, "ratio_mean": ratio.detach().mean() if lp.numel() else torch.zeros(()),
                 "policy_tokens": policy_tokens}
    return loss, stats
