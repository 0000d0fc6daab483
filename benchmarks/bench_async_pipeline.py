"""Async vs synchronous rollout schedule on the trainer's real rollout/buffer/learner machinery.

What is real: :class:`~flashreinforce.trainer.rollout.buffer.RolloutBuffer` (staleness bound, lag drops),
:class:`~flashreinforce.trainer.rollout.worker.RolloutWorker` threads in a
:class:`~flashreinforce.trainer.rollout.thread_pool.ThreadRolloutPool`, the episode loop, the environment interface,
:class:`~flashreinforce.engines.LocalWeightStore` weight publication by version, and the learner
loop's take / update / publish / release sequence. What is simulated: the engine (each trajectory
takes a lognormal time, median ``--median-ms``, sigma ``--sigma``: about 1% of trajectories take 20x
the median or more) and the learner step (a fixed ``--learner-ms``).

Both schedules use the same batch size B and the same workers:

* ``sync``: ``train.async_queue_size 0``: collect B trajectories, then train while workers idle;
* ``async``: ``train.async_queue_size Q`` and ``train.max_policy_lag L``: workers keep rolling out
  while the learner trains; trajectories more than L versions old are dropped and counted.

Prints one table row per schedule (medians over ``--repeats`` runs) and the throughput ratio.

    python benchmarks/bench_async_pipeline.py            # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Mapping, Sequence

import torch

from flashreinforce.trainer.rollout.buffer import RolloutBuffer
from flashreinforce.engines import Generation, GenerationRequest, LocalWeightStore, RolloutEngine, SamplingParams
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.worker import RolloutWorker
from flashreinforce.trainer.rollout.thread_pool import ThreadRolloutPool
from flashreinforce.models.tokenizers import CharTokenizer


class SimulatedEngine(RolloutEngine):
    """Sleeps a lognormal time per request (as a generation would take), returns 4 tokens."""

    def __init__(self, rng: random.Random, median_s: float, sigma: float, durations: list[float]) -> None:
        self.rng, self.median_s, self.sigma, self.durations = rng, median_s, sigma, durations
        self.version = -1

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        times = [self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0)) for _ in requests]
        self.durations.extend(times)
        time.sleep(max(times))
        return [Generation([10, 11, 12, 2], [-0.5] * 4, "stop", self.version) for _ in requests]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.version = version


class OneTurnEnv(Environment):
    def reset(self, *, seed: int) -> str:
        self.seed = seed
        return "q:"

    def step(self, action: str) -> StepResult:
        return StepResult(reward=float(self.seed % 2), done=True)


def run(schedule: str, *, batch: int, workers: int, updates: int, median_s: float, sigma: float, learner_s: float,
        queue: int, max_lag: int, seed: int) -> dict[str, float]:
    tok = CharTokenizer()
    buffer = RolloutBuffer(batch_groups=batch, async_queue_size=0 if schedule == "sync" else queue,
                           max_policy_lag=None if schedule == "sync" else max_lag, vocab_size=tok.vocab_size)
    store = LocalWeightStore()
    weights = {"w": torch.zeros(4)}
    store.publish(weights, 0)
    durations: list[float] = []
    settings = RolloutSettings(max_new_tokens=4, max_len=64, max_turns=1, episodes_per_call=1, seed=seed)
    pool = ThreadRolloutPool([
        RolloutWorker(i, SimulatedEngine(random.Random(seed * 1000 + i), median_s, sigma, durations), OneTurnEnv,
                      tok, buffer, store, settings) for i in range(workers)])
    lags: list[int] = []
    idle = 0.0
    version = 0
    pool.start()
    t0 = time.perf_counter()
    for _ in range(updates):
        w0 = time.perf_counter()
        got = buffer.take(version)
        idle += time.perf_counter() - w0
        lags.extend(t.policy_lag(version) for t in got.trajectories)
        time.sleep(learner_s)  # the learner step of fixed cost
        version += 1
        store.publish(weights, version)
        buffer.update_done()
    wall = time.perf_counter() - t0
    pool.stop()
    stats = pool.stats()
    lags.sort()
    ds = sorted(durations)
    return {
        "traj_per_s": updates * batch / wall,
        "learner_idle": idle / wall,
        "lag_mean": statistics.mean(lags),
        "lag_p50": lags[len(lags) // 2],
        "lag_p90": lags[int(0.9 * (len(lags) - 1))],
        "lag_max": lags[-1],
        "dropped": buffer.counters["dropped_stale_trajectories"],
        "worker_idle": statistics.mean(s["idle_s"] / max(1e-9, s["idle_s"] + s["busy_s"]) for s in stats),
        "tail_ratio": ds[-1] / ds[len(ds) // 2],
        "p99_ratio": ds[int(0.99 * (len(ds) - 1))] / ds[len(ds) // 2],
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="trajectories per update (B)")
    p.add_argument("--workers", type=int, default=16, help="rollout workers (engine slots)")
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--median-ms", type=float, default=20.0, help="median trajectory time")
    p.add_argument("--sigma", type=float, default=1.3, help="lognormal sigma of trajectory times")
    p.add_argument("--learner-ms", type=float, default=200.0, help="fixed learner step time")
    p.add_argument("--queue", type=int, default=2, help="train.async_queue_size of the async schedule")
    p.add_argument("--max-lag", type=int, default=4, help="train.max_policy_lag of the async schedule")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"B={a.batch} workers={a.workers} updates={a.updates} trajectory time lognormal(median {a.median_ms} ms, "
          f"sigma {a.sigma}) learner step {a.learner_ms} ms; async: queue {a.queue}, max lag {a.max_lag}; "
          f"medians of {a.repeats} runs\n")
    header = ("schedule", "traj/s", "learner idle", "lag mean", "lag p50", "lag p90", "lag max", "dropped",
              "worker idle", "max/median", "p99/median")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = {}
    for schedule in ("sync", "async"):
        runs = [run(schedule, batch=a.batch, workers=a.workers, updates=a.updates, median_s=a.median_ms / 1e3,
                    sigma=a.sigma, learner_s=a.learner_ms / 1e3, queue=a.queue, max_lag=a.max_lag, seed=r)
                for r in range(a.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results[schedule] = med
        print(f"| {schedule} | {med['traj_per_s']:.1f} | {med['learner_idle']:.1%} | {med['lag_mean']:.2f} | "
              f"{med['lag_p50']:.0f} | {med['lag_p90']:.0f} | {med['lag_max']:.0f} | {med['dropped']:.0f} | "
              f"{med['worker_idle']:.1%} | {med['tail_ratio']:.0f}x | {med['p99_ratio']:.0f}x |")
    ratio = results["async"]["traj_per_s"] / results["sync"]["traj_per_s"]
    print(f"\nasync / sync throughput: {ratio:.2f}x (target >= 2x); async learner idle "
          f"{results['async']['learner_idle']:.1%} (target < 20%); async max lag "
          f"{results['async']['lag_max']:.0f} <= bound {a.max_lag}")


if __name__ == "__main__":
    main()
