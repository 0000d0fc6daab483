"""PyTorch ops of the fused FlashREINFORCE loss (the thin layer over ``flashreinforce._C``).

The compiled core computes, in one forward call, the loss, the gradient with respect to
``log_probs`` and the statistics of docs/semantics.md. This module registers it as the custom op
``flashreinforce::fused_loss`` (with a fake implementation for ``torch.compile`` and an autograd
formula: backward scales the saved gradient by the incoming one) and exposes the two public entry
points, :func:`flashreinforce_loss_packed` and :func:`flashreinforce_loss`, whose signatures are
those of the pure-PyTorch reference in :mod:`flashreinforce.ops.reference`. Eager calls on plain
tensors run the same forward and backward through a ``torch.autograd.Function`` (less Python
dispatch per call); calls under ``torch.compile`` or other tracing go through the registered op.

Arguments are validated by the rules of :mod:`flashreinforce.ops.contract` (shared with the
reference) before anything is allocated; errors found by the core during its pass come back as an
error record ``(code, index)`` and are raised with the contract's messages. Tensors reach the core
as views ``(data_ptr, numel, dtype)``. The op runs on the device of the inputs (CPU, or CUDA when
the module was built with it) on the current CUDA stream.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from flashreinforce import _C
from flashreinforce.objective import KERNEL_OPTIONS, LossOptions
from flashreinforce.ops.contract import (CALL_SCALARS, OUTPUTS, STAT_NAMES, Arguments, check_arguments,
                                         compute_dtype_for, entry_point, error_for, op_options, options_mapping)

__all__ = [
    "flashreinforce_loss_packed",
    "flashreinforce_loss",
    "fused_loss_capturable",
    "fused_loss_deferred",
    "PendingErrors",
    "raise_for_error",
    "has_cuda",
]

# The core's element type names (csrc/core_common.cpp, dtype_name) of the torch dtypes it reads.
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
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
}
# The tensor inputs, in the op's (and Arguments') order; the core's views carry the same names.
_INPUT_NAMES = Arguments._fields[:7]


def has_cuda() -> bool:
    """Whether the compiled module contains the CUDA path."""
    return bool(_C.has_cuda())


def _view(t: Optional[Tensor]):
    """The core's view of a contiguous tensor: ``(data_ptr, numel, dtype name)``; None stays None."""
    if t is None:
        return None
    return (t.data_ptr(), t.numel(), _DTYPE_NAMES[t.dtype])


_NUMPY_STORAGE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                  torch.bfloat16: np.uint16}


def _empty_gradient(log_probs: Tensor) -> Tensor:
    """An uninitialized tensor like ``log_probs`` for the gradient.

    On the CPU it is allocated with the C heap (through NumPy) instead of PyTorch's CPU allocator:
    that one obtains large buffers with ``posix_memalign``, which glibc maps fresh on every call,
    so each call pays a page fault per 4 KiB page (about 4.6 ms for a 16 MiB gradient here, more
    than the fused loss itself), while ``malloc`` reuses the freed block. ``log_probs`` is a
    validated floating-point tensor (the arguments are checked before anything is allocated).
    """
    if log_probs.device.type != "cpu" or log_probs.numel() < 2**16:
        return torch.empty_like(log_probs)
    array = np.empty(log_probs.numel(), dtype=_NUMPY_STORAGE[log_probs.dtype])
    return torch.from_numpy(array).view(log_probs.dtype).view(log_probs.shape)


