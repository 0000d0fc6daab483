"""Toy preset under each scale-out layout: local threads, Ray workers, torchrun learners, and the
cluster-shaped layouts simulated on this machine (several Ray nodes; two torchrun "nodes").

Runs ``flashreinforce train --preset toy`` (400 updates unless ``--steps``) once per layout and prints
one table row per run from its ``metrics.jsonl`` / ``eval.jsonl``: training time, total time, mean
reward over updates 1-10 / 91-100 / 191-200 / the last 20, the first update whose 10-update mean
reward reaches 0.8, the greedy evaluation, policy lag and learner idle time. It shows that every
layout learns as the local run does, and what the machinery costs on the machine at hand.

``ray_3nodes``: a head node without CPUs (the learner's) and two worker nodes with one CPU each,
started here with ``ray.cluster_utils.Cluster`` (own raylets and object stores), the two rollout
workers spread over them. ``torchrun_2nodes``: ``torchrun --nnodes 2 --nproc-per-node 1`` as two
launcher processes meeting by c10d rendezvous on localhost.

    python benchmarks/bench_scaleout_toy.py                 # every layout (~6 min on 2 CPU cores)
    python benchmarks/bench_scaleout_toy.py --layouts local ray --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS = {
    "local": ([], []),
    "ray": ([], ["--rollout.backend", "ray"]),
    "ray_call64": ([], ["--rollout.backend", "ray", "--rollout.vllm_generate_batch_size", "64"]),
    "torchrun2": (["torchrun"], []),
    "torchrun2_fsdp": (["torchrun"], ["--fsdp.strategy", "fully_shard"]),
    "ray_3nodes": (["cluster"], ["--rollout.backend", "ray", "--ray.scheduling_strategy", "spread",
                                 "--rollout.vllm_generate_batch_size", "64"]),
    "torchrun_2nodes": (["torchrun_nodes"], []),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(layout: str, out: Path, steps: int, seed: int, ray_address: str | None) -> list[list[str]]:
    """The processes of one run (two launchers for ``torchrun_2nodes``, else one)."""
    launcher, flags = LAYOUTS[layout]
    args = ["train", "--preset", "toy", "--output", str(out), "--train.max_steps", str(steps), "--seed", str(seed),
            "--no_progress", *flags]
    if launcher == ["torchrun"]:
        return [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                 str(free_port()), "-m", "flashreinforce.cli", *args]]
    if launcher == ["torchrun_nodes"]:
        port = free_port()
        node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{port}",
                "-m", "flashreinforce.cli", *args]
        return [node, node]
    if launcher == ["cluster"]:
        args += ["--ray.address", ray_address]
    return [[sys.executable, "-m", "flashreinforce.cli", *args]]


class SimulatedCluster:
    """A Ray head without CPUs and ``workers`` nodes with one CPU each, on this machine."""

    def __init__(self, workers: int = 2) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False))
        for i in range(workers):
            self.cluster.add_node(num_cpus=1, resources={f"node_{chr(ord('a') + i)}": 1})
        self.address = self.cluster.address

    def close(self) -> None:
        self.cluster.shutdown()


def run_layout(layout: str, out: Path, steps: int, seed: int, env: dict[str, str]) -> tuple[float, str | None]:
    """Run one layout; returns the wall time and, if it failed, the tail of its output."""
    cluster = SimulatedCluster() if LAYOUTS[layout][0] == ["cluster"] else None
    try:
        t0 = time.perf_counter()
        procs = []
        for i, cmd in enumerate(commands(layout, out, steps, seed, cluster and cluster.address)):
            log = open(out.parent / f"{layout}.{i}.log", "w")  # files: launchers must never block on a pipe
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        codes = [p.wait() for p, _ in procs]
        total = time.perf_counter() - t0
        for _, log in procs:
            log.close()
    finally:
        if cluster is not None:
            cluster.close()
    if any(codes):
        tail = "\n".join((out.parent / f"{layout}.{i}.log").read_text()[-3000:] for i in range(len(procs)))
        return total, f"exit {codes}\n{tail}"
    return total, None


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(out: Path) -> dict:
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ev_path = out / "eval.jsonl"
    ev = [json.loads(line) for line in ev_path.read_text().splitlines()] if ev_path.is_file() else []
    r = [x["reward_mean"] for x in m]
    first = next((i + 1 for i in range(9, len(r)) if mean(r[i - 9:i + 1]) >= 0.8), None)
    return {
        "train_s": m[-1]["wall_time_s"],
        "rewards": [mean(r[:10]), mean(r[90:100]), mean(r[190:200]), mean(r[-20:])],
        "first_08": first, "first_08_s": m[first - 1]["wall_time_s"] if first else float("nan"),
        "eval": [round(e["eval_success_rate"], 2) for e in ev],
        "lag": mean(x["policy_lag_mean"] for x in m), "idle_s": sum(x["learner_idle_s"] for x in m),
        "lost": m[-1].get("lost_trajectories", 0), "restarts": m[-1].get("worker_restarts", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")  # also for the simulated Ray nodes
    env = dict(os.environ)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            out = Path(tmp) / layout
            total, failure = run_layout(layout, out, args.steps, args.seed, env)
            if failure:
                print(f"{layout}: failed ({failure})", file=sys.stderr)
                continue
            rows.append((layout, total, summarize(out)))
    print(f"toy preset, {args.steps} updates, seed {args.seed}, {os.cpu_count()} CPUs")
    print(f"{'layout':<16} {'train s':>8} {'total s':>8}  {'reward 1-10/91-100/191-200/last20':<34} "
          f"{'>=0.8 at':>9} {'lag':>5} {'idle s':>7} {'lost':>5} {'restarts':>8}  eval")
    for layout, total, s in rows:
        rewards = " / ".join(f"{x:.3f}" for x in s["rewards"])
        first = f"{s['first_08']} ({s['first_08_s']:.1f}s)" if s["first_08"] else "-"
        print(f"{layout:<16} {s['train_s']:>8.1f} {total:>8.1f}  {rewards:<34} {first:>9} {s['lag']:>5.2f} "
              f"{s['idle_s']:>7.1f} {s['lost']:>5} {s['restarts']:>8}  {s['eval']}")


if __name__ == "__main__":
    main()
