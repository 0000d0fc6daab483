"""The fused loss (compiled CPU path) against an independent float64 computation and the reference.

Tolerances (docs/semantics.md, section 5): float64 inputs 1e-10 relative; float32: gradient within 1e-5 of its largest
magnitude, loss within 1e-5 of the sum of the absolute per-trajectory terms, sequence_kl within
5e-3 relative, the same admission decisions away from the threshold; 16-bit gradients to their
rounding. Inputs are fresh random packed batches (see fused_cases.py) with masked slots holding
NaN / inf / positive garbage.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashreinforce as fr
from flashreinforce import loss as reference
from python_tests.ops.fused_cases import check_against_expected, expected_loss, random_batch

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def run_fused(b, fn=None, **extra):
    fn = fn or fr.flashreinforce_loss_packed
    lp = b.log_probs.clone().requires_grad_()
    opts = dict(b.options)
    opts.update(extra)
    loss, stats = fn(lp, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, **opts)
    loss.backward()
    return loss.detach(), lp.grad, stats


def pick_delta(b, quantile=0.6):
    """A delta between the trajectories' KLs so that some are admitted and some rejected."""
    _, stats = reference.flashreinforce_loss_packed(b.log_probs.double(), b.behavior_log_probs.double(), b.rewards,
                                                    b.cu_seqlens, b.action_mask, delta=math.inf)
    kls = sorted(set(stats["sequence_kl"].tolist()))
    k = min(max(1, int(quantile * len(kls))), len(kls) - 1)
    return (kls[k - 1] + kls[k]) / 2  # midway between two trajectories: no decision sits on it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("filter_q", [None, 0.3])
