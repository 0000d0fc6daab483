#!/usr/bin/env python
"""Staleness ablation: does the sequence trust gate keep one-rollout REINFORCE stable as rollouts go stale?

Every run is ``flashreinforce train`` with ``--train.fixed_policy_lag K`` (each trajectory sampled exactly K
versions behind the policy that trains on it), the same number of updates whatever K, the same seeds
(prompt order and sampling noise) across columns, a greedy held-out evaluation every ``--eval-every``
updates, and every trajectory's drift statistics in ``samples.jsonl``. Grids (``--grid``):

* ``pilot``: the learning-rate regime (K = 8, gate and gate off, at each ``--lrs``);
* ``main``: rows K in ``--lags``, columns :data:`MAIN_COLUMNS` (the gate, gate off, no IS, truncated IS,
  the other gate metrics, ppo); ``--columns gate_hold`` adds the gate without an optimizer step on
  updates it admitted nothing of (``--actor.step_on_zero_gradient false``), ``--columns gate_tis2`` the gate
  with the admitted trajectories' token ratios truncated at 2 (``--actor.is_truncation 2``), ``--columns
  gate_scaled`` the gate with each step at the learning rate times the update's acceptance rate
  (``--actor.scale_step_by_acceptance true``);
* ``delta``: the gate at each of ``--deltas`` at K = ``--delta-lag``;
* ``groups``: ``--groups`` samples per prompt at an equal rollout budget (``rollout.batch_size`` =
  trajectories / G; G = 1 is the method, G > 1 GRPO: the ppo loss with group advantages, not whitened).

Cells run in priority order (every column and lag of seed 0 before seed 1), one at a time. A finished cell
(its ``result.json``) is skipped, so the grid spans sessions; the run's checkpoint and export are
deleted once its result is written (2 GB a run). While the file ``OUTPUT/PAUSE`` exists, no new cell
starts (a quiet window for other measurements; a waiting runner goes on when it is removed);
``OUTPUT/STATUS`` says what runs. A running cell holds a lock on its folder's ``LOCK`` file, so a second
runner on the same OUTPUT skips that cell instead of running it again (the lock ends with its process,
whatever the way it ends). Each result records the
machine's CPU (``cpu``). ``--restore`` copies the results kept under ``--data`` back to OUTPUT where a cell
has none, so a grid carried on on another machine skips the cells that finished elsewhere.

    python benchmarks/bench_staleness.py --output runs/staleness --grid pilot --lrs 1e-5 4e-5 8e-5 --seeds 0
    python benchmarks/bench_staleness.py --output runs/staleness --grid main --lr 4e-5 --seeds 0 1 2
    python benchmarks/bench_staleness.py --output runs/staleness --report --data docs/data/staleness

``--report`` prints the tables (markdown), copies every result to ``--data`` and draws one figure per
table there (matplotlib, the ``plot`` extra). Cells: final held-out greedy accuracy (mean, min-max over
seeds), the area under the accuracy curve (mean accuracy over the evaluations, the base model's at
update 0 included, trapezoids), the share of trajectories the gate dropped, the largest gradient norm,
and collapses (an evaluation more than 20 points below the run's earlier peak), and the runs that ended
below the base model (on a task with a low base, a run can fall to nothing without a 20-point drop).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

#: Column name -> trainer flags (added to the task's).
COLUMNS: dict[str, list[str]] = {
    "gate": [],  # the method: binary_kl at the task's delta
    "gate_off": ["--actor.flash_gate_delta", "inf"],
    "no_is": ["--actor.flash_no_is", "true"],
    "tis2": ["--actor.is_truncation", "2", "--actor.flash_gate_delta", "inf"],
    "kpop": ["--actor.gate_metric", "kpop"],
    "k3": ["--actor.gate_metric", "k3"],
    "log_ratio": ["--actor.gate_metric", "log_ratio"],
    "ppo": ["--actor.loss_mode", "ppo", "--algo.advantage.estimator", "grpo", "--algo.advantage.no_whiten", "true",
            "--actor.eps_clip_low_high", "0.2", "0.2"],
    # The gate, and no optimizer step for an update it admitted nothing of (AdamW's momentum otherwise keeps
    # moving the weights); not in the main grid by default: --columns gate_hold.
    "gate_hold": ["--actor.step_on_zero_gradient", "false"],
    # The gate with its admitted trajectories' token ratios truncated at 2: separates what the gate's
    # admission does from what the unbounded token ratios inside the admitted trajectories do. Not in the
    # main grid by default: --columns gate_tis2.
    "gate_tis2": ["--actor.is_truncation", "2"],
    # The gate with each optimizer step at the learning rate times the update's acceptance rate: tests whether
    # the gate fails because an update on a few admitted trajectories moves the weights as far as a full one
    # (AdamW). Not in the main grid by default: --columns gate_scaled.
    "gate_scaled": ["--actor.scale_step_by_acceptance", "true"],
}
#: The main grid's columns unless --columns says otherwise.
MAIN_COLUMNS = [c for c in COLUMNS if c not in ("gate_hold", "gate_tis2", "gate_scaled")]
#: The gate metric each column's delta is for (``--metric-deltas`` overrides the task's default delta).
COLUMN_METRIC = {"gate": "binary_kl", "gate_tis2": "binary_kl", "gate_scaled": "binary_kl", "kpop": "kpop", "k3": "k3",
                 "log_ratio": "log_ratio"}

#: Task name -> trainer flags. ``rg_*``: a reasoning-gym task on the same model and budget.
TASKS: dict[str, list[str]] = {
    "arith": ["--preset", "arith"],
    # reasoning-gym's basic_arithmetic, two one-digit terms, + - *, in <answer> tags after two worked examples:
    # the base model writes the tags every time and is right 12% of the time (greedy and sampled), against 51%
    # on the arith preset's plainer prompt of similar problems: the headroom is the arithmetic under the format.
    "rg_basic_arithmetic": ["--preset", "arith", "--env", "reasoning_gym:basic_arithmetic", "--env.kwargs",
                            json.dumps({"size": 1000, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                        "operators": ["+", "-", "*"], "allow_parentheses": False,
                                        "allow_negation": False,
                                        "examples": [["Calculate 14 + 23.", "37"], ["Calculate 31 - 12.", "19"]]}),
                            "--rollout.max_new_tokens", "32", "--data.max_len", "384"],
}


@dataclass
class Cell:
    """One run: ``name`` is its folder under OUTPUT/TASK."""

    task: str
    grid: str
    lag: int
    column: str
    seed: int
    lr: float
    flags: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return folder_name(self.grid, self.lag, self.column, self.seed, self.lr)


def folder_name(grid: str, lag: int, column: str, seed: int, lr: float) -> str:
    """The folder under OUTPUT/TASK of a cell (a delta column is ``delta<value>``)."""
    if grid == "pilot":
        return f"pilot_lr{_lr_text(lr)}_K{lag}_{column}_s{seed}"
    if grid == "delta":
        return f"delta_K{lag}_d{column.removeprefix('delta')}_s{seed}"
    return f"{grid}_K{lag}_{column}_s{seed}"


def _lr_text(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def cells(args) -> list[Cell]:
    """The grid's cells in the order they run: seed-major, then the most informative lags first."""
    out: list[Cell] = []
    for seed in args.seeds:
        if args.grid == "pilot":
            for lr in args.lrs:
                for column in ("gate", "gate_off"):
                    out.append(Cell(args.task, "pilot", args.delta_lag, column, seed, lr, COLUMNS[column]))
        elif args.grid == "main":
            for lag in args.lags:
                for column in args.columns:
                    flags = list(COLUMNS[column])
                    metric = COLUMN_METRIC.get(column)
                    if metric and metric in args.metric_deltas:
                        flags += ["--actor.flash_gate_delta", str(args.metric_deltas[metric])]
                    out.append(Cell(args.task, "main", lag, column, seed, args.lr, flags))
        elif args.grid == "delta":
            for delta in args.deltas:
                out.append(Cell(args.task, "delta", args.delta_lag, f"delta{delta:g}", seed, args.lr,
                                ["--actor.flash_gate_delta", str(delta)]))
        elif args.grid == "groups":
            for g in args.groups:
                prompts = args.trajectories // g
                flags = ["--rollout.batch_size", str(prompts), "--train.batch_size", str(prompts * g),
                         "--rollout.n_samples_per_prompt", str(g)]
                if g > 1:
                    flags += COLUMNS["ppo"]
                out.append(Cell(args.task, "groups", args.group_lag, f"G{g}", seed, args.lr, flags))
    return out


