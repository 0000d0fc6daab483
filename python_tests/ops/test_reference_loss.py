"""The pure-PyTorch reference (flashreinforce.loss) against docs/semantics.md.

The reference is the readable definition; here it is checked against the worked numbers of
docs/semantics.md and against an independent per-token Python loop in float64 (math module only).
"""

import math
import random

import pytest
import torch

from flashreinforce import loss as ref


def _loop_objective(lp, blp, rewards, cu, mask, *, delta, q=1.0, ent=None, failed=None, baseline=None,
                    num_traj=None, agg="seq-mean-token-mean", scale_factor=None, num_tokens=None, no_is=False):
    """Straight transcription of docs/semantics.md with Python floats; returns (loss, grad list, admitted)."""
    B = len(rewards)
    base = sum(rewards) / B if baseline is None else baseline
    nt = B if num_traj is None else num_traj
    T = [sum(mask[cu[i]:cu[i + 1]]) for i in range(B)]
    total = sum(T) if num_tokens is None else num_tokens
    grad = [0.0] * len(lp)
    loss = 0.0
    admitted = []
    for i in range(B):
        toks = [t for t in range(cu[i], cu[i + 1]) if mask[t]]
        kl = 0.0
        for t in toks:
            b = lp[t] if no_is else blp[t]
            p = min(max(math.exp(b), 1e-6), 1 - 1e-6)
            qq = min(max(math.exp(lp[t]), 1e-6), 1 - 1e-6)
            kl += p * (math.log(p) - math.log(qq)) + (1 - p) * (math.log1p(-p) - math.log1p(-qq))
        kl = max(0.0, kl / T[i])
        admitted.append(kl <= delta)
        kept = toks
        if q < 1 and failed[i]:
            count = math.ceil(q * T[i])
            kept = sorted(toks, key=lambda t: (-ent[t], t))[:count]
        if agg == "seq-mean-token-mean":
            s = 1.0 / (T[i] * nt)
        elif agg == "token-mean":
            s = 1.0 / total
        else:
            s = 1.0 / (scale_factor * nt)
        if not admitted[-1]:
            continue
        for t in kept:
            rho = 1.0 if no_is else math.exp(lp[t] - blp[t])
            w = rho * (rewards[i] - base)
            loss -= s * w * lp[t]
            grad[t] = -s * w
    return loss, grad, admitted