def _batch_size(log_probs: Tensor, rewards: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return log_probs.shape[0] if cu_seqlens is None else rewards.shape[0]


def _allocate_outputs(log_probs: Tensor, batch: int, grad: Tensor) -> list[Tensor]:
    """The outputs of :data:`~flashreinforce.ops.contract.OUTPUTS`, in order (``grad`` given)."""
    device = log_probs.device
    compute = compute_dtype_for(log_probs.dtype)
    outputs = []
    for output in OUTPUTS:
        if output.dtype == "log_probs":
            outputs.append(grad)
            continue
        dtype = compute if output.dtype == "compute" else output.dtype
        outputs.append(torch.empty(batch if output.shape == "B" else (), dtype=dtype, device=device))
    return outputs


def _fused_loss_impl(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    cu_seqlens: Optional[Tensor],
    action_mask: Optional[Tensor],
    entropies: Optional[Tensor],
    failures: Optional[Tensor],
    options: Sequence[Union[int, float, bool]],
    raise_errors: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of the fused loss on validated arguments. ``cu_seqlens=None``: the padded ``[B, T]`` layout.

    ``options``: the loss options and the call's scalars as one argument
    (:func:`~flashreinforce.ops.contract.op_options`), read once per distinct value. Returns the outputs of :data:`~flashreinforce.ops.contract.OUTPUTS` (``grad`` is
    d loss / d log_probs), then ``error``, the int64 record ``[code, index]`` (code 0: no error)
    of the launch. With ``raise_errors`` a recorded error is raised (ValueError / FloatingPointError).
    """
    values = _options_mapping(tuple(options))
    padded = cu_seqlens is None
    log_probs_c = log_probs.detach().contiguous()
    inputs = (log_probs_c, behavior_log_probs.contiguous(), rewards.contiguous(),
              None if padded else cu_seqlens.contiguous(),
              None if action_mask is None else action_mask.contiguous(),
              None if entropies is None else entropies.contiguous(),
              None if failures is None else failures.contiguous())
    device = log_probs.device
    batch = _batch_size(log_probs, rewards, cu_seqlens)
    outputs = _allocate_outputs(log_probs_c, batch, _empty_gradient(log_probs_c))
    error = torch.zeros(2, dtype=torch.int64, device=device)
    views = {name: _view(t) for name, t in zip(_INPUT_NAMES, inputs)}
    for output, t in zip(OUTPUTS, outputs):
        views[output.name] = _view(t)
    views["error_record"] = _view(error)
    launch = {"device": device.type, "padded_row_length": log_probs.shape[1] if padded else 0,
              "num_threads": torch.get_num_threads(), "stream": 0, "synchronize": raise_errors}
    if device.type == "cuda":
        # The entropy filter's workspace whenever its inputs are given (the core needs them when it filters).
        nbytes = _C.cuda_workspace_bytes(log_probs.numel(), batch, entropies is not None)
        workspace = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        views["workspace"] = _view(workspace)
        launch["stream"] = torch.cuda.current_stream(device).cuda_stream
        with torch.cuda.device(device):  # kernels run on the inputs' device, on its current stream
            code, index = _C.loss_forward(views, values, launch)
    else:
        code, index = _C.loss_forward(views, values, launch)
    if code != 0 and raise_errors:
        loss_options = LossOptions(**{name: values[name] for name in KERNEL_OPTIONS})
        args = Arguments(*inputs, log_probs.numel(), batch, launch["padded_row_length"], compute_dtype_for(log_probs.dtype),
                         loss_options, *(values[name] for name in CALL_SCALARS))
        raise error_for(code, index, args)
    return (*outputs, error)


# The registered op (torch.compile, opcheck, direct torch.ops calls); eager calls of the public
# entry points take the cheaper autograd.Function below, which runs the same implementation.
_fused_loss = torch.library.custom_op("flashreinforce::fused_loss", mutates_args=())(_fused_loss_impl)


@functools.lru_cache(maxsize=256)
def _options_mapping(packed: tuple) -> dict:
    """The op's options argument as the mapping the core reads (shared, never changed: cached per value)."""
    return options_mapping(packed)


@_fused_loss.register_fake
def _(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, entropies, failures, options, raise_errors):
    batch = _batch_size(log_probs, rewards, cu_seqlens)
    grad = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)
    error = torch.empty(2, dtype=torch.int64, device=log_probs.device)
    return (*_allocate_outputs(log_probs, batch, grad), error)


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


# The arguments of _fused_loss_impl (only log_probs gets a gradient), counted from its signature.
_NUM_OP_INPUTS = len(inspect.signature(_fused_loss_impl).parameters)


def _backward(ctx, grad_loss, *unused):
    (grad,) = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * _NUM_OP_INPUTS
    # The common case, loss.backward() on the CPU: the incoming gradient is exactly 1, and the
    # saved gradient is the answer (skips an N-sized multiply and allocation). Not while tracing,
    # where the value is unknown, and not on CUDA, where reading it would synchronize.
    if _plain_cpu_scalar(grad_loss) and float(grad_loss) == 1.0:
        return (grad,) + (None,) * (_NUM_OP_INPUTS - 1)
    # grad_loss is 0-d in the compute dtype; the gradient keeps log_probs' dtype.
    grad_log_probs = (grad * grad_loss).to(grad.dtype)
    return (grad_log_probs,) + (None,) * (_NUM_OP_INPUTS - 1)


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


def _run(args: Arguments, raise_errors: bool = True):
    """Runs the op on checked arguments; returns its outputs and the error record."""
    if args.log_probs.device.type not in ("cpu", "cuda"):
        raise ValueError(f"log_probs is on {args.log_probs.device}; the fused loss runs on cpu and cuda tensors")
    entropies, failures = (args.entropies, args.failures) if args.filter else (None, None)
    tensors = (args.log_probs, args.behavior_log_probs, args.rewards, args.cu_seqlens, args.action_mask, entropies,
               failures)
    op_args = (*tensors, op_options(args.options, *(getattr(args, name) for name in CALL_SCALARS)), raise_errors)
    if _use_eager_function(tensors):
        return _EagerFusedLoss.apply(*op_args)
    return torch.ops.flashreinforce.fused_loss(*op_args)


def _stats(out) -> dict[str, Tensor]:
    return dict(zip(STAT_NAMES, out[2:2 + len(STAT_NAMES)]))


# ------------------------------------------------------------------------------------------------
# Public entry points (signatures: those of flashreinforce.ops.reference, defaults from the contract)


@entry_point
def flashreinforce_loss_packed(log_probs: Tensor, behavior_log_probs: Tensor, rewards: Tensor, cu_seqlens: Tensor,
                               action_mask: Optional[Tensor] = None, **keywords) -> tuple[Tensor, dict[str, Tensor]]:
    """Fused FlashREINFORCE loss over packed trajectories (compiled CPU / CUDA kernel).

    The contract (every argument, default, step, error and the worked numbers) is docs/semantics.md;
    :func:`flashreinforce.ops.reference.flashreinforce_loss_packed` is its readable PyTorch form,
    with the same signature, rules and messages.

    Args:
        log_probs: ``[N]`` float16/bfloat16/float32/float64, current-policy log-probability of each
            token; the only input that receives a gradient.
        behavior_log_probs: ``[N]`` float, log-probabilities recorded by the behavior policy.
        rewards: ``[B]`` real (floating-point or integer), one scalar reward per trajectory.
        cu_seqlens: ``[B+1]`` int32/int64 offsets; trajectory i owns tokens ``[cu[i], cu[i+1])``.
        action_mask: ``[N]`` bool, True on policy tokens; ``None``: every token is a policy token.
        entropies: ``[N]`` float, per-token policy entropy (needed when q < 1).
        failures: ``[B]`` bool, failure labels (needed when q < 1).
        reward_baseline: baseline subtracted from the rewards (default: their mean).
        num_trajectories: B of the denominators, at least ``len(rewards)`` (default ``len(rewards)``).
        num_policy_tokens: denominator of ``"token-mean"``, at least the batch's policy-token count
            (default: that count).
        options: a :class:`flashreinforce.objective.LossOptions` (a run's, built once); option keywords
            given with it override its fields.

    Returns:
        ``(loss, stats)``: 0-d loss in the compute dtype (float64 for float64 ``log_probs``, else
        float32) and the detached statistics (``contract.STAT_NAMES``): ``advantages``,
        ``sequence_kl``, ``admitted``, ``acceptance_rate``, ``policy_tokens``, ``retained_tokens``.

    Raises:
        ValueError: a bad shape, dtype, device, offset, option or value (the message names it).
        TypeError: a flag option is not a bool, or an unknown keyword.
        FloatingPointError: an importance ratio, or a gradient element in the dtype of
            ``log_probs``, overflows on an active token.
    """
    args = check_arguments(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, padded=False,
                           caller="flashreinforce_loss_packed", **keywords)
    out = _run(args)
    return out[0], _stats(out)


@entry_point
def flashreinforce_loss(log_probs: Tensor, behavior_log_probs: Tensor, rewards: Tensor, action_mask: Tensor,
                        **keywords) -> tuple[Tensor, dict[str, Tensor]]:
    """Fused FlashREINFORCE loss over padded ``[B, T]`` trajectories.

    The same computation as :func:`flashreinforce_loss_packed` with ``cu_seqlens[i] = i * T``
    (no offsets tensor is built and nothing is copied): ``log_probs``, ``behavior_log_probs``,
    ``action_mask`` (bool, required; padding slots False) and ``entropies`` are ``[B, T]``;
    ``rewards`` and ``failures`` are ``[B]``. The gradient has ``log_probs``' shape and dtype.
    """
    args = check_arguments(log_probs, behavior_log_probs, rewards, None, action_mask, padded=True,
                           caller="flashreinforce_loss", **keywords)
    out = _run(args)
    return out[0], _stats(out)


def fused_loss_capturable(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask=None, **options):
    """Packed fused loss that never synchronizes with the host (for CUDA graph capture).

    Takes the arguments of :func:`flashreinforce_loss_packed` and returns ``(loss, stats, error)``
    where ``error`` is an int64 ``[2]`` tensor ``[code, index]`` on the inputs' device (code 0: no
    error; codes: :class:`flashreinforce.ops.contract.ErrorCode`). Value errors found during the
    pass are not raised; call :func:`raise_for_error` on ``error`` after the work has run (e.g.
    after a graph replay). Argument errors (shapes, dtypes, options) are still raised at launch
    time. When an error is recorded the outputs are undefined.
    """
    out, _ = _run_unchecked(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, options)
    return out[0], _stats(out), out[len(OUTPUTS)]


def _run_unchecked(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, options: dict):
    """The packed op without the error read-back: ``(outputs with the error record last, arguments)``."""
    args = check_arguments(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, padded=False,
                           caller="fused_loss_capturable", **options)
    return _run(args, raise_errors=False), args


def raise_for_error(error: Tensor, num_tokens: int, batch: int) -> None:
    """Raises the ``ValueError`` / ``FloatingPointError`` recorded in ``error`` (reads it back)."""
    code, index = (int(v) for v in error.tolist())
    if code != 0:
        raise error_for(code, index, num_tokens=int(num_tokens), batch=int(batch))


class PendingErrors:
    """The error records of fused-loss calls made without a host read-back (:func:`fused_loss_deferred`).

    :meth:`check` reads every record back in one device-to-host transfer and raises the first
    recorded error (in call order) with the message the immediate call would have raised: each
    record keeps its call's checked arguments (which reference the inputs) until it is checked.
    """

    def __init__(self) -> None:
        self._records: list[tuple[Tensor, Arguments]] = []

    def __len__(self) -> int:
        return len(self._records)

    def add(self, error: Tensor, args: Arguments) -> None:
        self._records.append((error, args))

    def check(self) -> None:
        """Raise the first recorded error, if any (the records are dropped either way)."""
        records, self._records = self._records, []
        if not records:
            return
        codes = torch.stack([error for error, _ in records]).cpu().tolist()  # the one read-back
        for (code, index), (_, args) in zip(codes, records):
            if code != 0:
                raise error_for(int(code), int(index), args)


def fused_loss_deferred(pending: PendingErrors, log_probs, behavior_log_probs, rewards, cu_seqlens,
                        action_mask=None, **options):
    """:func:`flashreinforce_loss_packed` without the host read-back of its error record.

    Same arguments (keywords as there) and the same ``(loss, stats)``; the error record goes to
    ``pending``, and a value error of this call is raised by ``pending.check()``, with the same
    message. Argument errors (shapes, dtypes, options) are still raised at once. Until the check,
    the outputs of a call that recorded an error are undefined: check before using them for an
    optimizer step. A learner queues every micro-batch of a step this way and checks once.
    """
    out, args = _run_unchecked(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, options)
    pending.add(out[len(OUTPUTS)], args)
    return out[0], _stats(out)
