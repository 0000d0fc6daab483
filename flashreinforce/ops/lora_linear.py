"""A LoRA projection ``x W^T + b + scaling * (x A^T) B^T`` with the adapter's sum inside the products.

PEFT computes a LoRA-wrapped linear layer as ``base(x) + lora_B(lora_A(x)) * scaling``: besides the
three products, one multiplication and one addition over the whole ``[tokens, out]`` output forward,
and again backward, plus the addition of the two paths' input gradients over ``[tokens, in]``. Here
the scaled adapter product accumulates into the base output inside the matrix product (``addmm_``
with ``alpha = scaling``), and backward the adapter's input gradient accumulates into the base
path's the same way; the scaling multiplies only the ``[tokens, rank]`` and ``[out, rank]`` tensors.
Same products, same inputs saved (x and ``x A^T``); the values are PEFT's up to float rounding (the
scaling is applied inside the product rather than after it). Tests in
``python_tests/ops/test_lora_linear.py``, against float64 and PEFT's own forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["lora_linear"]


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2.mm(lora_a.t())
        out = x2.mm(weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
        out.addmm_(xa, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x2, xa, weight, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.input_shape = x.shape
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2, xa, weight, lora_a, lora_b = ctx.saved_tensors
        want_x, want_w, want_b, want_a, want_lb = ctx.needs_input_grad[:5]
        g = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_bias = grad_a = grad_lb = None
        if want_lb:
            grad_lb = g.t().mm(xa).mul_(ctx.scaling)
        if want_x or want_a:
            g_xa = g.mm(lora_b).mul_(ctx.scaling)
            if want_a:
                grad_a = g_xa.t().mm(x2)
            if want_x:
                grad_x = g.mm(weight).addmm_(g_xa, lora_a).view(ctx.input_shape)
        if want_w:
            grad_w = g.t().mm(x2)
        if want_b and ctx.has_bias:
            grad_bias = g.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_lb, None


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float) -> Tensor:
    """``x @ weight.T + bias + scaling * (x @ lora_a.T) @ lora_b.T`` with autograd.

    x: ``[..., in]``; weight: ``[out, in]``; bias: ``[out]`` or None; lora_a: ``[rank, in]``; lora_b:
    ``[out, rank]``; all one dtype and device. Returns ``[..., out]``. Gradients flow to every input that
    requires one (a LoRA run's frozen base weight gets none). Raises ``ValueError`` naming the argument
    when the shapes, dtypes or devices do not fit.
    """
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"lora_linear: weight {tuple(weight.shape)} must be [out, in] with in = the last "
                         f"dimension of x {tuple(x.shape)}")
    if lora_a.dim() != 2 or lora_a.shape[1] != weight.shape[1]:
        raise ValueError(f"lora_linear: lora_a {tuple(lora_a.shape)} must be [rank, {weight.shape[1]}]")
    if lora_b.dim() != 2 or lora_b.shape != (weight.shape[0], lora_a.shape[0]):
        raise ValueError(f"lora_linear: lora_b {tuple(lora_b.shape)} must be [{weight.shape[0]}, {lora_a.shape[0]}] "
                         "(out of weight, rank of lora_a)")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"lora_linear: bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
    for name, t in (("weight", weight), ("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"lora_linear: {name} ({t.dtype}, {t.device}) must have x's dtype and device "
                             f"({x.dtype}, {x.device})")
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scaling))
