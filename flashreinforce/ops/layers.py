"""The learner's RMS norm and SwiGLU activation as single passes of the compiled core, with autograd.

Eager PyTorch computes a Llama-style RMS norm as about five elementwise operations and its backward
as about eight, and SwiGLU's ``silu(gate) * up`` as two and three, each a pass over the whole packed
micro-batch, keeping the intermediates for the backward. :func:`rms_norm` and :func:`silu_mul` make
one pass each way (``csrc/flashreinforce/layer_glue.h``) and keep only their inputs, plus one float
per row for the norm. Same values as the eager modules up to float32 rounding (tests in
``python_tests/ops/test_layer_glue.py``, against float64).

Where they apply, the compiled module present and no ``torch.compile`` tracing:

* :func:`rms_norm`: float32 CPU ``x`` and weight, with CPU autocast on or off (autocast leaves a norm's
  float32 arithmetic alone). :func:`rms_norm_to_bf16` is its forward without a backward, rounding each
  output once to bfloat16: what a bf16-autocast product rounds the float32 norm to before multiplying,
  so a norm whose output feeds only such products may hand them bf16 directly (no float32 copy of the
  rows, no cast per product). :func:`norm_applies` says where both compute.
* :func:`silu_mul`: CPU ``gate`` and ``up`` both float32 or both bfloat16 (a bf16-autocast MLP's
  products give bf16); bfloat16 computes in float32 and rounds each result, and each gradient, once
  (eager PyTorch rounds ``silu(gate)`` before the product as well). :func:`silu_mul_applies` says where.
* :func:`compiled_layers_apply`: the narrower rule of the float32 operations without autocast (LoRA's
  fused product, :mod:`flashreinforce.ops.lora_linear`, routes by it).

Callers keep the eager computation for everything else.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashreinforce.compiled import compiled_has

__all__ = ["compiled_layers_available", "compiled_layers_apply", "norm_applies", "rms_norm", "rms_norm_to_bf16",
           "silu_mul", "silu_mul_applies"]


def _module():
    from flashreinforce import _C

    return _C


def compiled_layers_available() -> bool:
    """Whether the installed compiled module has the learner's layer operations."""
    return compiled_has("norm_forward", "norm_backward", "silu_mul_forward", "silu_mul_backward")


def compiled_layers_apply(*tensors: Tensor) -> bool:
    """Whether :func:`rms_norm` / :func:`silu_mul` compute for these tensors: float32 CPU tensors, CPU
    autocast off, not under ``torch.compile`` or another tracer, the compiled module present."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and compiled_layers_available())


def _cpu_of(dtypes: tuple, *tensors: Tensor) -> bool:
    return (all(t.device.type == "cpu" and t.dtype in dtypes for t in tensors)
            and len({t.dtype for t in tensors}) == 1)


def norm_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`rms_norm` and :func:`rms_norm_to_bf16` compute for ``x`` and ``weight``: float32
    CPU tensors (CPU autocast on or off), not under a tracer, the compiled module present."""
    return (_cpu_of((torch.float32,), x, weight) and not torch.compiler.is_compiling()
            and compiled_layers_available())


