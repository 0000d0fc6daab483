"""Where a step's time goes: one call under ``torch.profiler``, summarized as tables.

:func:`profile_breakdown` runs a callable once under the profiler and returns

* a breakdown by category (matrix products, attention, the fused loss, elementwise and
  reductions, copies and casts, optimizer, other) of the *device* time: on CUDA the kernels'
  own durations, on the CPU the self time of the operators (no double counting: a kernel or an
  operator's self time is counted once);
* the busy share: that time over the call's wall-clock time (on CUDA, what is left is the time
  the GPU waited for the host: launches, synchronizations, Python);
* the heaviest kernels or operators by self time.

Categories come from the kernel and operator names (regular expressions below, first match wins);
they are a reading aid, not an exact attribution (a cuBLAS kernel fused with an epilogue is a
matrix product; the fused loss's kernels live in the ``flashreinforce`` namespace).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Callable

import torch

__all__ = ["CATEGORIES", "profile_breakdown"]

#: (category, pattern over the lower-cased kernel or operator name), first match wins.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("fused loss", r"flashreinforce|flash_reinforce"),
    ("attention", r"flash_fwd|flash_bwd|fmha|attention|sdpa|scaled_dot|flex"),
    ("matrix products", r"gemm|xmma|cutlass|cublas|sm\d+_|aten::(mm|addmm|bmm|baddbmm|linear|matmul)\b"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copies and casts", r"memcpy|memset|copy|aten::to\b|_to_copy|aten::cat|index|gather|scatter|contiguous"),
    ("elementwise and reductions", r"elementwise|vectorized|reduce|softmax|exp|log|mul|add|sub|div|sum|max|norm|silu|rsqrt|pow|where|clamp|fill"),
)


def _category(name: str) -> str:
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def profile_breakdown(fn: Callable[[], object], device: torch.device, *, top: int = 12) -> dict:
    """Run ``fn()`` once under the profiler on ``device`` (CPU or CUDA).

    Returns ``{"wall_ms", "busy_ms", "busy_share", "categories": [(name, ms, share of busy)],
    "top": [(name, calls, ms)]}``: times in milliseconds, ``busy`` = device time on CUDA, operator
    self time on the CPU (it can exceed the wall time there, with several threads)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    per_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        on_device = evt.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda:
            continue
        us = evt.device_time_total if cuda else evt.self_cpu_time_total
        if us <= 0:
            continue
        per_name[evt.name][0] += 1
        per_name[evt.name][1] += us / 1e3
    busy = sum(ms for _, ms in per_name.values())
    by_category: dict[str, float] = defaultdict(float)
    for name, (_, ms) in per_name.items():
        by_category[_category(name)] += ms
    categories = sorted(((k, v, v / busy if busy else 0.0) for k, v in by_category.items()), key=lambda r: -r[1])
    heaviest = sorted(((name, calls, ms) for name, (calls, ms) in per_name.items()), key=lambda r: -r[2])[:top]
    return dict(wall_ms=wall * 1e3, busy_ms=busy, busy_share=busy / (wall * 1e3) if wall > 0 else 0.0,
                categories=categories, top=heaviest)
