"""CPU decode GEMMs on weights packed once per version, for the hf engine.

A decode step multiplies a few dozen rows (one per request) by every weight matrix of the model,
and on a CPU those skinny products are the step: about three quarters of it for SmolLM2-135M at 32
requests. ``torch.nn.functional.linear`` hands each of them to the BLAS with the weight in its plain
row-major layout, which the library reorganizes into its own blocked panels on every call. The
weights only change when a new version is loaded, so that work can be done once per version.

:func:`pack_linears` switches every ``torch.nn.Linear`` of a model to a forward that multiplies by
a copy of its weight in oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, then
``torch.ops.mkldnn._linear_pointwise``: the pair PyTorch's own compiler emits for frozen CPU
linears). The packed copy is made at the first call and again whenever the weight changed since:
its in-place version counter moved (``load_state_dict`` copies into it) or the parameter was
replaced, so loading weights needs no extra step and a stale copy is never used. Only an inference
call (autograd off) on a CPU tensor of the weight's dtype, float32 or bfloat16, takes the packed
path; any other call is the module's own forward. The packed copies cost one more copy of every
linear weight in memory.

The products agree with ``F.linear`` to float rounding (a different summation order), which the
engine's recorded behavior log-probabilities carry like any other kernel difference; the trust
region measures them. ``docs/performance.md`` has the measured gain.

:func:`pack_weight` and :func:`packed_matmul` also serve the hf engine's own decode step
(:mod:`flashreinforce.engines.hf.fast_decode`), with a choice of kernel (:data:`PRODUCT_KERNELS`):
oneDNN's, or the compiled core's skinny product (``csrc/flashreinforce/skinny_gemm.h``: AVX-512
register kernels that read each weight once per call and use every loaded weight vector for 8
rows; bfloat16 through the AVX-512 BF16 dot product), which ``auto`` picks where this build and
CPU have it. The compiled product sums each output in the order of ``k``, so its results do not
depend on the thread count.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PACKED_DTYPES", "PRODUCT_KERNELS", "PackedWeight", "compiled_products_available", "pack_linears",
           "pack_weight", "packed_linear_available", "packed_matmul", "refresh_packed", "resolve_product_kernel",
           "unpack_linears"]

#: Weight dtypes the packed path takes (others keep ``F.linear``).
PACKED_DTYPES = (torch.float32, torch.bfloat16)

#: Kernels of :func:`pack_weight`: ``auto`` (the compiled core's where :func:`compiled_products_available`,
#: else oneDNN's), ``compiled`` (an error where unavailable) or ``onednn``.
PRODUCT_KERNELS = ("auto", "compiled", "onednn")


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out_features, in_features]`` packed once for :func:`packed_matmul`: ``data`` is its
    copy in the layout of ``kernel`` (``"compiled"``: the compiled core's panels, a flat tensor of the
    weight's dtype; ``"onednn"``: oneDNN's blocked layout)."""
    kernel: str
    data: Tensor
    out_features: int
    in_features: int


@functools.lru_cache(maxsize=None)
def compiled_products_available(dtype: torch.dtype) -> bool:
    """Whether the compiled core's skinny product runs ``dtype`` (float32/bfloat16) weights in this build on
    this CPU (AVX-512F; bfloat16 also AVX-512 BF16)."""
    from flashreinforce.compiled import compiled_has

    if dtype not in PACKED_DTYPES or not compiled_has("skinny_gemm", "skinny_pack", "skinny_gemm_supported"):
        return False
    from flashreinforce import _C

    return bool(_C.skinny_gemm_supported(_DTYPE_NAMES[dtype]))


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # the compiled core's names


def resolve_product_kernel(dtype: torch.dtype, kernel: str, where: str = "pack_weight: kernel") -> str:
    """The kernel (``"compiled"`` or ``"onednn"``) that ``kernel`` (:data:`PRODUCT_KERNELS`) means for
    ``dtype`` weights here: ``auto`` is the compiled core's where :func:`compiled_products_available`.
    Raises ``ValueError``, its message starting with ``where`` (the caller and argument), for a name not
    in :data:`PRODUCT_KERNELS` or ``compiled`` where unavailable."""
    if kernel not in PRODUCT_KERNELS:
        raise ValueError(f"{where} must be one of {PRODUCT_KERNELS}, got {kernel!r}")
    if kernel == "auto":
        return "compiled" if compiled_products_available(dtype) else "onednn"
    if kernel == "compiled" and not compiled_products_available(dtype):
        raise ValueError(f"{where} 'compiled' needs flashreinforce._C's skinny product for {dtype}, which this build "
                         f"or CPU lacks (AVX-512F; bfloat16 also AVX-512 BF16); use 'auto' or 'onednn'")
    return kernel


