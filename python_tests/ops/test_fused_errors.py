"""Every error of docs/semantics.md, for both fused entry points, and the same exception with the
same message from the reference (one rule set, flashreinforce/ops/contract.py). Messages must name
the offending argument."""

from __future__ import annotations

import math

import pytest
import torch

import flashreinforce as fr
from flashreinforce import loss as reference
from flashreinforce.ops.contract import ErrorCode


def base_packed():
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.7, -0.1, -2.0])
    return dict(
        log_probs=lp,
        behavior_log_probs=lp - 0.01,
        rewards=torch.tensor([1.0, 0.0]),
        cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32),
        action_mask=torch.tensor([False, True, True, False, True, True]),
        options=dict(delta=0.1),
    )


def call_packed(fn, case):
    c = dict(case)
    opts = c.pop("options")
    return fn(c["log_probs"], c["behavior_log_probs"], c["rewards"], c["cu_seqlens"], c["action_mask"], **opts)


def call_padded(fn, case):
    """The same case in [B, T] form (cu_seqlens must be the uniform one)."""
    c = dict(case)
    opts = dict(c.pop("options"))
    rewards = c["rewards"]
    b = rewards.shape[0] if isinstance(rewards, torch.Tensor) and rewards.dim() == 1 else len(rewards)

    def rows(t):
        return t.reshape(b, -1) if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() % b == 0 and t.numel() else t

    if "entropies" in opts and opts["entropies"] is not None:
        opts["entropies"] = rows(opts["entropies"])
    return fn(rows(c["log_probs"]), rows(c["behavior_log_probs"]), c["rewards"], rows(c["action_mask"]), **opts)


def modify(**changes):
    def make():
        case = base_packed()
        opts = dict(case["options"])
        for key, value in changes.items():
            if key in ("log_probs", "behavior_log_probs", "rewards", "cu_seqlens", "action_mask"):
                case[key] = value(case[key]) if callable(value) else value
            else:
                opts[key] = value(case) if callable(value) else value
        case["options"] = opts
        return case
    return make


def set_at(index, value):
    def f(t):
        t = t.clone()
        t[index] = value
        return t
    return f


ENT = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
FAIL = torch.tensor([True, False])

