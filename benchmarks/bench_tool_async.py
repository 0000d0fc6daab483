#!/usr/bin/env python
"""Asynchrony where it matters: the arith_tool run with tools that take time, three schedules side by side.

    python benchmarks/bench_tool_async.py --output runs/tool_async                   # 8 updates each
    python benchmarks/bench_tool_async.py --output runs/tool_async --updates 4 --median-s 0.5 --sigma 1.0

Every tool call waits for the sandbox (its real time, ``tool_run_s``) plus a delay drawn from a
lognormal distribution (``--median-s``, ``--sigma``: the environment's ``tool_latency``; deterministic
per task, turn and call, so the schedules meet the same delays). One invocation runs, one after the
other, ``--updates`` updates of:

* ``async``: the ``arith_tool`` preset as it is (one rollout per prompt, one batch in flight ahead of
  the learner: ``train.async_queue_size 1``);
* ``sync``: the same with ``train.async_queue_size 0`` (rollouts wait for each update, the learner for
  each batch);
* ``stream``: ``async`` with the worker's episodes as a stream (``rollout.episodes_in_flight 64``: up
  to two batches of episodes in flight, new prompts started as others end, turns sampled while other
  episodes' tool calls run; ``flashreinforce/trainer/rollout/stream.py``);
* ``stream2``: the same with 96 episodes in flight and two batches ahead of the learner
  (``train.async_queue_size 2``, ``train.max_policy_lag 3``);
* ``grpo``: groups of 8 samples (``--actor.loss_mode ppo --algo.advantage.estimator grpo
  --rollout.n_samples_per_prompt 8``, 4 prompts per update of 32 trajectories), asynchronous like ``async``.

Reported from each run's ``metrics.jsonl`` (the first update, which includes start-up, left out):
trajectories per second, the learner's idle share (waiting for a batch), the policy lag, the
seconds per update, the tool time per trajectory (sandbox and added delay). Each schedule's result
is a file of its own (``OUTPUT/SCHEDULE.json``; a rerun skips finished ones).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import arith_curve  # noqa: E402
from flashreinforce.cli import set_openmp_spin_default  # noqa: E402

SCHEDULES = {
    "async": [],
    "sync": ["--train.async_queue_size", "0"],
    "stream": ["--rollout.episodes_in_flight", "64"],
    "stream2": ["--rollout.episodes_in_flight", "96", "--train.async_queue_size", "2", "--train.max_policy_lag", "3"],
    "grpo": ["--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo", "--rollout.n_samples_per_prompt", "8",
             "--rollout.batch_size", "4"],
}


def run(name: str, flags: list[str], args, out: Path) -> dict:
    from flashreinforce.config.presets import PRESETS

    kwargs = dict(PRESETS["arith_tool"]["env.kwargs"], tool_latency={"median_s": args.median_s, "sigma": args.sigma})
    run_dir = out / name
    cmd = arith_curve.cli("train", "--preset", "arith_tool", "--model", args.model, "--output", str(run_dir),
                          "--overwrite", "--env.kwargs", json.dumps(kwargs), "--train.max_steps", str(args.updates + 1),
                          "--eval.steps", "0", "--ckpt.save_steps", "0", "--no_progress", "--seed", str(args.seed),
                          *flags)
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    with open(out / f"{name}_log.txt", "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"[{name}] failed with exit status {code}; see {out / f'{name}_log.txt'}")
    metrics = arith_curve.read_jsonl(run_dir / "metrics.jsonl")[1:]  # the first update includes start-up
    seconds = sum(float(m["step_time_s"]) for m in metrics)
    trajectories = sum(int(m["trajectories"]) for m in metrics)
    mean = arith_curve.mean
    return {
        "schedule": name, "updates": len(metrics), "seconds_per_update": seconds / len(metrics),
        "trajectories_per_s": trajectories / seconds,
        "learner_idle_share": sum(float(m["learner_idle_s"]) for m in metrics) / seconds,
        "policy_lag_mean": mean(float(m["policy_lag_mean"]) for m in metrics),
        "policy_lag_max": max(int(m["policy_lag_max"]) for m in metrics),
        "prompts_per_update": trajectories / len(metrics) / (8 if name == "grpo" else 1),
        "tool_calls_per_trajectory": mean(float(m.get("env/tool_calls", 0.0)) for m in metrics),
        "tool_run_s_per_trajectory": mean(float(m.get("env/tool_run_s", 0.0)) for m in metrics),
        "tool_latency_s_per_trajectory": mean(float(m.get("env/tool_latency_s", 0.0)) for m in metrics),
        "reward_mean": mean(float(m["reward_mean"]) for m in metrics),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--updates", type=int, default=8, help="updates measured per schedule (after a first one)")
    p.add_argument("--median-s", type=float, default=0.5, help="median added delay per tool call")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the added delay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    args = p.parse_args(argv)
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    set_openmp_spin_default()  # as the flashreinforce console script does
    print(f"CPU {arith_curve.cpu_name()} ({os.cpu_count()} CPUs), load average {arith_curve.load_average()}; "
          f"tool delay lognormal, median {args.median_s} s, sigma {args.sigma}", flush=True)
    results = {}
    for name in args.schedules:
        path = out / f"{name}.json"
        if path.is_file():
            print(f"[{name}] {path.name} exists; kept", flush=True)
        else:
            path.write_text(json.dumps(run(name, SCHEDULES[name], args, out), indent=1))
        results[name] = json.loads(path.read_text())
    keys = [("seconds per update", "seconds_per_update", "{:.1f}"), ("trajectories/s", "trajectories_per_s", "{:.3f}"),
            ("learner idle share", "learner_idle_share", "{:.2f}"), ("policy lag (mean)", "policy_lag_mean", "{:.2f}"),
            ("policy lag (max)", "policy_lag_max", "{:.0f}"), ("prompts per update", "prompts_per_update", "{:.0f}"),
            ("tool calls per trajectory", "tool_calls_per_trajectory", "{:.2f}"),
            ("sandbox s per trajectory", "tool_run_s_per_trajectory", "{:.2f}"),
            ("added delay s per trajectory", "tool_latency_s_per_trajectory", "{:.2f}"),
            ("training reward", "reward_mean", "{:.3f}")]
    print(f"\nCPU {arith_curve.cpu_name()}, load average {arith_curve.load_average()}")
    print("| | " + " | ".join(results) + " |\n|" + " --- |" * (len(results) + 1))
    for label, key, fmt in keys:
        print(f"| {label} | " + " | ".join(fmt.format(r[key]) for r in results.values()) + " |")
    (out / "results.json").write_text(json.dumps({"cpu": arith_curve.cpu_name(), "median_s": args.median_s,
                                                  "sigma": args.sigma, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