def command(args, cell: Cell, out: Path) -> list[str]:
    return [sys.executable, "-m", "flashreinforce.cli", "train", *TASKS[cell.task], "--output", str(out),
            "--seed", str(cell.seed), "--train.max_steps", str(args.updates), "--train.fixed_policy_lag",
            str(cell.lag), "--actor.adam.lr", str(cell.lr), "--eval.steps", str(args.eval_every),
            "--eval.eval_at_start", "false", "--ckpt.save_steps", "0", "--no_progress",
            "--logger.log_samples_steps", "1", "--logger.log_samples_num", str(args.trajectories),
            "--overwrite", "--fsdp.param_dtype", learner_dtype(), *cell.flags]


def learner_dtype() -> str:
    """The learner's (and so the engine's) dtype for every cell on this machine: bf16 where the CPU computes
    it natively, float32 elsewhere. What the presets' ``auto`` chose for the cells run before it was pinned,
    but decided without ``auto``'s timing probe, so that a loaded machine cannot switch one cell to float32."""
    from flashreinforce.dtypes import cpu_computes_bf16

    return "bf16" if cpu_computes_bf16() else "fp32"


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
    return {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": v[-1],
            "mean": statistics.fmean(v)}


def collapsed(curve: list[tuple[int, float]], drop: float = 0.2) -> bool:
    """Whether an evaluation lies more than ``drop`` below the best one before it."""
    peak = -math.inf
    for _, acc in curve:
        if acc < peak - drop:
            return True
        peak = max(peak, acc)
    return False


