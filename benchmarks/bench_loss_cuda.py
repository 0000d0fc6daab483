"""CUDA benchmark of the fused FlashREINFORCE loss (the CUDA section of docs/performance.md).

Needs a CUDA device and flashreinforce._C built with the CUDA path. Prints tables of:

1. achieved bandwidth of the fused forward (loss, gradient and statistics in one launch
   sequence) at N = 1M, 4M, 16M and 64M tokens, against the measured device-to-device copy
   bandwidth; bytes counted are those that must move: log_probs, behavior_log_probs and
   action_mask read, the gradient written (13 bytes per float32 token, 7 per bfloat16 token);
2. fused forward + backward against the straightforward eager PyTorch objective (segment sums
   with ``index_add_``, as in bench_loss_cpu.py), the same under ``torch.compile``, and the
   package's pure-PyTorch reference (float64 internally), at N = 1M and 16M;
3. one 1M-token trajectory among thousands of short ones: time and agreement with the CPU path;
4. the entropy filter (q = 0.5, half failed) against the base path;
5. CUDA graph capture of the capturable variant: replay time, and equality with eager launches;
6. determinism: loss, gradient and statistics of repeated calls compared bit for bit;
7. the device time of one forward by kernel (PyTorch's profiler).

    python benchmarks/bench_loss_cuda.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

import flashreinforce as fr
from flashreinforce import _C
from flashreinforce.objective import LossOptions
from flashreinforce.ops import fused_loss_capturable, raise_for_error, reference
from flashreinforce.ops.contract import op_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import eager_loss, eager_step, fused_step, loss_batch, print_table  # noqa: E402


def reference_loss(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask, delta: float = 3e-3):
    """The package's pure-PyTorch reference, as an eager baseline with the benchmark's signature."""
    return reference.flashreinforce_loss_packed(log_probs, behavior_log_probs, rewards, cu_seqlens, action_mask,
                                                   delta=delta)[0]


def cuda_time(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def to_cuda(data: dict, dtype=None) -> dict:
    out = {k: v.cuda() for k, v in data.items()}
    if dtype is not None:
        for k in ("log_probs", "behavior_log_probs", "entropies"):
            out[k] = out[k].to(dtype)
    return out


def copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), repeats=20)
    return 2 * src.numel() * 4 / t  # read + write


def fused_forward(d, **opts):
    return lambda: torch.ops.flashreinforce.fused_loss(
        d["log_probs"], d["behavior_log_probs"], d["rewards"], d["cu_seqlens"], d["action_mask"],
        opts.get("entropies"), opts.get("failures"),
        op_options(LossOptions(delta=3e-3, negative_token_fraction=opts.get("negative_token_fraction", 1.0))),
        opts.get("raise_errors", False))


def main() -> None:
    parser = argparse.ArgumentParser(description="CUDA benchmark of the fused loss")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_loss_cuda: no CUDA device; nothing measured")
        return
    if not _C.has_cuda():
        print("bench_loss_cuda: flashreinforce._C was built without CUDA; nothing measured")
        return
    props = torch.cuda.get_device_properties(0)
    print(f"# bench_loss_cuda: {props.name}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")
    repeats = 10 if args.quick else 30
    failed = []
    state: dict = {}

    def batch16():
        if "d16" not in state:
            state["d16"] = to_cuda(loss_batch(16 * 2**20, 4096, seed=5))
        return state["d16"]

    # 1. Bandwidth.
    def bandwidth():
        copy_bw = copy_bandwidth(2**30)
        rows = [["device-to-device copy (1 GiB)", "-", f"{copy_bw / 1e9:,.0f}", "100%"]]
        sizes = [2**20, 16 * 2**20] if args.quick else [2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20]
        for n in sizes:
            for dtype, bytes_per_token in ((torch.float32, 13), (torch.bfloat16, 7)):
                d = to_cuda(loss_batch(n, 4096, seed=2), dtype)
                t = cuda_time(fused_forward(d), repeats)
                bw = bytes_per_token * n / t
                rows.append([f"fused forward N={n / 2**20:.0f}M {str(dtype)[6:]}", f"{t * 1e3:.3f}", f"{bw / 1e9:,.0f}",
                             f"{bw / copy_bw:.0%}"])
                del d
        print_table("bandwidth (bytes that must move / time; copy counts read + write)",
                    ["what", "ms", "GB/s", "of copy"], rows)

    # 2. Against eager PyTorch, torch.compile and the reference (forward + backward).
    def versus_eager():
        for n in [2**20, 16 * 2**20]:
            d = to_cuda(loss_batch(n, max(64, n // 4096), seed=3))
            compiled = torch.compile(eager_loss, dynamic=False)
            t0 = time.perf_counter()
            eager_step(d, compiled)()  # compile outside the timing
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            times = {"fused": cuda_time(fused_step(d), repeats),
                     "eager PyTorch": cuda_time(eager_step(d), max(5, repeats // 3)),
                     f"torch.compile(eager) (compiled in {compile_s:.0f} s)": cuda_time(eager_step(d, compiled),
                                                                                     max(5, repeats // 3)),
                     "reference (flashreinforce.ops.reference, float64 inside)":
                         cuda_time(eager_step(d, reference_loss), max(3, repeats // 10))}
            print_table(f"forward + backward, N = {n:,}, B = {d['rewards'].numel():,}, float32",
                        ["implementation", "ms", "fused speedup"],
                        [[name, f"{t * 1e3:.3f}", f"{t / times['fused']:.1f}x"] for name, t in times.items()])
            del d, compiled
            torch._dynamo.reset()

    # 3. One 1M-token trajectory among thousands of short ones.
    def skewed_lengths():
        lengths = [12] * 8000
        lengths[4321] = 1_000_000
        cpu = loss_batch(sum(lengths), len(lengths), seed=4)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        cpu["cu_seqlens"] = cu
        mask = cpu["action_mask"].clone()
        mask[cu[:-1].long()] = False
        mask[cu[1:].long() - 1] = True
        cpu["action_mask"] = mask
        gpu = to_cuda(cpu)
        loss_c, stats_c = fr.flashreinforce_loss_packed(cpu["log_probs"], cpu["behavior_log_probs"], cpu["rewards"],
                                                        cu, mask, delta=3e-3)
        loss_g, stats_g = fr.flashreinforce_loss_packed(gpu["log_probs"], gpu["behavior_log_probs"], gpu["rewards"],
                                                        gpu["cu_seqlens"], gpu["action_mask"], delta=3e-3)
        t_long = cuda_time(fused_forward(gpu), repeats)
        uniform = to_cuda(loss_batch(sum(lengths), len(lengths), seed=4))
        t_uniform = cuda_time(fused_forward(uniform), repeats)
        kl_err = float((stats_c["sequence_kl"] - stats_g["sequence_kl"].cpu()).abs().max())
        print_table(f"one 1M-token trajectory among {len(lengths) - 1} of 12 tokens (N = {sum(lengths):,})",
                    ["batch", "forward ms", "loss |cpu - gpu|", "max |kl cpu - gpu|", "same admissions"], [
            ["skewed", f"{t_long * 1e3:.3f}", f"{abs(float(loss_c) - float(loss_g)):.2e}", f"{kl_err:.2e}",
             str(torch.equal(stats_c["admitted"], stats_g["admitted"].cpu()))],
            ["lognormal lengths (same N, B)", f"{t_uniform * 1e3:.3f}", "-", "-", "-"],
        ])

    # 4. Entropy filter.
    def entropy_filter():
        d16 = batch16()
        t_base = cuda_time(fused_forward(d16), repeats)
        t_filter = cuda_time(fused_forward(d16, negative_token_fraction=0.5, entropies=d16["entropies"],
                                          failures=d16["failures"]), repeats)
        print_table("entropy filter (q = 0.5, half failed), N = 16M, forward", ["path", "ms", "vs base"], [
            ["base", f"{t_base * 1e3:.3f}", "1.00x"],
            ["filter", f"{t_filter * 1e3:.3f}", f"{t_filter / t_base:.2f}x"],
        ])

    # 5. CUDA graph capture.
    def graph_capture():
        d16 = batch16()
        opts = dict(delta=3e-3)
        static = d16["log_probs"].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fused_loss_capturable(static, d16["behavior_log_probs"], d16["rewards"], d16["cu_seqlens"],
                                      d16["action_mask"], **opts)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_loss, g_stats, g_error = fused_loss_capturable(static, d16["behavior_log_probs"], d16["rewards"],
                                                             d16["cu_seqlens"], d16["action_mask"], **opts)
        t_graph = cuda_time(graph.replay, repeats)
        t_plain = cuda_time(lambda: fused_loss_capturable(static, d16["behavior_log_probs"], d16["rewards"],
                                                          d16["cu_seqlens"], d16["action_mask"], **opts), repeats)
        graph.replay()
        torch.cuda.synchronize()
        raise_for_error(g_error, static.numel(), d16["rewards"].numel())
        ref_loss, _ = fr.flashreinforce_loss_packed(static, d16["behavior_log_probs"], d16["rewards"], d16["cu_seqlens"],
                                                    d16["action_mask"], **opts)
        print_table("CUDA graph capture (capturable variant, N = 16M)", ["launch", "ms", "loss equals eager launch"], [
            ["graph replay", f"{t_graph * 1e3:.3f}", str(torch.equal(g_loss, ref_loss))],
            ["eager launches", f"{t_plain * 1e3:.3f}", "-"],
        ])
        assert math.isfinite(float(ref_loss))

    # 6. Determinism: repeated calls compared bit for bit.
    def determinism():
        d16 = batch16()
        rows = []
        for name, opts in (("base", {}), ("entropy filter", dict(negative_token_fraction=0.5,
                                                                  entropies=d16["entropies"], failures=d16["failures"]))):
            first = None
            same = True
            for _ in range(5):
                lp = d16["log_probs"].clone().requires_grad_()
                loss, stats = fr.flashreinforce_loss_packed(lp, d16["behavior_log_probs"], d16["rewards"],
                                                            d16["cu_seqlens"], d16["action_mask"], delta=3e-3, **opts)
                loss.backward()
                got = [loss.detach(), lp.grad] + [stats[k] for k in sorted(stats)]
                if first is None:
                    first = got
                else:
                    same = same and all(torch.equal(a, b) for a, b in zip(first, got))
            rows.append([name, "5", str(same)])
        print_table("determinism (N = 16M, forward + backward repeated)", ["path", "calls", "bitwise equal"], rows)

    # 7. Where the time of one forward goes: the device time of each kernel (PyTorch's profiler).
    def kernel_breakdown():
        from torch.profiler import ProfilerActivity, profile

        d16 = batch16()
        rows = []
        for name, opts in (("base", {}), ("entropy filter", dict(negative_token_fraction=0.5,
                                                                  entropies=d16["entropies"],
                                                                  failures=d16["failures"]))):
            run = fused_forward(d16, **opts)
            run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    run()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages()
                      if getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) > 0]
            total = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) for e in events)
            for e in sorted(events, key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))):
                t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
                found = re.search(r"(\w+_kernel)", e.key)
                kernel = found.group(1) if found else e.key[:48]
                rows.append([name, kernel, str(e.count // 5), f"{t / 5:.1f}", f"{t / total:.0%}"])
        print_table("device time per forward by kernel (N = 16M, float32; profiler, 5 calls)",
                    ["path", "kernel", "launches", "us", "share"], rows)

    for section in (bandwidth, versus_eager, skewed_lengths, entropy_filter, graph_capture, determinism,
                    kernel_breakdown):
        try:
            section()
        except Exception as err:  # one failing section must not hide the others' numbers
            failed.append(section.__name__)
            print(f"\n## {section.__name__}: FAILED: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}")
        torch.cuda.synchronize()
    if failed:
        print(f"bench_loss_cuda: failed sections: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
