"""PyTorch ops of the fused FlashREINFORCE loss (the thin layer over ``flashreinforce._C``).

The compiled core computes, in one forward call, the loss, the gradient with respect to
``log_probs`` and the statistics of SEMANTICS.md. This module registers it as the custom op
``flashreinforce::fused_loss`` (with a fake implementation for ``torch.compile`` and an autograd
formula: backward scales the saved gradient by the incoming one) and exposes the two public entry
points, :func:`flashreinforce_loss_packed` and :func:`flashreinforce_loss`, whose signatures match
the pure-PyTorch reference in :mod:`flashreinforce.loss`. Eager calls on plain tensors run the
same forward and backward through a ``torch.autograd.Function`` (less Python dispatch per call);
calls under ``torch.compile`` or other tracing go through the registered op.

Tensors reach the core as descriptors ``(data_ptr, shape, strides, dtype, device_type,
device_index)``; the bindings validate every one of them and raise ``ValueError`` naming the
argument. The op runs on the device of the inputs (CPU, or CUDA when the module was built with it)
on the current CUDA stream.
"""

from __future__ import annotations

import contextlib
from numbers import Integral, Real
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from flashreinforce import _C

__all__ = [
    "flashreinforce_loss_packed",
    "flashreinforce_loss",
    "fused_loss_capturable",
    "raise_for_error",
    "has_cuda",
]

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
}


def has_cuda() -> bool:
    """Whether the compiled module contains the CUDA path."""
    return bool(_C.has_cuda())


def _desc(t: Optional[Tensor]):
    if t is None:
        return None
    device = t.device
    return (
        t.data_ptr(),
        t.shape,  # torch.Size is a tuple
        t.stride(),
        _DTYPE_NAMES.get(t.dtype) or str(t.dtype).replace("torch.", ""),
        device.type,
        -1 if device.index is None else device.index,
    )


_NUMPY_STORAGE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                  torch.bfloat16: np.uint16}


def _empty_gradient(log_probs: Tensor) -> Tensor:
    """An uninitialized tensor like ``log_probs`` for the gradient.

    On the CPU it is allocated with the C heap (through NumPy) instead of PyTorch's CPU allocator:
    that one obtains large buffers with ``posix_memalign``, which glibc maps fresh on every call,
    so each call pays a page fault per 4 KiB page (about 4.6 ms for a 16 MiB gradient here, more
    than the fused loss itself), while ``malloc`` reuses the freed block.
    """
    if log_probs.device.type != "cpu" or log_probs.numel() < 2**16:
        return torch.empty_like(log_probs)
    array = np.empty(log_probs.numel(), dtype=_NUMPY_STORAGE[log_probs.dtype])
    return torch.from_numpy(array).view(log_probs.dtype).view(log_probs.shape)