# (name, case factory, exception, message fragment, also for the padded form)
CASES = [
    ("empty log_probs", modify(log_probs=torch.zeros(0), behavior_log_probs=torch.zeros(0),
                               action_mask=torch.zeros(0, dtype=torch.bool), cu_seqlens=torch.tensor([0, 0, 0])),
     ValueError, "log_probs", False),
    ("empty rewards", modify(rewards=torch.zeros(0), cu_seqlens=torch.tensor([0])), ValueError, "rewards", False),
    ("behavior shape", modify(behavior_log_probs=lambda t: t[:5]), ValueError, "behavior_log_probs", True),
    ("mask shape", modify(action_mask=lambda t: t[:5]), ValueError, "action_mask", True),
    ("cu length", modify(cu_seqlens=torch.tensor([0, 6])), ValueError, "cu_seqlens", False),
    ("cu start", modify(cu_seqlens=torch.tensor([1, 3, 6])), ValueError, "cu_seqlens", False),
    ("cu decreasing", modify(cu_seqlens=torch.tensor([0, 4, 3, 6]), rewards=torch.tensor([1.0, 0.0, 0.5])),
     ValueError, "cu_seqlens", False),
    ("cu end", modify(cu_seqlens=torch.tensor([0, 3, 5])), ValueError, "cu_seqlens", False),
    ("cu dtype", modify(cu_seqlens=torch.tensor([0.0, 3.0, 6.0])), ValueError, "cu_seqlens", False),
    ("mask dtype", modify(action_mask=lambda t: t.float()), ValueError, "action_mask", True),
    ("failures dtype", modify(negative_token_fraction=0.5, entropies=ENT, failures=torch.tensor([1.0, 0.0])),
     ValueError, "failures", True),
    ("failures shape", modify(negative_token_fraction=0.5, entropies=ENT, failures=torch.tensor([True])),
     ValueError, "failures", True),
    ("int log_probs", modify(log_probs=lambda t: (t * 0).long()), ValueError, "log_probs", True),
    ("int behavior", modify(behavior_log_probs=lambda t: (t * 0).long()), ValueError, "behavior_log_probs", True),
    ("int entropies", modify(negative_token_fraction=0.5, entropies=ENT.long(), failures=FAIL), ValueError,
     "entropies", True),
    ("entropies shape", modify(negative_token_fraction=0.5, entropies=ENT[:4], failures=FAIL), ValueError,
     "entropies", False),
    ("bool rewards", modify(rewards=torch.tensor([True, False])), ValueError, "rewards", True),
    ("delta nan", modify(delta=math.nan), ValueError, "delta", True),
    ("delta negative", modify(delta=-1e-3), ValueError, "delta", True),
    ("q above 1", modify(negative_token_fraction=1.5, entropies=ENT, failures=FAIL), ValueError,
     "negative_token_fraction", True),
    ("q negative", modify(negative_token_fraction=-0.1, entropies=ENT, failures=FAIL), ValueError,
     "negative_token_fraction", True),
    ("q nan", modify(negative_token_fraction=math.nan, entropies=ENT, failures=FAIL), ValueError,
     "negative_token_fraction", True),
    ("q<1 without entropies", modify(negative_token_fraction=0.5, failures=FAIL), ValueError, "entropies", True),
    ("q<1 without failures", modify(negative_token_fraction=0.5, entropies=ENT), ValueError, "failures", True),
    ("no policy token", modify(action_mask=set_at(slice(3, 6), False)), ValueError, "action_mask", True),
    ("nan reward", modify(rewards=torch.tensor([1.0, math.nan])), ValueError, "rewards", True),
    ("inf reward", modify(rewards=torch.tensor([math.inf, 0.0])), ValueError, "rewards", True),
    ("nan log_prob", modify(log_probs=set_at(4, math.nan)), ValueError, "log_probs", True),
    ("inf log_prob", modify(log_probs=set_at(1, -math.inf)), ValueError, "log_probs", True),
    ("positive log_prob", modify(log_probs=set_at(2, 0.25)), ValueError, "log_probs", True),
    ("nan behavior", modify(behavior_log_probs=set_at(5, math.nan)), ValueError, "behavior_log_probs", True),
    ("positive behavior", modify(behavior_log_probs=set_at(1, 1e-3)), ValueError, "behavior_log_probs", True),
    ("inf entropy", modify(negative_token_fraction=0.5, entropies=set_at(4, math.inf)(ENT), failures=FAIL),
     ValueError, "entropies", True),
    ("unknown loss_agg", modify(loss_agg="sum"), ValueError, "loss_agg", True),
    ("sum-norm without factor", modify(loss_agg="seq-mean-token-sum-norm"), ValueError, "loss_scale_factor", True),
    ("sum-norm zero factor", modify(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=0.0), ValueError,
     "loss_scale_factor", True),
    ("sum-norm inf factor", modify(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=math.inf), ValueError,
     "loss_scale_factor", True),
    ("factor with another mode", modify(loss_scale_factor=10.0), ValueError, "loss_scale_factor", True),
    ("num_trajectories zero", modify(num_trajectories=0), ValueError, "num_trajectories", True),
    ("num_trajectories below B", modify(num_trajectories=1), ValueError, "num_trajectories", True),
    ("num_trajectories float", modify(num_trajectories=4.0), ValueError, "num_trajectories", True),
    ("num_trajectories bool", modify(num_trajectories=True), ValueError, "num_trajectories", True),
    ("num_policy_tokens below the count", modify(loss_agg="token-mean", num_policy_tokens=3), ValueError,
     "num_policy_tokens", True),
    ("num_policy_tokens negative", modify(num_policy_tokens=-3), ValueError, "num_policy_tokens", True),
    ("baseline nan", modify(reward_baseline=math.nan), ValueError, "reward_baseline", True),
    ("baseline string", modify(reward_baseline="0.5"), ValueError, "reward_baseline", True),
    ("baseline beyond float32", modify(reward_baseline=1e39), ValueError, "reward_baseline", True),
    ("delta bool", modify(delta=True), ValueError, "delta", True),
    ("no_is string", modify(no_is="false"), TypeError, "no_is", True),
    ("no_is int", modify(no_is=1), TypeError, "no_is", True),
    ("unknown gate_metric", modify(gate_metric="kl"), ValueError, "gate_metric", True),
    ("gate_metric not a string", modify(gate_metric=None), ValueError, "gate_metric", True),
    ("is_truncation below 1", modify(is_truncation=0.5), ValueError, "is_truncation", True),
    ("is_truncation nan", modify(is_truncation=math.nan), ValueError, "is_truncation", True),
    ("is_truncation bool", modify(is_truncation=True), ValueError, "is_truncation", True),
    ("reward beyond float32", modify(rewards=torch.tensor([1e300, 0.0], dtype=torch.float64)), ValueError,
     "rewards", True),
    ("advantage beyond float32", modify(rewards=torch.tensor([3e38, 0.0]), reward_baseline=-3e38), ValueError,
     "advantage of trajectory 0", True),
    ("cu_seqlens None", modify(cu_seqlens=None), ValueError, "cu_seqlens", False),
    ("not a tensor", modify(rewards=[1.0, 0.0]), ValueError, "rewards", True),
    ("ratio overflow", modify(log_probs=set_at(1, -1e-3), behavior_log_probs=set_at(1, -200.0), delta=math.inf),
     FloatingPointError, "ratio", True),
    ("gradient overflow", modify(log_probs=set_at(1, -1e-3), behavior_log_probs=set_at(1, -60.0), delta=math.inf,
                                 rewards=torch.tensor([1e20, 0.0])), FloatingPointError, "gradient", True),
]


