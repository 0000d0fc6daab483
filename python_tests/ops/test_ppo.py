"""GRPO advantages and the token-mean clipped PPO loss against float64 loops."""

import math
import random

import pytest
import torch

from flashreinforce.ops.ppo import group_advantages, ppo_clipped_loss_packed


def loop_advantages(rewards, groups, whiten, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))
        out.append((r - mean) / (std + eps) if whiten else r - mean)
    return out


@pytest.mark.parametrize("whiten", [False, True])
def test_group_advantages_match_a_loop(whiten):
    rng = random.Random(0)
    groups = [rng.randrange(5) for _ in range(23)]
    rewards = [float(rng.randint(0, 1)) if rng.random() < 0.7 else rng.random() for _ in groups]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), whiten=whiten)
    assert got.tolist() == pytest.approx(loop_advantages(rewards, groups, whiten), abs=1e-12)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.3)])
def test_ppo_loss_and_gradient_match_float64_loop(eps):
    rng = random.Random(1)
    lengths = [rng.randint(1, 9) for _ in range(7)]
    n = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    mask = torch.tensor([i > 0 and rng.random() < 0.8 for L in lengths for i in range(L)])
    if not mask.any():
        mask[1] = True
    lp = (-torch.rand(n, dtype=torch.float64) * 3).requires_grad_()
    blp = lp.detach() + (torch.rand(n, dtype=torch.float64) - 0.5) * 0.8  # ratios well outside the clip range too
    adv = torch.randn(len(lengths), dtype=torch.float64)
    total = int(mask.sum()) + 5  # a batch-global denominator larger than this micro-batch's
    loss, stats = ppo_clipped_loss_packed(lp, blp, adv, cu, mask, eps_clip_low=eps[0], eps_clip_high=eps[1],
                                          num_policy_tokens=total)
    loss.backward()
    # independent loop: value and analytic gradient of -min(r A, clip(r) A) / total
    want, grad = 0.0, [0.0] * n
    row = [i for i, L in enumerate(lengths) for _ in range(L)]
    for t in range(n):
        if not mask[t]:
            continue
        r = math.exp(float(lp.detach()[t]) - float(blp[t]))
        a = float(adv[row[t]])
        clipped = min(max(r, 1 - eps[0]), 1 + eps[1])
        if r * a <= clipped * a:
            want -= r * a / total
            grad[t] = -r * a / total
        else:
            want -= clipped * a / total  # constant in lp: no gradient
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert lp.grad.tolist() == pytest.approx(grad, rel=1e-10, abs=1e-14)
    assert 0.0 < float(stats["clip_fraction"]) < 1.0


def test_ppo_loss_parts_add_up_to_the_batch():
    torch.manual_seed(0)
    lengths = [3, 5, 2, 6]
    cu = torch.tensor([0, 3, 8, 10, 16])
    mask = torch.tensor([t > 0 for L in lengths for t in range(L)])
    lp = -torch.rand(16, dtype=torch.float64)
    blp = lp - 0.05
    adv = torch.randn(4, dtype=torch.float64)
    whole, _ = ppo_clipped_loss_packed(lp, blp, adv, cu, mask)
    total = int(mask.sum())
    a, _ = ppo_clipped_loss_packed(lp[:8], blp[:8], adv[:2], cu[:3], mask[:8], num_policy_tokens=total)
    b, _ = ppo_clipped_loss_packed(lp[8:], blp[8:], adv[2:], cu[2:] - 8, mask[8:], num_policy_tokens=total)
    assert float(a + b) == pytest.approx(float(whole), rel=1e-12)


def test_ppo_loss_validates_arguments():
    lp = torch.zeros(4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_clipped_loss_packed(lp, lp, torch.zeros(2), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="eps_clip_low"):
        ppo_clipped_loss_packed(lp, lp, torch.zeros(1), torch.tensor([0, 4]), eps_clip_low=1.5)
