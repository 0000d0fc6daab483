"""The fused loss with its error record left to a later check (fused_loss_deferred + PendingErrors):
the same outputs as the immediate call, the same errors with the same messages, one check for many calls."""

import pytest
import torch

from flashreinforce.ops import PendingErrors, flashreinforce_loss_packed, fused_loss_deferred


def inputs(seed, n=12, b=3):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g) * 3 - 0.01
    blp = (lp + 0.05 * torch.randn(n, generator=g)).clamp(max=-1e-3)
    cu = torch.tensor([0, 4, 9, n])[: b + 1]
    return lp, blp, torch.rand(b, generator=g, dtype=torch.float64), cu, torch.rand(n, generator=g) > 0.2


def test_deferred_outputs_and_gradient_equal_the_immediate_call():
    lp, blp, r, cu, mask = inputs(1)
    mask[[0, 4, 9]] = True
    a = lp.clone().requires_grad_()
    b = lp.clone().requires_grad_()
    loss_a, stats_a = flashreinforce_loss_packed(a, blp, r, cu, mask, delta=0.5)
    pending = PendingErrors()
    loss_b, stats_b = fused_loss_deferred(pending, b, blp, r, cu, mask, delta=0.5)
    assert len(pending) == 1
    pending.check()
    assert len(pending) == 0
    assert torch.equal(loss_a, loss_b)
    for name in stats_a:
        assert torch.equal(stats_a[name], stats_b[name]), name
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("where,value", [(2, float("nan")), (5, 0.5)])
def test_a_recorded_error_is_raised_by_the_check_with_the_immediate_message(where, value):
    lp, blp, r, cu, _ = inputs(2)
    bad = blp.clone()
    bad[where] = value
    with pytest.raises(ValueError) as immediate:
        flashreinforce_loss_packed(lp, bad, r, cu)
    pending = PendingErrors()
    fused_loss_deferred(pending, lp, blp, r, cu)  # a clean call first
    fused_loss_deferred(pending, lp, bad, r, cu)  # no exception yet
    fused_loss_deferred(pending, lp, blp.clone().fill_(float("nan")), r, cu)  # a later error
    with pytest.raises(ValueError) as deferred:
        pending.check()
    assert str(deferred.value) == str(immediate.value)  # the first error, with the values quoted
    pending.check()  # the records were dropped


def test_argument_errors_are_still_raised_at_once():
    lp, blp, r, cu, _ = inputs(3)
    pending = PendingErrors()
    with pytest.raises(ValueError, match="behavior_log_probs"):
        fused_loss_deferred(pending, lp, blp[:-1], r, cu)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fused_loss_deferred(pending, lp, blp, r, cu, delta_=1.0)
    assert len(pending) == 0
