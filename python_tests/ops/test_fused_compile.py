"""The custom op passes torch.library.opcheck and the entry points work under torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

import flashreinforce as fr
import flashreinforce.ops  # registers torch.ops.flashreinforce.fused_loss
from flashreinforce.objective import LossOptions
from flashreinforce.ops.contract import op_options
from python_tests.ops.fused_cases import random_batch


def op_args(b, delta=0.05, q=1.0, packed=True):
    return (
        b.log_probs.clone().requires_grad_(),
        b.behavior_log_probs,
        b.rewards,
        b.cu_seqlens if packed else None,
        b.action_mask,
        b.entropies if q < 1 else None,
        b.failures if q < 1 else None,
        op_options(LossOptions(delta=delta, negative_token_fraction=q)),
        True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("q", [1.0, 0.5])
def test_opcheck_packed(generator, dtype, q):
    b = random_batch(generator, dtype=dtype, batch=6, max_long=300, filter_q=q if q < 1 else None)
    torch.library.opcheck(torch.ops.flashreinforce.fused_loss.default, op_args(b, q=q))


def test_opcheck_padded(generator):
    b = random_batch(generator, dtype=torch.float32, lengths=[13] * 5)
    args = list(op_args(b, packed=False))
    args[0] = args[0].detach().view(5, 13).requires_grad_()
    args[1] = args[1].view(5, 13)
    args[4] = args[4].view(5, 13)
    torch.library.opcheck(torch.ops.flashreinforce.fused_loss.default, tuple(args))


@pytest.mark.parametrize("padded", [False, True])
def test_torch_compile_fullgraph(generator, padded):
    torch._dynamo.reset()
    width = 40
    b = random_batch(generator, dtype=torch.float32, lengths=[width] * 6, filter_q=0.5)

    def step(lp, blp, rewards, cu, mask, ent, fail):
        if padded:
            loss, stats = fr.flashreinforce_loss(lp, blp, rewards, mask, delta=0.05, negative_token_fraction=0.5,
                                                 entropies=ent, failures=fail)
        else:
            loss, stats = fr.flashreinforce_loss_packed(lp, blp, rewards, cu, mask, delta=0.05,
                                                        negative_token_fraction=0.5, entropies=ent, failures=fail)
        return loss * 2.0, stats["acceptance_rate"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    shape = (6, width) if padded else (-1,)
    inputs = [b.log_probs.view(shape), b.behavior_log_probs.view(shape), b.rewards, b.cu_seqlens,
              b.action_mask.view(shape), b.entropies.view(shape), b.failures]
    x1 = inputs[0].clone().requires_grad_()
    x2 = inputs[0].clone().requires_grad_()
    loss_c, rate_c = compiled(x1, *inputs[1:])
    loss_e, rate_e = step(x2, *inputs[1:])
    loss_c.backward()
    loss_e.backward()
    assert torch.equal(loss_c, loss_e) and torch.equal(rate_c, rate_e)
    assert torch.equal(x1.grad, x2.grad)


def test_torch_compile_inductor(generator):
    """The default backend (inductor) around the op, with surrounding arithmetic fused by it."""
    torch._dynamo.reset()
    b = random_batch(generator, dtype=torch.float32, batch=8, max_long=200)

    def step(raw, blp, rewards, cu, mask):
        lp = torch.nn.functional.logsigmoid(raw)  # some model-side arithmetic before the loss
        loss, _ = fr.flashreinforce_loss_packed(lp, blp, rewards, cu, mask, delta=math.inf)
        return loss

    raw = torch.randn(b.log_probs.shape, generator=generator)
    compiled = torch.compile(step, fullgraph=True)
    r1 = raw.clone().requires_grad_()
    r2 = raw.clone().requires_grad_()
    blp = torch.where(b.action_mask, torch.nn.functional.logsigmoid(raw) - 0.01, b.behavior_log_probs)
    compiled(r1, blp, b.rewards, b.cu_seqlens, b.action_mask).backward()
    step(r2, blp, b.rewards, b.cu_seqlens, b.action_mask).backward()
    assert torch.allclose(r1.grad, r2.grad, rtol=1e-6, atol=1e-9)


def test_eager_entry_point_equals_the_registered_op(generator):
    """Eager calls take a lighter autograd.Function; results and gradients equal the op's."""
    b = random_batch(generator, dtype=torch.float32, filter_q=0.5)
    args = op_args(b, q=0.5)
    x_op = args[0]
    out_op = torch.ops.flashreinforce.fused_loss(*args)
    (out_op[0] * 3.0).backward()
    x_eager = b.log_probs.clone().requires_grad_()
    loss, stats = fr.flashreinforce_loss_packed(x_eager, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask,
                                                delta=0.05, negative_token_fraction=0.5, entropies=b.entropies,
                                                failures=b.failures)
    assert loss.grad_fn is not None and "EagerFusedLoss" in type(loss.grad_fn).__name__
    (loss * 3.0).backward()
    assert torch.equal(loss.detach(), out_op[0].detach())
    assert torch.equal(x_eager.grad, x_op.grad)
    for i, key in enumerate(["advantages", "sequence_kl", "admitted", "acceptance_rate", "policy_tokens",
                             "retained_tokens"], start=2):
        assert torch.equal(stats[key], out_op[i]), key
        assert not stats[key].requires_grad


def test_compiled_calls_follow_changing_option_values(generator):
    """The op's one options argument is traced like the scalars it replaced: a compiled function called with
    other option values (floats the trace makes symbolic after a recompile) matches the eager calls."""
    torch._dynamo.reset()
    b = random_batch(generator, dtype=torch.float32, batch=6, max_long=50)

    def step(lp, delta, cap):
        loss, stats = fr.flashreinforce_loss_packed(lp, b.behavior_log_probs, b.rewards, b.cu_seqlens, b.action_mask,
                                                    delta=delta, is_truncation=cap)
        return loss, stats["acceptance_rate"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    seen = set()
    for delta, cap in [(1e-4, 1.5), (1.0, 1.5), (1.0, math.inf), (1e-4, 1.5)]:
        eager, out = step(b.log_probs, delta, cap), compiled(b.log_probs, delta, cap)
        assert all(torch.equal(x, y) for x, y in zip(eager, out)), (delta, cap)
        seen.add(float(eager[1]))
    assert len(seen) == 2  # the gate admitted different sets: the values reached the kernel