def _random_batch(rng, B, max_len, mask_fraction=0.3):
    lengths = [rng.randint(1, max_len) for _ in range(B)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    N = cu[-1]
    mask = [rng.random() > mask_fraction for _ in range(N)]
    for i in range(B):  # at least one policy token per trajectory
        mask[rng.randrange(cu[i], cu[i + 1])] = True
    lp = [-(rng.random() ** 2) * 3 - 1e-3 for _ in range(N)]
    blp = [min(-1e-4, v + rng.gauss(0, 0.05)) for v in lp]
    ent = [float(rng.randint(0, 4)) for _ in range(N)]  # many ties
    rewards = [float(rng.randint(0, 1)) for _ in range(B)]
    failed = [r == 0 for r in rewards]
    return lp, blp, rewards, cu, mask, ent, failed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("agg", ref.LOSS_AGGREGATIONS)
def test_reference_matches_float64_loop(seed, agg):
    rng = random.Random(seed)
    lp, blp, rewards, cu, mask, ent, failed = _random_batch(rng, B=rng.randint(1, 9), max_len=40)
    delta = [math.inf, 3e-3, 1e-3][seed % 3]
    q = [1.0, 0.5, 0.0][seed % 3 if seed < 3 else (seed + 1) % 3]
    no_is = seed == 5
    scale_factor = 17.0 if agg == "seq-mean-token-sum-norm" else None
    want_loss, want_grad, want_adm = _loop_objective(lp, blp, rewards, cu, mask, delta=delta, q=q, ent=ent,
                                                     failed=failed, agg=agg, scale_factor=scale_factor, no_is=no_is)
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    # Non-policy slots hold garbage that must be ignored.
    mask_t = torch.tensor(mask)
    blp_t = torch.where(mask_t, torch.tensor(blp, dtype=torch.float64), torch.nan)
    loss, stats = ref.flashreinforce_loss_packed(
        x, blp_t, torch.tensor(rewards, dtype=torch.float64), torch.tensor(cu), mask_t, delta=delta,
        negative_token_fraction=q, entropies=torch.tensor(ent, dtype=torch.float64), failures=torch.tensor(failed),
        loss_agg=agg, loss_scale_factor=scale_factor, no_is=no_is)
    loss.backward()
    assert stats["admitted"].tolist() == want_adm
    assert loss.item() == pytest.approx(want_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_worked_gradient_example():
    lp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, True, False], [True, True, True]])
    loss, stats = ref.flashreinforce_loss(lp, lp.detach() - 0.1, torch.tensor([1.0, 0.0], dtype=torch.float64),
                                          mask, delta=math.inf)
    loss.backward()
    assert stats["advantages"].tolist() == [0.5, -0.5]
    assert lp.grad[0, 1].item() == pytest.approx(-0.27629, abs=5e-6)
    assert lp.grad[1].tolist() == pytest.approx([0.09210] * 3, abs=5e-6)
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 2].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_worked_bernoulli_kl_and_inclusive_threshold(dtype):
    d = 0.2 * math.log(0.5) + 0.8 * math.log(0.8 / 0.6)
    assert d == pytest.approx(0.091516, abs=5e-7)
    lp = torch.tensor([0.0, math.log(0.4)], dtype=dtype)
    blp = torch.tensor([0.0, math.log(0.2)], dtype=dtype)
    mask = torch.tensor([False, True])
    args = (lp, blp, torch.tensor([1.0], dtype=dtype), torch.tensor([0, 2]), mask)
    _, stats = ref.flashreinforce_loss_packed(*args, delta=math.inf)
    kl = stats["sequence_kl"].item()
    assert kl == pytest.approx(d, rel=1e-6 if dtype == torch.float32 else 1e-12)
    assert ref.flashreinforce_loss_packed(*args, delta=kl)[1]["admitted"].item()
    assert not ref.flashreinforce_loss_packed(*args, delta=math.nextafter(kl, 0))[1]["admitted"].item()


@pytest.mark.parametrize("q, row1_kept", [(0.2, [False, False, True]), (0.9, [True] * 3), (0.0, [False] * 3)])
def test_worked_entropy_filter(q, row1_kept):
    lp = torch.full((2, 4), -1.0, requires_grad=True)
    mask = torch.tensor([[True, True, True, False]] * 2)
    ent = torch.tensor([[1.0, 2.0, 3.0, 99.0]] * 2)
    loss, stats = ref.flashreinforce_loss(lp, lp.detach(), torch.tensor([1.0, 0.0]), mask, negative_token_fraction=q,
                                          entropies=ent, failures=torch.tensor([False, True]))
    loss.backward()
    assert lp.grad[0, :3].tolist() == pytest.approx([-1 / 12] * 3)
    assert lp.grad[1, :3].tolist() == pytest.approx([1 / 12 if k else 0.0 for k in row1_kept])
    assert stats["retained_tokens"].tolist() == [3, sum(row1_kept)]
    assert stats["policy_tokens"].tolist() == [3, 3]


