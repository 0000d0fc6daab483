"""Evaluation of the current policy on held-out prompts, beside the training loop.

An :class:`Evaluator` owns one rollout worker that is not attached to the buffer: it plays a fixed
list of evaluation seeds with its own engine copy of the policy, picking up the newest published
weights before each call, and reports the mean reward and the success rate (1 - failure rate).
The training loop calls it every ``eval.steps`` updates; ``flashreinforce eval`` calls it twice on a
saved model (greedy accuracy, then sampled pass@1), overriding the sampling per call.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

from flashreinforce.engines import SamplingParams, WeightStore, create_engine
from flashreinforce.envs.base import Environment
from flashreinforce.trainer.rollout.buffer import Ticket
from flashreinforce.trainer.rollout.worker_kinds import worker_class
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode
from flashreinforce.trainer.reporting.outcomes import episode_means
from flashreinforce.trainer.rollout.settings import RolloutSettings

__all__ = ["EVAL_SEED_OFFSET", "Evaluator", "append_eval_record", "eval_seeds", "progress_lines"]

#: First evaluation seed of an environment without a finite prompt set (endless seeds): far from
#: the training seeds, which count up from 0.
EVAL_SEED_OFFSET = 1_000_000_000


def eval_seeds(num_prompts: int | None, requested: int) -> list[int]:
    """The evaluation seeds: rows ``0..min(num_prompts, requested)-1`` of a finite prompt set, or
    ``requested`` seeds from :data:`EVAL_SEED_OFFSET` for endless seeds."""
    if num_prompts is not None:
        return list(range(min(num_prompts, requested)))
    return [EVAL_SEED_OFFSET + i for i in range(requested)]


def progress_lines(note: Callable[[str], None], what: str, every_s: float = 10.0) -> Callable[[int, int, float], None]:
    """An :meth:`Evaluator.evaluate` ``progress`` that writes ``what: done/total prompts, N s`` with
    ``note`` at most every ``every_s`` seconds, and once at the end."""
    last = [0.0]

    def report(done: int, total: int, seconds: float) -> None:
        if done < total and seconds - last[0] < every_s:
            return
        last[0] = seconds
        note(f"{what}: {done}/{total} prompts, {seconds:.0f} s")

    return report


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


class Evaluator:
    """Plays ``seeds`` (``n_samples`` each) with the newest published policy.

    Args:
        env_factory: builds one evaluation environment.
        seeds: evaluation seeds (see :func:`eval_seeds`).
        model: the worker's own copy of the policy (a ``transformers`` causal LM on its device).
        tokenizer: the run's tokenizer.
        weights: the run's weight store (the evaluator loads the newest version before each call).
        rollout_settings: the training rollout settings (lengths, turns); sampling is replaced by
            ``sampling`` and the seed by ``seed``.
        n_samples: samples per evaluation prompt. episodes_per_call: episodes sampled together.
    """

    def __init__(self, *, env_factory: Callable[[], Environment], seeds: list[int], model, tokenizer,
                 weights: WeightStore, rollout_settings: RolloutSettings, sampling: SamplingParams,
                 n_samples: int = 1, episodes_per_call: int = 16, seed: int = 0) -> None:
        if n_samples <= 0:
            raise ValueError(f"n_samples must be positive, got {n_samples}")
        settings = copy.copy(rollout_settings)
        settings.sampling = sampling
        settings.seed = seed
        engine = create_engine("hf", model, pad_token_id=tokenizer.pad_token_id, version=-1)
        self.worker = worker_class(env_factory)(-1, engine, env_factory, tokenizer, None, weights, settings)
        self.seeds = list(seeds)
        self.n_samples = n_samples
        self.episodes_per_call = max(1, int(episodes_per_call))
        self.per_call = max(1, episodes_per_call // n_samples)

    def evaluate(self, policy_version: int, *, sampling: SamplingParams | None = None,
                 n_samples: int | None = None, trajectories: list | None = None,
                 progress: Callable[[int, int, float], None] | None = None) -> dict[str, float]:
        """Mean reward and success rate over every evaluation trajectory (keys prefixed ``eval_``).

        ``sampling`` / ``n_samples`` replace the evaluator's own for this call only (``flashreinforce
        eval`` scores greedy and sampled with one engine). ``trajectories``: a list that receives
        the evaluation :class:`~flashreinforce.trainer.rollout.trajectory.Trajectory` objects, in seed order.
        ``eval_response_tokens_mean`` is the mean number of sampled tokens per trajectory and
        ``eval_truncated_fraction`` the share with a turn cut at ``max_new_tokens`` or an episode
        stopped by the turn or context limit. Episodes the worker had to quarantine (an environment
        error or timeout) are left out of the means and counted in ``eval_quarantined_episodes``.
        ``progress(done, total, seconds)``: called after each engine round with the prompts done so far.
        """
        t0 = time.perf_counter()
        n = self.n_samples if n_samples is None else int(n_samples)
        if n <= 0:
            raise ValueError(f"n_samples must be positive, got {n}")
        settings = self.worker.settings
        saved = settings.sampling
        if sampling is not None:
            settings.sampling = sampling
        try:
            per_call = max(1, self.episodes_per_call // n)
            tickets = [Ticket(i, s, n) for i, s in enumerate(self.seeds)]
            trajs = []
            for k in range(0, len(tickets), per_call):
                for group in self.worker.run_tickets(tickets[k:k + per_call]):
                    trajs.extend(group)
                if progress is not None:
                    progress(min(k + per_call, len(tickets)), len(tickets), time.perf_counter() - t0)
        finally:
            settings.sampling = saved
        quarantined = sum(isinstance(t, QuarantinedEpisode) for t in trajs)
        trajs = [t for t in trajs if not isinstance(t, QuarantinedEpisode)]
        if trajectories is not None:
            trajectories.extend(trajs)
        return {"eval_reward_mean": _mean(t.reward for t in trajs),
                "eval_success_rate": _mean(0.0 if t.failed else 1.0 for t in trajs),
                "eval_response_tokens_mean": _mean(t.num_action_tokens for t in trajs),
                "eval_truncated_fraction": _mean(float(t.truncated or t.info.get("length_finishes", 0) > 0)
                                                 for t in trajs),
                "eval_trajectories": len(trajs), "eval_quarantined_episodes": quarantined,
                "eval_policy_version": policy_version,
                "eval_temperature": (sampling or saved).temperature, "eval_samples_per_prompt": n,
                "eval_time_s": time.perf_counter() - t0,
                **{f"eval_{key}": value for key, value in episode_means(trajs).items()}}

    def close(self) -> None:
        self.worker.close()


def append_eval_record(path: str | Path, step: int, metrics: dict[str, Any]) -> None:
    """Append one ``{"step": step, **metrics}`` line to the run's ``eval.jsonl``."""
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": step, **metrics}) + "\n")
