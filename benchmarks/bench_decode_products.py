#!/usr/bin/env python
"""The hf engine's decode-step matrix products one by one, against a square product on the same threads.

    python benchmarks/bench_decode_products.py --dtype bf16 --threads 1
    python benchmarks/bench_decode_products.py --dtype fp32 --threads 2 --rows 32 --shape smollm2-135m
    python benchmarks/bench_decode_products.py --dtype bf16 --rows 8 32 64 --sequence --blocks

A decode step multiplies ``--rows`` rows (one per request) by each projection of every layer (the
fused query/key/value and gate/up weights, the attention output, the MLP down projection) and once by
the output embedding. For each of those shapes, best of ``--repeats`` calls of each kernel
(``flashreinforce.engines.hf.packed_linear``): ``compiled``, the compiled core's skinny product the
engine uses where this build and CPU have it; ``onednn``, oneDNN's packed product (the engine's
kernel elsewhere); ``F.linear`` on the plain weight; and, for the output embedding, the oneDNN
product cut into column blocks of ``--blocks`` columns (each block packed on its own, the outputs
concatenated): milliseconds a call, GFLOP/s and the fraction of a square ``--square`` product's rate
measured in the same run (``benchmarks/common.py`` ``gemm_peak``). Random weights of the model
shape's sizes (nothing downloaded); nothing is asserted.

Those calls find their weight in cache (the same weight each repeat); a decode step reads each of
the model's weights once. ``--sequence`` also times the step's products as the step runs them: every
layer with its own packed weights (the whole model's bytes), in the step's order, nothing between
them; the packed kernels take turns, one pass each per round, and the best and median of the rounds
are printed beside the single products' sum.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import SHAPES, best_time, gemm_peak, machine_line, print_table  # noqa: E402

from flashreinforce.engines.hf.packed_linear import (compiled_products_available, pack_weight,  # noqa: E402
                                                     packed_linear_available, packed_matmul)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decode_shapes(cfg: dict) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features, products per step) of a decode step of a Llama-style config."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    layers = cfg["num_hidden_layers"]
    return [("query/key/value", h + 2 * kv, h, layers), ("attention output", h, h, layers),
            ("gate/up", 2 * inter, h, layers), ("down", h, inter, layers),
            ("output embedding", cfg["vocab_size"], h, 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rows", type=int, nargs="+", default=[32], help="rows of each product (requests decoded together)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--square", type=int, default=1024, help="size of the square product measured as the yardstick")
    p.add_argument("--sequence", action="store_true",
                   help="also time a step's products in order, each layer with its own weights")
    p.add_argument("--blocks", type=int, nargs="*", default=[4096, 16384],
                   help="column blocks the output embedding is cut into (none: skip)")
    args = p.parse_args()
    for name, value in (("--rows", min(args.rows)), ("--repeats", args.repeats), ("--square", args.square)):
        if value < 1:
            p.error(f"{name} must be at least 1, got {value}")
    if any(b < 1 for b in args.blocks):
        p.error(f"--blocks must be positive, got {args.blocks}")
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    kernels = [k for k, ok in (("compiled", compiled_products_available(dtype)),
                               ("onednn", packed_linear_available(dtype))) if ok]
    if not kernels:
        sys.exit(f"neither the compiled skinny product nor oneDNN's packed linear for {dtype} here: nothing to measure")
    cpu = torch.device("cpu")
    square = gemm_peak(cpu, dtype, args.square, repeats=args.repeats)
    print(f"machine: {machine_line(cpu)}")
    print(f"{args.shape}, {args.dtype}, {torch.get_num_threads()} threads; square {args.square} product "
          f"{square / 1e9:.0f} GFLOP/s; kernels {', '.join(kernels)}")
    for n_rows in args.rows:
        single_products(args, dtype, n_rows, kernels, square)
        if args.sequence:
            sequence = step_sequence(SHAPES[args.shape], n_rows, dtype, args.repeats, kernels)
            for kernel, (best, median, mib) in sequence.items():
                print(f"{n_rows} rows, a step's products in order, each layer's own weights, {kernel} ({mib:.0f} MiB "
                      f"packed): best {best * 1e3:.1f} ms, median {median * 1e3:.1f} ms")


def single_products(args, dtype: torch.dtype, n_rows: int, kernels: list[str], square: float) -> None:
    """The table of each product shape by each kernel, and each kernel's sum over a step."""
    torch.manual_seed(0)
    rows, step_ms = [], {k: 0.0 for k in [*kernels, "F.linear"]}
    with torch.no_grad():
        for name, n_out, n_in, per_step in decode_shapes(SHAPES[args.shape]):
            x = torch.randn(n_rows, n_in).to(dtype)
            w = (torch.randn(n_out, n_in) / n_in**0.5).to(dtype)
            flops = 2 * n_rows * n_in * n_out
            variants = [(k, lambda q=pack_weight(w, n_rows, k): packed_matmul(x, q, None)) for k in kernels]
            variants.append(("F.linear", lambda: F.linear(x, w)))
            if name == "output embedding" and "onednn" in kernels:
                for block in args.blocks:
                    parts = [pack_weight(w[i:i + block], n_rows) for i in range(0, n_out, block)]
                    variants.append((f"onednn, blocks of {block}",
                                     lambda parts=parts: torch.cat([packed_matmul(x, q, None) for q in parts], dim=1)))
            for label, fn in variants:
                seconds = best_time(fn, args.repeats)
                if label in step_ms:
                    step_ms[label] += seconds * per_step * 1e3
                rows.append([name, f"{n_out} x {n_in}", str(per_step), label, f"{seconds * 1e3:.3f}",
                             f"{flops / seconds / 1e9:.0f}", f"{flops / seconds / square:.2f}"])
    print_table(f"decode-step products, {n_rows} rows (best of the repeats)",
                ["product", "weight", "per step", "kernel", "ms a call", "GFLOP/s", "of the square product"], rows)
    print(f"{n_rows} rows, all products of a step: " + ", ".join(f"{k} {ms:.1f} ms" for k, ms in step_ms.items()))