def test_microbatch_split_sums_to_full_batch():
    rng = random.Random(7)
    lp, blp, rewards, cu, mask, _, _ = _random_batch(rng, B=8, max_len=30)
    full_x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    kw = dict(delta=0.01)
    loss, _ = ref.flashreinforce_loss_packed(full_x, torch.tensor(blp, dtype=torch.float64),
                                             torch.tensor(rewards, dtype=torch.float64), torch.tensor(cu),
                                             torch.tensor(mask), **kw)
    loss.backward()
    baseline = sum(rewards) / len(rewards)
    total, grads = 0.0, []
    for lo, hi in ((0, 3), (3, 4), (4, 8)):
        a, b = cu[lo], cu[hi]
        x = torch.tensor(lp[a:b], dtype=torch.float64, requires_grad=True)
        part, _ = ref.flashreinforce_loss_packed(
            x, torch.tensor(blp[a:b], dtype=torch.float64), torch.tensor(rewards[lo:hi], dtype=torch.float64),
            torch.tensor([c - a for c in cu[lo:hi + 1]]), torch.tensor(mask[a:b]),
            reward_baseline=baseline, num_trajectories=len(rewards), **kw)
        part.backward()
        total += part.item()
        grads.append(x.grad)
    assert total == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(torch.cat(grads), full_x.grad, rtol=1e-12, atol=1e-15)


def _base_args():
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.3])
    return dict(log_probs=lp, behavior_log_probs=lp - 0.01, rewards=torch.tensor([1.0, 0.0]),
                cu_seqlens=torch.tensor([0, 2, 4]), action_mask=torch.tensor([False, True, False, True]))


@pytest.mark.parametrize("change, match", [
    (dict(log_probs=torch.tensor([])), "log_probs"),
    (dict(behavior_log_probs=torch.zeros(3)), "behavior_log_probs"),
    (dict(rewards=torch.tensor([1.0])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([1, 2, 4])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 2, 3])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0.0, 2.0, 4.0])), "cu_seqlens"),
    (dict(action_mask=torch.tensor([0, 1, 0, 1])), "action_mask"),
    (dict(log_probs=torch.tensor([0, -1, 0, -1])), "log_probs"),
    (dict(action_mask=torch.tensor([False, True, False, False])), "action_mask"),
    (dict(rewards=torch.tensor([1.0, math.inf])), "rewards"),
    (dict(log_probs=torch.tensor([-0.5, math.nan, -0.2, -0.3])), "log_probs"),
    (dict(log_probs=torch.tensor([-0.5, 0.1, -0.2, -0.3])), "log_probs"),
    (dict(behavior_log_probs=torch.tensor([-0.5, -math.inf, -0.2, -0.3])), "behavior_log_probs"),
    (dict(delta=math.nan), "delta"),
    (dict(delta=-1.0), "delta"),
    (dict(negative_token_fraction=1.5), "negative_token_fraction"),
    (dict(negative_token_fraction=0.5), "entropies"),
    (dict(negative_token_fraction=0.5, entropies=torch.zeros(4)), "failures"),
    (dict(negative_token_fraction=0.5, entropies=torch.tensor([0.0, math.nan, 0, 0]),
          failures=torch.tensor([True, True])), "entropies"),
    (dict(negative_token_fraction=0.5, entropies=torch.zeros(4), failures=torch.tensor([1, 0])), "failures"),
    (dict(loss_agg="sum"), "loss_agg"),
    (dict(loss_agg="seq-mean-token-sum-norm"), "loss_scale_factor"),
    (dict(loss_scale_factor=4.0), "loss_scale_factor"),
    (dict(num_trajectories=0), "num_trajectories"),
    (dict(reward_baseline=math.nan), "reward_baseline"),
])
def test_errors_name_the_argument(change, match):
    args = {**_base_args(), **change}
    with pytest.raises(ValueError, match=match):
        ref.flashreinforce_loss_packed(**args)


def test_masked_garbage_is_ignored_and_ratio_overflow_raises():
    args = _base_args()
    args["log_probs"] = torch.tensor([math.nan, -1.0, math.inf, -0.3], requires_grad=True)
    args["behavior_log_probs"] = torch.tensor([5.0, -1.01, -math.inf, -0.31])
    loss, _ = ref.flashreinforce_loss_packed(**args)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(args["log_probs"].grad).all()
    args["log_probs"] = torch.tensor([-0.5, -1.0, -0.2, -0.0])
    args["behavior_log_probs"] = torch.tensor([-0.5, -1.0, -0.2, -200.0])
    with pytest.raises(FloatingPointError):
        ref.flashreinforce_loss_packed(**args, delta=math.inf)


