"""The training loop of an asynchronous FlashREINFORCE run.

:class:`Trainer` wires the parts together from a :class:`~flashreinforce.config.TrainerConfig`
(each built by its own module):

* the policy, its tokenizer and the environments (:mod:`.components`);
* the rollout side (:mod:`.rollout_side`): rollout workers (threads, or Ray actors with
  ``--rollout.backend ray``, each with its own engine copy of the policy) roll out prompts the
  buffer hands out and put finished trajectories into it;
* the learner (:mod:`~flashreinforce.trainer.learning.learner`): the loop takes the next batch
  (``rollout.batch_size`` groups in completion order), makes one optimizer step, publishes the new
  weights by version and lets the next batch start. Under ``torchrun`` it is data-parallel
  (:mod:`flashreinforce.distributed.data_parallel`, handed in as the run's ``scale_out``,
  :mod:`.scale_out`): rank 0 runs everything here and hands each rank its share of every batch;
  the other ranks only compute gradients;
* reporting (:mod:`~flashreinforce.trainer.reporting.metrics`,
  :mod:`~flashreinforce.trainer.reporting.evaluation`): one ``OUTPUT/metrics.jsonl`` line per update,
  evaluation every ``eval.steps`` updates into ``OUTPUT/eval.jsonl``;
* checkpoints (:mod:`~flashreinforce.trainer.persistence.checkpoints`) every ``ckpt.save_steps``
  updates, at the end and on Ctrl-C; ``--resume`` continues from the newest one with the same
  metrics history.

Environments with a finite prompt set (a dataset) play row ``seed % len``; the buffer hands out
seeds as shuffled passes over that set (``train.num_episodes`` passes).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashreinforce.config import ConfigError, TrainerConfig, write_config_file
from flashreinforce.config.files import absolute_paths, recorded_settings, review, settings_config
from flashreinforce.trainer.run import components
from flashreinforce.trainer.persistence.checkpoints import (ResumePoint, clean_interrupted_saves, clear_run,
                                                            existing_run_files, learner_state_to_restore, save_checkpoint)
from flashreinforce.trainer.errors import RunFailure
from flashreinforce.trainer.run.callbacks import CallbackList
from flashreinforce.trainer.reporting.fault_counters import FaultMetrics
from flashreinforce.trainer.run.interrupts import InterruptWatch, signal_label
from flashreinforce.trainer.run.stop_evaluation import evaluate_at_stop, evaluates_at_stop
from flashreinforce.trainer.reporting.heldout import HELDOUT_FILE, run_split
from flashreinforce.trainer.reporting.evaluation import Evaluator, append_eval_record, eval_seeds, progress_lines
from flashreinforce.trainer.learning.learner import Learner, PolicyLearner
from flashreinforce.trainer.reporting.metrics import UpdateTimings, open_metrics_log, process_cpu_seconds, update_metrics
from flashreinforce.trainer.run.prechecks import check_before_model, check_rollout_engine
from flashreinforce.trainer.persistence.run_dir import RunLock, create_output, remove_created
from flashreinforce.trainer.persistence.run_history import HistoryRecord
from flashreinforce.trainer.reporting.summary import write_run_summary
from flashreinforce.trainer.run.watchdog import Watchdog
from flashreinforce.models.lora import has_lora
from flashreinforce.trainer.persistence.export import export_policy
from flashreinforce.trainer.rollout.worker_kinds import is_agent_spec
from flashreinforce.trainer.rollout.backend import RolloutBackend
from flashreinforce.trainer.run.rollout_side import RolloutSide, start_rollout_side
from flashreinforce.trainer.run.scale_out import ScaleOut, require_scale_out

__all__ = ["Trainer"]

log = logging.getLogger("flashreinforce.trainer")

#: A reward of at least this magnitude is named when an update is skipped for a non-finite gradient.
LARGE_REWARD = 1e6


class Trainer:
    """One training run. ``run()`` returns a summary dict; see the module docstring."""

    def __init__(self, cfg: TrainerConfig, *, model: Any = None, tokenizer: Any = None, callbacks: Any = (),
                 scale_out: ScaleOut | None = None) -> None:
        """``model`` / ``tokenizer``: objects given in Python in place of ``--model`` / ``--tokenizer``;
        ``callbacks``: see :mod:`.callbacks`; ``scale_out``: the Ray rollout side and the torchrun
        learner (:mod:`.scale_out`; without it, one process with local rollout threads)."""
        if not cfg.output:
            raise ConfigError("--output DIR is required")
        if cfg.rollout.backend == "ray":
            require_scale_out(scale_out, "--rollout.backend ray")
        self.scale_out = scale_out
        cfg = cfg.copy()  # the caller's object stays as it is
        absolute_paths(cfg)  # recorded as absolute: resumed elsewhere, the run reads the same files
        #: The run's configuration, frozen: a later stage derives a new one (``settled_config``), never changes it.
        self.cfg = cfg.freeze()
        self._given = (model, tokenizer)
        self.callbacks = callbacks if isinstance(callbacks, CallbackList) else CallbackList(callbacks)
        self.stop_reason: str | None = None
        self.out = Path(cfg.output)
        self.ckpt_dir = Path(cfg.ckpt.path or self.out / "checkpoints")
        self.hf_dir = Path(cfg.ckpt.output_dir or self.out / "hf")
        self.device = components.device_of(cfg.device)
        self._interrupted = threading.Event()
        self._watch_signals: InterruptWatch | None = None  # Ctrl-C and SIGTERM while training
        self._evaluator: Evaluator | None = None
        self.evaluation_seeds: list[int] | None = None
        self.dist = None  # DistContext under torchrun
        self.rollout: RolloutSide | None = None
        self.learner: PolicyLearner | None = None
        self._resume_point: ResumePoint | None = None
        self.pool: RolloutBackend | None = None  # the running rollout workers (for tools and tests)
        self._started = time.time()  # this session's start, for OUTPUT/summary.json
        self._lock = RunLock(self.out)
        self._history = HistoryRecord(self.out)  # what each checkpoint vouches for of metrics.jsonl, eval.jsonl
        self._created: list[Path] = []  # folders of --output this run made (removed if it never starts)
        #: Whether the update loop began (a Ctrl-C before it stops a run that trained nothing).
        self.training_started = False

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg = self.cfg
        if cfg.torch_threads:
            torch.set_num_threads(int(cfg.torch_threads))
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        torch.manual_seed(cfg.seed)
        check_before_model(cfg, ckpt_dir=self.ckpt_dir, model_given=self._given[0] is not None)
        check_rollout_engine(cfg)
        t0 = time.perf_counter()
        log.info("loading the model %s ...", cfg.actor.model_name_or_path)
        policy = components.load_policy(cfg, self.device, model=self._given[0], tokenizer=self._given[1])
        log.info("model loaded in %.1f s; building the environments ...", time.perf_counter() - t0)
        self.model, self.tokenizer = policy.model, policy.tokenizer
        self.envs = components.load_environments(cfg, policy)
        # What the loaded parts decided (the turn limit, moot flags and warnings): a new configuration.
        self.cfg = cfg = components.settled_config(cfg, policy, self.envs)
        # The evaluation rows are read now, so that a bad --eval.dataset stops the run before it starts.
        evaluates = cfg.eval.steps or cfg.eval.every_min or cfg.eval.eval_at_start
        self.eval_envs = components.eval_environments(cfg, self.envs, self.tokenizer) if evaluates else self.envs
        # Without eval.dataset, a finite prompt set gives part of itself to the evaluation, never trained on.
        self.split = run_split(cfg, self.envs.num_prompts, self.out if cfg.resume else None,
                               self.envs.eval_rows) if evaluates else None
        self.num_prompts = self.envs.num_prompts if self.split is None else len(self.split.train_rows)
        self.max_steps = components.total_updates(cfg, self.num_prompts)
        settings = components.learner_settings(cfg, self.max_steps, self.device)
        if cfg.resume:  # the weights go in before any sharding of the model, on every rank
            self._resume_point = ResumePoint.load(self.ckpt_dir, cfg.resume, self.model)
        if self.dist is not None:
            self.learner = require_scale_out(self.scale_out, "torchrun").data_parallel_learner(
                self.model, settings, self.dist, pad_token_id=self.tokenizer.pad_token_id, strategy=cfg.fsdp.strategy)
        else:
            self.learner = Learner(self.model, settings, pad_token_id=self.tokenizer.pad_token_id)
        self.step = 0
        self.counters: dict[str, float] = {"skipped_updates": 0, "wall_time_s": 0.0}
        if not self._leads:
            return
        self.rollout = start_rollout_side(cfg, num_prompts=self.envs.num_prompts, vocab_size=self.tokenizer.vocab_size,
                                          seed=cfg.seed, exclude=self.split.rows if self.split else (),
                                          scale_out=self.scale_out)
        self.buffer, self.weights = self.rollout.buffer, self.rollout.weights
        self.rollout_settings = components.rollout_settings(cfg, self.tokenizer, cfg.seed)

    @property
    def _leads(self) -> bool:
        """This process runs the rollout side, metrics and checkpoints (always, except torchrun ranks > 0)."""
        return self.dist is None or self.dist.is_leader

    def _resume(self) -> None:
        point = self._resume_point
        if point is None:
            return
        point.check_within(self.max_steps)
        if self._leads:
            self._review_settings(point)  # before anything is restored or written
        self.learner.load_state_dict(learner_state_to_restore(point, sharded=self.learner.sharded))
        self.step = point.step
        if not self._leads:
            return
        self.buffer.load_state_dict(point.state["buffer"])
        self.counters.update(point.state.get("trainer", {}))
        # The history is checked first (a refused resume changes nothing on disk); a failed save's leftovers
        # are freed before the history is rewritten.
        self._history.resume(self.step, point.state.get("history"),
                             before_writing=lambda: clean_interrupted_saves(self.ckpt_dir))
        log.info("resumed from %s at step %d (policy version %d)", point.path, self.step, self.learner.version)

    def _review_settings(self, point: ResumePoint) -> None:
        """The resume table (:mod:`flashreinforce.config.files`) against the settings the checkpoint
        recorded (a checkpoint written before checkpoints held them: against ``config.json``)."""
        recorded = point.state.get("run_settings")
        source = f"{point.path / 'state.json'} run_settings"
        try:
            if isinstance(recorded, dict):
                saved, against = settings_config(recorded, source), f"against its checkpoint {point.path.name}"
            else:
                flat = recorded_settings(self.out)
                if flat is None:
                    return
                saved, against = settings_config(flat, str(self.out / "config.json")), "against its config.json"
        except ConfigError as err:  # settings of another version of this package
            log.warning("--resume: the run's recorded settings cannot be compared with these (%s)", err)
            return
        warnings = review(self.cfg, saved, self.out, against)
        if warnings:  # recorded with the run's configuration: a new, frozen one
            cfg = self.cfg.copy()
            cfg.warnings.extend(warnings)
            self.cfg = cfg.freeze()

    def _save(self) -> Path:
        learner_state = self.learner.state_dict()  # gathered to rank 0 under fully_shard
        state = {"buffer": self.buffer.state_dict(), "trainer": self.counters, "max_steps": self.max_steps,
                 "run_settings": self.cfg.to_file(), "history": self._history.snapshot()}
        if learner_state.get("optimizer_format"):
            state["optimizer_format"] = learner_state["optimizer_format"]
        model = self.learner.full_model() if self.learner.sharded else self.model
        if has_lora(model):  # what rebuilds the policy from this adapters-only checkpoint
            lora = components.lora_settings(self.cfg)
            state["lora"] = {"base_model": str(self.cfg.actor.model_name_or_path), "rank": lora.rank,
                             "alpha": lora.alpha, "dropout": lora.dropout,
                             "target_modules": list(lora.target_modules)}
        path = save_checkpoint(self.ckpt_dir, self.step, model=model, learner_state=learner_state,
                               state=state, tokenizer=self.tokenizer, max_keep=self.cfg.ckpt.max_ckpt_num)
        self.callbacks.on_save(self.step, path)
        return path

    def _export(self) -> None:
        """The final policy in Hugging Face format in ``hf/``; with LoRA, the adapters merged in, and the
        adapters alone in PEFT's format in ``hf/adapter`` with a loadable base (persistence/export.py)."""
        model = self.learner.full_model() if self.learner.sharded else self.model
        export_policy(self.hf_dir, model, self.tokenizer, base_spec=str(self.cfg.actor.model_name_or_path),
                      checkpoints_dir=self.ckpt_dir, agent=is_agent_spec(self.envs.spec.spec))

    def _make_workers(self) -> RolloutBackend:
        return self.rollout.make_workers(
            self.cfg, learner=self.learner, model_config=self.model.config, tokenizer=self.tokenizer,
            env_spec=self.envs.spec, env_factory=self.envs.factory, settings=self.rollout_settings,
            engine_options=components.engine_options(self.cfg, self.cfg.seed, self.device), device=self.device,
            torch_threads=self.cfg.torch_threads)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Mean reward and success rate on the evaluation prompts; the evaluation's engine is released after each call."""
        if self._evaluator is None:
            cfg = self.cfg
            envs = self.eval_envs
            if self.split is not None:  # the held-out rows of the training prompt set
                seeds = list(self.split.rows)
            elif envs is self.envs:
                seeds = eval_seeds(envs.num_prompts, cfg.eval.num_prompts)
            else:  # every row of the evaluation dataset
                seeds = eval_seeds(envs.num_prompts, envs.num_prompts or cfg.eval.num_prompts)
            self.evaluation_seeds = seeds  # what the evaluations play (tools and tests read it)
            self._evaluator = Evaluator(
                env_factory=envs.factory, seeds=seeds, model=self.learner.full_model(self.device),
                tokenizer=self.tokenizer, weights=self.weights, rollout_settings=self.rollout_settings,
                sampling=components.sampling_params(cfg, self.tokenizer, evaluation=True),
                n_samples=cfg.eval.n_samples_per_prompt, episodes_per_call=cfg.rollout.episodes_per_call,
                seed=self.cfg.seed + 1)
        note = getattr(self, "_note", None)
        try:
            return self._evaluator.evaluate(self.learner.version,
                                            progress=progress_lines(note, "  evaluating") if note else None)
        finally:
            evaluator, self._evaluator = self._evaluator, None
            evaluator.close()

    def _evaluate_paused(self) -> dict[str, float]:
        """:meth:`evaluate` with the rollouts paused (no prompt handed out, workers waiting between engine
        calls), so that an evaluation neither competes with them nor gives them free time."""
        self.buffer.pause()
        try:
            return self.evaluate()
        finally:
            self.buffer.resume()

    def _eval_note(self, what: str) -> str:
        """The line that announces an evaluation (it can take minutes with a real model)."""
        envs = self.eval_envs
        if self.split is not None:
            n, where = len(self.split.rows), "held-out prompts"
        elif envs is not self.envs and envs.num_prompts:
            n, where = envs.num_prompts, "eval.dataset prompts"
        else:
            n, where = self.cfg.eval.num_prompts, "evaluation prompts"
        return f"{what}: {n} {where} ..."

    def _write_eval(self, metrics: dict[str, float]) -> None:
        append_eval_record(self.out / "eval.jsonl", self.step, metrics)

    # ------------------------------------------------------------------ signals
    def _interrupt_message(self) -> str:
        signum = self._watch_signals.first_signal if self._watch_signals is not None else None
        what = signal_label(signum)
        then, after = (("saves a checkpoint, evaluates the policy", " (once the checkpoint is saved: skips the "
                        "evaluation)") if evaluates_at_stop(self.cfg) else ("saves a checkpoint", ""))
        return (f"flashreinforce: interrupted ({what}): the run stops when update {self.step + 1} (in progress) "
                f"ends, then {then} and exits with status {128 + int(signum or signal.SIGINT)}; "
                f"{what} again aborts without saving{after}")

    def _skipped(self, err: FloatingPointError, trajectories, in_a_row: int) -> None:
        """Report an update skipped for a non-finite gradient; :class:`RunFailure` once
        ``train.max_skipped_updates_in_a_row`` were skipped in a row (nothing would ever train)."""
        rewards = [abs(t.reward) for t in trajectories]
        largest = max(rewards, default=0.0)
        hint = (f"; the batch's rewards reach {largest:.3g} in magnitude: rewards this large overflow the loss, "
                "scale them down" if largest >= LARGE_REWARD else "")
        log.warning("update skipped: %s%s", err, hint)
        limit = self.cfg.train.max_skipped_updates_in_a_row
        if limit and in_a_row >= limit:
            raise RunFailure(f"{in_a_row} updates in a row were skipped for a non-finite gradient "
                             f"(--train.max_skipped_updates_in_a_row {limit}); the last: {err}{hint}")

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Train; returns the summary (torchrun ranks > 0 return ``status: follower``)."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.dist = require_scale_out(self.scale_out, "torchrun (WORLD_SIZE > 1)").data_parallel_context(
                self.cfg.device)
            self.device = self.dist.device
        try:
            return self._run() if self._leads else self._run_follower()
        finally:
            try:
                self._shutdown()
            finally:
                self._lock.release()

    def _shutdown(self) -> None:
        """Close the rollout side (Ray actors; only a Ray instance this run started is stopped);
        leave the torch.distributed job."""
        try:
            if self._evaluator is not None:  # its environment-call threads end with it
                self._evaluator.close()
            if self.rollout is not None:
                self.rollout.close()
        finally:
            if self.dist is not None:
                self.dist.close()

    def _run_follower(self) -> dict[str, Any]:
        """torchrun ranks > 0: compute gradients for rank 0 until it says stop."""
        self._setup()
        self._resume()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the run ends
        updates = self.learner.serve()
        return {"status": "follower", "rank": self.dist.rank, "updates": updates,
                "policy_version": self.learner.version}

    def _prepare_output(self) -> list[Path]:
        """Create ``--output`` and lock it (one run at a time,
        :mod:`~flashreinforce.trainer.persistence.run_dir`); an earlier run there is continued only with
        --resume and cleared only with --overwrite (a new run never mixes its records into another's). Returns what --overwrite will delete once the run has started."""
        self._created = create_output(self.out)
        self._lock.acquire()
        if self.cfg.resume:
            return []
        earlier = existing_run_files(self.out, self.ckpt_dir)
        if earlier and not self.cfg.overwrite:
            raise ConfigError(f"--output {self.out} already holds a run ({', '.join(p.name for p in earlier)}): "
                              "continue it with --resume, or start over with --overwrite (deletes that run's "
                              "records and checkpoints)")
        return earlier

    def _run(self) -> dict[str, Any]:
        earlier = self._prepare_output()
        try:
            self._setup()
            self._resume()
        except BaseException:  # a refused setting, Ctrl-C: nothing was trained, nothing is left behind
            if self.dist is not None and self.learner is not None:
                self.learner.stop()  # release the other ranks
            remove_created(self._created)
            raise
        if earlier:  # only now that the new run has started: a refused one deletes nothing
            log.warning("--overwrite: deleting the earlier run in %s (%s)", self.out, ", ".join(map(str, earlier)))
            clear_run(self.out, self.ckpt_dir, self.hf_dir)
        try:
            return self._train()
        finally:
            if self.dist is not None:
                self.learner.stop()

    def _write_config(self) -> None:
        cfg = self.cfg
        record = cfg.to_json()
        record.update(max_steps=self.max_steps, loss_impl=self.learner.loss_impl, num_prompts=self.num_prompts,
                      device=str(self.device), torch_threads=torch.get_num_threads(),
                      tokenizer_kind=type(self.tokenizer).__name__,
                      learner_ranks=1 if self.dist is None else self.dist.world_size,
                      learner_strategy=None if self.dist is None else cfg.fsdp.strategy,
                      rollout_backend=cfg.rollout.backend, rollout_engine=cfg.rollout.engine)
        if self.split is not None:
            record.update(heldout_prompts=len(self.split.rows), heldout_file=str(self.split.write(self.out)))
            log.info("evaluation holds out %d of the %d prompts (their rows: %s); training uses the other %d",
                     len(self.split.rows), self.split.num_prompts, self.out / HELDOUT_FILE, self.num_prompts)
        (self.out / "config.json").write_text(json.dumps(record, indent=1, default=str))
        write_config_file(cfg, self.out / "config.yaml")  # what --config and --resume read

    def _take_batch(self, pool: RolloutBackend):
        """The next batch, or ``None`` once interrupted; checks the workers and the watchdog while waiting."""
        batch = None
        self._watchdog.start_wait()
        while batch is None and not self._interrupted.is_set():
            batch = self.buffer.take(self.learner.version, timeout=0.25)
            if batch is None:
                pool.check()
                self._watchdog.check(self.buffer.stats(), pool.stats())
        return batch

    def _hold_for_fixed_lag(self, pool: RolloutBackend) -> float:
        """With ``train.fixed_policy_lag`` K: wait until the K batches after the one just trained are sampled
        (by the version about to be replaced) before the next version is published, so that every trajectory
        is sampled exactly K versions before the one that trains on it. Not before the last update (nothing
        would train on those batches), and not once interrupted. Returns the seconds waited."""
        if self.cfg.train.fixed_policy_lag is None or self.step + 1 >= self.max_steps:
            return 0.0
        t0 = time.perf_counter()
        self._watchdog.start_wait()
        while not self._interrupted.is_set() and not self.buffer.wait_until_full(timeout=0.25):
            if self.buffer.closed:
                break
            pool.check()
            self._watchdog.check(self.buffer.stats(), pool.stats())
        return time.perf_counter() - t0

    def _train(self) -> dict[str, Any]:
        cfg = self.cfg
        self._write_config()
        for w in cfg.warnings:
            log.warning(w)
        for note in [*cfg.notes, *components.dtype_notes(cfg, self.device)]:
            log.info(note)
        self.weights.publish(self.learner.policy_state(), self.learner.version,
                             frozen=self.learner.frozen_names())
        watch = self._watch_signals = InterruptWatch(self._interrupted.set, self._interrupt_message)
        watch.install()  # main thread only; answers Ctrl-C and SIGTERM at once, even inside a long learner update
        self.training_started = True
        try:
            return self._train_and_save()
        finally:
            watch.uninstall()  # only after the last save: a Ctrl-C during it is ours too

    def _train_and_save(self) -> dict[str, Any]:
        cfg = self.cfg
        metrics_log = open_metrics_log(cfg, self.out, tokenizer=self.tokenizer, total=self.max_steps,
                                       initial=self.step)
        self._note = metrics_log.note
        pool = None
        status = "completed"
        recorded_step = self.step  # the last update whose record is in metrics.jsonl
        self._watchdog = Watchdog(cfg.train.stall_timeout_s, cfg.rollout.max_failed_episodes_in_a_row)
        fault_metrics = FaultMetrics(log)  # per-update environment-call timeouts, and their warning
        try:
            if cfg.eval.eval_at_start and self.step == 0:
                metrics_log.note(self._eval_note("evaluation at start"))
                ev = self.evaluate()  # no rollouts yet: nothing to pause
                self._write_eval(ev)
                metrics_log.log_eval(self.step, ev)
                metrics_log.note(f"eval at start: reward {ev['eval_reward_mean']:.3f}, "
                                 f"success {ev['eval_success_rate']:.3f}")
                self.callbacks.on_eval(self.step, ev)
            pool = self.pool = self._make_workers()
            pool.start()
            self.callbacks.on_train_begin({"output": str(self.out), "step": self.step, "max_steps": self.max_steps,
                                           "num_prompts": self.num_prompts,
                                           "heldout_prompts": len(self.split.rows) if self.split else None})
            budget_s = cfg.train.max_minutes * 60.0 or math.inf  # this session's training time
            t_run = t_last = time.perf_counter()
            # Training time: wall time without evaluations and checkpoint saves (earlier sessions included),
            # the clock of eval.every_min and of train_time_s in metrics.jsonl.
            train_before, pauses, cpu_last = self.counters.get("train_time_s", 0.0), 0.0, process_cpu_seconds()
            metrics_log.start_clock(train_before)
            every_s = cfg.eval.every_min * 60.0
            next_eval = (int(train_before // every_s) + 1) * every_s if every_s else math.inf
            skipped_in_a_row = 0
            while self.step < self.max_steps:
                t_wait = time.perf_counter()
                batch = self._take_batch(pool)
                if batch is None:
                    status = "interrupted"
                    break
                idle = time.perf_counter() - t_wait
                version_before = self.learner.version
                try:
                    learner_metrics = self.learner.step(batch.trajectories, batch.group_ids)
                except FloatingPointError as err:
                    self.counters["skipped_updates"] += 1
                    self._hold_for_fixed_lag(pool)
                    self.buffer.update_done()
                    skipped_in_a_row += 1
                    self._skipped(err, batch.trajectories, skipped_in_a_row)
                    # The time budget holds on this path too: a run whose every update is skipped stops.
                    self.counters["train_time_s"] = train_before + (time.perf_counter() - t_run) - pauses
                    if self.counters["train_time_s"] - train_before >= budget_s:
                        self.stop_reason = f"train.max_minutes {cfg.train.max_minutes:g} reached (this session's " \
                            "training time)"
                        status = "stopped"
                        metrics_log.note(f"flashreinforce: stopping after a skipped update: {self.stop_reason}")
                        break
                    continue
                skipped_in_a_row = 0
                idle += self._hold_for_fixed_lag(pool)
                if learner_metrics.get("optimizer_step_skipped", 0.0):  # every weight as it was: the same tensors
                    self.weights.advance(self.learner.version)
                else:
                    self.weights.publish(self.learner.policy_state(), self.learner.version,
                                         frozen=self.learner.frozen_names())
                self.buffer.update_done()
                self.step += 1
                now, cpu_now = time.perf_counter(), process_cpu_seconds()
                buffer_stats, worker_stats = self.buffer.stats(), pool.stats()
                timings = UpdateTimings(idle=idle, step=now - t_last, wall=now - t_run, cpu=cpu_now - cpu_last)
                record = update_metrics(
                    step=self.step, policy_version=self.learner.version, version_before=version_before,
                    learner=learner_metrics, trajectories=batch.trajectories, buffer_stats=buffer_stats,
                    worker_stats=worker_stats, timings=timings, wall_time_before=self.counters["wall_time_s"])
                record.update(fault_metrics(buffer_stats, worker_stats))
                train_s = train_before + (now - t_run) - pauses
                record["train_time_s"] = train_s
                t_last, cpu_last = now, cpu_now
                by_steps = cfg.eval.steps and self.step % cfg.eval.steps == 0
                stop = False
                if by_steps or train_s >= next_eval:
                    metrics_log.note(self._eval_note(f"evaluation at update {self.step}"))
                    ev = self._evaluate_paused()
                    self._write_eval(dict(ev, train_time_s=train_s))
                    record.update(ev)
                    stop = self.callbacks.on_eval(self.step, dict(ev, train_time_s=train_s))
                    while next_eval <= train_s:
                        next_eval += every_s
                    t_last, cpu_last = time.perf_counter(), process_cpu_seconds()
                    pauses += t_last - now
                metrics_log.write(record, trajectories=batch.trajectories, learner=learner_metrics)
                recorded_step = self.step
                if cfg.ckpt.save_steps and self.step % cfg.ckpt.save_steps == 0:
                    t_save = time.perf_counter()
                    self._save()
                    pauses += time.perf_counter() - t_save
                self.counters["train_time_s"] = train_before + (time.perf_counter() - t_run) - pauses
                stop = self.callbacks.on_update(record) or stop
                if self.step < self.max_steps and (stop or self.counters["train_time_s"] - train_before >= budget_s):
                    self.stop_reason = self.callbacks.stop_reason or f"train.max_minutes {cfg.train.max_minutes:g} " \
                        "reached (this session's training time)"
                    status = "stopped"
                    metrics_log.note(f"flashreinforce: stopping after update {self.step}: {self.stop_reason}")
                    break
            self.counters["wall_time_s"] += time.perf_counter() - t_run
        except KeyboardInterrupt:
            status = "aborted"
            raise
        except Exception:
            status = "failed"  # the checkpoint below is still written; a stuck worker is not waited for long
            raise
        finally:
            metrics_log.close(status)
            if pool is not None:
                pool.stop(timeout=5.0 if status == "failed" else 30.0)
            if status in ("completed", "stopped", "interrupted"):
                log.info("saving a checkpoint at update %d ...", self.step)
                ckpt = self._save()
                log.info("checkpoint saved to %s", ckpt)
            elif status == "failed" and recorded_step < self.step:
                # The failure came between an update and its record (writing metrics.jsonl failed, say): a
                # checkpoint now would vouch for a history without that record, lost for good on resume.
                log.error("no checkpoint was written after the failure: the record of update %d is not in "
                          "metrics.jsonl; --resume repeats that update from the last checkpoint before it", self.step)
            elif status == "failed":
                # Best effort: what failed (a lost Ray cluster, say) may make the save fail too, and
                # that second error must not hide the first.
                try:
                    ckpt = self._save()
                    log.info("checkpoint saved to %s", ckpt)
                except Exception as err:
                    log.error("no checkpoint could be written after the failure (%s: %s); the last one written "
                              "before it is the one to resume from", type(err).__name__, str(err)[:300])
        if status in ("completed", "stopped"):
            log.info("exporting the model to %s ...", self.hf_dir)
            self._export()
        if status in ("completed", "stopped", "interrupted"):
            self._watch_signals.uninstall()  # from here Ctrl-C and SIGTERM skip the evaluation at the stop
            evaluate_at_stop(self, metrics_log.note, self.counters.get("train_time_s", 0.0))
        summary = {"status": status, "step": self.step, "policy_version": self.learner.version,
                   "output": str(self.out), "buffer": self.buffer.stats(), "loss_impl": self.learner.loss_impl}
        summary["summary_file"] = str(write_run_summary(
            self.out, config=cfg.to_json(), status=status, step=self.step, max_steps=self.max_steps,
            policy_version=self.learner.version, training_wall_s=self.counters["wall_time_s"],
            session_started=self._started, resumed=self._resume_point is not None, checkpoints_dir=self.ckpt_dir,
            checkpoint=ckpt, export_dir=self.hf_dir if status in ("completed", "stopped") else None,
            extra={"stop_reason": self.stop_reason} if self.stop_reason else None,
            train_time_s=self.counters.get("train_time_s"), warn_no_tool_calls_steps=cfg.logger.warn_no_tool_calls_steps,
            warn_gate_drop_steps=cfg.logger.warn_gate_drop_steps,
            scale_step_by_acceptance=cfg.actor.scale_step_by_acceptance))
        # The training reward as summary.json has it (over every session's updates), so that both say the same.
        written = json.loads(Path(summary["summary_file"]).read_text())
        summary.update({k: written.get(k) for k in ("reward_first", "reward_last", "reward_window")})
        if self.stop_reason:
            summary["stop_reason"] = self.stop_reason
        if status == "interrupted":  # the command's exit status is 128 + this signal's number
            summary["signal"] = int(self._watch_signals.first_signal or signal.SIGINT)
        self.callbacks.on_train_end(summary)
        return summary