def area(curve: list[tuple[int, float]]) -> float:
    """Mean accuracy over the run: trapezoids over the updates, divided by the last update."""
    total = 0.0
    for (s0, a0), (s1, a1) in zip(curve, curve[1:]):
        total += (s1 - s0) * (a0 + a1) / 2
    return total / curve[-1][0] if len(curve) > 1 and curve[-1][0] > 0 else curve[-1][1]


def result_of(cell: Cell, run: Path, base: float, wall_s: float) -> dict:
    """What the tables need from a finished run (kept small: committed under docs/data)."""
    metrics = _read_jsonl(run / "metrics.jsonl")
    evals = _read_jsonl(run / "eval.jsonl")
    samples = _read_jsonl(run / "samples.jsonl")
    curve = [(0, base)] + [(int(e["step"]), float(e["eval_success_rate"])) for e in evals]
    lags = sorted({(int(m["policy_lag_min"]), int(m["policy_lag_max"])) for m in metrics if m["step"] > cell.lag})
    drift_names = [k for k in (samples[0] if samples else {}) if k.startswith("drift_")]
    drift = {k.removeprefix("drift_"): _quantiles([float(s[k]) for s in samples if k in s]) for k in drift_names}
    histogram = {}
    for k in drift_names:  # log10 bins of the per-trajectory drift, for the distribution figures
        counts: dict[str, int] = {}
        for s in samples:
            x = float(s.get(k, 0.0))
            b = "zero" if x <= 0 else str(math.floor(math.log10(x) * 4) / 4)
            counts[b] = counts.get(b, 0) + 1
        histogram[k.removeprefix("drift_")] = counts
    acceptance = [float(m["acceptance_rate"]) for m in metrics if m.get("acceptance_rate") is not None]
    # Whom the gate drops: its acceptance among rewarded and unrewarded trajectories (a gate that keeps
    # the failures and drops the successes shifts the batch's advantages, whatever its threshold).
    by_outcome = {}
    for label, pick in (("rewarded", lambda s: float(s["reward"]) > 0), ("unrewarded", lambda s: float(s["reward"]) <= 0)):
        chosen = [s for s in samples if "admitted" in s and pick(s)]
        by_outcome[label] = statistics.fmean(1.0 if s["admitted"] else 0.0 for s in chosen) if chosen else None
    grad = [float(m["grad_norm"]) for m in metrics if m.get("grad_norm") is not None and math.isfinite(m["grad_norm"])]
    return {
        "task": cell.task, "grid": cell.grid, "lag": cell.lag, "column": cell.column, "seed": cell.seed,
        "lr": cell.lr, "flags": cell.flags, "updates": len(metrics), "curve": curve,
        "final_accuracy": curve[-1][1], "peak_accuracy": max(a for _, a in curve), "auc": area(curve),
        "collapsed": collapsed(curve), "gated_share": 1.0 - statistics.fmean(acceptance) if acceptance else 0.0,
        "acceptance_by_outcome": by_outcome,
        # Updates whose batch the gate admitted nothing of (a zero gradient: AdamW steps on its momentum
        # unless --actor.step_on_zero_gradient false), and those that made no optimizer step.
        "empty_updates": sum(1 for a in acceptance if a == 0.0),
        "optimizer_steps_skipped": sum(int(m.get("optimizer_step_skipped") or 0) for m in metrics),
        "grad_norm_max": max(grad) if grad else None, "lags_after_warmup": lags,
        "reward_first10": statistics.fmean(m["reward_mean"] for m in metrics[:10]) if metrics else None,
        "reward_last10": statistics.fmean(m["reward_mean"] for m in metrics[-10:]) if metrics else None,
        "distinct_problems": len({s.get("seed") for s in samples}),
        "trajectories": sum(int(m.get("trajectories", 0)) for m in metrics),
        "clip_fraction_mean": statistics.fmean(m["clip_fraction"] for m in metrics) if metrics and
        "clip_fraction" in metrics[0] else None,
        "drift": drift, "drift_histogram": histogram, "wall_s": wall_s, "cpu": _cpu(),
        "dtype": _resolved_dtype(run),
    }


