"""Edge cases of the objective's arguments: the fused op and the reference behave identically
(same result, or the same exception with the same message), per docs/semantics.md."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from flashreinforce.ops import contract, fused, reference

IMPLEMENTATIONS = {"fused": fused, "reference": reference}


def _base(dtype=torch.float32):
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.7, -0.1, -2.0], dtype=dtype)
    return dict(log_probs=lp, behavior_log_probs=lp - 0.01, rewards=torch.tensor([1.0, 0.0]),
                cu_seqlens=torch.tensor([0, 3, 6]), action_mask=torch.tensor([False, True, True, False, True, True]))


def _call(module, form, case, **options):
    """Calls ``module``'s packed or padded entry point on the packed ``case`` (rows of 3 tokens)."""
    c = dict(case)
    log_probs = c["log_probs"].clone().requires_grad_()
    if form == "packed":
        loss, stats = module.flashreinforce_loss_packed(log_probs, c["behavior_log_probs"], c["rewards"],
                                                        c["cu_seqlens"], c["action_mask"], **options)
    else:
        b = c["rewards"].shape[0]
        if isinstance(options.get("entropies"), torch.Tensor):
            options = {**options, "entropies": options["entropies"].view(b, -1)}
        loss, stats = module.flashreinforce_loss(log_probs.view(b, -1), c["behavior_log_probs"].view(b, -1),
                                                 c["rewards"], c["action_mask"].view(b, -1), **options)
    loss.backward()
    return loss.detach(), log_probs.grad, stats


def _outcome(module, form, case, **options):
    try:
        return _call(module, form, case, **options)
    except (ValueError, TypeError, FloatingPointError) as e:
        return e


def _assert_same_outcome(form, case, **options):
    """Both implementations raise the same exception type with the same message, or agree."""
    got = {name: _outcome(module, form, case, **options) for name, module in IMPLEMENTATIONS.items()}
    fused_out, reference_out = got["fused"], got["reference"]
    if isinstance(fused_out, Exception) or isinstance(reference_out, Exception):
        assert type(fused_out) is type(reference_out), (options, fused_out, reference_out)
        assert str(fused_out) == str(reference_out), options
        return fused_out
    loss, grad, stats = fused_out
    loss_r, grad_r, stats_r = reference_out
    tol = 1e-12 if loss.dtype == torch.float64 else 2e-6
    assert torch.allclose(loss, loss_r, rtol=tol, atol=1e-30), (options, loss, loss_r)
    scale = float(grad_r.double().abs().max())
    rounding = 2.0 ** -10 if grad.dtype in (torch.float16, torch.bfloat16) else tol
    assert float((grad.double() - grad_r.double()).abs().max()) <= rounding * scale + 1e-30, options
    for key in contract.STAT_NAMES:
        assert torch.allclose(stats[key].double(), stats_r[key].double(), rtol=tol, atol=1e-30), (options, key)
    return fused_out


FORMS = ["packed", "padded"]


# ------------------------------------------------------------------------------------------------
# Rewards, the baseline and the advantages must be finite in the compute dtype


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_float64_rewards_beyond_float32_are_a_value_error(name, form):
    """float64 rewards of +-1e300 with float32 log-probs used to give a NaN loss and no error."""
    case = _base()
    case["rewards"] = torch.tensor([1e300, -1e300], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rewards must be finite in the compute dtype \(float32\): rewards\[0\]"):
        _call(IMPLEMENTATIONS[name], form, case)
    # In float64 the same rewards are valid (their advantages too).
    loss, grad, _ = _call(IMPLEMENTATIONS[name], form, _base_with(case, dtype=torch.float64))
    assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())


def _base_with(case, dtype):
    c = dict(case)
    c["log_probs"] = c["log_probs"].to(dtype)
    c["behavior_log_probs"] = c["behavior_log_probs"].to(dtype)
    return c


