"""Learner memory: peak memory and time of one log-prob step, naive vs chunked.

One learner step = forward of the current log-probabilities of the sampled tokens from the last
hidden states and the output projection, then backward of ``sum(logp * c)`` with random
per-token weights ``c`` (the shape of the REINFORCE loss), producing gradients for the hidden
states and the projection weight.

* ``naive``: ``log_softmax(hidden @ weight.T).gather(targets)`` with autograd (holds ``[N, V]``
  logits, log-softmax, and builds ``[N, V]`` gradients in backward).
* ``chunked``: :func:`flashreinforce.ops.logprobs.sampled_token_logprobs`.

Method. Every (variant, repeat) runs in a fresh subprocess so that no allocator state carries
over. The worker builds the inputs (seeded, identical for all variants), runs a small warm-up step
(initializes BLAS and the thread pool without touching large memory), then reads its resident set
size ``VmRSS`` from ``/proc/self/status``, resets the kernel's high-water mark (``echo 5 >
/proc/self/clear_refs``) and runs the timed step; the peak is ``VmHWM - VmRSS_before``: every byte
the step made resident, gradients included (PyTorch's CPU allocator has no statistics and
``tracemalloc`` does not see it). Without ``clear_refs`` (non-Linux) the worker falls back to
``ru_maxrss``, which cannot be reset, and says so. Times are wall clock of the whole step. The
CPU time (user + system, all threads) is printed too: on a shared machine it is less
sensitive to other processes than wall time (but includes OpenMP spin-waiting). The first repeat
of each variant saves its gradients, and the parent compares them.

Run: ``python benchmarks/bench_learner_memory.py`` (defaults: 8,192 tokens, V = 151,936,
H = 256, 3 repeats, float32; the naive variant needs ~15 GB of RAM and ~1 min per repeat on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_inputs(torch, tokens, vocab, hidden_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype).requires_grad_()
    # Scale so that logits have a realistic spread (std ~0.8 at H = 256).
    weight = (torch.randn(vocab, hidden_size, generator=gen) * hidden_size ** -0.5 * 0.8)
    weight = weight.to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    coeff = torch.randn(tokens, generator=gen)
    return hidden, weight, targets, coeff


def _naive_logprobs(torch, hidden, weight, targets):
    logits = hidden @ weight.t()
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def _worker(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, _REPO)
    from flashreinforce.ops.logprobs import sampled_token_logprobs

    from common import reset_peak_rss, status_mib  # benchmarks/ is this script's directory

    dtype = getattr(torch, args.dtype)

    def step(hidden, weight, targets, coeff):
        if args.variant == "naive":
            logp = _naive_logprobs(torch, hidden, weight, targets)
        else:
            logp, _ = sampled_token_logprobs(hidden, weight, targets, chunk_size=args.chunk_size,
                                             vocab_chunk_size=args.vocab_chunk_size)
        return torch.autograd.grad((logp * coeff).sum(), (hidden, weight))

    warm = _make_inputs(torch, 64, min(args.vocab, 4096), args.hidden, dtype, args.seed + 1)
    step(*warm)
    del warm

    inputs = _make_inputs(torch, args.tokens, args.vocab, args.hidden, dtype, args.seed)
    before = status_mib("VmRSS")
    exact = reset_peak_rss() and before is not None
    if not exact:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    t0, c0 = time.perf_counter(), time.process_time()
    grads = step(*inputs)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = status_mib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if args.save_grads:
        torch.save({"hidden": grads[0], "weight": grads[1]}, args.save_grads)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mib": peak - before,
                      "exact_peak": exact,
                      "threads": torch.get_num_threads()}))


def _run_worker(args, variant, save_path):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant,
           "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
           "--dtype", args.dtype, "--seed", str(args.seed), "--threads", str(args.threads)]
    if args.chunk_size is not None:
        cmd += ["--chunk-size", str(args.chunk_size)]
    if args.vocab_chunk_size is not None:
        cmd += ["--vocab-chunk-size", str(args.vocab_chunk_size)]
    if save_path:
        cmd += ["--save-grads", save_path]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compare_grads(path_ref, path_new):
    import torch

    ref, new = torch.load(path_ref), torch.load(path_new)
    rows = []
    for name in ("hidden", "weight"):
        a, b = ref[name].double(), new[name].double()
        diff = (a - b).abs().max().item()
        scale = a.abs().max().item()
        rows.append((name, diff, diff / scale if scale else float("inf")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="token rows per tile for the chunked variant (default: the library's)")
    parser.add_argument("--vocab-chunk-size", type=int, default=None,
                        help="vocabulary columns per tile for the chunked variant (default: the library's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="naive,chunked")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="chunked", help=argparse.SUPPRESS)
    parser.add_argument("--save-grads", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in ("naive", "chunked"):
            parser.error(f"--variants: unknown variant {v!r}")
    print(f"learner log-prob step: N={args.tokens} V={args.vocab} H={args.hidden} {args.dtype}, "
          f"{args.repeats} repeats, fresh subprocess each; machine: {platform.machine()} "
          f"{os.cpu_count()} CPUs, {platform.platform()}")
    results = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        grads = {}
        # Interleave the variants so that background load affects them alike.
        for rep in range(args.repeats):
            for v in variants:
                save = os.path.join(tmp, f"{v}.pt") if rep == 0 else None
                r = _run_worker(args, v, save)
                results[v].append(r)
                print(f"  repeat {rep} {v:8s} {r['seconds']:8.2f} s wall {r['cpu_seconds']:8.2f} s cpu  "
                      f"peak {r['peak_mib']:9.1f} MiB"
                      + ("" if r["exact_peak"] else "  (ru_maxrss fallback)"), flush=True)
                if save:
                    grads[v] = save
        cmp_rows = (_compare_grads(grads["naive"], grads["chunked"])
                    if {"naive", "chunked"} <= grads.keys() else [])

    print()
    print("| variant | median wall time (s) | median CPU time (s) | median peak (MiB) | threads |")
    print("| --- | ---: | ---: | ---: | ---: |")
    med = {}
    for v in variants:
        t = statistics.median(r["seconds"] for r in results[v])
        c = statistics.median(r["cpu_seconds"] for r in results[v])
        m = statistics.median(r["peak_mib"] for r in results[v])
        med[v] = (t, m)
        print(f"| {v} | {t:.2f} | {c:.2f} | {m:.0f} | {results[v][0]['threads']} |")
    if "naive" in med and "chunked" in med and med["chunked"][1] > 0:
        (tn, mn), (tc, mc) = med["naive"], med["chunked"]
        print()
        print(f"memory ratio chunked/naive: 1/{mn / mc:.1f} (target at the default sizes <= 1/8: "
              f"{'met' if mc * 8 <= mn else 'NOT met'})")
        print(f"speedup naive/chunked: {tn / tc:.2f}x (target >= 1: {'met' if tc <= tn else 'NOT met'})")
        for name, diff, rel in cmp_rows:
            print(f"grad {name}: max |naive - chunked| = {diff:.3e} ({rel:.2e} of max |naive|)")


if __name__ == "__main__":
    main()