def step_sequence(cfg: dict, rows: int, dtype: torch.dtype, repeats: int,
                  kernels: list[str]) -> dict[str, tuple[float, float, float]]:
    """For each kernel: best and median seconds of one pass over a decode step's packed products in the
    step's order (per layer: query/key/value, attention output, gate/up, down; then the output
    embedding), every layer with weights of its own, and the packed weights' MiB. The kernels take
    turns, one pass each per round, after one untimed pass each."""
    shapes = decode_shapes(cfg)
    layers = cfg["num_hidden_layers"]
    inputs = {name: torch.randn(rows, n_in).to(dtype) for name, _, n_in, _ in shapes}
    weights = []  # (weight, input) in the step's order
    for _ in range(layers):
        for name, n_out, n_in, per_step in shapes:
            if per_step == layers:
                weights.append(((torch.randn(n_out, n_in) / n_in**0.5).to(dtype), inputs[name]))
    name, n_out, n_in, _ = shapes[-1]
    weights.append(((torch.randn(n_out, n_in) / n_in**0.5).to(dtype), inputs[name]))
    plans = {k: [(pack_weight(w, rows, k), x) for w, x in weights] for k in kernels}
    del weights
    times: dict[str, list[float]] = {k: [] for k in kernels}
    with torch.no_grad():
        for round_ in range(repeats + 1):
            for kernel, plan in plans.items():
                t0 = time.perf_counter()
                for packed, x in plan:
                    packed_matmul(x, packed, None)
                if round_:  # the first round is the warm-up
                    times[kernel].append(time.perf_counter() - t0)
    return {k: (min(t), statistics.median(t), sum(q.data.numel() * q.data.element_size() for q, _ in plans[k]) / 2**20)
            for k, t in times.items()}


if __name__ == "__main__":
    main()