def _compute_dtype(log_probs: Tensor) -> torch.dtype:
    return torch.float64 if log_probs.dtype == torch.float64 else torch.float32


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _batch_size(log_probs: Tensor, rewards: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    if cu_seqlens is None:  # padded [B, T]
        return log_probs.shape[0] if log_probs.dim() >= 1 else 0
    return rewards.shape[0] if rewards.dim() >= 1 else 0


def _fused_loss_impl(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    cu_seqlens: Optional[Tensor],
    action_mask: Optional[Tensor],
    entropies: Optional[Tensor],
    failures: Optional[Tensor],
    delta: float,
    negative_token_fraction: float,
    reward_baseline: Optional[float],
    num_trajectories: Optional[int],
    loss_agg: str,
    loss_scale_factor: Optional[float],
    num_policy_tokens: Optional[int],
    no_is: bool,
    raise_errors: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of the fused loss. ``cu_seqlens=None`` selects the padded ``[B, T]`` layout.

    Returns ``(loss, grad, advantages, sequence_kl, admitted, acceptance_rate, policy_tokens,
    retained_tokens, error)`` where ``grad`` is d loss / d log_probs and ``error`` is the int64
    record ``[code, index]`` (code 0: no error) of the launch.
    """
    padded = cu_seqlens is None
    log_probs_c = log_probs.detach().contiguous()
    inputs = [
        log_probs_c,
        _contiguous(behavior_log_probs),
        _contiguous(rewards),
        _contiguous(cu_seqlens),
        _contiguous(action_mask),
        _contiguous(entropies),
        _contiguous(failures),
    ]
    device = log_probs.device
    compute = _compute_dtype(log_probs)
    batch = _batch_size(log_probs, rewards, cu_seqlens)
    outputs = [
        torch.empty((), dtype=compute, device=device),
        _empty_gradient(log_probs_c),
        torch.empty(batch, dtype=compute, device=device),
        torch.empty(batch, dtype=compute, device=device),
        torch.empty(batch, dtype=torch.bool, device=device),
        torch.empty((), dtype=compute, device=device),
        torch.empty(batch, dtype=torch.int64, device=device),
        torch.empty(batch, dtype=torch.int64, device=device),
    ]
    error = torch.zeros(2, dtype=torch.int64, device=device)
    workspace = None
    stream = 0
    if device.type == "cuda":
        nbytes = _C.workspace_bytes(_desc(log_probs_c), _desc(rewards), padded, float(negative_token_fraction))
        workspace = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
    launch = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with launch:  # kernels run on the inputs' device, on its current stream
        _launch(padded, inputs, delta, negative_token_fraction, reward_baseline, num_trajectories, loss_agg,
                loss_scale_factor, num_policy_tokens, no_is, outputs, workspace, error, stream, raise_errors)
    return (*outputs, error)


# The registered op (torch.compile, opcheck, direct torch.ops calls); eager calls of the public
# entry points take the cheaper autograd.Function below, which runs the same implementation.
_fused_loss = torch.library.custom_op("flashreinforce::fused_loss", mutates_args=())(_fused_loss_impl)


def _launch(padded, inputs, delta, negative_token_fraction, reward_baseline, num_trajectories, loss_agg,
            loss_scale_factor, num_policy_tokens, no_is, outputs, workspace, error, stream, raise_errors):
    _C.loss_forward(
        padded,
        *[_desc(t) for t in inputs],
        delta,
        negative_token_fraction,
        reward_baseline,
        num_trajectories,
        loss_agg,
        loss_scale_factor,
        num_policy_tokens,
        no_is,
        [_desc(t) for t in outputs],
        _desc(workspace),
        _desc(error),
        torch.get_num_threads(),
        stream,
        raise_errors,
    )


@_fused_loss.register_fake
def _(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, entropies, failures, delta,
      negative_token_fraction, reward_baseline, num_trajectories, loss_agg, loss_scale_factor,
      num_policy_tokens, no_is, raise_errors):
    for name, t in (("behavior_log_probs", behavior_log_probs), ("rewards", rewards), ("cu_seqlens", cu_seqlens),
                    ("action_mask", action_mask), ("entropies", entropies), ("failures", failures)):
        if t is not None and t.device != log_probs.device:
            raise ValueError(f"{name} is on {t.device} but log_probs is on {log_probs.device}")
    device = log_probs.device
    compute = _compute_dtype(log_probs)
    batch = _batch_size(log_probs, rewards, cu_seqlens)
    return (
        torch.empty((), dtype=compute, device=device),
        torch.empty(log_probs.shape, dtype=log_probs.dtype, device=device),
        torch.empty(batch, dtype=compute, device=device),
        torch.empty(batch, dtype=compute, device=device),
        torch.empty(batch, dtype=torch.bool, device=device),
        torch.empty((), dtype=compute, device=device),
        torch.empty(batch, dtype=torch.int64, device=device),
        torch.empty(batch, dtype=torch.int64, device=device),
        torch.empty(2, dtype=torch.int64, device=device),
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(*output[1:])
    # Only the loss carries a gradient: do not let autograd build zero tensors (one of them
    # N-sized) for the other outputs.
    ctx.set_materialize_grads(False)


def _outside_tracing() -> bool:
    """Not under torch.compile, a dispatch mode (fake / functional tensors) or a functorch transform."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and torch._C._functorch.peek_interpreter_stack() is None)


def _plain_cpu_scalar(t: Tensor) -> bool:
    """A real 0-d CPU tensor outside any tracing."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.dim() == 0 and _outside_tracing()


def _backward(ctx, grad_loss, *unused):
    (grad,) = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 16
    # The common case, loss.backward() on the CPU: the incoming gradient is exactly 1, and the
    # saved gradient is the answer (skips an N-sized multiply and allocation). Not while tracing,
    # where the value is unknown, and not on CUDA, where reading it would synchronize.
    if _plain_cpu_scalar(grad_loss) and float(grad_loss) == 1.0:
        return (grad,) + (None,) * 15
    # grad_loss is 0-d in the compute dtype; the gradient keeps log_probs' dtype.
    grad_log_probs = (grad * grad_loss).to(grad.dtype)
    return (grad_log_probs,) + (None,) * 15


_fused_loss.register_autograd(_backward, setup_context=_setup_context)


class _EagerFusedLoss(torch.autograd.Function):
    """Eager-mode autograd wrapper of the same forward and backward as the registered op.

    Calling ``torch.ops.flashreinforce.fused_loss`` costs about 75 microseconds more Python
    dispatch per forward + backward (the custom-op layers and their autograd kernel; 130 against
    56 us in all at 512 tokens) than this Function, which matters for small batches.
    Used only outside tracing (see ``_use_eager_function``); the results are identical.
    """

    @staticmethod
    def forward(ctx, *args):
        output = _fused_loss_impl(*args)
        _setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        return _backward(ctx, grad_loss)


def _use_eager_function(tensors) -> bool:
    """Plain tensors (no subclasses) outside any tracing."""
    return _outside_tracing() and all(t is None or type(t) is torch.Tensor for t in tensors)


# ------------------------------------------------------------------------------------------------
# Public entry points


def _tensor_arg(name: str, value, required: bool = True) -> Optional[Tensor]:
    if value is None and not required:
        return None
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _real_arg(name: str, value, message: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} {message}, got {value!r}")
    return float(value)


def _optional_int(name: str, value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (Integral, Tensor)) or int(value) != value or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _optional_float(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (Real, Tensor)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _call(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, *, delta, negative_token_fraction,
          entropies, failures, reward_baseline, num_trajectories, loss_agg, loss_scale_factor, num_policy_tokens,
          no_is, padded, raise_errors=True):
    log_probs = _tensor_arg("log_probs", log_probs)
    behavior_log_probs = _tensor_arg("behavior_log_probs", behavior_log_probs)
    rewards = _tensor_arg("rewards", rewards)
    if not padded:
        cu_seqlens = _tensor_arg("cu_seqlens", cu_seqlens)
    action_mask = _tensor_arg("action_mask", action_mask, required=padded)
    entropies = _tensor_arg("entropies", entropies, required=False)
    failures = _tensor_arg("failures", failures, required=False)
    if not isinstance(loss_agg, str):
        raise ValueError(f"loss_agg must be a string, got {loss_agg!r}")
    tensors = (log_probs, behavior_log_probs, rewards, None if padded else cu_seqlens, action_mask, entropies,
               failures)
    args = (
        *tensors,
        _real_arg("delta", delta, "must be a non-negative number (inf disables the gate)"),
        _real_arg("negative_token_fraction", negative_token_fraction, "must be in [0, 1]"),
        _optional_float("reward_baseline", reward_baseline),
        _optional_int("num_trajectories", num_trajectories),
        loss_agg,
        _optional_float("loss_scale_factor", loss_scale_factor),
        _optional_int("num_policy_tokens", num_policy_tokens),
        bool(no_is),
        raise_errors,
    )
    if _use_eager_function(tensors):
        return _EagerFusedLoss.apply(*args)
    return torch.ops.flashreinforce.fused_loss(*args)


def _stats(out) -> dict[str, Tensor]:
    return {
        "advantages": out[2],
        "sequence_kl": out[3],
        "admitted": out[4],
        "acceptance_rate": out[5],
        "policy_tokens": out[6],
        "retained_tokens": out[7],
    }


def flashreinforce_loss_packed(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    cu_seqlens: Tensor,
    action_mask: Optional[Tensor] = None,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: Optional[Tensor] = None,
    failures: Optional[Tensor] = None,
    reward_baseline: float | Tensor | None = None,
    num_trajectories: int | None = None,
    loss_agg: str = "seq-mean-token-mean",
    loss_scale_factor: float | None = None,
    num_policy_tokens: int | None = None,
    no_is: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Fused FlashREINFORCE loss over packed trajectories (compiled CPU / CUDA kernel).

    Args:
        log_probs: ``[N]`` float16/bfloat16/float32/float64, current-policy log-probability of each
            token; the only input that receives a gradient.
        behavior_log_probs: ``[N]`` float, log-probabilities recorded by the behavior policy.
        rewards: ``[B]`` real, one scalar reward per trajectory.
        cu_seqlens: ``[B+1]`` int32/int64 offsets; trajectory i owns tokens ``[cu[i], cu[i+1])``.
        action_mask: ``[N]`` bool, True on policy tokens; ``None``: every token is a policy token.
        delta: trust threshold on the per-trajectory Bernoulli KL (inclusive); ``inf`` disables it.
        negative_token_fraction: q in [0, 1]; below 1 each failed trajectory keeps its
            ``ceil(q T_i)`` highest-entropy policy tokens (ties: earlier first).
        entropies: ``[N]`` float, per-token policy entropy (needed when q < 1).
        failures: ``[B]`` bool, failure labels (needed when q < 1).
        reward_baseline: baseline subtracted from the rewards (default: their mean).
        num_trajectories: B of the denominators (default ``len(rewards)``).
        loss_agg: ``"seq-mean-token-mean"``, ``"token-mean"`` or ``"seq-mean-token-sum-norm"``.
        loss_scale_factor: divisor of ``"seq-mean-token-sum-norm"`` (required there only).
        num_policy_tokens: denominator of ``"token-mean"`` (default: the batch's policy tokens).
        no_is: detached denominator = current policy (ratios 1, every trajectory admitted).

    Returns:
        ``(loss, stats)``: 0-d loss in the compute dtype (float64 for float64 ``log_probs``, else
        float32) and the detached statistics ``advantages``, ``sequence_kl``, ``admitted``,
        ``acceptance_rate``, ``policy_tokens``, ``retained_tokens`` (see SEMANTICS.md).

    Raises:
        ValueError: a bad shape, dtype, device, offset, option or value (the message names it).
        FloatingPointError: an importance ratio overflows on an active token.
    """
    out = _call(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, delta=delta,
                negative_token_fraction=negative_token_fraction, entropies=entropies, failures=failures,
                reward_baseline=reward_baseline, num_trajectories=num_trajectories, loss_agg=loss_agg,
                loss_scale_factor=loss_scale_factor, num_policy_tokens=num_policy_tokens, no_is=no_is,
                padded=False)
    return out[0], _stats(out)


def flashreinforce_loss(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    action_mask: Tensor,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: Optional[Tensor] = None,
    failures: Optional[Tensor] = None,
    reward_baseline: float | Tensor | None = None,
    num_trajectories: int | None = None,
    loss_agg: str = "seq-mean-token-mean",
    loss_scale_factor: float | None = None,
    num_policy_tokens: int | None = None,
    no_is: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Fused FlashREINFORCE loss over padded ``[B, T]`` trajectories.

    The same computation as :func:`flashreinforce_loss_packed` with ``cu_seqlens[i] = i * T``
    (no offsets tensor is built and nothing is copied): ``log_probs``, ``behavior_log_probs``,
    ``action_mask`` (bool, required; padding slots False) and ``entropies`` are ``[B, T]``;
    ``rewards`` and ``failures`` are ``[B]``. The gradient has ``log_probs``' shape and dtype.
    """
    out = _call(log_probs, behavior_log_probs, rewards, None, action_mask, delta=delta,
                negative_token_fraction=negative_token_fraction, entropies=entropies, failures=failures,
                reward_baseline=reward_baseline, num_trajectories=num_trajectories, loss_agg=loss_agg,
                loss_scale_factor=loss_scale_factor, num_policy_tokens=num_policy_tokens, no_is=no_is,
                padded=True)
    return out[0], _stats(out)


def fused_loss_capturable(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask=None, **options):
    """Packed fused loss that never synchronizes with the host (for CUDA graph capture).

    Takes the arguments of :func:`flashreinforce_loss_packed` and returns ``(loss, stats, error)``
    where ``error`` is an int64 ``[2]`` tensor ``[code, index]`` on the inputs' device (code 0: no
    error). Value errors found during the pass are not raised; call :func:`raise_for_error` on
    ``error`` after the work has run (e.g. after a graph replay). Argument errors (shapes, dtypes,
    options) are still raised at launch time. When an error is recorded the outputs are undefined.
    """
    defaults = dict(delta=3e-3, negative_token_fraction=1.0, entropies=None, failures=None, reward_baseline=None,
                    num_trajectories=None, loss_agg="seq-mean-token-mean", loss_scale_factor=None,
                    num_policy_tokens=None, no_is=False)
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {sorted(unknown)}")
    defaults.update(options)
    out = _call(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, padded=False, raise_errors=False,
                **defaults)
    return out[0], _stats(out), out[8]


def raise_for_error(error: Tensor, num_tokens: int, batch: int) -> None:
    """Raises the ``ValueError`` / ``FloatingPointError`` recorded in ``error`` (reads it back)."""
    code, index = (int(v) for v in error.tolist())
    if code != 0:
        _C.raise_for_error(code, index, int(num_tokens), int(batch), 0)