def test_float32_sequence_kl_is_accurate_when_policies_are_close():
    # p close to q: the two terms of the Bernoulli KL cancel; the reference must still be within
    # the contract's float32 tolerance (5e-3 relative, docs/semantics.md) of the float64 value.
    gen = torch.Generator().manual_seed(3)
    lp64 = -torch.rand(4000, generator=gen, dtype=torch.float64) * 4 - 1e-3
    blp64 = (lp64 + torch.randn(4000, generator=gen, dtype=torch.float64) * 3e-5).clamp(max=-1e-4)
    lp32, blp32 = lp64.float(), blp64.float()
    cu = torch.tensor([0, 1000, 2500, 4000])
    want = ref.flashreinforce_loss_packed(lp32.double(), blp32.double(), torch.zeros(3, dtype=torch.float64),
                                          cu)[1]["sequence_kl"]
    got = ref.flashreinforce_loss_packed(lp32, blp32, torch.zeros(3), cu)[1]["sequence_kl"]
    assert got.dtype == torch.float32 and (want > 0).all()
    torch.testing.assert_close(got.double(), want, rtol=5e-3, atol=0)


def test_float64_bernoulli_kl_keeps_its_digits_when_policies_are_close():
    # The textbook form loses about |log p| * 1e-16 / KL of its value to cancellation: for tokens whose
    # log-probability moved by 1e-9..1e-4 that is far above the contract's 1e-10 (float64, docs/semantics.md).
    # Against 40-digit decimals, the reference's form holds 1e-12 relative, the clamp bounds included.
    from python_tests.ops.fused_cases import bernoulli_kl_exact

    rng = random.Random(11)
    behavior, current = [], []
    for _ in range(400):
        b = -rng.expovariate(0.5)
        behavior.append(b)
        current.append(min(b + rng.choice((-1, 1)) * 10 ** rng.uniform(-9, -4), 0.0))
    behavior += [-1e-8, -2e-6, -1.2e-6, -13.0, -0.7]   # p at the upper clamp, q just below it; swapped; ...
    current += [-1.5e-6, -1e-8, -3e-9, -13.0 + 1e-8, -0.7 - 1e-12]
    want = torch.tensor([bernoulli_kl_exact(b, c) for b, c in zip(behavior, current)], dtype=torch.float64)
    got = ref.bernoulli_kl(torch.tensor(behavior, dtype=torch.float64), torch.tensor(current, dtype=torch.float64))
    assert (want > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_clamp_bounds_are_those_of_the_compute_dtype(dtype):
    # docs/semantics.md, step 3: in float32 (the compute dtype of every input but float64) 1 - 1e-6 is
    # 1 - 1.0133e-6. A behavior token at p = 1 against q = 1 - 1e-5 feels the difference in 1 - p (1.3%).
    from python_tests.ops.fused_cases import BOUNDS32, BOUNDS64, bernoulli_kl_float64

    behavior = torch.tensor([0.0, -0.5], dtype=dtype)
    current = torch.tensor([math.log1p(-1e-5), -0.5], dtype=dtype)
    _, stats = ref.flashreinforce_loss_packed(current, behavior, torch.zeros(1, dtype=dtype), torch.tensor([0, 2]))
    bounds = BOUNDS64 if dtype == torch.float64 else BOUNDS32
    b, c = float(behavior[0]), float(current[0])
    want = bernoulli_kl_float64(b, c, bounds) / 2
    other = bernoulli_kl_float64(b, c, BOUNDS32 if dtype == torch.float64 else BOUNDS64) / 2
    assert abs(want - other) > 1e-3 * want  # the two bounds do give different values here
    assert float(stats["sequence_kl"][0]) == pytest.approx(want, rel=1e-5)