@pytest.mark.parametrize("name,factory,exc,fragment,padded_too", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_error(name, factory, exc, fragment, padded_too, form):
    if form == "padded" and not padded_too:
        pytest.skip("packed-only case (offsets)")
    call = call_packed if form == "packed" else call_padded
    with pytest.raises(exc, match=fragment) as fused_error:
        call(fr.flashreinforce_loss_packed if form == "packed" else fr.flashreinforce_loss, factory())
    # The reference raises the same exception, with the same message, for the same input.
    with pytest.raises(exc) as reference_error:
        call(reference.flashreinforce_loss_packed if form == "packed" else reference.flashreinforce_loss, factory())
    assert type(fused_error.value) is type(reference_error.value)
    assert str(fused_error.value) == str(reference_error.value)


def test_overflow_on_inactive_token_is_not_an_error():
    """A huge ratio on a rejected trajectory or a filtered-out token never exponentiates."""
    case = base_packed()
    lp = case["log_probs"].clone()
    blp = case["behavior_log_probs"].clone()
    blp[1] = -300.0  # trajectory 0 becomes far off-policy: its KL rejects it
    loss, stats = fr.flashreinforce_loss_packed(lp, blp, case["rewards"], case["cu_seqlens"], case["action_mask"],
                                                delta=0.1)
    assert stats["admitted"].tolist() == [False, True]
    assert math.isfinite(float(loss))


def test_float32_ratio_overflow_threshold():
    """In float32 the ratio overflows when log_prob - behavior exceeds ln(FLT_MAX) ~ 88.72."""
    lp = torch.tensor([-1e-3])
    cu = torch.tensor([0, 1])
    rewards = torch.tensor([1.0])
    fr.flashreinforce_loss_packed(lp, torch.tensor([-88.0]), rewards, cu, delta=math.inf)
    with pytest.raises(FloatingPointError):
        fr.flashreinforce_loss_packed(lp, torch.tensor([-89.0]), rewards, cu, delta=math.inf)


def test_padded_requires_a_mask_and_2d_inputs():
    lp = torch.full((2, 3), -0.5)
    with pytest.raises(ValueError, match="action_mask"):
        fr.flashreinforce_loss(lp, lp, torch.zeros(2), None)
    with pytest.raises(ValueError, match="log_probs"):
        fr.flashreinforce_loss(lp.view(-1), lp.view(-1), torch.zeros(2), torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="rewards"):
        fr.flashreinforce_loss(lp, lp, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))


def test_mixed_devices_are_rejected():
    """A tensor on another device is a ValueError from the shared rules (here on 'meta', where the
    rules run without data), with the same message from the reference."""
    lp = torch.full((4,), -0.5, device="meta")
    args = (lp, torch.full((4,), -0.5), torch.zeros(1, device="meta"), torch.tensor([0, 4], device="meta"))
    with pytest.raises(ValueError, match="behavior_log_probs is on cpu but log_probs is on meta") as fused_error:
        fr.flashreinforce_loss_packed(*args)
    with pytest.raises(ValueError) as reference_error:
        reference.flashreinforce_loss_packed(*args)
    assert str(fused_error.value) == str(reference_error.value)


