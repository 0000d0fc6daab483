"""Helpers the benchmarks share: table printing, the machine's measured limits, the CPU's name.

Nothing here is timed against a target; these are the yardsticks the benchmarks report beside
their numbers (a copy bandwidth, a GEMM peak), measured on the machine at hand, so that a result
says how far it is from what this machine can do.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["SHAPES", "copy_bandwidth", "cpu_name", "gemm_peak", "machine_line", "median_time", "print_table"]

#: Model shapes the benchmarks build from a config (random weights, nothing downloaded): the
#: ``transformers`` config keyword arguments, ``model_type`` included.
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, num_hidden_layers=30, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, model_type="llama"),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, num_hidden_layers=24, rope_theta=1000000.0, tie_word_embeddings=True,
                         max_position_embeddings=32768, model_type="qwen2"),
}



def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A Markdown table (cells already formatted) under ``title``."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name) and the instruction set PyTorch dispatches to."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "?")()
    return f"{name}, {torch.get_num_threads()} threads, PyTorch CPU capability {capability}"


def machine_line(device: torch.device) -> str:
    """One line naming the device a benchmark ran on."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"{cpu_name()} (torch {torch.__version__})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                device: torch.device | None = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device is not None:
            _sync(device)
        t0 = time.perf_counter()
        fn()
        if device is not None:
            _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a copy of ``mib`` MiB on ``device`` (bytes read plus bytes written), best
    of ``repeats``: the memory-bound yardstick (a decode step must read every weight once)."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def gemm_peak(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a ``size`` x ``size`` by ``size`` x ``size`` matrix product in ``dtype`` (best of
    ``repeats``): the compute-bound yardstick, measured, not a data-sheet figure."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best
