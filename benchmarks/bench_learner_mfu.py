#!/usr/bin/env python
"""How close the learner is to this machine's limit: model FLOP/s against a measured GEMM peak, for
full fine-tuning and LoRA, side by side.

    python benchmarks/bench_learner_mfu.py                                   # SmolLM2 shape, CPU
    python benchmarks/bench_learner_mfu.py --compiled-layers both --profile     # eager and compiled layers
    python benchmarks/bench_learner_mfu.py --shape qwen2.5-0.5b --device cuda --dtype bf16 --lora-rank 16

The peak is measured here, not taken from a data sheet: the best of square matrix products of a few
sizes in the learner's compute dtype (float32, or bf16 for a bf16 learner), all cores
(``benchmarks/common.py``). Then, for full fine-tuning and for LoRA adapters of ``--lora-rank`` on the
attention and MLP projections, the real learner step (:meth:`flashreinforce.trainer.learning.learner.Learner.step`:
packed forward, fused loss, backward, AdamW) on the same random batch: median step time over
``--steps``, the learner's own model FLOPs (``flashreinforce/trainer/learning/flops.py``; a frozen weight counts two
forwards, a trained one three) over that time, its fraction of the measured peak (``mfu``), the learner's
peak memory (resident set growth during the steps on a CPU, the CUDA allocator's peak on a GPU) and the
bytes a weight sync sends after the first (the trainable tensors: the whole model, or the adapters).

``--compiled-layers both``: each policy with the learner's RMS norms, SwiGLU and LoRA projections in
eager PyTorch (PEFT's) and fused (``train.compiled_layers``), on the same batch, their steps taken in
turn (peak memory is then not told apart; run ``on`` and ``off`` alone for it). ``all`` adds a third
variant between the two: norms and SwiGLU compiled, LoRA projections PEFT's (``no-lora``).

``--equal-rewards``: every trajectory of the batch gets the same reward, so every advantage is 0: the
update a slow-tools run makes most often, a forward for the statistics and no backward, with no optimizer
step (``actor.step_on_zero_gradient false``, as the streamed schedules of ``bench_tool_async.py`` run;
FLOPs then count one forward).

``--profile``: one more step of each policy under ``torch.profiler``, as a table of where the step's
operator time goes (matrix products, attention, the fused loss, elementwise operations, copies, the
optimizer; ``benchmarks/common.py``) and its heaviest operators: what keeps the step from the peak.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import SHAPES, gemm_peak, machine_line, print_table, profile_breakdown  # noqa: E402

from flashreinforce.models.fused_layers import use_compiled_layers  # noqa: E402
from flashreinforce.objective import LossOptions  # noqa: E402
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings  # noqa: E402
from flashreinforce.trainer.rollout.trajectory import Trajectory  # noqa: E402


def measured_peak(device: torch.device, dtype: torch.dtype) -> float:
    return max(gemm_peak(device, dtype, size) for size in (1024, 2048, 3072))


def make_batch(n: int, mean_len: int, vocab: int, seed: int = 0, equal_rewards: bool = False) -> list[Trajectory]:
    """``n`` random trajectories: a prompt of 16-48 tokens and an action part of about ``mean_len``
    (exponential, at least 8); rewards 0 or 1 at random, or all 1 with ``equal_rewards``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(16, 48)
        length = prompt + max(8, int(rng.expovariate(1.0 / mean_len)))
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        mask = [False] * prompt + [True] * (length - prompt)
        blp = [(-rng.random() * 3 if m else 0.0) for m in mask]
        reward = 1.0 if equal_rewards else float(rng.random() < 0.5)
        out.append(Trajectory(tokens, mask, blp, reward=reward, failed=reward == 0.0))
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run(variants: list[tuple[str, torch.nn.Module, str]], args, batch, device, peak) -> list[list[str]]:
    """Time the learner step of each ``(label, model, layers)`` variant on ``batch`` (layers: ``on``,
    ``off`` or ``no-lora``, see ``--compiled-layers``). Several
    variants step in turn (A B A B ...), so that a machine whose speed drifts slows each alike; the
    peak memory is then not told apart (one process) and reads "-"."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()
    learners = []
    for label, model, layers in variants:
        settings = LearnerSettings(lr=1e-5, loss=LossOptions(delta=float("inf")), param_dtype=args.dtype,
                                   micro_batch_tokens=args.micro_batch_tokens, total_steps=100,
                                   compiled_layers=layers == "on",
                                   step_on_zero_gradient=not args.equal_rewards)
        learners.append(Learner(model, settings))
        if layers == "no-lora":
            use_compiled_layers(learners[-1].model, lora=False)
    times = [[] for _ in learners]
    flops = [[] for _ in learners]
    high = before
    for i in range(args.steps + 1):
        for k, learner in enumerate(learners):
            label = variants[k][0]
            t0 = time.perf_counter()
            metrics = learner.step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            high = max(high, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss_bytes())
            if args.equal_rewards and metrics.get("backward_skipped") != 1.0:
                raise RuntimeError(f"{label}: --equal-rewards, yet the learner ran a backward ({metrics!r})")
            if i:  # the first step allocates the optimizer state
                times[k].append(dt)
                flops[k].append(metrics["model_flops"])
    rows = []
    for (label, _, _), learner, ts, fs in zip(variants, learners, times, flops):
        step = statistics.median(ts)
        rate = statistics.median(fs) / step
        if args.profile:
            prof = profile_breakdown(lambda: learner.step(batch), device, top=args.profile_top)
            print_table(f"{label}: one step under the profiler ({prof['wall_ms'] / 1e3:.2f} s; operator self time "
                        f"{prof['busy_ms'] / 1e3:.2f} s over {torch.get_num_threads()} threads)",
                        ["category", "s", "share"], [[c, f"{ms / 1e3:.2f}", f"{share:.1%}"] for c, ms, share in
                                                     prof["categories"]])
            print_table(f"{label}: heaviest operators", ["operator", "calls", "s"],
                        [[n, str(c), f"{ms / 1e3:.3f}"] for n, c, ms in prof["top"]])
        sync = sum(p.numel() * p.element_size() for p in learner.model.parameters() if p.requires_grad)
        trainable = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
        memory = f"{(high - before) / 2**20:.0f}" if len(variants) == 1 else "-"
        rows.append([label, f"{trainable / 1e6:.2f}M", f"{step:.2f}", f"{rate / 1e9:.1f}", f"{rate / peak:.1%}",
                     memory, f"{sync / 2**20:.1f}"])
    return rows


_LABELS = {"on": ", compiled layers", "off": ", eager layers", "no-lora": ", compiled layers but PEFT's LoRA"}


def _suffix(layers: str, modes: list[str]) -> str:
    return "" if len(modes) == 1 else _LABELS[layers]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (faster)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the learner's compute dtype")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mean-len", type=int, default=192)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--equal-rewards", action="store_true",
                   help="every reward equal: the statistics forward alone (no backward, no optimizer step)")
    p.add_argument("--profile", action="store_true", help="one more step of each under torch.profiler, by category")
    p.add_argument("--profile-top", type=int, default=15, help="heaviest operators listed with --profile")
    p.add_argument("--only", choices=("full", "lora"), default=None, help="one of the two policies only")
    p.add_argument("--compiled-layers", choices=("on", "off", "both", "all"), default="on",
                   help="the learner's RMS norms, SwiGLU and LoRA projections fused (train.compiled_layers), "
                        "eager PyTorch's, both, or all (adds norms and SwiGLU fused beside PEFT's LoRA), steps in turn")
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = dict(SHAPES[args.shape])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.float32)
    batch = make_batch(args.batch, args.mean_len, config.vocab_size, equal_rewards=args.equal_rewards)
    compute = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peak = measured_peak(device, compute)
    print(f"machine: {machine_line(device)}")
    print(f"shape {args.shape} ({config.num_hidden_layers} layers), {args.batch} trajectories, "
          f"{sum(t.num_tokens for t in batch):,} tokens{', every reward equal (no backward)' if args.equal_rewards else ''}; "
          f"learner {args.dtype}; measured {args.dtype} GEMM peak "
          f"{peak / 1e9:.0f} GFLOP/s")
    rows = []
    flags = {"on": ["on"], "off": ["off"], "both": ["off", "on"], "all": ["off", "no-lora", "on"]}[args.compiled_layers]
    if args.only in (None, "full"):
        rows += run([("full fine-tuning" + _suffix(c, flags), copy.deepcopy(base), c) for c in flags if c != "no-lora"],
                    args, batch, device, peak)
    if args.only in (None, "lora"):
        from flashreinforce.models.lora import LoraSettings, apply_lora

        lora = apply_lora(copy.deepcopy(base), LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank))
        rows += run([(f"LoRA rank {args.lora_rank}" + _suffix(c, flags), copy.deepcopy(lora), c) for c in flags],
                    args, batch, device, peak)
    print_table(f"learner step (median of {args.steps} after a first step)",
                ["policy", "trainable", "step s", "model GFLOP/s", "of measured peak (mfu)", "peak memory MiB",
                 "sync MiB per update"], rows)


if __name__ == "__main__":
    main()
