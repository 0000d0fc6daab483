#!/usr/bin/env python
"""The arith preset trained several ways, same training budget, several seeds: held-out accuracy
curves, learner time, memory, weight-sync cost, side by side.

    python benchmarks/bench_arith_variants.py --output runs/variants --variants full lora16     # LoRA vs full
    python benchmarks/bench_arith_variants.py --output runs/variants --variants vllm          # in the vLLM env
    python benchmarks/bench_arith_variants.py --output runs/variants --table-only            # just the table

Each run is ``scripts/arith_curve.py`` (base evaluation, ``--budget-min`` training minutes with a
held-out greedy evaluation every ``--eval-every`` updates, final evaluation of the newest checkpoint)
in ``OUTPUT/VARIANT_seedS``; a finished run (its ``summary.json``) is skipped, an interrupted one
resumes, so the measurement can span sessions and the two Python environments (vLLM's CPU build
needs its own). Variants (:data:`VARIANTS`) add trainer flags to the preset. The table gives, per
variant, the mean over the seeds that finished (and the range) of the base and final held-out greedy
accuracy, the gain, updates made, learner seconds per update, acceptance rate, weight-sync seconds
and bytes of the last update, and the training process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

#: Variant name -> trainer flags added to ``--preset arith``.
VARIANTS: dict[str, list[str]] = {
    "full": [],
    "vllm": ["--rollout.engine", "vllm"],
    "lora16": ["--lora.rank", "16", "--lora.alpha", "32", "--actor.adam.lr", "2e-4"],
    "lora16_lr5e-5": ["--lora.rank", "16", "--lora.alpha", "32", "--actor.adam.lr", "5e-5"],
    "lora16_lr1e-3": ["--lora.rank", "16", "--lora.alpha", "32", "--actor.adam.lr", "1e-3"],
    "lora64": ["--lora.rank", "64", "--lora.alpha", "64", "--actor.adam.lr", "2e-4"],
}


def run(args, variant: str, seed: int) -> None:
    out = Path(args.output) / f"{variant}_seed{seed}"
    if (out / "summary.json").is_file():
        print(f"{out.name}: done, kept", flush=True)
        return
    cmd = [sys.executable, str(ROOT / "scripts" / "arith_curve.py"), "--output", str(out), "--budget-min",
           str(args.budget_min), "--eval-every", str(args.eval_every), "--eval-prompts", str(args.eval_prompts),
           "--", "--seed", str(seed), *VARIANTS[variant]]
    print(f"{out.name}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def cell(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    m = statistics.mean(values)
    if len(values) == 1:
        return format(m, fmt)
    return f"{format(m, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(args) -> None:
    from common import print_table

    rows = []
    for variant in VARIANTS:
        runs = []
        for path in sorted(Path(args.output).glob(f"{variant}_seed*/summary.json")):
            runs.append(json.loads(path.read_text()))
        if not runs:
            continue
        get = lambda k: [float(r[k]) for r in runs if r.get(k) is not None]  # noqa: E731
        rows.append([variant, str(len(runs)), cell(get("base_accuracy"), ".3f"), cell(get("final_accuracy"), ".3f"),
                     cell(get("gain_points"), ".1f"), cell(get("updates"), ".0f"),
                     cell(get("learner_compute_s_mean"), ".1f"), cell(get("acceptance_rate_mean"), ".3f"),
                     cell(get("weight_sync_s_mean"), ".3f"), cell([b / 2**20 for b in get("weight_sync_bytes_last")],
                                                                   ".1f"),
                     cell(get("peak_rss_mib"), ".0f")])
    print_table(f"arith, {args.budget_min} training minutes per run",
                ["variant", "seeds", "base acc", "final acc", "gain (points)", "updates", "learner s/update",
                 "acceptance", "sync s", "sync MiB", "peak RSS MiB"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True)
    p.add_argument("--variants", nargs="+", default=["full", "lora16"], choices=sorted(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget-min", type=float, default=10.0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    if not args.table_only:
        for seed in args.seeds:  # seeds outer: the variants of a seed run close together in time
            for variant in args.variants:
                run(args, variant, seed)
    table(args)


if __name__ == "__main__":
    main()
