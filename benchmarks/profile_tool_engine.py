#!/usr/bin/env python
"""Where a tool-using run's time goes: the hf engine's prefill and decode, and the learner, schedule by schedule.

    python benchmarks/profile_tool_engine.py --output runs/tool_profile --model runs/arith_tool_model \
        --schedules sync_threads2 stream2_steady_threads2 --updates 11 --seed 0

Runs ``bench_tool_async.py``'s schedules (``common.TOOL_ASYNC_SCHEDULES``: the same command, flags,
tools and delays) one after the other, each in a process of its own whose hf engine and rollout worker carry timers: every
``generate`` call of the worker (its episodes), every prefill (a fresh one, and one that goes on
from kept turns or the shared prefix, with the tokens it computed: the shared prefix where computed,
then rows x width, padding included) and every decode step (its rows). Then per schedule: seconds
and CPU seconds per update, the engine's wall seconds per update in each part, decode rows per step,
the turns sampled against those the updates used (an asynchronous run ends with episodes in flight
that no update takes), and the learner's compute per update, for the updates without a backward and
those with one (the first update left out, as in ``bench_tool_async.py``). Under an asynchronous
schedule the engine and the learner share the cores, so their wall seconds overlap and each is
slowed by the other; compare parts within a schedule, and CPU seconds across schedules.

The timers wrap private methods of the engine (``HFEngine._prefill``, ``_continued_prefill`` and
``_forward``, ``FastDecoder.step``): a profiling aid tied to this version of the engine, not an
interface. Each schedule's timings go to ``OUTPUT/SCHEDULE/engine_timings.jsonl``, the table to
``OUTPUT/table.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))


def child(timings: str, train_args: list[str]) -> int:
    """``flashreinforce train TRAIN_ARGS`` in this process, with timers on the engine and the worker."""
    from flashreinforce.cli import main as cli_main
    from flashreinforce.engines.hf import engine as hf_engine
    from flashreinforce.engines.hf import fast_decode
    from flashreinforce.trainer.rollout import worker as rollout_worker

    out = open(timings, "w", buffering=1 << 16)
    computed = [0]  # tokens through the model's forward since the current prefill began

    def timed(owner, name: str, describe, *, prefill: bool = False) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if prefill:
                computed[0] = 0
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            out.write(json.dumps({"part": name, "s": time.perf_counter() - t0, **describe(args)}) + "\n")
            return result

        setattr(owner, name, wrapper)

    forward = hf_engine.HFEngine._forward

    def counted_forward(self, ids, *args, **kwargs):  # every prefill's input, padding included
        computed[0] += int(ids.numel())
        return forward(self, ids, *args, **kwargs)

    hf_engine.HFEngine._forward = counted_forward
    timed(rollout_worker.RolloutWorker, "_act", lambda a: {"rows": len(a[1])})
    for name in ("_prefill", "_continued_prefill"):
        timed(hf_engine.HFEngine, name, lambda a: {"rows": len(a[1]), "tokens": computed[0]}, prefill=True)
    timed(fast_decode.FastDecoder, "step", lambda a: {"rows": int(a[1].shape[0])})
    try:
        return cli_main(["train", *train_args])
    finally:
        out.close()


def summarize(name: str, run_dir: Path) -> dict:
    import arith_curve

    every_update = arith_curve.read_jsonl(run_dir / "metrics.jsonl")
    metrics = every_update[1:]
    rows = arith_curve.read_jsonl(run_dir / "engine_timings.jsonl")
    n = len(metrics)
    parts = {}
    for part in ("_act", "_prefill", "_continued_prefill", "step"):
        got = [r for r in rows if r["part"] == part]
        parts[part] = {"calls": len(got), "s": sum(r["s"] for r in got), "rows": sum(r["rows"] for r in got),
                       "tokens": sum(r.get("tokens", r["rows"]) for r in got)}
    learner = {k: [float(m["learner_compute_s"]) for m in metrics if float(m.get("backward_skipped", 0.0)) == k]
               for k in (1.0, 0.0)}
    # The timers cover the whole run (its first update too): per update over all updates.
    updates = n + 1
    return {
        "schedule": name, "updates": n,
        "seconds_per_update": sum(float(m["step_time_s"]) for m in metrics) / n,
        "cpu_seconds_per_update": sum(float(m["cpu_time_s"]) for m in metrics) / n,
        "generate_s_per_update": parts["_act"]["s"] / updates,
        "prefill_s_per_update": parts["_prefill"]["s"] / updates,
        "continued_prefill_s_per_update": parts["_continued_prefill"]["s"] / updates,
        "decode_s_per_update": parts["step"]["s"] / updates,
        "prefill_tokens_per_update": (parts["_prefill"]["tokens"] + parts["_continued_prefill"]["tokens"]) / updates,
        "decode_tokens_per_update": parts["step"]["tokens"] / updates,
        "decode_rows_per_step": parts["step"]["rows"] / max(1, parts["step"]["calls"]),
        "episodes_per_generate_call": parts["_act"]["rows"] / max(1, parts["_act"]["calls"]),
        # Turns the worker sampled against those in the batches the learner took (all updates): an
        # asynchronous run ends with episodes in flight that no update uses.
        "turns_sampled": parts["_act"]["rows"],
        "turns_used": round(sum(float(m["trajectories"]) * float(m["num_turns_mean"]) for m in every_update)),
        "learner_s_without_backward": statistics.median(learner[1.0]) if learner[1.0] else float("nan"),
        "learner_s_with_backward": statistics.median(learner[0.0]) if learner[0.0] else float("nan"),
        "updates_with_backward": len(learner[0.0]),
    }


ROWS = [("seconds per update", "seconds_per_update", "{:.2f}"),
        ("CPU seconds per update", "cpu_seconds_per_update", "{:.1f}"),
        ("engine: generate calls, s per update", "generate_s_per_update", "{:.2f}"),
        ("engine: fresh prefill, s per update", "prefill_s_per_update", "{:.2f}"),
        ("engine: continued prefill, s per update", "continued_prefill_s_per_update", "{:.2f}"),
        ("engine: decode steps, s per update", "decode_s_per_update", "{:.2f}"),
        ("engine: prefill tokens computed per update", "prefill_tokens_per_update", "{:.0f}"),
        ("engine: decoded tokens per update", "decode_tokens_per_update", "{:.0f}"),
        ("engine: rows per decode step", "decode_rows_per_step", "{:.1f}"),
        ("engine: episodes per generate call", "episodes_per_generate_call", "{:.1f}"),
        ("turns sampled in the run / used by its updates", None, None),
        ("learner: compute s, update without a backward (median)", "learner_s_without_backward", "{:.2f}"),
        ("learner: compute s, update with a backward (median)", "learner_s_with_backward", "{:.2f}"),
        ("updates with a backward", "updates_with_backward", "{:d}")]


def table(results: list[dict]) -> str:
    lines = ["| | " + " | ".join(r["schedule"] for r in results) + " |", "| --- |" + " --- |" * len(results)]
    for label, key, fmt in ROWS:
        cells = [f"{r['turns_sampled']} / {r['turns_used']}" if key is None else fmt.format(r[key]) for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2:])
    import arith_curve
    from common import TOOL_ASYNC_SCHEDULES, add_tool_async_arguments, tool_async_env_kwargs, tool_async_train_args
    from flashreinforce.cli import set_openmp_spin_default

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_tool_async_arguments(p, updates=11)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", nargs="+", default=["sync_threads2", "stream2_steady_threads2"],
                   choices=[s for s in TOOL_ASYNC_SCHEDULES if not s.endswith("_warmup")])
    args = p.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    set_openmp_spin_default()
    print(f"CPU {arith_curve.cpu_name()} ({os.cpu_count()} CPUs), load average {arith_curve.load_average()}",
          flush=True)
    kwargs = tool_async_env_kwargs(args.median_s, args.sigma)
    results = []
    for name in args.schedules:
        run_dir = out / name
        train = tool_async_train_args(args.model, run_dir, kwargs, args.updates + 1, args.seed,
                                      TOOL_ASYNC_SCHEDULES[name], evaluate_at_stop=False)
        run_dir.mkdir(parents=True, exist_ok=True)
        timings = run_dir / "engine_timings.jsonl"
        print(f"[{name}] seed {args.seed}", flush=True)
        with open(out / f"{name}_log.txt", "w") as log:
            code = subprocess.run([sys.executable, __file__, "--child", str(timings), *train], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if code != 0:
            raise SystemExit(f"[{name}] failed with exit status {code}; see {out / f'{name}_log.txt'}")
        results.append(summarize(name, run_dir))
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
