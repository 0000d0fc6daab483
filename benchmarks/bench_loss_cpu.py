"""CPU benchmark of the fused FlashREINFORCE loss (the CPU targets of docs/performance.md).

Forward + backward over a packed batch, side by side with a straightforward eager PyTorch
implementation of the same objective (segment sums with ``index_add_``) and with ``torch.compile``
of that implementation. Prints tables of medians and ratios:

1. the main comparison (N = 4,194,304 tokens, B = 1024 uneven trajectories, 90% policy tokens,
   float32, delta = 3e-3) at 2 threads, with ns/token;
   then the same fused call right after a PyTorch parallel op, and with / without an action mask;
2. 1 vs 2 threads, with every call after a 30 ms pause and back-to-back;
3. N from 64k to 16M at B = 1024: ns/token, and ns/token beyond the per-call overhead (the time of
   an 8,192-token call), whose flat column means linear time;
4. the entropy filter (q = 0.5, half the trajectories failed) vs the base path;
5. heap memory held between forward and backward, per implementation (fresh subprocesses);
6. per instruction set of the fused path (generic, AVX2, AVX-512, up to what the CPU has), each in a
   subprocess with FLASHREINFORCE_CPU_ISA: fused against eager side by side, and back-to-back calls
   with 1 thread and with N.

    python benchmarks/bench_loss_cpu.py              # everything (a few minutes on 2 cores)
    python benchmarks/bench_loss_cpu.py --quick      # fewer repeats, smaller sweep
    python benchmarks/bench_loss_cpu.py --isa-table  # only table 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import flashreinforce as fr
from common import eager_loss, eager_step, fused_step, loss_batch, median_time, print_table
from flashreinforce import _C


# The batch (common.loss_batch) and the straightforward eager implementation (common.eager_loss: what
# a user would write; no entropy filter) are shared with bench_loss_cuda.py.


# ------------------------------------------------------------------------------------------------
# Timing


def time_interleaved(fns: dict, repeats: int, warmup: int = 2, threads: dict | None = None) -> dict:
    """Median seconds per call of each function, measured in interleaved rounds (one call of each
    per round) so that load from other processes affects every entry alike. ``threads`` optionally
    sets torch's thread count per entry. Each call starts after a 30 ms pause: PyTorch's OpenMP
    threads keep spinning for milliseconds after a parallel region (GOMP_SPINCOUNT), and would
    otherwise take the cores from whatever entry comes next (see `after_openmp` in main)."""
    threads = threads or {}
    default = torch.get_num_threads()
    samples = {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name, fn in fns.items():
            torch.set_num_threads(threads.get(name, default))
            time.sleep(0.03)
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                samples[name].append(time.perf_counter() - t0)
    torch.set_num_threads(default)
    return {name: statistics.median(v) for name, v in samples.items()}


def machine_parallelism(threads: int) -> float:
    """Speedup of a plain PyTorch elementwise op from 1 to `threads` threads right now: a
    reference for the thread-scaling numbers (other processes on the machine lower it)."""
    x = torch.rand(16 * 2**20)
    out = torch.empty_like(x)
    times = []
    for n in (1, threads):
        torch.set_num_threads(n)
        times.append(median_time(lambda: torch.exp(x, out=out), 7, warmup=2))
    torch.set_num_threads(threads)
    return times[0] / times[1]


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.2f}"


# ------------------------------------------------------------------------------------------------
# Memory: bytes the C heap holds while the forward's results are alive (glibc mallinfo2; PyTorch's
# CPU tensors, NumPy arrays and the core's vectors all come from it), measured in a fresh
# subprocess per implementation after a warm-up on a small batch.


class _MallInfo2(__import__("ctypes").Structure):
    _fields_ = [(name, __import__("ctypes").c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> int:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _memory_child(kind: str, num_tokens: int, batch: int) -> None:
    data = loss_batch(num_tokens, batch)
    small = loss_batch(65536, 16, seed=9)

    def forward(d):
        lp = d["log_probs"].requires_grad_()
        if kind == "eager":
            return eager_loss(lp, d["behavior_log_probs"], d["rewards"], d["cu_seqlens"], d["action_mask"])
        opts = {} if kind == "fused" else dict(negative_token_fraction=0.5, entropies=d["entropies"],
                                                failures=d["failures"])
        return fr.flashreinforce_loss_packed(lp, d["behavior_log_probs"], d["rewards"], d["cu_seqlens"],
                                             d["action_mask"], delta=3e-3, **opts)[0]

    forward(small).backward()  # lazy initialization
    before = _heap_in_use()
    loss = forward(data)  # the results (and whatever autograd saved) are alive here
    held = _heap_in_use() - before
    loss.backward()
    print(json.dumps({"held_mib": held / 2**20}))


def measure_memory(kind: str, num_tokens: int, batch: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--memory-child", kind, str(num_tokens), str(batch)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["held_mib"]


# ------------------------------------------------------------------------------------------------
# Per instruction set: each in a fresh process, since the core chooses it once per process.

ISAS = ("generic", "avx2", "avx512")


def cpu_model() -> str:
    """The CPU's model name and its widest vector extensions (Linux: /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    vector = [f for f in ("avx512f", "avx2", "fma", "avx") if f in flags]
    return f"{name} ({', '.join(vector) or 'no AVX'})"


