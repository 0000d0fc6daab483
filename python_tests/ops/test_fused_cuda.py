"""The CUDA path against the float64 computation, the CPU path, and in a CUDA graph.

Skipped (visibly) without a CUDA device, or when the extension was built without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashreinforce as fr
from flashreinforce import _C
from flashreinforce.ops.contract import ErrorCode
from python_tests.ops.fused_cases import check_against_expected, expected_loss, random_batch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none found)"),
    pytest.mark.skipif(not _C.has_cuda(), reason="flashreinforce._C was built without CUDA"),
]


def to_cuda(b):
    for name in ("log_probs", "behavior_log_probs", "rewards", "cu_seqlens", "action_mask", "entropies", "failures"):
        setattr(b, name, getattr(b, name).cuda())
    for key in ("entropies", "failures"):
        if key in b.options:
            b.options[key] = getattr(b, key)
    return b


def run(b, **opts):
    lp = b.log_probs.clone().requires_grad_()
    loss, stats = fr.flashreinforce_loss_packed(lp, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask,
                                                **{**b.options, **opts})
    loss.backward()
    return loss.detach(), lp.grad, stats


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("filter_q", [None, 0.3])
def test_cuda_against_float64(generator, dtype, filter_q):
    b = random_batch(generator, dtype=dtype, batch=40, filter_q=filter_q, max_long=20_000)
    cpu_loss, cpu_grad, cpu_stats = run(b, delta=math.inf)
    delta = float(cpu_stats["sequence_kl"].double().quantile(0.5)) * 1.0001
    exp = expected_loss(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, delta=delta,
                        **b.options)
    to_cuda(b)
    loss, grad, stats = run(b, delta=delta)
    assert grad.device.type == "cuda" and grad.dtype == dtype
    check_against_expected(loss.cpu(), grad.cpu(), {k: v.cpu() for k, v in stats.items()}, exp, dtype, delta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu(generator, dtype):
    b = random_batch(generator, dtype=dtype, batch=64, filter_q=0.5, entropy_ties=True, max_long=50_000)
    cpu = run(b, delta=0.02)
    to_cuda(b)
    gpu = run(b, delta=0.02)
    assert torch.equal(cpu[2]["admitted"], gpu[2]["admitted"].cpu())
    assert torch.equal(cpu[2]["retained_tokens"], gpu[2]["retained_tokens"].cpu())
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    scale = float(cpu[1].abs().max())
    assert float((cpu[1] - gpu[1].cpu()).abs().max()) <= tol * scale
    assert torch.allclose(cpu[2]["sequence_kl"], gpu[2]["sequence_kl"].cpu(), rtol=1e-5 if dtype == torch.float32 else 1e-12)


def test_cuda_deterministic_and_padded(generator):
    b = to_cuda(random_batch(generator, dtype=torch.float32, lengths=[300] * 50, filter_q=0.5))
    r1 = run(b, delta=0.02)
    r2 = run(b, delta=0.02)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    lp = b.log_probs.view(50, 300).clone().requires_grad_()
    opts = dict(b.options)
    opts["entropies"] = b.entropies.view(50, 300)
    loss, stats = fr.flashreinforce_loss(lp, b.behavior_log_probs.view(50, 300), b.rewards,
                                         b.action_mask.view(50, 300), delta=0.02, **opts)
    loss.backward()
    assert torch.equal(loss.detach(), r1[0]) and torch.equal(lp.grad.view(-1), r1[1])


def test_cuda_one_huge_trajectory_among_many_short(generator):
    lengths = [10] * 3000
    lengths[1234] = 1_000_000
    b = random_batch(generator, dtype=torch.float32, lengths=lengths, filter_q=0.5, garbage=False)
    cpu = run(b, delta=math.inf)
    to_cuda(b)
    gpu = run(b, delta=math.inf)
    scale = float(cpu[1].abs().max())
    assert float((cpu[1] - gpu[1].cpu()).abs().max()) <= 1e-5 * scale
    assert torch.equal(cpu[2]["retained_tokens"], gpu[2]["retained_tokens"].cpu())
    assert torch.equal(cpu[2]["policy_tokens"], gpu[2]["policy_tokens"].cpu())


@pytest.mark.parametrize("case", ["nan log_prob", "cu_seqlens", "overflow", "no policy", "entropy",
                                  "gradient overflow", "advantage", "num_policy_tokens"])
def test_cuda_errors(case):
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.7, -0.1, -2.0], device="cuda")
    blp = lp - 0.01
    cu = torch.tensor([0, 3, 6], device="cuda")
    mask = torch.tensor([False, True, True, False, True, True], device="cuda")
    opts = dict(delta=math.inf)
    exc, frag = ValueError, "log_probs"
    if case == "nan log_prob":
        lp[4] = math.nan
    elif case == "cu_seqlens":
        cu = torch.tensor([0, 4, 5], device="cuda")
        exc, frag = ValueError, "cu_seqlens"
    elif case == "overflow":
        blp[1] = -200.0
        exc, frag = FloatingPointError, "ratio"
    elif case == "no policy":
        mask[4:] = False
        exc, frag = ValueError, "action_mask"
    elif case == "gradient overflow":  # ratio e^60 is finite in float32, ratio * A * s is not
        blp[1] = -60.0
        opts.update(reward_baseline=-1e20)
        exc, frag = FloatingPointError, "gradient overflows float32"
    elif case == "advantage":  # 3e38 - (-1e38) overflows float32
        opts.update(reward_baseline=-1e38)
        lp[1] = -1e-3
        exc, frag = ValueError, "advantage of trajectory 0"
    elif case == "num_policy_tokens":
        opts.update(loss_agg="token-mean", num_policy_tokens=3)
        exc, frag = ValueError, r"policy-token count \(4\), got 3"
    else:
        ent = torch.ones(6, device="cuda")
        ent[2] = math.inf
        opts.update(negative_token_fraction=0.5, entropies=ent, failures=torch.tensor([True, False], device="cuda"))
        exc, frag = ValueError, "entropies"
    rewards = torch.tensor([3e38 if case == "advantage" else 1.0, 0.0], device="cuda")
    with pytest.raises(exc, match=frag) as cuda_error:
        fr.flashreinforce_loss_packed(lp, blp, rewards, cu, mask, **opts)
    # The same exception and message as the CPU path (and hence the reference).
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (lp, blp, rewards, cu, mask)]
    cpu_opts = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    with pytest.raises(exc) as cpu_error:
        fr.flashreinforce_loss_packed(*cpu, **cpu_opts)
    assert str(cuda_error.value) == str(cpu_error.value)


def test_cuda_graph_capture(generator):
    from flashreinforce.ops import fused_loss_capturable, raise_for_error
    b = to_cuda(random_batch(generator, dtype=torch.float32, batch=100, max_long=5000, filter_q=0.5))
    opts = dict(delta=0.02, negative_token_fraction=0.5, entropies=b.entropies, failures=b.failures)
    static_lp = b.log_probs.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up outside the graph (allocations, lazy init)
            fused_loss_capturable(static_lp, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask, **opts)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, stats, error = fused_loss_capturable(static_lp, b.behavior_log_probs, b.rewards, b.cu_seqlens,
                                                   b.action_mask, **opts)
    for scale in (1.0, 0.5):
        static_lp.copy_(b.log_probs * scale)
        graph.replay()
        torch.cuda.synchronize()
        raise_for_error(error, static_lp.numel(), b.batch)
        ref_loss, ref_stats = fr.flashreinforce_loss_packed(b.log_probs * scale, b.behavior_log_probs, b.rewards,
                                                            b.cu_seqlens, b.action_mask, **opts)
        assert torch.equal(loss, ref_loss)
        assert torch.equal(stats["admitted"], ref_stats["admitted"])


def _midpoint_delta(kl: torch.Tensor) -> float:
    """A gate threshold halfway between two distinct sequence KLs (no decision sits on it)."""
    values = sorted(set(kl.double().tolist()))
    if len(values) < 2:
        return math.inf
    j = len(values) // 2
    return 0.5 * (values[j - 1] + values[j])


# Layouts and dtypes the CUDA path handles with separate code: tile (2048-token) boundaries, a single
# trajectory, a partial last tile, no mask (lengths kernel), int32 offsets, mixed input dtypes,
# float64 / float16 entropy keys (12 / 8 radix passes), q = 0 and no_is.
_LAYOUTS = {
    "tile boundaries": dict(lengths=[2048, 2047, 1, 2049, 4096, 3, 2048]),
    "one trajectory": dict(lengths=[5000]),
    "no mask": dict(lengths=[3, 2050, 700, 4097], no_mask=True),
    "int32 offsets": dict(batch=40, cu_dtype=torch.int32, max_long=9000),
    "bf16 lp, f32 behavior, f16 entropies": dict(batch=30, dtype=torch.bfloat16, behavior_dtype=torch.float32,
                                                 entropy_dtype=torch.float16, max_long=6000),
    "f64 lp, f16 behavior, f64 entropies": dict(batch=30, dtype=torch.float64, behavior_dtype=torch.float16,
                                                entropy_dtype=torch.float64, entropy_ties=True, max_long=6000),
    "q = 0": dict(batch=30, filter_q=0.0),
    "no_is": dict(batch=30, no_is=True),
    "kpop, truncated": dict(batch=30, gate_metric="kpop", is_truncation=1.5),
    "k3": dict(batch=30, gate_metric="k3", spread=0.3),
    "log_ratio, truncated": dict(batch=30, dtype=torch.bfloat16, gate_metric="log_ratio", is_truncation=2.0),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_cuda_layouts_match_cpu(generator, layout):
    spec = dict(_LAYOUTS[layout])
    no_mask = spec.pop("no_mask", False)
    opts = {name: spec.pop(name) for name in ("no_is", "gate_metric", "is_truncation") if name in spec}
    spec.setdefault("filter_q", 0.4)
    b = random_batch(generator, garbage=not no_mask, **spec)
    if no_mask:
        b.action_mask = torch.ones_like(b.action_mask)
    cpu = run(b, delta=math.inf, **opts)
    delta = _midpoint_delta(cpu[2]["sequence_kl"])
    cpu = run(b, delta=delta, **opts)
    to_cuda(b)
    if no_mask:
        b.action_mask = None
    gpu = run(b, delta=delta, **opts)
    for key in ("admitted", "policy_tokens", "retained_tokens"):
        assert torch.equal(cpu[2][key], gpu[2][key].cpu()), key
    dtype = b.log_probs.dtype
    assert gpu[1].dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 1e-2)
    scale = max(float(cpu[1].double().abs().max()), 1e-30)
    assert float((cpu[1].double() - gpu[1].cpu().double()).abs().max()) <= tol * scale
    kl_tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(cpu[2]["sequence_kl"], gpu[2]["sequence_kl"].cpu(), rtol=kl_tol, atol=1e-30)
    assert abs(float(cpu[0]) - float(gpu[0])) <= max(tol, 1e-5) * max(abs(float(cpu[0])), 1e-30)


def _policy_tokens(b, trajectory):
    a, e = int(b.cu_seqlens[trajectory]), int(b.cu_seqlens[trajectory + 1])
    return [t for t in range(a, e) if bool(b.action_mask[t])]


@pytest.mark.parametrize("case", ["log_probs twice", "behavior before log_probs", "entropy before overflow",
                                  "two overflows", "offsets", "no policy and reward", "advantage before log_probs",
                                  "ratio before gradient overflow", "policy-token count first"])
def test_cuda_error_record_matches_cpu(generator, case):
    """Several errors at once: the CUDA record holds the CPU's (smallest code, then smallest index)."""
    from flashreinforce.ops import fused_loss_capturable
    b = random_batch(generator, lengths=[3000, 9, 5000, 7, 2500])
    b.failures = torch.tensor([True, False, False, True, False])
    opts = dict(delta=math.inf)
    late, early = _policy_tokens(b, 2)[-1], _policy_tokens(b, 0)[-1]  # different tiles
    if case == "log_probs twice":
        b.log_probs[late], b.log_probs[early] = math.nan, 0.5
    elif case == "behavior before log_probs":
        b.log_probs[late], b.behavior_log_probs[early] = math.inf, math.nan
    elif case == "entropy before overflow":
        b.entropies[late] = math.nan
        t = _policy_tokens(b, 1)[0]
        b.log_probs[t], b.behavior_log_probs[t] = -1e-3, -200.0
        opts.update(negative_token_fraction=0.5, entropies=b.entropies, failures=b.failures)
    elif case == "two overflows":
        for t in (late, _policy_tokens(b, 4)[0]):
            b.log_probs[t], b.behavior_log_probs[t] = -1e-3, -200.0
    elif case == "offsets":
        b.cu_seqlens = torch.tensor([0, 3000, 2000, 8009, 8000, 99], dtype=b.cu_seqlens.dtype)
    elif case == "advantage before log_probs":
        b.rewards[3] = 3e38
        b.log_probs[early] = math.nan
        opts.update(reward_baseline=-1e38)
    elif case == "ratio before gradient overflow":  # a gradient overflow early, a ratio overflow late
        b.rewards[0] = 1e36
        t0 = _policy_tokens(b, 0)[0]
        b.log_probs[t0], b.behavior_log_probs[t0] = -1e-3, -20.0
        t4 = _policy_tokens(b, 4)[0]
        b.log_probs[t4], b.behavior_log_probs[t4] = -1e-3, -200.0
        opts.update(reward_baseline=0.0)
    elif case == "policy-token count first":
        b.log_probs[early] = math.nan
        opts.update(loss_agg="token-mean", num_policy_tokens=1)
    else:
        b.action_mask[int(b.cu_seqlens[3]):int(b.cu_seqlens[4])] = False
        b.rewards[1] = math.inf
    *_, cpu_error = fused_loss_capturable(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens,
                                          b.action_mask, **opts)
    assert cpu_error.tolist()[0] != 0
    expected = {"advantage before log_probs": ErrorCode.NON_FINITE_ADVANTAGE,
                "ratio before gradient overflow": ErrorCode.RATIO_OVERFLOW,
                "policy-token count first": ErrorCode.TOO_FEW_POLICY_TOKENS}.get(case)
    assert expected is None or cpu_error.tolist()[0] == expected, cpu_error.tolist()
    to_cuda(b)
    if "entropies" in opts:
        opts.update(entropies=b.entropies, failures=b.failures)
    *_, gpu_error = fused_loss_capturable(b.log_probs, b.behavior_log_probs, b.rewards, b.cu_seqlens,
                                          b.action_mask, **opts)
    assert gpu_error.device.type == "cuda"
    assert gpu_error.tolist() == cpu_error.tolist(), case


