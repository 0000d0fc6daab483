"""The argument contract of the objective, shared by the fused op and the pure-PyTorch reference.

One definition each of what both entry points must agree on (docs/semantics.md):

* the keywords and their defaults (:data:`KEYWORDS`, :data:`DEFAULTS`, in signature order: the loss options'
  from :class:`flashreinforce.objective.LossOptions`), and the signature both entry points take from them
  (:func:`entry_point`);
* the op's one options argument (:func:`op_options`);
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

import dataclasses
import enum
import inspect
import math
from numbers import Integral, Real
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flashreinforce.objective import KERNEL_OPTIONS, LOSS_AGGREGATIONS, OPTION_FIELDS, LossOptions

__all__ = [
    "CALL_KEYWORDS",
    "CALL_SCALARS",
    "DEFAULTS",
    "KEYWORDS",
    "LOSS_AGGREGATIONS",
    "OP_OPTION_NAMES",
    "OUTPUTS",
    "OUTPUT_NAMES",
    "PROB_CLAMP",
    "STAT_NAMES",
    "Arguments",
    "ErrorCode",
    "check_arguments",
    "compute_dtype_for",
    "entry_point",
    "error_for",
    "op_options",
    "options_mapping",
    "make_stats",
]


#: Probabilities in the Bernoulli-KL gate are clamped to ``[PROB_CLAMP, 1 - PROB_CLAMP]``.
PROB_CLAMP = 1e-6


#: The keywords of one call besides the loss options: its optional tensors and the batch-global values that
#: make a part of a batch a summand of the whole batch's loss. Each defaults to ``None``.
CALL_KEYWORDS = ("entropies", "failures", "reward_baseline", "num_trajectories", "num_policy_tokens")
#: The scalars of one call the fused op carries to the core beside the loss options (its ``LossOptions``
#: struct has both: csrc/flashreinforce/core.h, ``kLossOptionFields``).
CALL_SCALARS = CALL_KEYWORDS[2:]
#: The keyword-only parameters of both entry points, in signature order: the loss options the op
#: carries (:data:`flashreinforce.objective.KERNEL_OPTIONS`, from :class:`LossOptions`' own definition), the
#: call's keywords, and ``options``: a :class:`LossOptions` built once (a run's), which the option keywords
#: given with it override.
KEYWORDS = KERNEL_OPTIONS + CALL_KEYWORDS + ("options",)
#: The defaults of :data:`KEYWORDS` (``DEFAULTS.delta`` is ``LossOptions.delta``).
DEFAULTS = SimpleNamespace(**{name: getattr(LossOptions, name) for name in KERNEL_OPTIONS},
                           **{name: None for name in CALL_KEYWORDS + ("options",)})
_ANNOTATIONS = {"entropies": "Optional[Tensor]", "failures": "Optional[Tensor]",
                "reward_baseline": "Optional[float | Tensor]", "num_trajectories": "Optional[int]",
                "num_policy_tokens": "Optional[int]", "options": "Optional[LossOptions]"}


def entry_point(function):
    """Gives a loss function written as ``f(tensors..., **keywords)`` the signature of :data:`KEYWORDS`
    (keyword-only, with :data:`DEFAULTS`) and its documentation, both derived from :class:`LossOptions`:
    a new option edits neither the fused op's nor the reference's functions. The keywords themselves are
    checked by :func:`check_arguments` (an unknown one is a ``TypeError``, as Python's own)."""
    signature = inspect.signature(function)
    positional = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    annotations = {f.name: _annotation(f) for f in OPTION_FIELDS if f.name in KERNEL_OPTIONS} | _ANNOTATIONS
    keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(DEFAULTS, name),
                                  annotation=annotations[name]) for name in KEYWORDS]
    function.__signature__ = signature.replace(parameters=positional + keywords)
    lines = [f"        {f.name}: {f.metadata['help']} (flag ``--{f.metadata['flag']}``; default ``{f.default!r}``)."
             for f in OPTION_FIELDS if f.name in KERNEL_OPTIONS]
    function.__doc__ = (function.__doc__ or "").rstrip() + "\n\n    Loss options (keyword-only; " \
        ":class:`flashreinforce.objective.LossOptions`, docs/semantics.md), or ``options=LossOptions(...)``:\n" + \
        "\n".join(lines) + "\n"
    return function