def _resolved_dtype(run: Path) -> str | None:
    """The learner dtype the run used: its ``fsdp.param_dtype`` (config.json), ``auto`` read from its log's
    decision (``... auto: bfloat16 (why)``)."""
    from flashreinforce.dtypes import canonical_dtype

    config = run / "config.json"
    flag = json.loads(config.read_text())["flags"].get("fsdp.param_dtype") if config.is_file() else None
    if flag is None:
        return None
    if flag != "auto":
        return canonical_dtype(flag, what="fsdp.param_dtype")
    log = run.parent / "train.log"
    found = re.search(r"fsdp\.param_dtype[^\n]*?auto: (\w+)", log.read_text(errors="replace")) if log.is_file() else None
    return found.group(1) if found else None


def _cpu() -> str:
    """The machine's CPU model and core count (cells of one grid may have run on different machines)."""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def restore(args) -> None:
    """Put the results kept in ``--data`` back as OUTPUT/TASK/CELL/result.json where a cell has none, so that
    a grid carried on on another machine (or after its run folders were lost) skips what finished."""
    data, root = Path(args.data), Path(args.output)
    for folder in sorted(p for p in data.iterdir() if p.is_dir()):
        task = root / folder.name
        task.mkdir(parents=True, exist_ok=True)
        if not (task / "base.json").is_file() and (folder / "base.json").is_file():
            (task / "base.json").write_text((folder / "base.json").read_text())
        restored = kept = 0
        for path in sorted(folder.glob("*.json")):
            if path.name == "base.json":
                continue
            result = json.loads(path.read_text())
            target = task / folder_name(*(result[k] for k in ("grid", "lag", "column", "seed", "lr"))) / "result.json"
            if target.is_file():
                kept += 1
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(result, indent=1))
            restored += 1
        print(f"[{folder.name}] restored {restored} results from {folder}, {kept} already there", flush=True)