@pytest.mark.parametrize("gate", ["inf", "finite"])
def test_random_batches_against_float64(generator, dtype, filter_q, gate):
    b = random_batch(generator, dtype=dtype, filter_q=filter_q, cu_dtype=torch.int32 if gate == "inf" else torch.int64)
    delta = math.inf if gate == "inf" else pick_delta(b)
    loss, grad, stats = run_fused(b, delta=delta)
    exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, delta=delta,
                        **b.options)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert grad.dtype == dtype and grad.shape == b.log_probs.shape
    assert stats["admitted"].dtype == torch.bool
    assert stats["policy_tokens"].dtype == torch.int64 and stats["retained_tokens"].dtype == torch.int64
    if gate == "finite":
        assert 0 < int(exp.admitted.sum()) < b.batch
    check_against_expected(loss, grad, stats, exp, dtype, delta)
    assert float(stats["acceptance_rate"]) == pytest.approx(float(stats["admitted"].double().mean()))
    # Zeros on every slot that is not an active token (masked slots held NaN / inf garbage).
    assert bool((grad[~b.action_mask] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("metric", ["binary_kl", "kpop", "k3", "log_ratio"])
@pytest.mark.parametrize("truncation", [math.inf, 1.2])
def test_gate_metrics_and_truncation_against_float64(generator, dtype, metric, truncation):
    """Each gate metric (and truncated ratios) of the fused op, and of the reference, against the float64
    definition, with a delta that admits some trajectories and rejects others."""
    b = random_batch(generator, dtype=dtype, spread=0.2, filter_q=0.4 if metric == "kpop" else None)
    _, free = reference.flashreinforce_loss_packed(b.log_probs.double(), b.behavior_log_probs.double(), b.rewards,
                                                   b.cu_seqlens, b.action_mask, delta=math.inf, gate_metric=metric)
    kls = sorted(set(free["sequence_kl"].tolist()))
    delta = (kls[len(kls) // 2 - 1] + kls[len(kls) // 2]) / 2
    exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, delta=delta,
                        gate_metric=metric, is_truncation=truncation, **b.options)
    assert 0 < int(exp.admitted.sum()) < b.batch
    for fn in (fr.flashreinforce_loss_packed, reference.flashreinforce_loss_packed):
        loss, grad, stats = run_fused(b, fn=fn, delta=delta, gate_metric=metric, is_truncation=truncation)
        check_against_expected(loss, grad, stats, exp, dtype, delta, where=f"{fn.__module__} {metric}")
    # The metrics differ: the same batch's sequence values are not those of the Bernoulli KL (but for it).
    _, kl_stats = reference.flashreinforce_loss_packed(b.log_probs.double(), b.behavior_log_probs.double(), b.rewards,
                                                       b.cu_seqlens, b.action_mask, delta=math.inf)
    assert torch.equal(free["sequence_kl"], kl_stats["sequence_kl"]) == (metric == "binary_kl")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_truncation_clips_every_ratio_at_the_cap(dtype):
    """With is_truncation C each active token's gradient is -min(rho, C) A s: ratios above C are clipped,
    those below are not, and a ratio that would overflow is the cap, not an error."""
    current = torch.tensor([-5.0, -0.1, -2.0, -1.0, -0.5], dtype=dtype)
    behavior = torch.tensor([-5.0, -3.1, -2.5, -1.0, -800.0], dtype=dtype)  # ratios e^3, e^0.5, 1, e^799.5
    mask = torch.tensor([False, True, True, True, True])
    cu = torch.tensor([0, 3, 5])
    rewards = torch.tensor([1.0, 0.0], dtype=dtype)
    for fn in (fr.flashreinforce_loss_packed, reference.flashreinforce_loss_packed):
        with pytest.raises(FloatingPointError, match="importance ratio overflows"):
            fn(current.clone().requires_grad_(), behavior, rewards, cu, mask, delta=math.inf)
        lp = current.clone().requires_grad_()
        loss, stats = fn(lp, behavior, rewards, cu, mask, delta=math.inf, is_truncation=2.0)
        loss.backward()
        # A = [0.5, -0.5], s_i = 1 / (2 * 2): gradient -min(rho, 2) * A_i / 4
        want = [0.0, -2.0 * 0.5 / 4, -math.exp(0.5) * 0.5 / 4, 1.0 * 0.5 / 4, 2.0 * 0.5 / 4]
        assert lp.grad.tolist() == pytest.approx(want, rel=1e-6), fn.__module__


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filter_q", [None, 0.5])
def test_fused_matches_reference(generator, dtype, filter_q):
    b = random_batch(generator, dtype=dtype, filter_q=filter_q)
    delta = pick_delta(b, 0.5)
    loss, grad, stats = run_fused(b, delta=delta)
    loss_r, grad_r, stats_r = run_fused(b, fn=reference.flashreinforce_loss_packed, delta=delta)
    far = (stats_r["sequence_kl"].double() - delta).abs() > 1e-2 * delta
    assert torch.equal(stats["admitted"][far], stats_r["admitted"][far])
    if torch.equal(stats["admitted"], stats_r["admitted"]):
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        scale = float(grad_r.double().abs().max())
        assert float((grad.double() - grad_r.double()).abs().max()) <= tol * scale + (
            2.0 ** -8 * scale if dtype == torch.bfloat16 else 0.0)
        assert torch.equal(stats["retained_tokens"], stats_r["retained_tokens"])
        assert torch.equal(stats["policy_tokens"], stats_r["policy_tokens"])
        assert float(stats["acceptance_rate"]) == float(stats_r["acceptance_rate"])
        assert stats["acceptance_rate"].dtype == stats_r["acceptance_rate"].dtype


def test_mixed_input_dtypes(generator):
    """bfloat16 current log-probs with float32 behavior log-probs and float64 entropies."""
    b = random_batch(generator, dtype=torch.bfloat16, behavior_dtype=torch.float32, entropy_dtype=torch.float64,
                     filter_q=0.4)
    loss, grad, stats = run_fused(b, delta=math.inf)
    exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, delta=math.inf,
                        **b.options)
    check_against_expected(loss, grad, stats, exp, torch.bfloat16, math.inf)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_entropy_filter_keeps_exact_counts(generator, ties, q):
    b = random_batch(generator, dtype=torch.float64, filter_q=q, entropy_ties=ties)
    if q == 1.0:
        b.options.update(negative_token_fraction=1.0)
    loss, grad, stats = run_fused(b, delta=math.inf)
    exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, delta=math.inf,
                        **b.options)
    check_against_expected(loss, grad, stats, exp, torch.float64, math.inf)
    counts = stats["policy_tokens"]
    want = torch.where(b.failures, torch.tensor([math.ceil(q * int(c)) for c in counts]), counts)
    assert torch.equal(stats["retained_tokens"], want)


def test_long_trajectory_with_many_ties(generator):
    """One long failed trajectory whose threshold bin holds many equal entropies (radix fallback)."""
    lengths = [60_000, 7, 1, 33]
    b = random_batch(generator, dtype=torch.float32, lengths=lengths, filter_q=0.37, entropy_ties=True)
    b.failures[:] = True
    loss, grad, stats = run_fused(b, delta=math.inf)
    exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, delta=math.inf,
                        **b.options)
    check_against_expected(loss, grad, stats, exp, torch.float32, math.inf)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("no_is", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_loss_agg_modes_and_no_is(generator, loss_agg, no_is, dtype):
    b = random_batch(generator, dtype=dtype, filter_q=0.5)
    opts = dict(loss_agg=loss_agg, no_is=no_is, delta=pick_delta(b, 0.5))
    if loss_agg == "seq-mean-token-sum-norm":
        opts["loss_scale_factor"] = 6144.0
    if loss_agg == "token-mean":
        opts["num_policy_tokens"] = int(b.action_mask.sum()) + 17
    loss, grad, stats = run_fused(b, **opts)
    exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask,
                        **{**b.options, **opts})
    check_against_expected(loss, grad, stats, exp, dtype, opts["delta"])
    if no_is:
        assert bool(stats["admitted"].all()) and float(stats["sequence_kl"].abs().max()) == 0.0
        assert float(stats["acceptance_rate"]) == 1.0