@pytest.mark.parametrize("form", FORMS)
def test_float32_rewards_near_the_float32_limit_agree(form):
    """Rewards near 3e38 in float32: finite advantages, so both give the same finite loss (the
    reference used to form a float32 mean that overflowed to inf, hence NaN)."""
    case = _base()
    case["rewards"] = torch.tensor([3.0e38, 3.3e38])
    loss, _, stats = _assert_same_outcome(form, case, delta=0.1)
    assert math.isfinite(float(loss))
    assert stats["advantages"].tolist() == pytest.approx([-1.5e37, 1.5e37], rel=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_advantage_beyond_the_compute_dtype_is_a_value_error(form):
    case = _base()
    case["rewards"] = torch.tensor([3.0e38, -3.0e38])
    error = _assert_same_outcome(form, case, delta=0.1, reward_baseline=-1e38)  # 4e38 for trajectory 0
    assert isinstance(error, ValueError) and "advantage of trajectory 0" in str(error)


@pytest.mark.parametrize("baseline", [1e39, -math.inf, math.nan])
def test_reward_baseline_must_be_finite_in_the_compute_dtype(baseline):
    error = _assert_same_outcome("packed", _base(), reward_baseline=baseline)
    assert isinstance(error, ValueError) and str(error).startswith("reward_baseline must be finite")
    if math.isfinite(baseline):  # finite in float64: valid with float64 log-probs
        assert not isinstance(_assert_same_outcome("packed", _base_with(_base(), torch.float64),
                                                   reward_baseline=baseline), Exception)


# ------------------------------------------------------------------------------------------------
# Gradient overflow in the storage dtype of log_probs


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_float16_gradient_overflow_is_a_floating_point_error(name, form):
    """float16 log-probs, ratio e^15, reward 100: the loss is finite in float32 but the gradient
    (8.2e7) overflows float16; this used to return an inf gradient without any error."""
    lp = torch.tensor([-1e-3, -1e-3], dtype=torch.float16)
    case = dict(log_probs=lp, behavior_log_probs=torch.tensor([-15.0, -1e-3], dtype=torch.float16),
                rewards=torch.tensor([100.0, 0.0]), cu_seqlens=torch.tensor([0, 1, 2]),
                action_mask=torch.tensor([True, True]))
    with pytest.raises(FloatingPointError, match=r"gradient overflows float16 \(the dtype of log_probs\) on "
                                                 r"active token 0"):
        _call(IMPLEMENTATIONS[name], form, case, delta=math.inf)
    # A ratio of e^5 keeps the gradient (about 3.7e3) within float16: no error.
    case["behavior_log_probs"] = torch.tensor([-5.0, -1e-3], dtype=torch.float16)
    _, grad, _ = _call(IMPLEMENTATIONS[name], form, case, delta=math.inf)
    assert bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_overflow_with_a_finite_ratio(dtype):
    """bfloat16 and float32: ratio e^80 (finite in float32) times a large advantage overflows."""
    lp = torch.tensor([-1e-3, -1e-3], dtype=dtype)
    case = dict(log_probs=lp, behavior_log_probs=torch.tensor([-80.0, -1e-3], dtype=dtype),
                rewards=torch.tensor([1e10, 0.0]), cu_seqlens=torch.tensor([0, 1, 2]),
                action_mask=torch.tensor([True, True]))
    error = _assert_same_outcome("packed", case, delta=math.inf)
    assert isinstance(error, FloatingPointError) and "gradient overflows" in str(error), error


def test_ratio_overflow_is_reported_before_a_gradient_overflow():
    lp = torch.tensor([-1e-3, -1e-3, -1e-3], dtype=torch.float16)
    case = dict(log_probs=lp, behavior_log_probs=torch.tensor([-15.0, -1e-3, -200.0], dtype=torch.float16),
                rewards=torch.tensor([100.0, 0.0, 1.0]), cu_seqlens=torch.tensor([0, 1, 2, 3]),
                action_mask=torch.tensor([True, True, True]))
    error = _assert_same_outcome("packed", case, delta=math.inf)
    assert isinstance(error, FloatingPointError) and "importance ratio overflows on active token 2" in str(error)


# ------------------------------------------------------------------------------------------------
# Flags, counts and dtypes


@pytest.mark.parametrize("value", ["false", "False", 0, 1, None, torch.tensor(False), 0.0])
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_no_is_must_be_a_real_bool(name, value):
    """``no_is="false"`` used to be taken as True (truthy string)."""
    with pytest.raises(TypeError, match="no_is must be a bool"):
        _call(IMPLEMENTATIONS[name], "packed", _base(), no_is=value)


def test_no_is_accepts_python_and_numpy_bools():
    for value in (True, np.bool_(True)):
        loss, _, stats = _assert_same_outcome("packed", _base(), no_is=value)
        assert stats["sequence_kl"].tolist() == [0.0, 0.0]
    assert float(_assert_same_outcome("packed", _base(), no_is=np.bool_(False))[2]["sequence_kl"][0]) > 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.int64])
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_non_float_log_probs_are_refused_before_any_allocation(name, dtype):
    """N >= 65,536 used to raise ``KeyError: torch.int32`` from the gradient allocation."""
    n = 70_000
    values = torch.zeros(n, dtype=dtype)
    with pytest.raises(ValueError, match="log_probs must be a floating-point tensor"):
        IMPLEMENTATIONS[name].flashreinforce_loss_packed(values, values, torch.tensor([1.0]), torch.tensor([0, n]))


