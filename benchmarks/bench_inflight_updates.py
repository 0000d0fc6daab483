#!/usr/bin/env python
"""In-flight weight updates on a long-tail task: token lag and learner idle time, with and without.

    python benchmarks/bench_inflight_updates.py --output runs/inflight             # hf engine, 3 seeds
    python benchmarks/bench_inflight_updates.py --output runs/inflight --engine vllm --seeds 0

The task (:class:`LongTailEnv`, given to the trainer as ``--env benchmarks/bench_inflight_updates.py:LongTailEnv``):
the toy model is asked to repeat a letter, and each episode's turn ends after a number of tokens drawn
from a lognormal distribution (median 24, sigma 1, at most ``--max-new-tokens``): most turns are short,
a few are ten times longer, as reasoning traces are. The reward is the fraction of the turn's
characters that are the letter. Every run trains the toy preset's tiny model for ``--steps`` updates
of ``--batch`` episodes (two rollout workers, ``train.async_queue_size 1``), once with
``rollout.inflight_weight_updates`` and once without, seeds interleaved.

Each run writes its ``metrics.jsonl`` under ``--output`` and a ``result.json`` beside it; finished
runs are skipped, so the measurement can be resumed. The table gives, per side (mean over seeds, with
the range): the action tokens' lag at the update that trained them (learner version minus the
version that sampled each token; over all and over the trust gate's admitted trajectories), the
trajectory lag (from a trajectory's oldest token), the learner's idle time (waiting for its batch),
the wall time, turns continued under newer weights, and the mean reward of the last 10 updates.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from flashreinforce.envs.base import Environment, StepResult  # noqa: E402


class LongTailEnv(Environment):
    """Repeat the letter of the prompt for a turn whose length (tokens) is lognormal per episode."""

    letters = "abcdefgh"
    median = 24
    sigma = 1.0
    cap = 256

    def reset(self, *, seed: int) -> str:
        rng = random.Random(seed)
        self.letter = rng.choice(self.letters)
        self.length = max(1, min(self.cap, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))))
        return f"say {self.letter}:"

    def turn_end(self, text: str) -> int | None:
        return self.length if len(text) >= self.length else None

    def step(self, action: str) -> StepResult:
        hits = sum(ch == self.letter for ch in action[: self.length])
        reward = hits / self.length
        return StepResult("", reward, True, failed=reward < 0.5, info={"turn_tokens": float(len(action))})


def run(args, seed: int, inflight: bool) -> dict:
    name = f"{'inflight' if inflight else 'between_turns'}_seed{seed}"
    out = Path(args.output) / name
    done = out / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy",
           "--env", f"{Path(__file__).resolve()}:LongTailEnv", "--rollout.engine", args.engine,
           "--rollout.inflight_weight_updates", str(inflight).lower(), "--rollout.max_new_tokens", str(args.max_new_tokens),
           "--data.max_len", str(args.max_new_tokens + 16), "--rollout.batch_size", str(args.batch),
           "--rollout.vllm_generate_batch_size", str(args.batch // 2),
           "--train.max_steps", str(args.steps), "--train.async_queue_size", "1", "--train.max_policy_lag", "8",
           "--eval.steps", "0", "--eval.eval_at_start", "false", "--ckpt.save_steps", "0", "--seed", str(seed),
           "--output", str(out), "--no_progress", "--overwrite"]
    if args.engine == "vllm":
        cmd += ["--vllm.num_engines", "2"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {
        "token_lag_mean": statistics.mean(r["token_lag_mean"] for r in rows),
        "admitted_token_lag_mean": statistics.mean(r["admitted_token_lag_mean"] for r in rows
                                                   if not math.isnan(r["admitted_token_lag_mean"])),
        "policy_lag_mean": statistics.mean(r["policy_lag_mean"] for r in rows),
        "learner_idle_s": sum(r["learner_idle_s"] for r in rows),
        "train_s": rows[-1]["wall_time_s"],
        "wall_s": wall,
        "inflight_pauses": rows[-1]["inflight_pauses"],
        "acceptance_rate": statistics.mean(r["acceptance_rate"] for r in rows),
        "reward_last10": statistics.mean(r["reward_mean"] for r in rows[-10:]),
        "turn_tokens_mean": statistics.mean(r.get("env/turn_tokens", float("nan")) for r in rows),
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True)
    p.add_argument("--engine", default="hf")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args()
    os.makedirs(args.output, exist_ok=True)
    results: dict[bool, list[dict]] = {True: [], False: []}
    for seed in args.seeds:
        for inflight in (False, True):
            r = run(args, seed, inflight)
            results[inflight].append(r)
            print(f"seed {seed} {'in-flight' if inflight else 'between turns'}: {json.dumps(r)}", flush=True)

    from common import print_table

    keys = ["token_lag_mean", "admitted_token_lag_mean", "policy_lag_mean", "learner_idle_s", "train_s",
            "inflight_pauses", "acceptance_rate", "reward_last10", "turn_tokens_mean"]

    def cell(values):
        m = statistics.mean(values)
        return f"{m:.3g} ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else f"{m:.3g}"

    rows = [[("in-flight updates" if side else "between turns only")] + [cell([r[k] for r in results[side]]) for k in keys]
            for side in (False, True)]
    print_table(f"{args.engine} engine, {args.steps} updates of {args.batch} episodes, seeds {args.seeds}",
                ["weights arrive"] + keys, rows)


if __name__ == "__main__":
    main()
