#!/usr/bin/env python
"""Asynchrony where it matters: the arith_tool run with tools that take time, schedules side by side.

    python benchmarks/bench_tool_async.py --output runs/tool_async                   # 8 updates each
    python benchmarks/bench_tool_async.py --output runs/tool_async --updates 4 --median-s 0.5 --sigma 1.0
    python benchmarks/bench_tool_async.py --output runs/tool_async --model runs/arith_tool_model \
        --updates 11 --seeds 0 1 2 --schedules sync stream2 stream2_steady

Every tool call waits for the sandbox (its real time, ``tool_run_s``) plus a delay drawn from a
lognormal distribution (``--median-s``, ``--sigma``: the environment's ``tool_latency``; deterministic
per task, turn and call, so the schedules meet the same delays). One invocation runs, one after the
other, for each seed, ``--updates`` updates (after a first one) of:

* ``async``: the ``arith_tool`` preset as it is (one rollout per prompt, one batch in flight ahead of
  the learner: ``train.async_queue_size 1``);
* ``sync``: the same with ``train.async_queue_size 0`` (rollouts wait for each update, the learner for
  each batch);
* ``sync_threads2``: ``sync`` with two intra-op threads instead of the preset's one: the learner and
  the rollouts never run at once in a synchronous run, so each may take every core of this 2-core
  machine (the preset's one thread each is for the asynchronous runs, where they run side by side);
  the stronger synchronous baseline;
* ``stream``: ``async`` with the worker's episodes as a stream (``rollout.episodes_in_flight 64``: up
  to two batches of episodes in flight, new prompts started as others end, turns sampled while other
  episodes' tool calls run; ``flashreinforce/trainer/rollout/stream.py``);
* ``stream2``: the same with 96 episodes in flight and two batches ahead of the learner
  (``train.async_queue_size 2``, ``train.max_policy_lag 3``);
* ``stream2_steady``: ``stream2`` with the two optimizer settings that keep a policy two versions
  ahead of its samples from running off: no optimizer step on an exactly zero gradient
  (``actor.step_on_zero_gradient false``: a batch whose rewards are all equal carries no signal, and
  AdamW's momentum would still move the weights) and a step scaled by the gate's acceptance
  (``actor.scale_step_by_acceptance true``);
* ``stream2_steady_threads2``: ``stream2_steady`` with two intra-op threads for the learner and for the
  rollouts (instead of one each): where the rollouts wait on their tools the learner's products may
  take both cores, at the price of four threads on two cores when both compute;
* ``sync_threads2_nostats`` and ``stream2_steady_threads2_nostats``: those two with
  ``--actor.statistics_without_gradient false``: a batch whose every reward is equal (no gradient, known
  before any pass) gets no forward for the gate's statistics either (the learner then does no work on
  it; its acceptance and sequence KL are NaN), on both sides alike;
* ``stream2_steady_threads2_gather``: ``stream2_steady_threads2`` with fewer, larger engine calls: a call
  for fewer than 16 episodes while other episodes' tools run first waits up to 0.3 s for an answer and
  as long again for others (``--rollout.stream_call_min_episodes 16 --rollout.stream_call_gather_s 0.3``);
* ``sync_warmup`` and ``stream2_warmup``: ``sync`` and ``stream2`` with the learning rate raised
  linearly over the first ``--warmup-updates`` updates (default 4; ``actor.lr_warmup_ratio``). A run
  that starts from a trained checkpoint starts a fresh AdamW, whose first steps move every weight by
  about the full rate whatever the gradient's size; a policy two versions ahead of its samples meets
  those steps before its samples show their effect;
* ``grpo``: groups of 8 samples (``--actor.loss_mode ppo --algo.advantage.estimator grpo
  --rollout.n_samples_per_prompt 8``, 4 prompts per update of 32 trajectories), asynchronous like ``async``.

Each run ends with the preset's held-out greedy evaluation of its final policy (128 prompts, the
same slow tools; not counted in the training time); ``--evaluate-missing`` evaluates, with
``flashreinforce eval``, the final policy of a kept result that has no such number. Reported from
each run's ``metrics.jsonl`` (the first update, which includes start-up, left out of the rates):
trajectories per second, the learner's idle share (waiting for a batch), the CPU seconds per update
(the trainer's process and its finished sandboxes) and the CPU busy share (those seconds over what
the usable cores could have done: a schedule that ran the same work with no core ever idle would be
at most 1 / busy share faster; CPU seconds over the cores is the shortest update any schedule of
that work can have), the policy lag, the seconds per update, the tool time per trajectory (sandbox
and added delay), the share of updates whose rewards were all equal (the learner ran no backward for
them: every advantage 0) and of those that ran no forward either (``*_nostats``), the training reward,
its lowest update, the held-out accuracy at the stop; and per update the reward, the gate's acceptance,
the sequence KL and the CPU seconds. Each run's result is a file of its own (``OUTPUT/seedS/SCHEDULE.json``; a rerun skips finished ones); the
table gives the mean over seeds (the largest for a maximum) with each seed's value.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import arith_curve  # noqa: E402
from common import TOOL_ASYNC_SCHEDULES, add_tool_async_arguments, tool_async_env_kwargs, tool_async_train_args  # noqa: E402
from flashreinforce.cli import set_openmp_spin_default  # noqa: E402

SCHEDULES = TOOL_ASYNC_SCHEDULES


def summarize(name: str, metrics: list[dict], evals: list[dict]) -> dict:
    """One run's numbers from its ``metrics.jsonl`` rows (one per update, the first included) and its
    ``eval.jsonl`` rows. Rates leave the first update out (it includes start-up); ``train_time_s`` is
    the trainer's training clock at the last update (evaluations excluded), the first update included."""
    if len(metrics) < 2:
        raise ValueError(f"[{name}] {len(metrics)} update(s) in metrics.jsonl; the rates need at least 2")
    timed = metrics[1:]
    seconds = sum(float(m["step_time_s"]) for m in timed)
    trajectories = sum(int(m["trajectories"]) for m in timed)
    mean = arith_curve.mean
    # CPU work over the updates against what the usable cores could do in that time (trainers that
    # predate the cpu metrics leave them out: NaN).
    busy = (sum(float(m["cpu_busy_share"]) * float(m["step_time_s"]) for m in timed) / seconds
            if all("cpu_busy_share" in m for m in timed) else float("nan"))
    stop = [e for e in evals if int(e["step"]) == int(metrics[-1]["step"])]
    return {
        "schedule": name, "updates": len(timed), "seconds_per_update": seconds / len(timed),
        "train_time_s": float(metrics[-1].get("train_time_s", float("nan"))),
        "trajectories_per_s": trajectories / seconds,
        "learner_idle_share": sum(float(m["learner_idle_s"]) for m in timed) / seconds,
        "cpu_busy_share": busy, "speedup_bound": 1.0 / busy if busy > 0 else float("nan"),
        "cpu_seconds_per_update": (mean(float(m["cpu_time_s"]) for m in timed)
                                   if all("cpu_time_s" in m for m in timed) else float("nan")),
        "policy_lag_mean": mean(float(m["policy_lag_mean"]) for m in timed),
        "policy_lag_max": max(int(m["policy_lag_max"]) for m in timed),
        "prompts_per_update": trajectories / len(timed) / (8 if name == "grpo" else 1),
        "tool_calls_per_trajectory": mean(float(m.get("env/tool_calls", 0.0)) for m in timed),
        "tool_run_s_per_trajectory": mean(float(m.get("env/tool_run_s", 0.0)) for m in timed),
        "tool_latency_s_per_trajectory": mean(float(m.get("env/tool_latency_s", 0.0)) for m in timed),
        "backward_skipped_share": mean(float(m.get("backward_skipped", 0.0)) for m in timed),
        "forward_skipped_share": mean(float(m.get("forward_skipped", 0.0)) for m in timed),
        "reward_mean": mean(float(m["reward_mean"]) for m in timed),
        "reward_min": min(float(m["reward_mean"]) for m in timed),
        "heldout_accuracy": float(stop[-1]["eval_success_rate"]) if stop else float("nan"),
        "per_update": [{"step": int(m["step"]), "reward": float(m["reward_mean"]),
                        "acceptance": float(m.get("acceptance_rate", float("nan"))),
                        "sequence_kl": float(m.get("sequence_kl_mean", float("nan"))),
                        "policy_lag": float(m["policy_lag_mean"]), "grad_norm": float(m.get("grad_norm", float("nan"))),
                        "backward_skipped": float(m.get("backward_skipped", 0.0)),
                        "step_time_s": float(m["step_time_s"]),
                        "cpu_time_s": float(m.get("cpu_time_s", float("nan")))} for m in metrics],
    }