def test_argument_errors_allocate_nothing_proportional_to_n(monkeypatch):
    """Every argument rule runs before the gradient buffer is allocated."""
    calls = []
    monkeypatch.setattr(fused, "_empty_gradient", lambda t: calls.append(t) or torch.empty_like(t))
    case = _base()
    for options in (dict(num_trajectories=1), dict(no_is="yes"), dict(delta=-1.0), dict(loss_agg="sum"),
                    dict(negative_token_fraction=0.5), dict(reward_baseline=1e39)):
        with pytest.raises((ValueError, TypeError)):
            _call(fused, "packed", case, **options)
    assert calls == []
    _call(fused, "packed", case)
    assert len(calls) == 1


@pytest.mark.parametrize("form", FORMS)
def test_num_trajectories_below_the_batch_is_refused(form):
    error = _assert_same_outcome(form, _base(), num_trajectories=1)
    assert str(error) == "num_trajectories must be at least the batch's trajectory count (2), got 1"
    _assert_same_outcome(form, _base(), num_trajectories=2)  # == B: valid


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_num_policy_tokens_below_the_batch_count_is_refused(form, loss_agg):
    """The base case holds 4 policy tokens; 3 used to be accepted (a larger token-mean loss)."""
    error = _assert_same_outcome(form, _base(), num_policy_tokens=3, loss_agg=loss_agg)
    assert str(error) == "num_policy_tokens must be at least the batch's policy-token count (4), got 3"
    _assert_same_outcome(form, _base(), num_policy_tokens=4, loss_agg=loss_agg)


@pytest.mark.parametrize("make", [np.int64, np.int32, np.uint8, int])
def test_counts_accept_python_and_numpy_integers(make):
    with_int = _assert_same_outcome("packed", _base(), num_trajectories=4, loss_agg="token-mean",
                                    num_policy_tokens=10)
    with_make = _assert_same_outcome("packed", _base(), num_trajectories=make(4), loss_agg="token-mean",
                                     num_policy_tokens=make(10))
    assert torch.equal(with_int[0], with_make[0])


@pytest.mark.parametrize("value", [True, False, 4.0, np.float64(4.0), "4", torch.tensor(4), np.bool_(True)])
@pytest.mark.parametrize("name", ["num_trajectories", "num_policy_tokens"])
def test_counts_refuse_bools_floats_strings_and_tensors(name, value):
    error = _assert_same_outcome("packed", _base(), **{name: value})
    assert isinstance(error, ValueError) and str(error).startswith(f"{name} must be an integer")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16,
                                   torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("form", FORMS)
def test_rewards_of_any_real_dtype(form, dtype):
    """Unsigned rewards wider than 8 bits used to be refused by the fused op only."""
    case = _base()
    case["rewards"] = torch.tensor([3, 1]).to(dtype)
    loss, _, stats = _assert_same_outcome(form, case, delta=0.1)
    assert stats["advantages"].tolist() == [1.0, -1.0]


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_rewards_of_other_dtypes_are_refused(dtype):
    case = _base()
    case["rewards"] = torch.ones(2).to(dtype)
    error = _assert_same_outcome("packed", case)
    assert isinstance(error, ValueError) and str(error).startswith("rewards must be a real-valued tensor")


