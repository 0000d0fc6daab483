"""What a run reports about each update: one ``metrics.jsonl`` line and the progress display.

:func:`update_metrics` turns one update (the learner's statistics, the batch, the buffer's and the
workers' counters, the timings) into the flat record written to ``OUTPUT/metrics.jsonl``;
:class:`MetricsLog` writes those records and shows progress (the run's summary is :mod:`.summary`'s).
Every key is documented in ``docs/trainer.md``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from flashreinforce.trainer.reporting.diagnostics import ToolUseWatch, TrustGateWatch, ZeroSignalWatch
from flashreinforce.trainer.reporting.loggers import close_sinks, open_sinks
from flashreinforce.trainer.reporting.outcomes import episode_means, failure_kind
from flashreinforce.trainer.reporting.samples import SampleLog, short_sample
from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["MetricsLog", "UpdateTimings", "failure_kinds", "mean", "no_answer_fraction",
           "open_metrics_log", "std", "update_metrics"]

#: Learner statistics copied into the record when the loss mode or the learner reports them.
_OPTIONAL_LEARNER_KEYS = ("sequence_kl_max", "retained_token_fraction", "entropy_mean", "clip_fraction",
                          "advantage_abs_mean", "rank_tokens_max", "rank_tokens_min", "model_flops", "learner_tflops",
                          "mfu")


def mean(xs) -> float:
    """Arithmetic mean, NaN for nothing."""
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


def std(xs) -> float:
    """Population standard deviation, NaN for nothing."""
    xs = [float(x) for x in xs]
    if not xs:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def failure_kinds(trajectories: Sequence[Trajectory]) -> dict[str, int]:
    """Count of each :func:`failure_kind` among the failed trajectories, most common first."""
    counts = Counter(k for k in map(failure_kind, trajectories) if k is not None)
    return dict(counts.most_common())


def no_answer_fraction(trajectories: Sequence[Trajectory]) -> float | None:
    """Share of trajectories without a gradable answer, or None when no environment reports it.

    Environments that extract an answer (math, Python tool) put ``answer_extraction`` (``boxed``,
    ``last_number`` or ``none``) in the final step's ``info``; a trajectory without the key (cut
    off before its final step) counts as having no answer.
    """
    trajs = list(trajectories)
    if not any("answer_extraction" in t.info for t in trajs):
        return None
    return mean(float(t.info.get("answer_extraction", "none") == "none") for t in trajs)


def process_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process, all its threads, and its finished child processes
    (a sandbox's interpreter counts once it has exited and been waited for)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class UpdateTimings:
    """Seconds: ``idle`` the learner waited for the batch; ``step`` since the previous update ended;
    ``wall`` since the workers started (this session; earlier sessions are in the counters); ``cpu``
    the CPU seconds of :func:`process_cpu_seconds` over ``step`` (NaN: not measured)."""

    idle: float
    step: float
    wall: float
    cpu: float = float("nan")


def update_metrics(*, step: int, policy_version: int, version_before: int, learner: Mapping[str, Any],
                   trajectories: Sequence[Trajectory], buffer_stats: Mapping[str, int],
                   worker_stats: Sequence[Mapping[str, float]], timings: UpdateTimings,
                   wall_time_before: float) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of one update.

    ``learner``: what the learner's ``step`` returned; ``version_before``: the policy version the
    batch was trained against (lags are measured from it); ``wall_time_before``: wall-clock seconds
    of earlier sessions of a resumed run.
    """
    trajs = list(trajectories)
    lags = [t.policy_lag(version_before) for t in trajs]
    token_lags = [[version_before - v for v in t.action_versions()] for t in trajs]
    admitted = learner.get("per_trajectory", {}).get("admitted")
    admitted_lags = [x for lag, a in zip(token_lags, admitted or []) if a for x in lag]
    tokens = sum(t.num_tokens for t in trajs)
    unanswered = no_answer_fraction(trajs)
    idle_frac = [w["idle_s"] / max(1e-9, w["idle_s"] + w["busy_s"]) for w in worker_stats]
    out = {
        "step": step,
        "policy_version": policy_version,
        "reward_mean": mean(t.reward for t in trajs),
        "reward_std": std(t.reward for t in trajs),
        "success_rate": mean(0.0 if t.failed else 1.0 for t in trajs),
        "failure_kinds": failure_kinds(trajs),
        **({} if unanswered is None else {"no_answer_fraction": unanswered}),
        "acceptance_rate": learner["acceptance_rate"],
        "sequence_kl_mean": learner["sequence_kl_mean"],
        "policy_lag_mean": mean(lags),
        "policy_lag_max": max(lags),
        "policy_lag_min": min(lags),
        # Per action token: the learner's version minus the version that sampled the token (with
        # in-flight weight updates a trajectory's later tokens are fresher than its first ones).
        "token_lag_mean": mean(x for lag in token_lags for x in lag),
        "token_lag_max": max((x for lag in token_lags for x in lag), default=0),
        **({} if admitted is None else {"admitted_token_lag_mean": mean(admitted_lags) if admitted_lags else
                                        float("nan")}),
        "trajectories": len(trajs),
        "tokens": tokens,
        "action_tokens": learner["policy_tokens"],
        "loss": learner["loss"],
        "grad_norm": learner["grad_norm"],
        "optimizer_step_skipped": learner.get("optimizer_step_skipped", 0.0),
        "backward_skipped": learner.get("backward_skipped", 0.0),
        "forward_skipped": learner.get("forward_skipped", 0.0),
        "lr": learner["lr"],
        "learner_idle_s": timings.idle,
        "learner_compute_s": learner["learner_compute_s"],
        "step_time_s": timings.step,
        # The CPU work of the update (this process and its finished children: Ray workers on other
        # processes are not in it) and its share of what the usable cores could have done.
        "cpu_time_s": timings.cpu,
        "cpu_busy_share": timings.cpu / (timings.step * usable_cores()) if timings.step > 0 else float("nan"),
        "tokens_per_s": tokens / timings.step if timings.step > 0 else float("nan"),
        "rejected_trajectories": buffer_stats.get("rejected_trajectories", 0),
        "dropped_stale_trajectories": buffer_stats.get("dropped_stale_trajectories", 0),
        "cancelled_groups": buffer_stats.get("cancelled_groups", 0),
        "lost_trajectories": buffer_stats.get("lost_trajectories", 0),
        "worker_restarts": sum(int(w.get("restarts", 0)) for w in worker_stats),
        "multi_version_trajectories": sum(t.policy_version_max != t.policy_version_min for t in trajs),
        "truncated_fraction": mean(float(t.truncated) for t in trajs),
        "num_turns_mean": mean(t.num_turns for t in trajs),
        # From the learner's count: walking every action mask again cost ~90 ms per update at 128 x 8k tokens.
        "response_tokens_mean": learner["policy_tokens"] / len(trajs) if trajs else float("nan"),
        "buffer_in_flight": buffer_stats["in_flight"],
        "worker_idle_fraction": mean(idle_frac),
        "worker_errors": sum(w["errors"] for w in worker_stats),
        # The last weight load of each worker: seconds, and bytes its engine received.
        "weight_sync_s": mean(w.get("last_weight_sync_s", 0.0) for w in worker_stats),
        "weight_sync_bytes": mean(w.get("last_weight_sync_bytes", 0) for w in worker_stats),
        "inflight_pauses": sum(int(w.get("inflight_pauses", 0)) for w in worker_stats),
        "wall_time_s": wall_time_before + timings.wall,
    }
    for key in _OPTIONAL_LEARNER_KEYS:
        if key in learner:
            out[key] = learner[key]
    out.update(episode_means(trajs))
    return out


