"""Resident memory of a training run, phase by phase: what holds it (docs/performance.md, "Memory of an
agent LoRA run").

Runs ``flashreinforce.train`` in this process on the settings given as JSON (the file format of
``--config``, dotted flags and ``preset``, ``model``, ``agent``, ``env``...) with a thread that reads
``VmRSS`` every 0.5 s, and marks ``VmRSS`` / ``VmHWM`` (``/proc/self/status``) before and after each
phase: loading the policy, building the learner, each evaluation, starting the rollout workers, each
learner update, the export. ``tracemalloc`` cannot see PyTorch's tensors; the resident set can.

    python benchmarks/bench_run_memory.py --output runs/mem '{"preset": "agent",
        "agent": "flashreinforce.agents.arith_calculator:agent", "lora.rank": 16, "actor.adam.lr": 2e-4,
        "train.max_steps": 2, "eval.num_prompts": 16, "ckpt.save_steps": 0}'
    MALLOC_MMAP_THRESHOLD_=2097152 python benchmarks/bench_run_memory.py ...   # glibc gives freed blocks back

Prints one line per mark (seconds, phase, VmRSS GiB, VmHWM GiB) and writes them, with the samples, to
``OUTPUT.memory.json``. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def status() -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of this process, GiB."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 2**20
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", help="the run's settings as JSON (the --config format)")
    p.add_argument("--output", required=True, help="the run's output directory (must not hold a run)")
    args = p.parse_args()
    import flashreinforce as fr
    from flashreinforce.trainer.learning import learner as learner_module
    from flashreinforce.trainer.run import components, loop

    t0 = time.time()
    marks: list[tuple[float, str, float, float]] = []
    samples: list[tuple[float, float]] = []

    def mark(what: str) -> None:
        s = status()
        marks.append((round(time.time() - t0, 1), what, round(s["VmRSS"], 3), round(s["VmHWM"], 3)))
        print("%7.1f s  %-28s VmRSS %6.3f  VmHWM %6.3f GiB" % marks[-1], file=sys.stderr, flush=True)

    def sample() -> None:
        while True:
            samples.append((round(time.time() - t0, 1), round(status()["VmRSS"], 3)))
            time.sleep(0.5)

    def around(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapped(*a, **k):
            mark(f"before {label}")
            try:
                return real(*a, **k)
            finally:
                mark(f"after {label}")

        setattr(owner, name, wrapped)

    around(components, "load_policy", "loading the policy")
    around(loop, "Learner", "building the learner")
    around(loop.Trainer, "evaluate", "an evaluation")
    around(loop.Trainer, "_make_workers", "starting the workers")
    around(loop, "export_policy", "the export")
    around(learner_module.Learner, "step", "a learner update")
    threading.Thread(target=sample, daemon=True).start()
    mark("imports")
    try:
        summary = fr.train(json.loads(args.settings), output=args.output, progress=False)
    finally:
        mark("end")
        Path(args.output + ".memory.json").write_text(json.dumps({"marks": marks, "samples": samples}))
    print(json.dumps({"status": summary["status"], "step": summary["step"], "peak_gib": max(m[3] for m in marks)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