def test_string_baseline_and_bool_delta_are_refused_by_both():
    assert isinstance(_assert_same_outcome("packed", _base(), reward_baseline="0.5"), ValueError)
    assert isinstance(_assert_same_outcome("packed", _base(), delta=True), ValueError)
    assert isinstance(_assert_same_outcome("packed", _base(), negative_token_fraction=False), ValueError)


def test_missing_cu_seqlens_is_refused_by_both():
    case = _base()
    case["cu_seqlens"] = None
    error = _assert_same_outcome("packed", case)
    assert str(error) == "cu_seqlens must be a torch.Tensor, got NoneType"


@pytest.mark.parametrize("form", FORMS)
def test_ceil_of_q_times_t_is_evaluated_in_floating_point(form):
    """q = 0.07 and T = 100: 0.07 * 100 is 7.000000000000001 in binary floating point, and the
    published reference's ceil keeps 8 tokens; documented, not "fixed"."""
    n = 101
    lp = torch.full((2 * n,), -0.5)
    mask = torch.ones(2 * n, dtype=torch.bool)
    mask[0] = mask[n] = False
    case = dict(log_probs=lp, behavior_log_probs=lp, rewards=torch.tensor([0.0, 1.0]),
                cu_seqlens=torch.tensor([0, n, 2 * n]), action_mask=mask)
    ent = torch.arange(2 * n, dtype=torch.float32)
    _, _, stats = _assert_same_outcome(form, case, negative_token_fraction=0.07, entropies=ent,
                                       failures=torch.tensor([True, False]))
    assert math.ceil(0.07 * 100) == 8
    assert stats["retained_tokens"].tolist() == [8, 100]


# ------------------------------------------------------------------------------------------------
# Differential test: odd argument values for both implementations


_ODD_VALUES = {
    "delta": [0.0, 1e-3, math.inf, -0.0, True, 1, np.float32(0.1), np.int64(1), "0.1", None, math.nan, -1.0,
              torch.tensor(0.1)],
    "negative_token_fraction": [1, 1.0, 0, 0.5, np.float64(0.5), True, -0.0, 2, math.nan, "1", None],
    "reward_baseline": [None, 0, 0.5, np.float32(0.5), np.int8(1), torch.tensor(0.5), torch.tensor([0.5]),
                        torch.tensor([0.5, 0.5]), torch.tensor(True), "0.5", True, math.inf, 1e39, 1e300],
    "num_trajectories": [None, 2, 3, np.int64(2), np.uint16(5), 1, 0, -2, 2.0, True, "2", torch.tensor(2)],
    "loss_agg": list(contract.LOSS_AGGREGATIONS) + ["sum", None, 3, b"token-mean"],
    "loss_scale_factor": [None, 1, 8.0, np.float32(8.0), 0.0, -1.0, math.inf, True, "8"],
    "num_policy_tokens": [None, 4, 9, np.int32(6), 3, 0, 4.0, False],
    "no_is": [False, True, np.bool_(True), 0, 1, "false", None],
    "gate_metric": ["binary_kl", "kpop", "k3", "log_ratio", "KL", None, 0],
    "is_truncation": [math.inf, 1, 1.0, 2.5, np.float32(3.0), 0.99, 0, -1.0, math.nan, True, "2"],
}


def test_odd_arguments_give_the_same_outcome_in_both_implementations(seed):
    """Random combinations of odd option values: the same exception type and message, or results
    that agree. Half of the draws use the entropy filter."""
    rng = random.Random(seed)
    for draw in range(60):
        options = {name: rng.choice(values) for name, values in _ODD_VALUES.items() if rng.random() < 0.5}
        if rng.random() < 0.5:
            options.update(negative_token_fraction=rng.choice([0.0, 0.3, 0.5, 1.0]),
                           entropies=torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 1.0]),
                           failures=torch.tensor([rng.random() < 0.5, True]))
        case = _base(rng.choice([torch.float32, torch.float64, torch.bfloat16]))
        _assert_same_outcome(rng.choice(FORMS), case, **options)
