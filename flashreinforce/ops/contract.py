"""The argument contract of the objective, shared by the fused op and the pure-PyTorch reference.

One definition each of what both entry points must agree on (docs/semantics.md):

* the keyword options and their defaults (:data:`DEFAULTS`, in signature order);
* the outputs of the fused op in order (:data:`OUTPUTS`) and the statistics (:data:`STAT_NAMES`);
* the argument rules (:func:`check_arguments`): tensor kinds, dtypes, devices, shapes and option
  values, all O(1) (no pass over the tokens, no read of device memory except a tensor
  ``reward_baseline``), raising ``ValueError`` / ``TypeError`` with one message per rule;
* the value errors that need a pass over the data (:class:`ErrorCode`, the reporting priority) and
  their exceptions (:func:`error_for`): the fused op's core finds them during its single pass and
  the reference with plain tensor operations, and both raise the exception built here.

This module imports only the standard library, NumPy and PyTorch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flashreinforce.objective import LOSS_AGGREGATIONS, LossOptions

__all__ = [
    "DEFAULTS",
    "KEYWORDS",
    "LOSS_AGGREGATIONS",
    "OUTPUTS",
    "OUTPUT_NAMES",
    "PROB_CLAMP",
    "STAT_NAMES",
    "Arguments",
    "ErrorCode",
    "check_arguments",
    "error_for",
    "make_stats",
]


#: Probabilities in the Bernoulli-KL gate are clamped to ``[PROB_CLAMP, 1 - PROB_CLAMP]``.
PROB_CLAMP = 1e-6


@dataclass(frozen=True)
class Defaults:
    """The keyword-only parameters of both entry points, in signature order, with their defaults
    (the options' defaults are :class:`flashreinforce.objective.LossOptions`')."""

    delta: float = LossOptions.delta
    negative_token_fraction: float = LossOptions.negative_token_fraction
    entropies: Optional[Tensor] = None
    failures: Optional[Tensor] = None
    reward_baseline: Optional[float] = None
    num_trajectories: Optional[int] = None
    loss_agg: str = LossOptions.loss_agg
    loss_scale_factor: Optional[float] = LossOptions.loss_scale_factor
    num_policy_tokens: Optional[int] = None
    no_is: bool = LossOptions.no_is
    gate_metric: str = LossOptions.gate_metric
    is_truncation: float = LossOptions.is_truncation


DEFAULTS = Defaults()
KEYWORDS = tuple(f.name for f in fields(Defaults))


class Output(NamedTuple):
    """One output of the fused op: ``shape`` is ``()`` (scalar), ``"N"`` (like ``log_probs``) or
    ``"B"`` (one per trajectory); ``dtype`` is ``"compute"``, ``"log_probs"`` or a torch dtype."""

    name: str
    shape: object
    dtype: object


#: The fused op's outputs, in order (the registered op returns them, then the error record).
OUTPUTS = (
    Output("loss", (), "compute"),
    Output("grad", "N", "log_probs"),
    Output("advantages", "B", "compute"),
    Output("sequence_kl", "B", "compute"),
    Output("admitted", "B", torch.bool),
    Output("acceptance_rate", (), "compute"),
    Output("policy_tokens", "B", torch.int64),
    Output("retained_tokens", "B", torch.int64),
)
OUTPUT_NAMES = tuple(o.name for o in OUTPUTS)
#: The detached statistics returned with the loss, in order.
STAT_NAMES = OUTPUT_NAMES[2:]


def make_stats(**values: Tensor) -> dict[str, Tensor]:
    """The statistics dict in :data:`STAT_NAMES` order (every name exactly once)."""
    if values.keys() != set(STAT_NAMES):
        raise TypeError(f"statistics must be exactly {STAT_NAMES}, got {tuple(values)}")
    return {name: values[name] for name in STAT_NAMES}


# ------------------------------------------------------------------------------------------------
# Argument rules

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_NAMES = "float16, bfloat16, float32 or float64"
_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
             torch.uint64)
_REWARD_DTYPES = _FLOATS + _INTEGERS
# float32 rounds every magnitude from (2 - 2^-24) * 2^127 up to infinity.
_FLOAT32_OVERFLOW = 3.4028235677973366e38


class Arguments(NamedTuple):
    """The arguments of one call after :func:`check_arguments` (tensors as given, options normalized).

    ``cu_seqlens`` is ``None`` for the padded form, whose offsets are ``cu[i] = i * padded_width``;
    ``padded_width`` is 0 for the packed form. ``filter`` is ``negative_token_fraction < 1``.
    """

    log_probs: Tensor
    behavior_log_probs: Tensor
    rewards: Tensor
    cu_seqlens: Optional[Tensor]
    action_mask: Optional[Tensor]
    entropies: Optional[Tensor]
    failures: Optional[Tensor]
    num_tokens: int
    batch: int
    padded_width: int
    compute_dtype: torch.dtype
    delta: float
    negative_token_fraction: float
    reward_baseline: Optional[float]
    num_trajectories: Optional[int]
    loss_agg: str
    loss_scale_factor: Optional[float]
    num_policy_tokens: Optional[int]
    no_is: bool
    gate_metric: str
    is_truncation: float

    @property
    def filter(self) -> bool:
        return self.negative_token_fraction < 1.0


def _type_name(value) -> str:
    return type(value).__name__


def _tensor(name: str, value, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {_type_name(value)}")


def _float_dtype(name: str, value: Optional[Tensor]) -> None:
    if value is not None and value.dtype not in _FLOATS:
        raise ValueError(f"{name} must be a floating-point tensor ({_FLOAT_NAMES}), got {value.dtype}")


def _bool_dtype(name: str, value: Optional[Tensor]) -> None:
    if value is not None and value.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got {value.dtype}")


def _real_number(name: str, value, requirement: str) -> float:
    """A Python or NumPy real number that is not a bool (bools are flags, not numbers)."""
    if type(value) is float:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, Real):  # NumPy bools are not Real either
        raise ValueError(f"{name} {requirement}, got {value!r}")
    return float(value)


#: The largest count the op takes: its counts are 64-bit signed integers.
COUNT_LIMIT = 2**63 - 1


def _count(name: str, value, minimum: int, what: str) -> Optional[int]:
    """An optional count: a Python or NumPy integer (not a bool) from ``minimum`` to :data:`COUNT_LIMIT`."""
    if value is None:
        return None
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, Integral)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be at least {what} ({minimum}), got {value}")
    if value > COUNT_LIMIT:
        raise ValueError(f"{name} must be at most 2**63 - 1 (a 64-bit count), got {value}")
    return value


def finite_in(value: float, compute_dtype: torch.dtype) -> bool:
    """Whether a float64 value stays finite once rounded to ``compute_dtype`` (float32 or float64)."""
    if compute_dtype == torch.float64:
        return math.isfinite(value)
    return -_FLOAT32_OVERFLOW < value < _FLOAT32_OVERFLOW


def _reward_baseline(value, compute_dtype: torch.dtype) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, Tensor):
        # A one-element real tensor (read once: a host synchronization for a CUDA tensor).
        if value.numel() != 1 or value.dtype not in _REWARD_DTYPES:
            raise ValueError(f"reward_baseline must be a real number or a one-element real tensor, got a "
                             f"{value.dtype} tensor of shape {tuple(value.shape)}")
        value = float(value)
    else:
        value = _real_number("reward_baseline", value, "must be a real number or a one-element real tensor")
    if not finite_in(value, compute_dtype):
        raise ValueError(f"reward_baseline must be finite in the compute dtype "
                         f"({str(compute_dtype).replace('torch.', '')}), got {value!r}")
    return value


def check_arguments(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, *, padded: bool, delta,
                    negative_token_fraction, entropies, failures, reward_baseline, num_trajectories, loss_agg,
                    loss_scale_factor, num_policy_tokens, no_is, gate_metric=DEFAULTS.gate_metric,
                    is_truncation=DEFAULTS.is_truncation) -> Arguments:
    """Validates one call's arguments (both entry points, both layouts) and normalizes the options.

    ``padded``: the ``[B, T]`` form (``cu_seqlens`` is not an argument there and must be ``None``),
    else the packed ``[N]`` form. Order of the checks: tensor kinds, dtypes, devices, shapes, then
    the options; the first failing rule raises. O(1): nothing here reads tensor data (except a
    tensor ``reward_baseline``). Data errors (offsets, masks, values, overflows) are left to the pass
    over the data, see :class:`ErrorCode`.
    """
    # Kinds.
    _tensor("log_probs", log_probs, True)
    _tensor("behavior_log_probs", behavior_log_probs, True)
    _tensor("rewards", rewards, True)
    if not padded:
        _tensor("cu_seqlens", cu_seqlens, True)
    _tensor("action_mask", action_mask, padded)
    _tensor("entropies", entropies, False)
    _tensor("failures", failures, False)

    # Dtypes.
    _float_dtype("log_probs", log_probs)
    _float_dtype("behavior_log_probs", behavior_log_probs)
    _float_dtype("entropies", entropies)
    _bool_dtype("action_mask", action_mask)
    _bool_dtype("failures", failures)
    if rewards.dtype not in _REWARD_DTYPES:
        raise ValueError(f"rewards must be a real-valued tensor (floating-point or integer), got {rewards.dtype}")
    if not padded and cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")

    # Devices.
    device = log_probs.device
    for name, value in (("behavior_log_probs", behavior_log_probs), ("rewards", rewards),
                        ("cu_seqlens", cu_seqlens), ("action_mask", action_mask), ("entropies", entropies),
                        ("failures", failures)):
        if value is not None and value.device != device:
            raise ValueError(f"{name} is on {value.device} but log_probs is on {device}")

    # Shapes.
    shape = log_probs.shape
    if padded:
        if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
            raise ValueError(f"log_probs must be a non-empty [B, T] tensor, got shape {tuple(shape)}")
        batch, width = shape[0], shape[1]
        for name, value in (("behavior_log_probs", behavior_log_probs), ("action_mask", action_mask),
                            ("entropies", entropies)):
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} must have shape {tuple(shape)} like log_probs, got {tuple(value.shape)}")
        if rewards.shape != (batch,):
            raise ValueError(f"rewards must have shape [{batch}] (one per row of log_probs), "
                             f"got {tuple(rewards.shape)}")
        num_tokens = batch * width
    else:
        if len(shape) != 1 or shape[0] == 0:
            raise ValueError(f"log_probs must be a non-empty 1-D [N] tensor, got shape {tuple(shape)}")
        if rewards.dim() != 1 or rewards.shape[0] == 0:
            raise ValueError(f"rewards must be a non-empty 1-D [B] tensor, got shape {tuple(rewards.shape)}")
        num_tokens, batch, width = shape[0], rewards.shape[0], 0
        for name, value in (("behavior_log_probs", behavior_log_probs), ("action_mask", action_mask),
                            ("entropies", entropies)):
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} must have shape [{num_tokens}] like log_probs, got {tuple(value.shape)}")
        if cu_seqlens.shape != (batch + 1,):
            raise ValueError(f"cu_seqlens must have shape [B+1] = [{batch + 1}], got {tuple(cu_seqlens.shape)}")
    if failures is not None and failures.shape != (batch,):
        raise ValueError(f"failures must have shape [{batch}] like rewards, got {tuple(failures.shape)}")

    # Options: the objective's own (one check, LossOptions'), then those that depend on this call.
    compute_dtype = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    options = LossOptions(delta=delta, negative_token_fraction=negative_token_fraction, loss_agg=loss_agg,
                          loss_scale_factor=loss_scale_factor, no_is=no_is, gate_metric=gate_metric,
                          is_truncation=is_truncation)
    if options.entropy_filter and (entropies is None or failures is None):
        missing = " and ".join(n for n, v in (("entropies", entropies), ("failures", failures)) if v is None)
        raise ValueError(f"negative_token_fraction < 1 needs entropies and failures; missing {missing}")
    reward_baseline = _reward_baseline(reward_baseline, compute_dtype)
    num_trajectories = _count("num_trajectories", num_trajectories, batch, "the batch's trajectory count")
    num_policy_tokens = _count("num_policy_tokens", num_policy_tokens, 1, "one token")

    return Arguments(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, entropies, failures,
                     num_tokens, batch, width, compute_dtype, options.delta, options.negative_token_fraction,
                     reward_baseline, num_trajectories, options.loss_agg, options.loss_scale_factor, num_policy_tokens,
                     options.no_is, options.gate_metric, options.is_truncation)


# ------------------------------------------------------------------------------------------------
# Value errors found in the pass over the data


class ErrorCode(enum.IntEnum):
    """Errors found in the pass over the data; the order is the reporting priority (the smallest
    code wins, then the smallest index). ``index`` is what the error record holds."""

    OK = 0
    BAD_CU_SEQLENS = 1         # index: i with cu[i] < cu[i-1], or 0 / B for a bad first / last offset
    NO_POLICY_TOKENS = 2       # index: trajectory
    TOO_FEW_POLICY_TOKENS = 3  # index: the batch's policy-token count
    NON_FINITE_REWARD = 4      # index: trajectory
    NON_FINITE_ADVANTAGE = 5   # index: trajectory
    BAD_LOG_PROB = 6           # index: token
    BAD_BEHAVIOR_LOG_PROB = 7  # index: token
    BAD_ENTROPY = 8            # index: token
    RATIO_OVERFLOW = 9         # index: token
    GRADIENT_OVERFLOW = 10     # index: token


def _token(index: int, padded_width: int) -> str:
    if padded_width > 0:
        return f"{index} (row {index // padded_width}, column {index % padded_width})"
    return str(index)


def _flat_value(tensor: Optional[Tensor], index: int) -> Optional[float]:
    """Element ``index`` of the flattened tensor as a float (one read; None without a tensor)."""
    if tensor is None:
        return None
    return float(tensor.reshape(-1)[index])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def error_for(code: int, index: int, args: Optional[Arguments] = None, *, num_tokens: Optional[int] = None,
              batch: Optional[int] = None) -> Exception:
    """The exception of an error record ``(code, index)``, with the contract's message.

    With ``args`` (the call's checked arguments) the message quotes the offending value, read from
    the inputs; without them (:func:`flashreinforce.ops.raise_for_error` after a captured launch)
    only ``num_tokens`` and ``batch`` are known and the message omits the values.
    """
    code = ErrorCode(code)
    if args is not None:
        num_tokens, batch, width = args.num_tokens, args.batch, args.padded_width
    else:
        width = 0

    def value(tensor_name: str, i: int) -> str:
        if args is None:
            return "(value not read)"
        v = _flat_value(getattr(args, tensor_name), i)
        return repr(v) if v is not None else "(none)"

    if code == ErrorCode.BAD_CU_SEQLENS:
        if index == 0:
            return ValueError(f"cu_seqlens must start at 0, got {_int_value(args, 0)}")
        if index == batch:
            return ValueError(f"cu_seqlens must end at N = {num_tokens} (the length of log_probs), "
                              f"got {_int_value(args, index)}")
        return ValueError(f"cu_seqlens must be non-decreasing (cu_seqlens[{index}] is smaller than the offset "
                          "before it)")
    if code == ErrorCode.NO_POLICY_TOKENS:
        return ValueError(f"action_mask: trajectory {index} has no policy token")
    if code == ErrorCode.TOO_FEW_POLICY_TOKENS:
        given = args.num_policy_tokens if args is not None else "num_policy_tokens"
        return ValueError(f"num_policy_tokens must be at least the batch's policy-token count ({index}), "
                          f"got {given}")
    compute = _dtype_name(args.compute_dtype) if args is not None else "the compute dtype"
    if code == ErrorCode.NON_FINITE_REWARD:
        return ValueError(f"rewards must be finite in the compute dtype ({compute}): "
                          f"rewards[{index}] = {value('rewards', index)}")
    if code == ErrorCode.NON_FINITE_ADVANTAGE:
        if args is None:
            detail = ""
        else:
            baseline = args.reward_baseline
            if baseline is None:
                baseline = float(args.rewards.double().sum()) / args.batch
            detail = f": rewards[{index}] - baseline = {_flat_value(args.rewards, index)!r} - {baseline!r}"
        return ValueError(f"rewards: the advantage of trajectory {index} is not finite in the compute dtype "
                          f"({compute}){detail}")
    if code in (ErrorCode.BAD_LOG_PROB, ErrorCode.BAD_BEHAVIOR_LOG_PROB):
        name = "log_probs" if code == ErrorCode.BAD_LOG_PROB else "behavior_log_probs"
        return ValueError(f"{name}: policy token {_token(index, width)} has log probability {value(name, index)}; "
                          "policy-token log probabilities must be finite and <= 0")
    if code == ErrorCode.BAD_ENTROPY:
        return ValueError(f"entropies: policy token {_token(index, width)} has non-finite entropy "
                          f"{value('entropies', index)}")
    if code == ErrorCode.RATIO_OVERFLOW:
        if args is None:
            detail = "log_probs - behavior_log_probs is too large"
        else:
            diff = _flat_value(args.log_probs, index) - _flat_value(args.behavior_log_probs, index)
            detail = f"log_probs - behavior_log_probs = {diff!r} is too large"
        return FloatingPointError(f"importance ratio overflows on active token {_token(index, width)} ({detail})")
    if code == ErrorCode.GRADIENT_OVERFLOW:
        storage = _dtype_name(args.log_probs.dtype) if args is not None else "the dtype of log_probs"
        return FloatingPointError(f"gradient overflows {storage} (the dtype of log_probs) on active token "
                                  f"{_token(index, width)}: ratio * advantage * trajectory scale is too large")
    raise ValueError(f"unknown error code {int(code)}")


def _int_value(args: Optional[Arguments], index: int) -> str:
    if args is None or args.cu_seqlens is None:
        return "(value not read)"
    return str(int(args.cu_seqlens[index]))
