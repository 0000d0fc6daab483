#!/usr/bin/env python
"""The compiled decode-step attention alone, at an engine's shape, per instruction-set build, against
reading the same cache and against PyTorch's SDPA.

    python benchmarks/bench_decode_attention.py
    python benchmarks/bench_decode_attention.py --dtype bf16 --isa best avx512 avx2 --length 128 512

A decode step of the hf engine calls ``fused_decode_attention`` once per layer: ``--batch`` requests,
``--kv-heads`` key/value heads of ``--groups`` queries each, ``--head-dim``, over ``--length``
positions of a cache of ``--capacity`` (default: the length plus 8) positions, a few leading
positions of each request masked (left padding, as the engine's padded prompts). ``--layers`` layers
each read their own cache, as a step does, so that the keys and values come from memory, not from
cache. Each ``--isa`` runs in a subprocess with ``FLASHREINFORCE_CPU_ISA`` set (``best``: unset; see
docs/kernel.md, "Instruction sets"; ``avx512`` is AVX-512 without its BF16 extension), one after the
other, ``--rounds`` times in turn; printed per dtype, build and length: the median over rounds of
the best-of-``--repeats`` time of one pass over the layers, as milliseconds a step, microseconds a
layer, nanoseconds per (request, key/value head, position) and GB/s of keys and values read;
beside it the rate at which ``torch.sum`` reads the same keys and values as 32-bit integers (a
streaming read of the same bytes) and ``scaled_dot_product_attention`` on the same tensors (``--sdpa``). Random data; nothing
is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine_line, print_table  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_case(args, dtype: torch.dtype, length: int):
    """The layers' caches (keys and values [batch, kv_heads, capacity, head_dim] each), the queries
    ``[batch, kv_heads, groups, head_dim]`` and the mask ``[batch, length]``."""
    g = torch.Generator().manual_seed(length)
    capacity = args.capacity or length + 8
    shape = (args.batch, args.kv_heads, capacity, args.head_dim)
    caches = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
              for _ in range(args.layers)]
    q = torch.randn(args.batch, args.kv_heads, args.groups, args.head_dim, generator=g).to(dtype)
    attend = torch.ones(args.batch, length, dtype=torch.bool)
    for b in range(args.batch):
        attend[b, :b % min(16, length)] = False  # left padding of 0-15 positions
    return caches, q, attend


def best_pass(fn, layers: int, repeats: int) -> float:
    """Best seconds of ``repeats`` passes of ``fn(layer)`` over the layers, after one untimed pass."""
    for layer in range(layers):
        fn(layer)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(layers):
            fn(layer)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(args) -> dict:
    """One build's times (this process's FLASHREINFORCE_CPU_ISA): {dtype: {length: {kernel: seconds}}}."""
    from flashreinforce import _C
    from flashreinforce.engines.hf.decode_attention import fused_decode_attention

    out: dict = {"isa": _C.cpu_isa(), "avx512_bf16": bool(_C.cpu_avx512_bf16()), "times": {}}
    scale = args.head_dim ** -0.5
    with torch.no_grad():
        for name in args.dtype:
            for length in args.length:
                caches, q, attend = build_case(args, DTYPES[name], length)
                keys = [k[:, :, :length] for k, _ in caches]
                values = [v[:, :, :length] for _, v in caches]
                # the same bytes as 32-bit integers: a streaming read whose speed does not depend on the dtype
                words = [(k.view(torch.int32), v.view(torch.int32)) for k, v in zip(keys, values)]
                row = {"compiled": best_pass(lambda i: fused_decode_attention(q, keys[i], values[i], attend, scale),
                                             args.layers, args.repeats),
                       "read": best_pass(lambda i: (words[i][0].sum(), words[i][1].sum()), args.layers, args.repeats)}
                if args.sdpa:
                    mask = attend[:, None, None, :]
                    row["sdpa"] = best_pass(lambda i: F.scaled_dot_product_attention(
                        q, keys[i], values[i], attn_mask=mask, scale=scale), args.layers, args.repeats)
                out["times"].setdefault(name, {})[str(length)] = row
    return out


def run_build(isa: str, argv: list[str]) -> dict:
    """measure() in a subprocess with FLASHREINFORCE_CPU_ISA set for ``isa`` (``best``: unset)."""
    env = dict(os.environ)
    env.pop("FLASHREINFORCE_CPU_ISA", None)
    if isa != "best":
        env["FLASHREINFORCE_CPU_ISA"] = isa
    done = subprocess.run([sys.executable, __file__, *argv, "--child"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the {isa} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--isa", nargs="+", choices=("best", "avx512", "avx2", "generic"), default=["best", "avx512"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--length", type=int, nargs="+", default=[128])
    p.add_argument("--capacity", type=int, default=0, help="cache positions (0: the longest --length plus 8)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="the builds run in turn this many times")
    p.add_argument("--sdpa", action="store_true", help="also time scaled_dot_product_attention")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("batch", "kv_heads", "groups", "head_dim", "layers", "repeats", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.length) < 1:
        p.error(f"--length must be at least 1, got {args.length}")
    if args.capacity and args.capacity < max(args.length):
        p.error(f"--capacity ({args.capacity}) must hold the longest --length ({max(args.length)})")
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args)))
        return
    argv = sys.argv[1:]
    print(f"machine: {machine_line(torch.device('cpu'))}")
    print(f"{args.batch} requests x {args.kv_heads} key/value heads x {args.groups} queries, head size "
          f"{args.head_dim}, {args.layers} layers, {torch.get_num_threads()} threads")
    runs: dict[str, list[dict]] = {isa: [] for isa in args.isa}
    for round_ in range(args.rounds):
        for isa in args.isa:
            runs[isa].append(run_build(isa, argv))
            print(f"round {round_ + 1}/{args.rounds}: {isa} done", file=sys.stderr)
    rows = []
    for name in args.dtype:
        elem = torch.tensor([], dtype=DTYPES[name]).element_size()
        for length in args.length:
            positions = args.batch * args.kv_heads * length
            step_bytes = 2 * positions * args.head_dim * elem * args.layers
            for isa in args.isa:
                first = runs[isa][0]
                build = first["isa"] + (" + BF16" if first["avx512_bf16"] else "")
                for kernel in ("compiled", "read", "sdpa"):
                    if kernel not in first["times"][name][str(length)]:
                        continue
                    if kernel != "compiled" and isa != args.isa[0]:
                        continue  # PyTorch's rows do not depend on the core's build
                    s = statistics.median(r["times"][name][str(length)][kernel] for r in runs[isa])
                    label = {"compiled": f"compiled ({build})", "read": "reading the same keys and values",
                             "sdpa": "scaled_dot_product_attention"}[kernel]
                    rows.append([name, str(length), label, f"{s * 1e3:.2f}", f"{s / args.layers * 1e6:.0f}",
                                 f"{s / args.layers / positions * 1e9:.2f}",
                                 f"{step_bytes / s / 1e9:.1f}"])
    print_table("decode attention, a step's layers (median over rounds of the best of the repeats)",
                ["dtype", "length", "kernel", "ms a step", "us a layer", "ns a position", "GB/s of keys + values"],
                rows)


if __name__ == "__main__":
    main()