def _isa_child(args) -> None:
    data = loss_batch(args.tokens, args.batch)
    n = args.tokens
    repeats = 5 if args.quick else 9
    t = time_interleaved({"fused": fused_step(data), "eager": eager_step(data)}, repeats)
    back_to_back = {}
    for threads in (1, args.threads):
        torch.set_num_threads(threads)
        back_to_back[threads] = median_time(fused_step(data), repeats * 2, warmup=2)
    torch.set_num_threads(args.threads)
    print(json.dumps({"isa": _C.cpu_isa(), "fused": t["fused"], "eager": t["eager"], "ns_per_token": t["fused"] / n * 1e9,
                      "b2b_1": back_to_back[1], "b2b_n": back_to_back[args.threads]}))


def isa_table(args) -> None:
    rows, seen = [], set()
    for isa in ISAS:
        command = [sys.executable, __file__, "--isa-child", "--tokens", str(args.tokens), "--batch", str(args.batch),
                   "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
        out = subprocess.run(command, env=dict(os.environ, FLASHREINFORCE_CPU_ISA=isa), capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if r["isa"] in seen:  # this CPU lacks the requested instruction set: the child ran a lower one
            continue
        seen.add(r["isa"])
        rows.append([r["isa"], fmt_ms(r["fused"]), f"{r['ns_per_token']:.2f}", fmt_ms(r["eager"]),
                     f"{r['eager'] / r['fused']:.1f}x", fmt_ms(r["b2b_1"]), fmt_ms(r["b2b_n"]),
                     f"{r['b2b_1'] / r['b2b_n']:.2f}x"])
    print_table(f"per instruction set (forward + backward, float32, N = {args.tokens:,}, B = {args.batch}; "
                f"{args.threads} threads unless stated; each ISA in its own process; CPU: {cpu_model()})",
                ["ISA", "fused ms (after pause)", "ns/token", "eager ms (same rounds)", "fused speedup",
                 "1 thread b2b ms", f"{args.threads} threads b2b ms", "thread scaling"], rows)


# ------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description="CPU benchmark of the fused loss")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and a smaller N sweep")
    parser.add_argument("--tokens", type=int, default=4_194_304)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa-table", action="store_true", help="only the per-instruction-set table")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--isa-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        kind, n, b = args.memory_child
        torch.set_num_threads(args.threads)
        _memory_child(kind, int(n), int(b))
        return
    if args.isa_child:
        torch.set_num_threads(args.threads)
        _isa_child(args)
        return

    repeats = 5 if args.quick else 11
    torch.set_num_threads(args.threads)
    print(f"# bench_loss_cpu: torch {torch.__version__}, {cpu_model()}, "
          f"{os.cpu_count()} CPUs, {args.threads} threads, fused ISA {_C.cpu_isa()}")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"machine parallelism now (torch.exp on 16M floats, 1 vs {args.threads} threads): "
          f"{machine_parallelism(args.threads):.2f}x")
    if args.isa_table:
        isa_table(args)
        print(f"\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return

    data = loss_batch(args.tokens, args.batch)
    n = args.tokens
    _, stats = fr.flashreinforce_loss_packed(data["log_probs"], data["behavior_log_probs"], data["rewards"],
                                             data["cu_seqlens"], data["action_mask"], delta=3e-3)
    print(f"# N = {n:,} tokens, B = {args.batch}, policy tokens {float(data['action_mask'].float().mean()):.1%}, "
          f"acceptance rate {float(stats['acceptance_rate']):.3f}, longest trajectory "
          f"{int((data['cu_seqlens'][1:] - data['cu_seqlens'][:-1]).max()):,}")

    # 1. Main comparison (interleaved rounds).
    compiled = torch.compile(eager_loss, dynamic=False)
    t = time_interleaved({"fused": fused_step(data), "eager": eager_step(data),
                          "compiled": eager_step(data, compiled)}, max(5, repeats // 2), warmup=2)
    t_fused, t_eager, t_compiled = t["fused"], t["eager"], t["compiled"]
    rows = [
        ["fused (flashreinforce._C)", fmt_ms(t_fused), f"{t_fused / n * 1e9:.3f}", "1.0x"],
        ["eager PyTorch (index_add_)", fmt_ms(t_eager), f"{t_eager / n * 1e9:.3f}", f"{t_eager / t_fused:.1f}x"],
        ["torch.compile(eager)", fmt_ms(t_compiled), f"{t_compiled / n * 1e9:.3f}", f"{t_compiled / t_fused:.1f}x"],
    ]
    print_table(f"forward + backward, float32, {args.threads} threads (median of interleaved runs)",
                ["implementation", "ms", "ns/token", "fused speedup"], rows)

    # 1b. The same fused call right after a PyTorch parallel op (OpenMP threads still spinning).
    x = torch.rand(16 * 2**20)
    out = torch.empty_like(x)
    step = fused_step(data)
    samples = []
    for r in range(2 + repeats):
        time.sleep(0.03)
        torch.exp(x, out=out)
        t0 = time.perf_counter()
        step()
        if r >= 2:
            samples.append(time.perf_counter() - t0)
    after_openmp = statistics.median(samples)
    print(f"\nfused right after a PyTorch parallel op: {after_openmp * 1e3:.2f} ms "
          f"({after_openmp / n * 1e9:.3f} ns/token; PyTorch's OpenMP threads spin for a while after a parallel "
          f"region: OMP_WAIT_POLICY=PASSIVE avoids it)")

    # 1c. Without an action mask (every token a policy token), back-to-back.
    no_mask = dict(data, action_mask=None)
    t_masked = median_time(fused_step(data), repeats, warmup=2)
    t_no_mask = median_time(fused_step(no_mask), repeats, warmup=2)
    print(f"fused back-to-back: with the action mask {t_masked * 1e3:.2f} ms ({t_masked / n * 1e9:.3f} ns/token), "
          f"without one {t_no_mask * 1e3:.2f} ms ({t_no_mask / n * 1e9:.3f} ns/token)")

    # 2. Thread scaling (interleaved 1 / N threads).
    t = time_interleaved({"1": fused_step(data), "n": fused_step(data)}, repeats * 2,
                         threads={"1": 1, "n": args.threads})
    t_fused_1, t_fused_2 = t["1"], t["n"]
    b2b = {"1": [], "n": []}
    for _ in range(3):  # alternate blocks of back-to-back calls, so that drift hits both alike
        for key, count in (("1", 1), ("n", args.threads)):
            torch.set_num_threads(count)
            b2b[key].append(median_time(fused_step(data), repeats, warmup=2))
    torch.set_num_threads(args.threads)
    b2b_1, b2b_2 = statistics.median(b2b["1"]), statistics.median(b2b["n"])
    print_table("thread scaling (fused): each call after a 30 ms pause (interleaved), and back-to-back",
                ["threads", "ms (after pause)", "speedup vs 1", "ms (back-to-back)", "speedup vs 1"], [
        ["1", fmt_ms(t_fused_1), "1.00x", fmt_ms(b2b_1), "1.00x"],
        [str(args.threads), fmt_ms(t_fused_2), f"{t_fused_1 / t_fused_2:.2f}x", fmt_ms(b2b_2), f"{b2b_1 / b2b_2:.2f}x"],
    ])

    # 3. N sweep.
    sizes = [65_536, 262_144, 1_048_576, 4_194_304] + ([] if args.quick else [16_777_216])
    times = []
    for size in [8192] + sizes:
        d = loss_batch(size, args.batch, seed=1)
        times.append(median_time(fused_step(d), repeats * 2 if size < 16_000_000 else max(3, repeats // 2), warmup=2))
    overhead, times = times[0], times[1:]
    rows = [[f"{size:,}", fmt_ms(t), f"{t / size * 1e9:.3f}", f"{(t - overhead) / (size - 8192) * 1e9:.3f}"]
            for size, t in zip(sizes, times)]
    print_table(f"time vs N (fused, float32, B = {args.batch}, back-to-back calls); per-call overhead = an 8,192-token "
                f"call: {overhead * 1e6:.0f} us", ["N", "ms", "ns/token", "ns/token beyond the overhead"], rows)

    # 4. Entropy filter (interleaved with the base path).
    t = time_interleaved({"base": fused_step(data), "filter": fused_step(
        data, negative_token_fraction=0.5, entropies=data["entropies"], failures=data["failures"])}, repeats * 2)
    print_table("entropy filter (q = 0.5, half the trajectories failed)", ["path", "ms", "ns/token", "vs base"], [
        ["base (q = 1)", fmt_ms(t["base"]), f"{t['base'] / n * 1e9:.3f}", "1.00x"],
        ["filter", fmt_ms(t["filter"]), f"{t['filter'] / n * 1e9:.3f}", f"{t['filter'] / t['base']:.2f}x"],
    ])

    print(f"\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"machine parallelism now: {machine_parallelism(args.threads):.2f}x")

    # 5. Memory.
    grad_mib = n * 4 / 2**20
    rows = []
    for kind in ("fused", "fused_filter", "eager"):
        held = measure_memory(kind, n, args.batch)
        rows.append([kind, f"{held:.1f}", f"{held / grad_mib:.2f}x"])
    print_table(f"heap held between forward and backward (the gradient alone is {grad_mib:.1f} MiB)",
                ["implementation", "MiB", "x gradient size"], rows)

    # 6. Per instruction set.
    isa_table(args)


if __name__ == "__main__":
    main()
