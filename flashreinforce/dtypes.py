"""The floating-point dtype names the trainer's options take, and the torch dtypes they stand for.

One table for every option that names a dtype (``fsdp.param_dtype``, ``rollout.engine_dtype``,
the engines' ``dtype``): an alias (``bf16``) and the canonical name (``bfloat16``) mean the same.
The table itself needs no torch, so configuration code can validate names without importing it;
:func:`torch_dtype` imports torch when it is called. ``auto`` (:func:`resolve_auto_dtype`) is decided
by the machine: bfloat16 on GPUs that have it and on CPUs that compute it natively (and measurably
faster than float32), float32 elsewhere.
"""

from __future__ import annotations

__all__ = ["DTYPE_NAMES", "canonical_dtype", "cpu_computes_bf16", "resolve_auto_dtype", "resolve_dtype", "torch_dtype"]

#: Accepted names -> canonical name (the attribute of ``torch`` that is that dtype).
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


def canonical_dtype(name: str, *, what: str = "dtype") -> str:
    """The canonical name of ``name``; ``ValueError`` naming ``what`` and the accepted names otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"{what} must be one of {sorted(DTYPE_NAMES)}, got {name!r}")
    return DTYPE_NAMES[name]


def torch_dtype(name: str, *, what: str = "dtype"):
    """The ``torch.dtype`` that ``name`` stands for (``ValueError`` as :func:`canonical_dtype`)."""
    import torch

    return getattr(torch, canonical_dtype(name, what=what))


_AUTO_CHOICE: dict[str, tuple[str, str]] = {}


def cpu_computes_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX tiles) that PyTorch uses."""
    import torch

    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(callable(p) and p() for p in probes)


def _bf16_probe_speedup(rounds: int = 15) -> float:
    """How many times faster a bf16-autocast GEMM of a learner-sized product runs than float32 (>1: bf16 is
    faster): the fastest of ``rounds`` float32 timings over the fastest of ``rounds`` bf16 ones, the two
    interleaved. On a loaded machine another process slows some timings of both kinds alike; the fastest of
    each is the machine's own speed (5 timings each, one series after the other, once read 0.93x on a machine
    where bf16 runs 2x). A few tens of milliseconds."""
    import time

    import torch

    a = torch.randn(512, 1024)
    w = torch.randn(2048, 1024)

    def f32():
        return a @ w.t()

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ w.t()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    f32(), bf16()  # first calls pick their kernels
    t_f32, t_bf16 = [], []
    for _ in range(rounds):
        t_f32.append(timed(f32))
        t_bf16.append(timed(bf16))
    return min(t_f32) / min(t_bf16)


def resolve_auto_dtype(device_type: str) -> tuple[str, str]:
    """What ``auto`` means for the learner and the engines on ``device_type``: ``(canonical name, why)``.

    CUDA: bfloat16 where the device supports it, else float32. CPU: bfloat16 only where the CPU computes
    it natively (:func:`cpu_computes_bf16`) and a short probe (a bf16-autocast GEMM against float32, a few
    milliseconds) finds it faster; float32 elsewhere (emulated bf16 is several times slower than float32).
    Decided once per process and device type.
    """
    if device_type in _AUTO_CHOICE:
        return _AUTO_CHOICE[device_type]
    import torch

    if device_type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        choice = ("bfloat16", "the GPU supports bf16") if ok else ("float32", "the GPU has no bf16")
    elif not cpu_computes_bf16():
        choice = ("float32", "this CPU has no native bf16 arithmetic (AVX512-BF16 or AMX)")
    else:
        speedup = _bf16_probe_speedup()
        if speedup > 1.1:
            choice = ("bfloat16", f"this CPU computes bf16 natively and a bf16 GEMM ran {speedup:.1f}x float32's speed")
        else:
            choice = ("float32", f"this CPU computes bf16 natively, but a bf16 GEMM ran only {speedup:.2f}x "
                                 "float32's speed")
    _AUTO_CHOICE[device_type] = choice
    return choice


def resolve_dtype(name: str, device_type: str, *, what: str = "dtype") -> str:
    """The canonical dtype name of ``name`` (``auto`` resolved by :func:`resolve_auto_dtype`)."""
    if name == "auto":
        return resolve_auto_dtype(device_type)[0]
    return canonical_dtype(name, what=what)