def pack_weight(weight: Tensor, rows_hint: int, kernel: str = "onednn") -> PackedWeight:
    """``weight [out, in]`` (float32/bfloat16, CPU, no autograd history needed) copied once for
    :func:`packed_matmul` by ``kernel`` (:data:`PRODUCT_KERNELS`; the default, oneDNN's, is what
    :func:`pack_linears` uses). ``rows_hint``: the typical rows of a product (oneDNN may choose its
    blocking by it; any row count is computed correctly)."""
    chosen = resolve_product_kernel(weight.dtype, kernel)
    w = weight.detach().contiguous()
    if chosen == "onednn":
        return PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(w, int(rows_hint)), *w.shape)
    from flashreinforce import _C

    if w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"pack_weight: a 2-D CPU weight is needed, got shape {tuple(w.shape)} on {w.device}")
    out_features, in_features = w.shape
    name = _DTYPE_NAMES[w.dtype]
    data = torch.empty(_C.skinny_gemm_packed_elements(name, out_features, in_features), dtype=w.dtype)
    _C.skinny_pack(name, out_features, in_features, w.data_ptr(), w.stride(0), data.data_ptr(),
                   torch.get_num_threads())
    return PackedWeight("compiled", data, int(out_features), int(in_features))


def packed_matmul(x: Tensor, packed: PackedWeight, bias: Tensor | None) -> Tensor:
    """``x [..., in] @ W.T + bias`` with ``packed`` from :func:`pack_weight` (``x`` of the weight's
    dtype, on the CPU, autograd off; ``bias [out]`` of the same dtype or ``None``): ``[..., out]``."""
    if packed.kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    return _compiled_matmul(x, packed, bias)


def _compiled_matmul(x: Tensor, packed: PackedWeight, bias: Tensor | None) -> Tensor:
    from flashreinforce import _C

    w = packed.data
    n_in, n_out = packed.in_features, packed.out_features
    if x.dtype != w.dtype or x.device.type != "cpu" or x.shape[-1] != n_in:
        raise ValueError(f"packed_matmul: x must be a CPU {w.dtype} tensor [..., {n_in}], got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    if bias is not None:
        if bias.dtype != w.dtype or bias.shape != (n_out,):
            raise ValueError(f"packed_matmul: bias must be {w.dtype} [{n_out}], got {bias.dtype} {tuple(bias.shape)}")
        if bias.stride(0) != 1:
            bias = bias.contiguous()
    rows = x if x.dim() == 2 else x.reshape(-1, n_in)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < n_in):  # e.g. a row broadcast by expand
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], n_out, dtype=w.dtype)
    _C.skinny_gemm(_DTYPE_NAMES[w.dtype], rows.shape[0], n_in, n_out, rows.data_ptr(), rows.stride(0), w.data_ptr(),
                   0 if bias is None else bias.data_ptr(), y.data_ptr(), n_out, torch.get_num_threads())
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n_out)


@functools.lru_cache(maxsize=None)
def packed_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch build and CPU run oneDNN's packed linear ops on ``dtype`` weights and they
    compute a small product correctly (checked once per dtype against ``F.linear``; bfloat16 needs
    AVX-512 or AVX-NE-CONVERT on x86)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        x = torch.randn(3, 5, 40, generator=g).to(dtype)
        with torch.no_grad():
            y = packed_matmul(x, pack_weight(w, 8), b)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _current_packed(module: torch.nn.Linear) -> PackedWeight:
    """The packed copy of ``module.weight`` as it is now (packed again if it changed)."""
    w = module.weight
    # (the weight object, its version counter, the packed copy): a tuple, so the module does not
    # register the weight a second time as a parameter of its own.
    packed_of, version, packed = module._fr_packed
    if packed_of is not w or version != w._version:
        packed = pack_weight(w, module._fr_rows_hint)
        module._fr_packed = (w, w._version, packed)
    return packed


def _packed_forward(self: torch.nn.Linear, x: Tensor) -> Tensor:
    w = self.weight
    if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != w.dtype or not packed_linear_available(w.dtype):
        return F.linear(x, w, self.bias)
    return packed_matmul(x, _current_packed(self), self.bias)


def _is_packed(module: torch.nn.Module) -> bool:
    return "forward" in vars(module) and getattr(module.forward, "__func__", None) is _packed_forward


def pack_linears(model: torch.nn.Module, rows_hint: int = 32) -> int:
    """Switch every ``torch.nn.Linear`` of ``model`` with a float32/bfloat16 CPU weight to the packed
    forward (module docstring); ``rows_hint``: the typical rows of a call (the decode batch), which
    oneDNN may use to choose its blocking (any number of rows is computed correctly). Returns how
    many modules were switched (none whose dtype :func:`packed_linear_available` refuses)."""
    switched = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:  # subclasses may compute something else
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dim() != 2 or not packed_linear_available(w.dtype):
            continue
        module._fr_rows_hint = int(rows_hint)
        module._fr_packed = (None, None, None)
        module.forward = types.MethodType(_packed_forward, module)
        switched += 1
    return switched


def refresh_packed(model: torch.nn.Module) -> int:
    """Pack now every switched module whose weight changed since its copy was made (a forward would
    do it at its first call; the engine calls this right after loading weights, so the cost is
    counted as part of the weight load). Returns how many copies were made."""
    made = 0
    with torch.no_grad():
        for module in model.modules():
            if _is_packed(module):
                before = module._fr_packed[2]
                made += _current_packed(module) is not before
    return made


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo :func:`pack_linears` (free the packed copies); returns how many modules were switched back."""
    switched = 0
    for module in model.modules():
        if _is_packed(module):
            del module.forward
            for name in ("_fr_rows_hint", "_fr_packed"):
                vars(module).pop(name, None)
            switched += 1
    return switched