def test_no_is_ignores_behavior_values(generator):
    b = random_batch(generator, dtype=torch.float32)
    b.behavior_log_probs[b.action_mask] = math.nan  # shape-checked only
    loss, grad, stats = run_fused(b, no_is=True)
    exp = expected_loss(b.log_probs, torch.zeros_like(b.log_probs), b.rewards, b.cu_seqlens, b.action_mask,
                        no_is=True)
    check_against_expected(loss, grad, stats, exp, torch.float32, math.inf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("no_is", [False, True])
def test_no_mask_means_every_token_is_policy(generator, dtype, no_is):
    # Long trajectories cross the core's 512-token blocks and its 16384-token chunks.
    b = random_batch(generator, dtype=dtype, garbage=False, lengths=[5, 9000, 1, 40, 12000, 3, 700, 2])
    lp = b.log_probs.clone().requires_grad_()
    loss, stats = fr.flashreinforce_loss_packed(lp, b.behavior_log_probs, b.rewards, b.cu_seqlens, delta=math.inf,
                                                no_is=no_is)
    loss.backward()
    exp = expected_loss(b.log_probs.double(), b.behavior_log_probs.double(), b.rewards, b.cu_seqlens, None,
                        delta=math.inf, no_is=no_is)
    check_against_expected(loss.detach(), lp.grad, stats, exp, dtype, math.inf)
    assert torch.equal(stats["policy_tokens"], b.cu_seqlens[1:] - b.cu_seqlens[:-1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_equals_packed(generator, dtype):
    batch, width = 9, 57
    lengths = [width] * batch
    b = random_batch(generator, dtype=dtype, lengths=lengths, filter_q=0.5)
    delta = pick_delta(b, 0.5)
    lp_packed = b.log_probs.clone().requires_grad_()
    loss_p, stats_p = fr.flashreinforce_loss_packed(lp_packed, b.behavior_log_probs, b.rewards, b.cu_seqlens,
                                                    b.action_mask, delta=delta, **b.options)
    loss_p.backward()
    lp_padded = b.log_probs.view(batch, width).clone().requires_grad_()
    opts = dict(b.options)
    opts["entropies"] = b.entropies.view(batch, width)
    loss_d, stats_d = fr.flashreinforce_loss(lp_padded, b.behavior_log_probs.view(batch, width), b.rewards,
                                             b.action_mask.view(batch, width), delta=delta, **opts)
    loss_d.backward()
    assert torch.equal(loss_p, loss_d)
    assert lp_padded.grad.shape == (batch, width)
    assert torch.equal(lp_packed.grad.view(batch, width), lp_padded.grad)
    for key in stats_p:
        assert torch.equal(stats_p[key], stats_d[key]), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_microbatches_sum_to_full_batch(generator, dtype):
    b = random_batch(generator, dtype=dtype, batch=20, filter_q=0.5)
    delta = pick_delta(b, 0.5)
    baseline = float(b.rewards.double().mean())
    loss_full, grad_full, _ = run_fused(b, delta=delta, reward_baseline=baseline)
    grad_parts = torch.zeros_like(grad_full, dtype=torch.float64)
    loss_parts = 0.0
    cu = b.cu_seqlens
    for lo, hi in [(0, 3), (3, 4), (4, 13), (13, 20)]:
        a, z = int(cu[lo]), int(cu[hi])
        lp = b.log_probs[a:z].clone().requires_grad_()
        loss, _ = fr.flashreinforce_loss_packed(
            lp, b.behavior_log_probs[a:z], b.rewards[lo:hi], cu[lo:hi + 1] - cu[lo], b.action_mask[a:z],
            delta=delta, negative_token_fraction=0.5, entropies=b.entropies[a:z], failures=b.failures[lo:hi],
            reward_baseline=baseline, num_trajectories=b.batch)
        loss.backward()
        grad_parts[a:z] = lp.grad.double()
        loss_parts += float(loss.detach())
    # Each trajectory's gradient is computed by the same arithmetic in both runs: equal exactly.
    assert torch.equal(grad_parts, grad_full.double())
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert loss_parts == pytest.approx(float(loss_full), rel=tol, abs=tol * float(grad_full.abs().max()))


def test_results_do_not_depend_on_thread_count(generator):
    # ~500k tokens: enough for the core to use every thread it is given (>= 32k tokens each).
    lengths = [int(x) for x in torch.randint(1, 25_000, (40,), generator=generator)]
    b = random_batch(generator, dtype=torch.float32, lengths=lengths, filter_q=0.5)
    delta = pick_delta(b, 0.5)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(run_fused(b, delta=delta))
    finally:
        torch.set_num_threads(threads)
    for loss, grad, stats in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert torch.equal(grad, results[0][1])
        for key in stats:
            assert torch.equal(stats[key], results[0][2][key]), key


def test_gradient_scales_with_incoming_grad(generator):
    b = random_batch(generator, dtype=torch.float64)
    lp = b.log_probs.clone().requires_grad_()
    loss, _ = fr.flashreinforce_loss_packed(lp, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask,
                                            delta=math.inf)
    (3.5 * loss).backward()
    _, grad, _ = run_fused(b, delta=math.inf)
    assert torch.allclose(lp.grad, 3.5 * grad, rtol=1e-15, atol=0)
    assert loss.requires_grad and not any(v.requires_grad for v in _.values())


def test_only_log_probs_receive_gradients(generator):
    b = random_batch(generator, dtype=torch.float32, garbage=False)
    lp = b.log_probs.clone().requires_grad_()
    blp = b.behavior_log_probs.clone().requires_grad_()
    rewards = b.rewards.clone().requires_grad_()
    loss, _ = fr.flashreinforce_loss_packed(lp, blp, rewards, b.cu_seqlens, b.action_mask, delta=math.inf)
    loss.backward()
    assert lp.grad is not None and blp.grad is None and rewards.grad is None


def test_single_token_and_all_masked_but_one():
    lp = torch.tensor([-0.5, -1.0, -2.0, -0.25, -3.0], dtype=torch.float64)
    blp = lp - 0.02
    cu = torch.tensor([0, 1, 5])
    mask = torch.tensor([True, False, False, True, False])
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    x = lp.clone().requires_grad_()
    loss, stats = fr.flashreinforce_loss_packed(x, blp, rewards, cu, mask, delta=math.inf)
    loss.backward()
    exp = expected_loss(lp, blp, rewards, cu, mask, delta=math.inf)
    check_against_expected(loss.detach(), x.grad, stats, exp, torch.float64, math.inf)
    assert stats["policy_tokens"].tolist() == [1, 1]


# ---------------------------------------------------------------------------------------------
# The worked numbers of docs/semantics.md, for both entry points.


@pytest.mark.parametrize("padded", [False, True])
def test_worked_example_gradient(padded):
    current = torch.tensor([[-1.0, -1.2, -0.7], [-0.3, -2.0, -0.9]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False], [True, True, True]])
    behavior = current - 0.1
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    x = current.clone().requires_grad_()
    if padded:
        loss, stats = fr.flashreinforce_loss(x, behavior, rewards, mask, delta=math.inf)
    else:
        loss, stats = fr.flashreinforce_loss_packed(x.view(-1), behavior.view(-1), rewards,
                                                    torch.tensor([0, 3, 6]), mask.view(-1), delta=math.inf)
    loss.backward()
    assert stats["advantages"].tolist() == [0.5, -0.5]
    g = x.grad
    assert g[0, 1].item() == pytest.approx(-0.5 * math.exp(0.1) / 2, rel=1e-12)
    assert g[0, 1].item() == pytest.approx(-0.27629, abs=5e-6)
    for j in range(3):
        assert g[1, j].item() == pytest.approx(0.09210, abs=5e-6)
    assert g[0, 0].item() == 0.0 and g[0, 2].item() == 0.0


@pytest.mark.parametrize("padded", [False, True])
def test_worked_example_kl_threshold_inclusive(padded):
    d = 0.2 * math.log(0.5) + 0.8 * math.log(0.8 / 0.6)
    assert d == pytest.approx(0.091516, abs=5e-7)
    behavior = torch.tensor([[math.log(0.2)]], dtype=torch.float64)
    current = torch.tensor([[math.log(0.4)]], dtype=torch.float64)
    rewards = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.tensor([[True]])

    def run(delta):
        if padded:
            return fr.flashreinforce_loss(current, behavior, rewards, mask, delta=delta)[1]
        return fr.flashreinforce_loss_packed(current.view(-1), behavior.view(-1), rewards, torch.tensor([0, 1]),
                                             delta=delta)[1]

    stats = run(math.inf)
    kl = float(stats["sequence_kl"][0])
    assert kl == pytest.approx(d, rel=1e-12)
    # Inclusive threshold: delta exactly equal to the trajectory's KL admits it; just below does not.
    assert bool(run(kl)["admitted"][0])
    assert bool(run(d * (1 + 1e-12))["admitted"][0])
    assert not bool(run(math.nextafter(kl, 0.0))["admitted"][0])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("q,kept_row1", [(0.2, [False, False, True]), (0.9, [True, True, True]), (0.0, [False] * 3)])
def test_worked_example_entropy_filter(padded, q, kept_row1):
    current = torch.full((2, 4), -1.0, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    entropies = torch.tensor([[1.0, 2.0, 3.0, 99.0], [1.0, 2.0, 3.0, 99.0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    failures = torch.tensor([False, True])
    x = current.clone().requires_grad_()
    opts = dict(delta=math.inf, negative_token_fraction=q, failures=failures)
    if padded:
        loss, stats = fr.flashreinforce_loss(x, current, rewards, mask, entropies=entropies, **opts)
    else:
        loss, stats = fr.flashreinforce_loss_packed(x.view(-1), current.view(-1), rewards, torch.tensor([0, 4, 8]),
                                                    mask.view(-1), entropies=entropies.view(-1), **opts)
    loss.backward()
    g = x.grad
    for j in range(3):
        assert g[0, j].item() == pytest.approx(-1 / 12, rel=1e-12)
        assert g[1, j].item() == (pytest.approx(1 / 12, rel=1e-12) if kept_row1[j] else 0.0)
    assert g[0, 3].item() == 0.0 and g[1, 3].item() == 0.0
    assert stats["retained_tokens"].tolist() == [3, sum(kept_row1)]


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_each_cpu_instruction_set(tmp_path, seed, isa):
    """Every compiled instruction-set variant of the CPU path (chosen per process through
    FLASHREINFORCE_CPU_ISA; a variant above what this CPU supports falls back) against float64."""
    import os
    import subprocess
    import sys

    script = f"""
import math, sys, torch
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[2])!r})
import flashreinforce as fr
from flashreinforce import _C
from python_tests.ops.fused_cases import random_batch
gen = torch.Generator().manual_seed({seed})
out = {{"isa": _C.cpu_isa()}}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    b = random_batch(gen, dtype=dtype, filter_q=0.4, batch=17)
    lp = b.log_probs.clone().requires_grad_()
    loss, stats = fr.flashreinforce_loss_packed(lp, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask,
                                                delta=math.inf, **b.options)
    loss.backward()
    out[str(dtype)] = (b, loss.detach(), lp.grad, stats)
torch.save(out, {str(tmp_path / 'out.pt')!r})
"""
    env = dict(os.environ, FLASHREINFORCE_CPU_ISA=isa)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    print("instruction set in use:", out.pop("isa"))
    for key, (b, loss, grad, stats) in out.items():
        dtype = b.log_probs.dtype
        exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask,
                            delta=math.inf, **b.options)
        check_against_expected(loss, grad, stats, exp, dtype, math.inf, where=f"{isa} {key}")


def test_concurrent_calls_from_python_threads(generator):
    """Calls from several host threads share the core's thread pool; each gets its own results."""
    import threading

    lengths = [int(x) for x in torch.randint(1, 30_000, (24,), generator=generator)]
    batches = [random_batch(generator, dtype=torch.float32, lengths=lengths, filter_q=q) for q in (None, 0.5, None)]
    expected = [run_fused(b, delta=math.inf) for b in batches]
    failures = []

    def worker(k):
        try:
            for r in range(6):
                j = (k + r) % len(batches)
                loss, grad, stats = run_fused(batches[j], delta=math.inf)
                if not (torch.equal(loss, expected[j][0]) and torch.equal(grad, expected[j][1])):
                    failures.append((k, r))
        except Exception as exc:  # surfaced below
            failures.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