def test_fused_loss_runs_on_cpu_and_cuda_only():
    lp = torch.full((4,), -0.5, device="meta")
    with pytest.raises(ValueError, match="log_probs is on meta; the fused loss runs on cpu and cuda tensors"):
        fr.flashreinforce_loss_packed(lp, lp, torch.zeros(1, device="meta"), torch.tensor([0, 4], device="meta"))


def test_non_contiguous_inputs_are_accepted(generator):
    """The ops layer makes inputs contiguous (a copy only when needed)."""
    lp = -torch.rand(20, 2, generator=generator, dtype=torch.float64)
    cu = torch.tensor([0, 7, 20])
    x = lp[:, 0].clone().requires_grad_()
    loss_a, _ = fr.flashreinforce_loss_packed(lp[:, 0], lp[:, 1], torch.tensor([1.0, 0.0]), cu, delta=math.inf)
    loss_b, _ = fr.flashreinforce_loss_packed(x, lp[:, 1].contiguous(), torch.tensor([1.0, 0.0]), cu,
                                              delta=math.inf)
    assert torch.equal(loss_a, loss_b.detach())


def test_capturable_variant_records_errors_instead_of_raising():
    from flashreinforce.ops import fused_loss_capturable, raise_for_error
    case = base_packed()
    lp = case["log_probs"].clone()
    lp[4] = math.nan
    loss, stats, error = fused_loss_capturable(lp, case["behavior_log_probs"], case["rewards"], case["cu_seqlens"],
                                               case["action_mask"], delta=0.1)
    assert error.tolist() == [ErrorCode.BAD_LOG_PROB, 4]
    with pytest.raises(ValueError, match="log_probs: policy token 4"):
        raise_for_error(error, lp.numel(), 2)
    _, _, ok = fused_loss_capturable(case["log_probs"], case["behavior_log_probs"], case["rewards"],
                                     case["cu_seqlens"], case["action_mask"], delta=0.1)
    assert ok.tolist() == [0, -1]
    raise_for_error(ok, lp.numel(), 2)


def _long_packed(dtype, with_mask):
    """~50k tokens in 3 trajectories (so trajectories span the core's 512-token blocks and
    16384-token chunks), valid values on every token."""
    gen = torch.Generator().manual_seed(7)
    lengths = [20_000, 7, 30_000]
    n = sum(lengths)
    lp = (-(torch.rand(n, generator=gen) ** 2) * 3.0).to(dtype)
    blp = (lp.double() - 0.01).clamp(max=0.0).to(dtype)
    cu = torch.tensor([0, 20_000, 20_007, 50_007], dtype=torch.int64)
    mask = torch.ones(n, dtype=torch.bool) if with_mask else None
    return lp, blp, torch.tensor([1.0, 0.0, 0.5]), cu, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize("kind,code", [("log_probs", ErrorCode.BAD_LOG_PROB),
                                       ("behavior", ErrorCode.BAD_BEHAVIOR_LOG_PROB),
                                       ("overflow", ErrorCode.RATIO_OVERFLOW)])
def test_first_offending_token_is_reported_across_blocks_and_chunks(dtype, with_mask, kind, code):
    """The recorded index is the first bad token even when several blocks and chunks hold one."""
    first, later = 33_333, 45_000  # a later block of the second chunk of trajectory 2; and after it
    lp, blp, rewards, cu, mask = _long_packed(dtype, with_mask)
    for t in (later, first):
        if kind == "log_probs":
            lp[t] = math.nan
        elif kind == "behavior":
            blp[t] = 0.5
        else:  # the ratio exp(lp - blp) overflows every dtype's range
            lp[t], blp[t] = -1e-3, -1000.0 if dtype == torch.float64 else -200.0
    from flashreinforce.ops import fused_loss_capturable

    _, _, error = fused_loss_capturable(lp, blp, rewards, cu, mask, delta=math.inf)
    assert error.tolist() == [code, first], (kind, error.tolist())
    expected = {ErrorCode.BAD_LOG_PROB: "log_probs: policy token 33333",
                ErrorCode.BAD_BEHAVIOR_LOG_PROB: "behavior_log_probs: policy token 33333",
                ErrorCode.RATIO_OVERFLOW: "active token 33333"}[code]
    with pytest.raises((ValueError, FloatingPointError), match=expected):
        fr.flashreinforce_loss_packed(lp, blp, rewards, cu, mask, delta=math.inf)
