#!/usr/bin/env python
"""Measured learning on the arith preset: base eval, a fixed training budget, final eval, a curve.

    python scripts/arith_curve.py --output runs/arith_curve                 # 30 minutes of training
    python scripts/arith_curve.py --output runs/arith_curve --budget-min 5  # a short check
    python scripts/arith_curve.py --output runs/x -- --actor.adam.lr 2e-5   # extra train flags after --

Steps (each skipped when its output exists, so rerunning the same command after a crash or a
Ctrl-C continues where it stopped, resuming training from its newest checkpoint):

1. ``OUTPUT/base_eval.json``: ``flashreinforce eval`` of the base model on the held-out split
   (greedy accuracy and sampled pass@1).
2. ``OUTPUT/run``: ``flashreinforce train --preset arith`` with a held-out greedy evaluation every
   ``--eval-every`` updates; the script stops it with SIGINT (the trainer saves a checkpoint and
   exits) once its *training* time reaches the budget. Training time is the trainer's wall clock
   (``wall_time_s`` in ``metrics.jsonl``) minus the time spent in periodic evaluations, so
   evaluating more often does not shorten training.
3. ``OUTPUT/final_eval.json``: ``flashreinforce eval`` of the run's newest checkpoint.
4. ``OUTPUT/curve.csv``, ``OUTPUT/summary.json`` and ``OUTPUT/curve.png`` (held-out greedy accuracy
   and training reward against training minutes; needs matplotlib, else the PNG is skipped with a
   message). The summary has the per-update timings (generation vs learning split) and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashreinforce.analysis.runs import read_jsonl  # noqa: E402  (also used by bench_vs_trl.py)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def training_times(metrics: list[dict], evals: list[dict]) -> dict[int, float]:
    """Training seconds at each update: the trainer's own ``train_time_s`` (wall clock without
    evaluations and checkpoint saves), or for older runs its wall clock minus earlier evaluations."""
    eval_time = {int(e["step"]): float(e.get("eval_time_s", 0.0)) for e in evals}
    out, spent = {}, 0.0
    for m in metrics:
        step = int(m["step"])
        out[step] = float(m["train_time_s"]) if "train_time_s" in m else float(m["wall_time_s"]) - spent
        spent += eval_time.get(step, 0.0)  # the evaluation after this update
    return out


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flashreinforce.cli", *args]


def run_eval(model: str, out: Path, common: list[str], log: Path) -> dict:
    if out.is_file():
        print(f"[curve] {out.name} exists; kept", flush=True)
        return json.loads(out.read_text())
    t0 = time.time()
    with open(log, "a") as fh:
        subprocess.run(cli("eval", "--model", model, *common, "--output", str(out)), check=True, stdout=fh,
                       stderr=subprocess.STDOUT, cwd=ROOT)
    result = json.loads(out.read_text())
    print(f"[curve] {out.name}: greedy accuracy {result['accuracy']:.3f}, pass@1 {result.get('pass@1')} "
          f"({time.time() - t0:.0f} s)", flush=True)
    return result


def train_for(budget_s: float, run_dir: Path, args: argparse.Namespace, extra: list[str], log: Path) -> str:
    """Run (or resume) training until its training time reaches ``budget_s``; returns how it ended."""
    metrics_path, eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    done = training_times(read_jsonl(metrics_path), read_jsonl(eval_path))
    if done and max(done.values()) >= budget_s:
        print(f"[curve] training already reached the budget ({max(done.values()):.0f} s); kept", flush=True)
        return "kept"
    resume = ["--resume"] if (run_dir / "checkpoints" / "latest").is_file() else []
    cmd = cli("train", "--preset", args.preset, "--model", args.model, "--output", str(run_dir),
              "--eval.steps", str(args.eval_every), "--eval.num_prompts", str(args.eval_prompts),
              "--eval.eval_at_start", "false", "--eval.eval_at_stop", "false", "--no_progress", *resume, *extra)
    print(f"[curve] {' '.join(cmd[2:])}", flush=True)
    with open(log, "a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        stopped = False
        last_report = 0.0
        peak = peak_rss_mib(run_dir)
        while proc.poll() is None:
            time.sleep(2.0)
            peak = max(peak, process_peak_mib(proc.pid))
            if run_dir.is_dir():  # the trainer makes it once its model is loaded; the peak is its lifetime's
                (run_dir / "peak_rss.json").write_text(json.dumps({"peak_rss_mib": peak}))
            times = training_times(read_jsonl(metrics_path), read_jsonl(eval_path))
            trained = max(times.values()) if times else 0.0
            if times and time.time() - last_report > 60:
                print(f"[curve] update {max(times)}: {trained / 60:.1f} of {budget_s / 60:.1f} training minutes",
                      flush=True)
                last_report = time.time()
            if not stopped and trained >= budget_s:
                proc.send_signal(signal.SIGINT)  # the trainer checkpoints and exits
                stopped = True
        code = proc.returncode
    if code not in (0, 130):
        raise SystemExit(f"[curve] training failed with exit status {code}; see {log}")
    return "stopped at the budget" if stopped else "completed train.max_steps"


def process_peak_mib(pid: int) -> float:
    """The peak resident memory of process ``pid`` so far (``VmHWM``), in MiB; 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def peak_rss_mib(run_dir: Path) -> float:
    """The training process's peak resident memory recorded so far (over its sessions), in MiB."""
    try:
        return float(json.loads((run_dir / "peak_rss.json").read_text())["peak_rss_mib"])
    except (OSError, ValueError, KeyError):
        return 0.0


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(out: Path, base: dict, final: dict | None, budget_s: float) -> dict:
    run = out / "run"
    metrics, evals = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "eval.jsonl")
    times = training_times(metrics, evals)
    base_tools = (base.get("greedy_episode_means") or base.get("episode_means") or {}).get("tool_calls")
    rows = [{"step": 0, "train_min": 0.0, "heldout_greedy_accuracy": base["accuracy"], "source": "base_eval",
             **({} if base_tools is None else {"tool_calls": base_tools})}]
    for e in evals:
        step = int(e["step"])
        if step in times:
            rows.append({"step": step, "train_min": times[step] / 60, "heldout_greedy_accuracy": e["eval_success_rate"],
                         "source": "periodic",
                         **({"tool_calls": e["eval_env/tool_calls"]} if "eval_env/tool_calls" in e else {})})
    if final is not None and metrics:
        final_tools = (final.get("greedy_episode_means") or final.get("episode_means") or {}).get("tool_calls")
        rows.append({"step": final.get("checkpoint_step") or int(metrics[-1]["step"]),
                     "train_min": max(times.values()) / 60, "heldout_greedy_accuracy": final["accuracy"],
                     "source": "final_eval", **({} if final_tools is None else {"tool_calls": final_tools})})
    with open(out / "curve.csv", "w") as fh:
        fh.write("step,train_min,heldout_greedy_accuracy,heldout_tool_calls_per_trajectory,source\n")
        for r in rows:
            tools = f"{r['tool_calls']:.3f}" if "tool_calls" in r else ""
            fh.write(f"{r['step']},{r['train_min']:.3f},{r['heldout_greedy_accuracy']:.4f},{tools},{r['source']}\n")
    k = 10
    timing = {}
    if metrics:
        per_update = [m for m in metrics if int(m["step"]) > 1]  # the first update includes start-up
        timing = {
            "updates": len(metrics),
            "trajectories": sum(int(m.get("trajectories", 0)) for m in metrics),
            "step_time_s_mean": mean(float(m["step_time_s"]) for m in per_update),
            "learner_compute_s_mean": mean(float(m["learner_compute_s"]) for m in per_update),
            "learner_idle_s_mean": mean(float(m["learner_idle_s"]) for m in per_update),
            "worker_idle_fraction_mean": mean(float(m.get("worker_idle_fraction", float("nan"))) for m in per_update),
            "response_tokens_mean": mean(float(m.get("response_tokens_mean", float("nan"))) for m in metrics),
            "reward_first_10": mean(float(m["reward_mean"]) for m in metrics[:k]),
            "reward_last_10": mean(float(m["reward_mean"]) for m in metrics[-k:]),
            "policy_lag_mean": mean(float(m.get("policy_lag_mean", float("nan"))) for m in metrics),
            "acceptance_rate_mean": mean(float(m.get("acceptance_rate", float("nan"))) for m in metrics),
            "token_lag_mean": mean(float(m.get("token_lag_mean", float("nan"))) for m in metrics),
            "weight_sync_s_mean": mean(float(m["weight_sync_s"]) for m in per_update if m.get("weight_sync_bytes")),
            "weight_sync_bytes_last": float(metrics[-1].get("weight_sync_bytes", float("nan"))),
            "peak_rss_mib": peak_rss_mib(run),
            # The environment's per-episode numbers (tool calls, answers from the tool, turns), first and
            # last 10 updates.
            **{f"{key}_first_10": mean(float(m[key]) for m in metrics[:k] if key in m)
               for key in sorted({x for m in metrics for x in m if x.startswith("env/")})},
            **{f"{key}_last_10": mean(float(m[key]) for m in metrics[-k:] if key in m)
               for key in sorted({x for m in metrics for x in m if x.startswith("env/")})},
        }
    summary = {
        "cpu": cpu_name(), "cpus": os.cpu_count(), "load_average_end": load_average(), "budget_min": budget_s / 60,
        "trained_min": max(times.values()) / 60 if times else 0.0,
        "base_accuracy": base["accuracy"], "base_pass@1": base.get("pass@1"),
        "final_accuracy": final["accuracy"] if final else None, "final_pass@1": final.get("pass@1") if final else None,
        "gain_points": 100 * (final["accuracy"] - base["accuracy"]) if final else None,
        "num_prompts": base["num_prompts"], "curve": rows, **timing,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(out, rows, metrics, times)
    return summary


def plot(out: Path, rows: list[dict], metrics: list[dict], times: dict[int, float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[curve] matplotlib is not installed (pip install 'flashreinforce[bench]'): no curve.png; "
              "curve.csv has the numbers", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["train_min"] for r in rows], [r["heldout_greedy_accuracy"] for r in rows], "o-",
            label="held-out greedy accuracy")
    if metrics:
        xs = [times[int(m["step"])] / 60 for m in metrics]
        rewards = [float(m["reward_mean"]) for m in metrics]
        smooth = [mean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
        ax.plot(xs, smooth, "-", alpha=0.7, label="training reward (mean of 5 updates)")
    handles, labels = ax.get_legend_handles_labels()
    tool_rows = [r for r in rows if "tool_calls" in r]
    if tool_rows:  # a tool task: tool calls per held-out trajectory on a second axis
        ax2 = ax.twinx()
        line, = ax2.plot([r["train_min"] for r in tool_rows], [r["tool_calls"] for r in tool_rows], "s--",
                         color="tab:green", label="tool calls per held-out trajectory")
        ax2.set_ylabel("tool calls per trajectory")
        ax2.set_ylim(0, max(1.5, max(r["tool_calls"] for r in tool_rows) * 1.1))
        handles, labels = handles + [line], labels + [line.get_label()]
    ax.set_xlabel("training wall-clock (minutes, evaluations and checkpoints excluded)")
    ax.set_ylabel("accuracy / reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(handles, labels, loc="lower right")
    ax.set_title(f"{out.name}: {cpu_name()}, {os.cpu_count()} CPUs")
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=120)
    print(f"[curve] wrote {out / 'curve.png'}", flush=True)


def split_extra_args(argv=None) -> tuple[list[str], list[str]]:
    """``(own, extra)``: the script's own arguments, and those after ``--`` (passed to the trainer)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv=None) -> int:
    argv, extra = split_extra_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="directory for every result of this measurement")
    p.add_argument("--preset", default="arith")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget-min", type=float, default=30.0, help="training minutes (evaluations excluded)")
    p.add_argument("--eval-every", type=int, default=10, help="updates between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts per evaluation")
    args = p.parse_args(argv)
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    print(f"[curve] CPU {cpu_name()} ({os.cpu_count()} CPUs), load average {load_average()}; log: {log}", flush=True)
    common = ["--preset", args.preset, "--eval.num_prompts", str(args.eval_prompts), *extra]
    base = run_eval(args.model, out / "base_eval.json", common, log)
    ended = train_for(args.budget_min * 60, out / "run", args, extra, log)
    print(f"[curve] training {ended}", flush=True)
    final = run_eval(str(out / "run"), out / "final_eval.json", common, log)
    s = summarize(out, base, final, args.budget_min * 60)
    print(json.dumps({k: v for k, v in s.items() if k != "curve"}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