def _annotation(f) -> str:
    return {"float": "float", "str": "str", "bool": "bool"}[f.metadata["kind"]] + (
        " | None" if f.default is None else "")


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
    ``padded_width`` is 0 for the packed form. ``options``: the call's :class:`LossOptions`; ``filter`` is
    its ``entropy_filter``.
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
    options: LossOptions
    reward_baseline: Optional[float]
    num_trajectories: Optional[int]
    num_policy_tokens: Optional[int]

    @property
    def filter(self) -> bool:
        return self.options.entropy_filter


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


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype the objective computes in for inputs of ``dtype``: float64 stays float64; float32,
    float16 and bfloat16 compute in float32 (the kernels' accumulation, the gate's clamp bounds)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def check_arguments(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, *, padded: bool,
                    caller: str = "flashreinforce_loss_packed", **keywords) -> Arguments:
    """Validates one call's arguments (both entry points, both layouts) and normalizes the options.

    ``padded``: the ``[B, T]`` form (``cu_seqlens`` is not an argument there and must be ``None``),
    else the packed ``[N]`` form. Order of the checks: tensor kinds, dtypes, devices, shapes, then
    the options; the first failing rule raises. O(1): nothing here reads tensor data (except a
    tensor ``reward_baseline``). Data errors (offsets, masks, values, overflows) are left to the pass
    over the data, see :class:`ErrorCode`. ``keywords``: those of :data:`KEYWORDS` (``caller`` names the
    function in the ``TypeError`` of any other).
    """
    unknown = [name for name in keywords if name not in _KEYWORD_SET]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    entropies, failures = keywords.get("entropies"), keywords.get("failures")
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
    compute_dtype = compute_dtype_for(log_probs.dtype)
    options = keywords.get("options")
    overrides = {name: keywords[name] for name in KERNEL_OPTIONS if name in keywords}
    if options is None:
        options = LossOptions(**overrides)
    elif not isinstance(options, LossOptions):
        raise TypeError(f"options must be a flashreinforce.objective.LossOptions, got {_type_name(options)}")
    elif overrides:
        options = dataclasses.replace(options, **overrides)
    if options.entropy_filter and (entropies is None or failures is None):
        missing = " and ".join(n for n, v in (("entropies", entropies), ("failures", failures)) if v is None)
        raise ValueError(f"negative_token_fraction < 1 needs entropies and failures; missing {missing}")
    reward_baseline = _reward_baseline(keywords.get("reward_baseline"), compute_dtype)
    num_trajectories = _count("num_trajectories", keywords.get("num_trajectories"), batch,
                              "the batch's trajectory count")
    num_policy_tokens = _count("num_policy_tokens", keywords.get("num_policy_tokens"), 1, "one token")

    return Arguments(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, entropies, failures,
                     num_tokens, batch, width, compute_dtype, options, reward_baseline, num_trajectories,
                     num_policy_tokens)


_KEYWORD_SET = frozenset(KEYWORDS)


#: The names of the fused op's options, in the order of its one options argument (:func:`op_options`).
OP_OPTION_NAMES = KERNEL_OPTIONS + CALL_SCALARS
_CHOICES = {f.name: f.metadata["choices"] for f in OPTION_FIELDS if f.metadata["choices"]}
_COUNTS = frozenset(("num_trajectories", "num_policy_tokens"))


def op_options(options: LossOptions, reward_baseline: Optional[float] = None, num_trajectories: Optional[int] = None,
               num_policy_tokens: Optional[int] = None) -> list:
    """The fused op's one options argument (a ``Scalar[]`` of the registered op): the values of
    :data:`OP_OPTION_NAMES` in order, the loss options it carries (:data:`KERNEL_OPTIONS` of the checked
    ``options``) then the call's checked scalars (:data:`CALL_SCALARS`). Exact for every value (64-bit counts stay
    integers); a string option is its index among its choices, ``None`` is NaN (a real: no option takes NaN)
    or -1 (a count). Plain Python, so that ``torch.compile`` traces it (symbolic floats included).
    :func:`options_mapping` reads it back; the core fills its ``LossOptions`` from that mapping through its field
    table (csrc/flashreinforce/core.h)."""
    values = [getattr(options, name) for name in KERNEL_OPTIONS] + [reward_baseline, num_trajectories,
                                                                     num_policy_tokens]
    packed = []
    for name, value in zip(OP_OPTION_NAMES, values):
        if name in _CHOICES:
            value = _CHOICES[name].index(value)
        elif value is None:
            value = -1 if name in _COUNTS else math.nan
        packed.append(value)
    return packed


def options_mapping(packed) -> dict:
    """The mapping by name of the op's options argument (:func:`op_options`), as the core reads it."""
    out = {}
    for name, value in zip(OP_OPTION_NAMES, packed):
        if name in _CHOICES:
            value = _CHOICES[name][int(value)]
        elif name in _COUNTS:
            value = None if value == -1 else int(value)
        elif isinstance(value, float) and math.isnan(value):
            value = None
        out[name] = value
    return out


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