class MetricsLog:
    """Appends update records to ``metrics.jsonl``, shows progress on stderr, and feeds the run's observers.

    With ``progress`` a tqdm bar (reward, acceptance rate and policy lag beside it); without it, one
    line every ``logging_steps`` updates. ``history`` keeps this session's records.

    Observers (all optional): ``sinks`` (:mod:`.loggers`: TensorBoard, W&B) get every record;
    ``samples`` (:class:`~.samples.SampleLog`) writes decoded trajectories on its steps, and every
    ``console_sample_every``-th of those steps one of them is shown on the console; ``watch``
    (:class:`~.diagnostics.ZeroSignalWatch`) warns once when the first updates cannot learn,
    ``tool_watch`` (:class:`~.diagnostics.ToolUseWatch`) when tools are offered and never called, and
    ``gate_watch`` (:class:`~.diagnostics.TrustGateWatch`) when the trust gate drops most of each batch.

    ``budget_s``: this session's training-time budget (``train.max_minutes``); with it the bar counts
    training seconds up to the budget (the update count beside it) rather than updates up to ``total``.
    """

    def __init__(self, out: str | Path, *, total: int, initial: int, progress: bool, logging_steps: int,
                 sinks: Sequence[Any] = (), samples: Any = None, watch: Any = None, tool_watch: Any = None,
                 gate_watch: Any = None, console_sample_every: int = 10, budget_s: float | None = None) -> None:
        from tqdm import tqdm

        self.path = Path(out) / "metrics.jsonl"
        self.progress = progress
        self.logging_steps = logging_steps
        self.history: list[dict[str, Any]] = []
        self.sinks = list(sinks)
        self._failed_sinks: list[Any] = []
        self.samples = samples
        self.watch = watch
        self.tool_watch = tool_watch
        self.gate_watch = gate_watch
        self.console_sample_every = console_sample_every
        self._sample_steps = 0
        self.total = total
        self.budget_s = budget_s if budget_s and math.isfinite(budget_s) else None
        self._train_s_before: float | None = None  # training time of earlier sessions (budget_s counts this one)
        if self.budget_s is None:
            self.bar = tqdm(total=total, initial=initial, disable=not progress, desc="train", dynamic_ncols=True,
                            file=sys.stderr)
        else:  # the budget ends the run first: the bar is its minutes
            self.bar = tqdm(total=round(self.budget_s), initial=0, disable=not progress, desc="train (time budget)",
                            unit="s", dynamic_ncols=True, file=sys.stderr,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of training "
                                       "[{elapsed}<{remaining}{postfix}]")

    def write(self, record: Mapping[str, Any], *, trajectories: Sequence[Trajectory] | None = None,
              learner: Mapping[str, Any] | None = None) -> None:
        """Append one update's record and advance the display.

        ``trajectories`` (the batch, in learner row order) and ``learner`` (what the learner's step
        returned, with its ``per_trajectory`` statistics) feed the samples and the warnings; without
        them only the record is written.
        """
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.history.append(dict(record))
        step = int(record["step"])
        self._to_sinks(step, record)
        # "success" is the share of rewarded episodes; "admitted" the share of trajectories the trust gate
        # kept (acceptance_rate), which is not an accuracy. The numbers are set before the count moves, so
        # that the redraw update() makes shows this update's numbers beside its count.
        shown = {"update": f"{step}/{self.total}"} if self.budget_s is not None else {}
        self.bar.set_postfix(**shown, reward=f"{record['reward_mean']:.3f}",
                             success=f"{record.get('success_rate', 0.0):.2f}",
                             admitted=f"{record['acceptance_rate']:.2f}", lag=f"{record['policy_lag_mean']:.1f}",
                             refresh=False)
        if self.budget_s is None:
            self.bar.update(1)
        else:
            self._advance_clock(record)
        if not self.progress and record["step"] % self.logging_steps == 0:
            print(f"step {record['step']}: reward {record['reward_mean']:.3f} success "
                  f"{record.get('success_rate', 0.0):.2f} gate-admitted {record['acceptance_rate']:.2f} lag "
                  f"{record['policy_lag_mean']:.2f} loss {record['loss']:.4f}", file=sys.stderr, flush=True)
        if trajectories is None:
            return
        if self.samples is not None and self.samples.due(step):
            per_trajectory = (learner or {}).get("per_trajectory", {})
            version = int(record["policy_version"]) - 1  # the version the batch was trained against
            written = self.samples.write(step, trajectories, per_trajectory, version)
            self._sample_steps += 1
            if written and self.console_sample_every and (self._sample_steps - 1) % self.console_sample_every == 0:
                self.note(f"sample at update {step}: {short_sample(written[0])}")
        if self.watch is not None:
            warning = self.watch.observe(step, trajectories)
            if warning:
                self.note(f"flashreinforce: {warning}")
        for record_watch in (self.tool_watch, self.gate_watch):
            warning = None if record_watch is None else record_watch.observe(record)
            if warning:
                self.note(f"flashreinforce: {warning}")

    def start_clock(self, train_s_before: float) -> None:
        """The training seconds of earlier sessions: the time-budget bar counts this session's from there."""
        self._train_s_before = float(train_s_before)

    def _advance_clock(self, record: Mapping[str, Any]) -> None:
        train_s = record.get("train_time_s")
        if not isinstance(train_s, (int, float)):
            self.bar.refresh()
            return
        if self._train_s_before is None:  # not told (start_clock): what came before this update's step
            self._train_s_before = float(train_s) - float(record.get("step_time_s", 0.0))
        done = min(float(self.bar.total), max(0.0, float(train_s) - self._train_s_before))
        self.bar.update(done - self.bar.n)

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Evaluation results outside an update record (the evaluation at start) to the trackers."""
        self._to_sinks(step, metrics)

    def _to_sinks(self, step: int, record: Mapping[str, Any]) -> None:
        # metrics.jsonl is the record of the run: a tracker that fails (disk full, a W&B error) is
        # reported once and dropped, and training goes on.
        for sink in list(self.sinks):
            try:
                sink.log(step, record)
            except Exception as err:
                self.sinks.remove(sink)
                self._failed_sinks.append(sink)  # still closed at the end, to release its files
                self.note(f"flashreinforce: warning: {type(sink).__name__} failed at update {step} and is off "
                          f"for the rest of the run ({type(err).__name__}: {err}); metrics.jsonl is unaffected")

    def note(self, text: str) -> None:
        """A line of text that does not break the progress bar."""
        self.bar.write(text, file=sys.stderr)

    def close(self, status: str = "completed") -> None:
        """Close the display and the trackers; never raises (the run's checkpoint comes after this)."""
        self.bar.close()
        sinks, self.sinks = self.sinks + self._failed_sinks, []
        self._failed_sinks = []
        try:
            close_sinks(sinks, status)
        except Exception as err:
            self.note(f"flashreinforce: warning: closing a tracker failed ({type(err).__name__}: {err})")


def open_metrics_log(cfg, out: str | Path, *, tokenizer, total: int, initial: int) -> MetricsLog:
    """The :class:`MetricsLog` of a run with the observers its ``logger.*`` flags turn on.

    ``cfg``: the :class:`~flashreinforce.config.TrainerConfig`; ``initial``: the step the run
    starts (or resumes) from. Raises ``ImportError`` naming the install line when a tracker's
    package is missing.
    """
    log_cfg = cfg.logger
    resume = bool(cfg.resume)
    sinks = open_sinks(log_cfg, out, config=cfg.to_json(), initial_step=initial, resume=resume)
    samples = SampleLog(out, tokenizer, every=log_cfg.log_samples_steps, per_update=log_cfg.log_samples_num,
                        initial_step=initial if resume else 0)
    watch = ZeroSignalWatch(log_cfg.warn_zero_variance_steps, tokenizer, initial_step=initial)
    return MetricsLog(out, total=total, initial=initial, progress=cfg.progress, logging_steps=log_cfg.logging_steps,
                      sinks=sinks, samples=samples, watch=watch,
                      tool_watch=ToolUseWatch(log_cfg.warn_no_tool_calls_steps),
                      gate_watch=TrustGateWatch(log_cfg.warn_gate_drop_steps,
                                                scaled=cfg.actor.scale_step_by_acceptance),
                      budget_s=cfg.train.max_minutes * 60.0 or None)