def base_accuracy(args, task: str) -> float:
    """The base model's greedy held-out accuracy (deterministic: measured once per task, cached)."""
    path = Path(args.output) / task / "base.json"
    if path.is_file():
        return float(json.loads(path.read_text())["accuracy"])
    path.parent.mkdir(parents=True, exist_ok=True)
    out = Path(args.output) / task / "base_run"
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", *TASKS[task], "--output", str(out), "--train.max_steps",
           "1", "--eval.steps", "0", "--eval.eval_at_start", "true", "--ckpt.save_steps", "0", "--no_progress",
           "--overwrite"]
    print(f"[{task}] base model evaluation: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    first = _read_jsonl(out / "eval.jsonl")[0]
    assert int(first["step"]) == 0, first
    path.write_text(json.dumps({"accuracy": float(first["eval_success_rate"]), "eval": first}))
    shutil.rmtree(out, ignore_errors=True)
    return float(first["eval_success_rate"])


def _same_as_the_gate(args, cell: Cell, root: Path) -> dict | None:
    """At K = 0 nothing is stale: when the gate's run of the same seed dropped no trajectory and every
    trajectory's drift in this column's metric stayed within the column's delta, this column's run is
    the same computation (the gate decides nothing), so its result is that run's, marked as such."""
    if cell.grid != "main" or cell.lag != 0 or cell.column not in ("gate_off", "kpop", "k3", "log_ratio"):
        return None
    gate = root / cell.task / f"main_K0_gate_s{cell.seed}" / "result.json"
    if not gate.is_file():
        return None
    result = json.loads(gate.read_text())
    metric = COLUMN_METRIC.get(cell.column, "binary_kl")
    delta = math.inf if cell.column == "gate_off" else float(args.metric_deltas.get(metric, math.nan))
    if result["gated_share"] != 0.0 or not result["drift"].get(metric, {}).get("max", math.inf) <= delta:
        return None
    return dict(result, column=cell.column, flags=cell.flags, wall_s=0.0,
                identical_to=gate.parent.name, reason=f"K = 0: the gate dropped nothing and every trajectory's "
                f"{metric} drift (max {result['drift'][metric]['max']:.3g}) is within delta {delta:g}")


def _load() -> str:
    try:
        return f"load average {os.getloadavg()[0]:.1f}"
    except OSError:
        return "load unknown"


@contextlib.contextmanager
def claim(folder: Path):
    """Hold the cell ``folder`` for this process while the block runs: yields ``True``, or ``False`` when
    another live runner holds it (an exclusive ``flock`` on ``folder/LOCK``, released when its holder's
    process ends, however it ends, so a killed runner leaves nothing stale behind)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "LOCK", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            fh.truncate(0)  # the last holder's line (appends land at the start of the emptied file)
            fh.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            fh.flush()
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_cell(args, cell: Cell, folder: Path, base: float, root: Path, counter: str) -> int:
    """Run one cell (the trainer in a subprocess, its log in ``folder/train.log``) and write its
    ``result.json``; returns the trainer's exit status. The caller holds ``claim(folder)``, which made
    the folder."""
    run = folder / "run"
    cmd = command(args, cell, run)
    (root / "STATUS").write_text(f"running {cell.name} since {time.strftime('%Y-%m-%d %H:%M:%S')} "
                                 f"({_load()}, pid {os.getpid()})\n")
    print(f"{counter} {cell.name} ({_load()}): {' '.join(cmd[3:])}", flush=True)
    t0 = time.time()
    with open(folder / "train.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"  {cell.name} failed with status {proc.returncode}: see {folder / 'train.log'}", flush=True)
        return proc.returncode
    result = result_of(cell, run, base, wall)
    (folder / "result.json").write_text(json.dumps(result, indent=1))
    for heavy in ("checkpoints", "hf"):
        shutil.rmtree(run / heavy, ignore_errors=True)
    print(f"  final {result['final_accuracy']:.3f} auc {result['auc']:.3f} gated {result['gated_share']:.3f} "
          f"grad max {result['grad_norm_max']} lags {result['lags_after_warmup']} ({wall / 60:.1f} min)",
          flush=True)
    return 0


def run_grid(args) -> None:
    root = Path(args.output)
    todo = cells(args)
    base = base_accuracy(args, args.task)
    done = sum((root / c.task / c.name / "result.json").is_file() for c in todo)
    print(f"[{args.task}] grid {args.grid}: {len(todo)} cells, {done} done; base accuracy {base:.3f}", flush=True)
    for i, cell in enumerate(todo, 1):
        folder = root / cell.task / cell.name
        if (folder / "result.json").is_file():
            continue
        same = _same_as_the_gate(args, cell, root)
        if same is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "result.json").write_text(json.dumps(same, indent=1))
            print(f"[{i}/{len(todo)}] {cell.name}: {same['reason']}: the gate's run", flush=True)
            continue
        while (root / "PAUSE").exists():
            (root / "STATUS").write_text(f"paused before {cell.name} ({time.strftime('%H:%M:%S')})\n")
            time.sleep(10)
        with claim(folder) as mine:
            if not mine:
                print(f"[{i}/{len(todo)}] {cell.name}: another runner holds it ({(folder / 'LOCK').read_text().strip()}); "
                      "skipped", flush=True)
                continue
            if (folder / "result.json").is_file():  # finished by another runner while this one waited
                continue
            if run_cell(args, cell, folder, base, root, f"[{i}/{len(todo)}]") in (130, -2):
                raise SystemExit(130)  # interrupted: stop the grid, not just the cell
    (root / "STATUS").write_text(f"grid {args.grid} of {args.task} finished {time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def reextract(args) -> None:
    """``result.json`` of every finished cell again, from its run folder (metrics, evaluations, samples)."""
    root = Path(args.output)
    for path in sorted(root.glob("*/*/result.json")):
        old = json.loads(path.read_text())
        base = json.loads((path.parents[1] / "base.json").read_text())["accuracy"]
        cell = Cell(old["task"], old["grid"], old["lag"], old["column"], old["seed"], old["lr"], old["flags"])
        same = old.get("identical_to")
        run = path.parents[1] / same / "run" if same else path.parent / "run"
        if not (run / "metrics.jsonl").is_file():  # restored from --data: nothing to extract it from again
            print(f"{path.parent.name}: kept as it is (no run folder: restored with --restore)")
            continue
        new = result_of(cell, run, base, old["wall_s"])
        new["cpu"] = old.get("cpu", new["cpu"])  # the machine the run had, not this one
        if same:  # a column that is another cell's run (see identical_to): keep the reference and its reason
            new.update(identical_to=same, reason=old.get("reason"))
        if old.get("note"):  # what was said of the run by hand (kept)
            new["note"] = old["note"]
        path.write_text(json.dumps(new, indent=1))
        print(f"{path.parent.name}: re-extracted")


# ------------------------------------------------------------------------------------------------ report

def _spread(values: list[float], fmt: str, scale: float = 1.0) -> str:
    if not values:
        return "-"
    v = [x * scale for x in values]
    m = statistics.fmean(v)
    if len(v) == 1:
        return format(m, fmt)
    return f"{format(m, fmt)} ({format(min(v), fmt)}-{format(max(v), fmt)})"


def _results(root: Path, task: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((root / task).glob("*/result.json"))]


def _ordered(keys) -> list:
    return sorted(keys, key=lambda x: (isinstance(x, str), x))


def _columns(rows: list[dict], key_col: str) -> list:
    present = {r[key_col] for r in rows}
    return [c for c in list(COLUMNS) if c in present] + sorted(present - set(COLUMNS))


def _tables(rows: list[dict], key_row: str, key_col: str, base: float) -> list[tuple[str, list[str], list[list[str]]]]:
    """One table per statistic: rows ``key_row``, columns ``key_col``; a cell is the mean over seeds and the
    range (or, for the gradient norm, the largest; for collapses and for runs that ended below ``base``, the
    base model's accuracy, how many of the seeds). The second count catches what the collapse rule cannot
    on a task with a low base: a run that never rose above it and fell to nothing."""
    row_keys, col_keys = _ordered({r[key_row] for r in rows}), _columns(rows, key_col)
    stats = [("final held-out greedy accuracy (%), mean (min-max)",
              lambda c: _spread([r["final_accuracy"] for r in c], ".1f", 100)),
             ("area under the accuracy curve (%), mean (min-max)", lambda c: _spread([r["auc"] for r in c], ".1f", 100)),
             ("share of trajectories the gate dropped (%)",
              lambda c: f"{100 * statistics.fmean(r['gated_share'] for r in c):.1f}"),
             ("updates the gate admitted nothing of, mean over seeds (of the run's updates)",
              lambda c: f"{statistics.fmean(r.get('empty_updates', 0) for r in c):.1f}"),
             ("largest gradient norm (before clipping)", lambda c: f"{max(r['grad_norm_max'] or 0.0 for r in c):.3g}"),
             ("collapses (an evaluation 20 points below the run's earlier peak) / seeds",
              lambda c: f"{sum(r['collapsed'] for r in c)}/{len(c)}"),
             (f"runs that ended below the base model ({100 * base:.1f}%) / seeds",
              lambda c: f"{sum(r['final_accuracy'] < base for r in c)}/{len(c)}")]
    out = []
    for title, fn in stats:
        lines = []
        for rk in row_keys:
            line = [str(rk)]
            for ck in col_keys:
                cell = [r for r in rows if r[key_row] == rk and r[key_col] == ck]
                line.append(fn(cell) if cell else "-")
            lines.append(line)
        out.append((title, [key_row] + [str(c) for c in col_keys], lines))
    return out


def _verdicts(rows: list[dict], base: float) -> list[str]:
    """The main grid's questions, answered from the finished cells: where a neighbour beats the gate, and
    the gate's gain kept at each lag against K = 0."""
    out = []
    for lag in _ordered({r["lag"] for r in rows}):
        gate = [r for r in rows if r["lag"] == lag and r["column"] == "gate"]
        if not gate:
            continue
        g_final, g_auc = (statistics.fmean(r[k] for r in gate) for k in ("final_accuracy", "auc"))
        better = []
        for col in _columns(rows, "column"):
            if col == "gate":
                continue
            other = [r for r in rows if r["lag"] == lag and r["column"] == col]
            if not other:
                continue
            o_final, o_auc = (statistics.fmean(r[k] for r in other) for k in ("final_accuracy", "auc"))
            if o_final > g_final or o_auc > g_auc:
                better.append(f"{col} ({100 * o_final:.1f} / {100 * o_auc:.1f})")
        out.append(f"- K = {lag}: the gate {100 * g_final:.1f} final / {100 * g_auc:.1f} AUC (n = {len(gate)}); "
                   f"beaten on final accuracy or AUC by: {', '.join(better) if better else 'none'}")
    k0 = [r for r in rows if r["lag"] == 0 and r["column"] == "gate"]
    if k0:
        gain0 = statistics.fmean(r["final_accuracy"] for r in k0) - base
        for lag in _ordered({r["lag"] for r in rows} - {0}):
            k = [r for r in rows if r["lag"] == lag and r["column"] == "gate"]
            if k and gain0 > 0:
                kept = (statistics.fmean(r["final_accuracy"] for r in k) - base) / gain0
                out.append(f"- the gate's gain over the base model at K = {lag}: {100 * kept:.0f}% of its K = 0 gain")
    return out


def _markdown(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def report(args) -> None:
    root = Path(args.output)
    data = Path(args.data)
    for task in sorted(p.name for p in root.iterdir() if p.is_dir()):
        results = _results(root, task)
        if not results:
            continue
        base = json.loads((root / task / "base.json").read_text())["accuracy"]
        target = data / task
        target.mkdir(parents=True, exist_ok=True)
        for r in results:
            name = f"{r['grid']}_K{r['lag']}_{r['column']}_lr{_lr_text(r['lr'])}_s{r['seed']}.json"
            (target / name).write_text(json.dumps(r, indent=1))
        (target / "base.json").write_text((root / task / "base.json").read_text())
        text = [f"# {task}: base model held-out greedy accuracy {100 * base:.1f}\n"]
        for grid, key_row, key_col in (("pilot", "lr", "column"), ("main", "lag", "column"),
                                       ("delta", "lag", "column"), ("groups", "lag", "column")):
            rows = [r for r in results if r["grid"] == grid]
            if grid == "delta":  # the main grid's gate (its delta) and gate-off cells at the sweep's lag belong here
                lags = {r["lag"] for r in rows}
                rows += [dict(r, column="delta" + ("inf" if r["column"] == "gate_off" else "default"))
                         for r in results if r["grid"] == "main" and r["lag"] in lags and r["column"] in ("gate",
                                                                                                          "gate_off")]
            if not rows:
                continue
            text.append(f"## {grid}\n")
            for title, header, lines in _tables(rows, key_row, key_col, base):
                text.append(f"{title}:\n\n" + _markdown(header, lines) + "\n")
            if grid == "main":
                text.append("\n".join(_verdicts(rows, base)) + "\n")
            if grid == "groups":
                text.append("distinct problems trained on: " + ", ".join(
                    f"{r['column']} seed {r['seed']}: {r['distinct_problems']}" for r in rows) + "\n")
            _figure(rows, grid, key_row, key_col, base, data / f"{task}_{grid}.png")
        drift_rows = [r for r in results if r["grid"] in ("main", "pilot") and r["column"] == "gate_off"]
        if drift_rows:
            text.append("## Drift per lag (the gate-off runs: nothing dropped)\n\n" + _drift_table(drift_rows))
            _drift_figure(drift_rows, data / f"{task}_drift.png")
        delta_rows = [r for r in results if r["grid"] == "delta"]
        lags = {r["lag"] for r in delta_rows}  # the main grid's gate (the task's delta) and gate off beside them
        delta_rows += [dict(r, column="delta" + ("inf" if r["column"] == "gate_off" else "default")) for r in results
                       if r["grid"] == "main" and r["lag"] in lags and r["column"] in ("gate", "gate_off")]
        if delta_rows:
            _delta_figure(delta_rows, data / f"{task}_delta.png")
        (target / "tables.md").write_text("\n".join(text))
        print("\n".join(text))


def _drift_table(rows: list[dict]) -> str:
    """Quantiles of each trajectory's mean drift, per lag and metric, pooled over seeds and updates."""
    header = ["lag", "lr", "metric", "p10", "p50", "p90", "p99", "max"]
    lines = []
    for r in sorted(rows, key=lambda r: (r["lr"], r["lag"], r["seed"])):
        for metric, q in sorted(r["drift"].items()):
            lines.append([str(r["lag"]), f"{r['lr']:g}", f"{metric} (seed {r['seed']})"] +
                         [f"{q[k]:.3g}" for k in ("p10", "p50", "p90", "p99", "max")])
    return _markdown(header, lines) + "\n"


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no figure: matplotlib is not installed; pip install 'flashreinforce[plot]')")
        return None
    return plt


def _drift_figure(rows: list[dict], path: Path) -> None:
    plt = _plt()
    if plt is None:
        return
    metrics = sorted({m for r in rows for m in r["drift_histogram"]})
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for r in sorted(rows, key=lambda r: (r["lr"], r["lag"])):
            hist = r["drift_histogram"].get(metric, {})
            bins = sorted((float(b), n) for b, n in hist.items() if b != "zero")
            if not bins:
                continue
            total = sum(hist.values())
            ax.step([10 ** b for b, _ in bins], [n / total for _, n in bins], where="post",
                    label=f"K={r['lag']} lr={r['lr']:g} s{r['seed']}")
        ax.set_xscale("log")
        ax.set_title(f"trajectory mean {metric}")
        ax.set_ylabel("share of trajectories")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _delta_figure(rows: list[dict], path: Path) -> None:
    plt = _plt()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    for i, r in enumerate(rows):
        x = 1 - r["gated_share"]
        ax.scatter(x, 100 * r["final_accuracy"], color="C0", label="final" if i == 0 else None)
        ax.scatter(x, 100 * r["auc"], color="C1", marker="s", label="area under the curve" if i == 0 else None)
        ax.annotate(r["column"].removeprefix("delta"), (x, 100 * r["final_accuracy"]), fontsize=7)
    ax.set_xlabel("acceptance rate (mean over updates)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.legend(fontsize=7)
    ax.set_title(f"delta sweep at K = {rows[0]['lag']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _figure(rows: list[dict], grid: str, key_row: str, key_col: str, base: float, path: Path) -> None:
    plt = _plt()
    if plt is None:
        return
    row_keys = sorted({r[key_row] for r in rows}, key=lambda x: (isinstance(x, str), x))
    cols = list(dict.fromkeys(r[key_col] for r in rows))
    fig, axes = plt.subplots(1, len(row_keys), figsize=(4 * len(row_keys), 3.4), squeeze=False, sharey=True)
    for ax, rk in zip(axes[0], row_keys):
        for i, ck in enumerate(cols):  # one colour per column in every panel
            runs = [r for r in rows if r[key_row] == rk and r[key_col] == ck]
            if not runs:
                continue
            steps = [s for s, _ in runs[0]["curve"]]
            mean = [statistics.fmean(dict(map(tuple, r["curve"])).get(s, math.nan) for r in runs) for s in steps]
            ax.plot(steps, [100 * m for m in mean], marker="o", markersize=3, label=ck, color=f"C{i % 10}",
                    linestyle="-" if i < 10 else "--")
        ax.axhline(100 * base, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"{key_row} {rk}")
        ax.set_xlabel("update")
    axes[0][0].set_ylabel("held-out greedy accuracy (%)")
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[0][-1].legend(handles.values(), handles.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="where the runs go (OUTPUT/TASK/CELL)")
    p.add_argument("--task", default="arith", choices=sorted(TASKS))
    p.add_argument("--grid", choices=("pilot", "main", "delta", "groups"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--updates", type=int, default=30, help="optimizer updates per run, whatever the lag")
    p.add_argument("--eval-every", type=int, default=5, help="updates between held-out evaluations")
    p.add_argument("--trajectories", type=int, default=32, help="trajectories per update (the task's batch)")
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 4e-5, 8e-5])
    p.add_argument("--lags", type=int, nargs="+", default=[0, 8, 2, 4, 16])
    p.add_argument("--columns", nargs="+", default=MAIN_COLUMNS, choices=list(COLUMNS))
    p.add_argument("--metric-deltas", type=json.loads, default={},
                   help='JSON {metric: delta} for the gate-metric columns, e.g. {"k3": 0.02}')
    p.add_argument("--deltas", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2])
    p.add_argument("--delta-lag", type=int, default=8)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--group-lag", type=int, default=0)
    p.add_argument("--report", action="store_true", help="print the tables of what finished and write --data")
    p.add_argument("--reextract", action="store_true",
                   help="rewrite every finished cell's result.json from its run folder (after a change of result_of)")
    p.add_argument("--data", default=str(ROOT / "docs" / "data" / "staleness"))
    p.add_argument("--restore", action="store_true",
                   help="copy the results in --data back to OUTPUT where a cell has none (a grid carried on elsewhere)")
    args = p.parse_args()
    if args.restore:
        restore(args)
        return
    if args.reextract:
        reextract(args)
        return
    if args.report:
        report(args)
        return
    if args.grid is None:
        p.error("--grid is required unless --report")
    run_grid(args)


if __name__ == "__main__":
    main()