def _env_kwargs(args) -> dict:
    return tool_async_env_kwargs(args.median_s, args.sigma)


def _run_logged(cmd: list[str], log: Path, label: str) -> None:
    """Run a ``flashreinforce`` command with its output in ``log``; stop the benchmark if it fails."""
    print(f"{label} {' '.join(cmd[2:])}", flush=True)
    with open(log, "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"{label} failed with exit status {code}; see {log}")


def run(name: str, flags: list[str], args, seed: int, out: Path) -> dict:
    kwargs = _env_kwargs(args)
    run_dir = out / name
    if name.endswith("_warmup"):  # ceil(ratio * (updates + 1)) = args.warmup_updates, safe from rounding
        flags = [*flags, "--actor.lr_warmup_ratio", f"{(args.warmup_updates - 0.5) / (args.updates + 1):.6f}"]
    cmd = arith_curve.cli("train", *tool_async_train_args(args.model, run_dir, kwargs, args.updates + 1, seed, flags,
                                                          evaluate_at_stop=True))
    _run_logged(cmd, out / f"{name}_log.txt", f"[{name} seed {seed}]")
    result = summarize(name, arith_curve.read_jsonl(run_dir / "metrics.jsonl"),
                       arith_curve.read_jsonl(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").is_file() else [])
    return dict(result, seed=seed, cpu=arith_curve.cpu_name(), load_average_after=arith_curve.load_average())


def evaluate_final_policy(name: str, args, seed: int, out: Path) -> float:
    """Held-out greedy accuracy of a finished run's final policy by ``flashreinforce eval`` (the preset's
    128 held-out prompts, the run's tools), for a kept result whose run did not evaluate at its stop."""
    kwargs = _env_kwargs(args)
    report = out / name / "heldout_eval.json"
    cmd = arith_curve.cli("eval", "--preset", "arith_tool", "--model", str(out / name), "--env.kwargs",
                          json.dumps(kwargs), "--no_sampled", "--seed", str(seed), "--output", str(report))
    _run_logged(cmd, out / f"{name}_eval_log.txt", f"[{name} seed {seed}] evaluation")
    return float(json.loads(report.read_text())["accuracy"])


ROWS = [("seconds per update", "seconds_per_update", "{:.1f}"), ("trajectories/s", "trajectories_per_s", "{:.3f}"),
        ("learner idle share", "learner_idle_share", "{:.2f}"),
        ("CPU seconds per update", "cpu_seconds_per_update", "{:.1f}"),
        ("CPU busy share (of the usable cores)", "cpu_busy_share", "{:.2f}"),
        ("speed-up bound for the same work (1 / busy share)", "speedup_bound", "{:.2f}x"),
        ("policy lag (mean)", "policy_lag_mean", "{:.2f}"),
        ("policy lag (max)", "policy_lag_max", "{:.0f}"), ("prompts per update", "prompts_per_update", "{:.0f}"),
        ("tool calls per trajectory", "tool_calls_per_trajectory", "{:.2f}"),
        ("sandbox s per trajectory", "tool_run_s_per_trajectory", "{:.2f}"),
        ("added delay s per trajectory", "tool_latency_s_per_trajectory", "{:.2f}"),
        ("updates without a backward (every reward equal)", "backward_skipped_share", "{:.2f}"),
        ("updates without any pass (no statistics)", "forward_skipped_share", "{:.2f}"),
        ("training reward", "reward_mean", "{:.3f}"), ("lowest update's reward", "reward_min", "{:.3f}"),
        ("held-out accuracy at the stop", "heldout_accuracy", "{:.3f}")]


def table(results: dict[str, list[dict]]) -> str:
    """Markdown table: per schedule the mean over its seeds (the largest for a maximum), each seed's
    value in parentheses when there are several; a row of speed against ``sync`` (its mean seconds per
    update over this schedule's) when ``sync`` ran."""
    def cell(runs: list[dict], key: str, fmt: str) -> str:
        values = [float(r.get(key, math.nan)) for r in runs]
        text = fmt.format(max(values) if key.endswith("_max") else arith_curve.mean(values))
        return text if len(values) == 1 else f"{text} ({', '.join(fmt.format(v) for v in values)})"

    lines = ["| | " + " | ".join(results) + " |", "|" + " --- |" * (len(results) + 1)]
    lines.append("| seeds | " + " | ".join(", ".join(str(r["seed"]) for r in runs) for runs in results.values()) + " |")
    for label, key, fmt in ROWS:
        if not any(key in r for runs in results.values() for r in runs):
            continue  # results of a benchmark version without this number
        lines.append(f"| {label} | " + " | ".join(cell(runs, key, fmt) for runs in results.values()) + " |")
    if "sync" in results:
        base = arith_curve.mean(r["seconds_per_update"] for r in results["sync"])
        speeds = [base / arith_curve.mean(r["seconds_per_update"] for r in runs) for runs in results.values()]
        lines.append("| against sync | " + " | ".join(f"{x:.2f}x" for x in speeds) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tool_async_arguments(p, updates=8)
    p.add_argument("--warmup-updates", type=int, default=4,
                   help="the *_warmup schedules' linear learning-rate warmup, in updates (from the run's first)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per schedule and seed")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--evaluate-missing", action="store_true",
                   help="for kept results without a held-out accuracy (their run did not evaluate at its stop), "
                        "evaluate the run's final policy with flashreinforce eval and record it")
    args = p.parse_args(argv)
    if args.updates < 1:
        p.error(f"--updates must be at least 1, got {args.updates}")
    warm = any(name.endswith("_warmup") for name in args.schedules)
    if warm and not 1 <= args.warmup_updates <= args.updates + 1:
        p.error(f"--warmup-updates must lie in [1, {args.updates + 1}] (the run's updates), got {args.warmup_updates}")
    out = Path(args.output).resolve()
    set_openmp_spin_default()  # as the flashreinforce console script does
    print(f"CPU {arith_curve.cpu_name()} ({os.cpu_count()} CPUs), load average {arith_curve.load_average()}; "
          f"tool delay lognormal, median {args.median_s} s, sigma {args.sigma}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in args.schedules}
    for seed in args.seeds:
        folder = out / f"seed{seed}"
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.schedules:
            path = folder / f"{name}.json"
            if path.is_file():
                print(f"[{name} seed {seed}] {path.relative_to(out)} exists; kept", flush=True)
            else:
                path.write_text(json.dumps(run(name, SCHEDULES[name], args, seed, folder), indent=1))
            result = json.loads(path.read_text())
            if args.evaluate_missing and math.isnan(float(result.get("heldout_accuracy", float("nan")))):
                result.update(heldout_accuracy=evaluate_final_policy(name, args, seed, folder),
                              heldout_source="flashreinforce eval of the final policy, after the run")
                path.write_text(json.dumps(result, indent=1))
            results[name].append(result)
    text = table(results)
    print(f"\nCPU {arith_curve.cpu_name()}, load average {arith_curve.load_average()}\n{text}")
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"cpu": arith_curve.cpu_name(), "median_s": args.median_s,
                                                  "sigma": args.sigma, "seeds": args.seeds, "results": results},
                                                 indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