def test_cuda_deferred_error_check_matches_the_immediate_call(generator):
    """The learner's path on CUDA: outputs equal to the immediate call's, errors raised by one later check."""
    from flashreinforce.ops import PendingErrors, fused_loss_deferred

    b = to_cuda(random_batch(generator, dtype=torch.float32, batch=6))
    loss, grad, stats = run(b)
    pending = PendingErrors()
    lp = b.log_probs.clone().requires_grad_()
    deferred, deferred_stats = fused_loss_deferred(pending, lp, b.behavior_log_probs, b.rewards, b.cu_seqlens,
                                                   b.action_mask, **b.options)
    deferred.backward()
    pending.check()
    assert torch.equal(deferred.detach(), loss) and torch.equal(lp.grad, grad)
    for name in stats:
        assert torch.equal(stats[name], deferred_stats[name]), name
    bad = b.behavior_log_probs.clone()
    bad[int(torch.nonzero(b.action_mask)[0])] = 0.5
    with pytest.raises(ValueError) as immediate:
        fr.flashreinforce_loss_packed(b.log_probs, bad, b.rewards, b.cu_seqlens, b.action_mask, **b.options)
    fused_loss_deferred(pending, b.log_probs, bad, b.rewards, b.cu_seqlens, b.action_mask, **b.options)
    with pytest.raises(ValueError) as later:
        pending.check()
    assert str(later.value) == str(immediate.value)