def silu_mul_applies(gate: Tensor, up: Tensor) -> bool:
    """Whether :func:`silu_mul` computes for ``gate`` and ``up``: CPU tensors both float32 or both
    bfloat16, not under a tracer, the compiled module present."""
    return (_cpu_of((torch.float32, torch.bfloat16), gate, up) and not torch.compiler.is_compiling()
            and compiled_layers_available())


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x2 = x.detach().reshape(-1, x.shape[-1]).contiguous()
        w = weight.detach().contiguous()
        out = torch.empty_like(x2)
        inv = torch.empty(x2.shape[0], dtype=torch.float32)
        _module().norm_forward(x2.shape[0], x2.shape[1], x2.data_ptr(), w.data_ptr(), out.data_ptr(), inv.data_ptr(),
                               float(eps), torch.get_num_threads(), "float32")
        ctx.save_for_backward(x2, w, inv)
        ctx.input_shape = x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2, w, inv = ctx.saved_tensors
        g = grad_out.reshape(x2.shape).contiguous()
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x2) if want_x else None
        grad_w = torch.empty_like(w) if want_w else None
        if want_x or want_w:
            _module().norm_backward(x2.shape[0], x2.shape[1], x2.data_ptr(), w.data_ptr(), inv.data_ptr(), g.data_ptr(),
                                    _ptr(grad_x), _ptr(grad_w), torch.get_num_threads())
        return (None if grad_x is None else grad_x.view(ctx.input_shape)), grad_w, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        g, u = gate.detach().contiguous(), up.detach().contiguous()
        out = torch.empty_like(g)
        _module().silu_mul_forward(g.numel(), g.data_ptr(), u.data_ptr(), out.data_ptr(), torch.get_num_threads(),
                                   _DTYPE_NAMES[g.dtype])
        ctx.save_for_backward(g, u)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        g, u = ctx.saved_tensors
        dy = grad_out.contiguous()
        grad_g = torch.empty_like(g) if ctx.needs_input_grad[0] else None
        grad_u = torch.empty_like(u) if ctx.needs_input_grad[1] else None
        if grad_g is not None or grad_u is not None:
            _module().silu_mul_backward(g.numel(), g.data_ptr(), u.data_ptr(), dy.to(g.dtype).data_ptr(),
                                        _ptr(grad_g), _ptr(grad_u), torch.get_num_threads(), _DTYPE_NAMES[g.dtype])
        return grad_g, grad_u


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x / sqrt(mean(x**2, -1) + eps))`` in one pass each way.

    x: ``[..., hidden]`` float32 on the CPU; weight: ``[hidden]`` float32. Returns x's shape. Raises
    ``ValueError`` naming the argument when the shapes or dtypes do not fit (see
    :func:`norm_applies` for where it computes; CPU autocast on or off).
    """
    _check_norm("rms_norm", x, weight)
    return _RmsNorm.apply(x, weight, eps)


def rms_norm_to_bf16(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:func:`rms_norm`'s value rounded once to bfloat16, without a backward.

    x: ``[..., hidden]`` float32 on the CPU; weight: ``[hidden]`` float32. Returns a bfloat16 tensor of x's
    shape, each element the float32 norm rounded to nearest even (what CPU autocast's bf16 products do to
    a float32 input). ``ValueError`` naming the argument when the shapes or dtypes do not fit, or when
    autograd would need a gradient of ``x`` or ``weight`` (use :func:`rms_norm` there).
    """
    _check_norm("rms_norm_to_bf16", x, weight)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise ValueError("rms_norm_to_bf16: has no backward, but x or weight requires a gradient (use rms_norm)")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    w = weight.contiguous()
    out = torch.empty(x2.shape, dtype=torch.bfloat16)
    _module().norm_forward(x2.shape[0], x2.shape[1], x2.data_ptr(), w.data_ptr(), out.data_ptr(), 0, float(eps),
                           torch.get_num_threads(), "bfloat16")
    return out.view(x.shape)


def _check_norm(name: str, x: Tensor, weight: Tensor) -> None:
    """``ValueError`` naming the argument unless the norm ``name`` computes for ``x`` and ``weight``."""
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"{name}: weight must have shape ({x.shape[-1] if x.dim() else '?'},) to match the last "
                         f"dimension of x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if not norm_applies(x, weight):
        raise ValueError(f"{name}: x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) must be "
                         "float32 CPU tensors, with the compiled module built")


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (a SwiGLU MLP's activation) in one pass each way.

    gate, up: the same shape, on the CPU, both float32 or both bfloat16 (the result's dtype; bfloat16
    computes in float32 and rounds each result once). Raises ``ValueError`` naming the argument otherwise.
    """
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if not silu_mul_applies(gate, up):
        raise ValueError(f"silu_mul: gate ({gate.dtype}, {gate.device}) and up ({up.dtype}, {up.device}) must be "
                         "CPU tensors, both float32 or both bfloat16, with the compiled module built")
    return _SiluMul.apply(gate, up)
