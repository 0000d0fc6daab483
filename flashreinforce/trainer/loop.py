"""Orchestration of an asynchronous FlashREINFORCE run: workers, buffer, learner, checkpoints, metrics.

:class:`Trainer` wires the pieces together from a :class:`~flashreinforce.config.ResolvedConfig`:

* rollout workers (``rollout.num_workers`` threads, or Ray actors with ``--rollout.backend ray``, each
  with its own engine copy of the policy) roll out prompts the buffer hands out and put finished
  trajectories into it;
* the learner loop takes the next batch (``rollout.batch_size`` groups in completion order), makes
  one optimizer step, publishes the new weights by version, and lets the next batch start;
* under ``torchrun`` the learner is data-parallel (:mod:`flashreinforce.distributed.data_parallel`):
  rank 0 runs everything above and hands each rank its share of every batch; the other ranks only
  compute gradients;
* every update appends one JSON line to ``OUTPUT/metrics.jsonl``; checkpoints every
  ``ckpt.save_steps`` updates, at the end and on Ctrl-C; ``--resume`` continues from the newest one
  with the same metrics history.

Environment factory: environments are built by
``flashreinforce.envs.make_environment(spec, config, **env.kwargs)`` with ``spec`` from ``--env`` /
``train.agent_path`` (a shipped name, ``MODULE:CLASS``, or ``FILE.py[:CLASS]``) and ``config`` the
flat resolved flags (``data.prompt_dataset``, ``data.input_key``, ...). An environment with a finite
prompt set (a dataset) plays row ``seed % len``; the trainer hands out seeds as shuffled passes
over that set (``train.num_episodes`` passes).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashreinforce.trainer.buffer import PromptStream, RolloutBuffer
from flashreinforce.trainer.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint
from flashreinforce.config import ConfigError, ResolvedConfig
from flashreinforce.engines import LocalWeightStore, SamplingParams, create_engine
from flashreinforce.envs.registry import EnvironmentSpecError, EnvSpec, accepts_chat_template, num_prompts
from flashreinforce.trainer.evaluation import Evaluator, append_eval_record, eval_seeds
from flashreinforce.trainer.learner import Learner, LearnerSettings
from flashreinforce.models.loading import build_model
from flashreinforce.trainer.rollout import RolloutBackend, RolloutSettings, RolloutWorker, ThreadRolloutPool
from flashreinforce.models.tokenizers import HFTokenizer, load_tokenizer

__all__ = ["Trainer"]

log = logging.getLogger("flashreinforce.trainer")


# ---------------------------------------------------------------------------- helpers
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


# ---------------------------------------------------------------------------- the trainer
class Trainer:
    """One training run. ``run()`` returns a summary dict; see the module docstring."""

    def __init__(self, cfg: ResolvedConfig) -> None:
        if not cfg.output:
            raise ConfigError("--output DIR is required")
        self.cfg = cfg
        f = cfg.flags
        self.out = Path(cfg.output)
        self.ckpt_dir = Path(f["ckpt.path"] or self.out / "checkpoints")
        self.hf_dir = Path(f["ckpt.output_dir"] or self.out / "hf")
        self.device = _device(cfg.device)
        self._interrupted = threading.Event()
        self._evaluator: Evaluator | None = None
        self.dist = None  # DistContext under torchrun
        self._ray = None  # RayRollout with --rollout.backend ray
        self._loaded: dict | None = None  # the checkpoint being resumed from
        self.pool: RolloutBackend | None = None  # the running rollout workers (for tools and tests)

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg, f = self.cfg, self.cfg.flags
        if cfg.torch_threads:
            torch.set_num_threads(int(cfg.torch_threads))
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        torch.manual_seed(cfg.seed)
        if f["actor.model_name_or_path"] is None:
            raise ConfigError("no model: give --model (or --actor.model_name_or_path, or a --preset)")
        self.model, tok_spec = build_model(f["actor.model_name_or_path"], device=self.device,
                                           attn_implementation=f["fsdp.attn_implementation"], seed=cfg.seed)
        tok_spec = cfg.tokenizer or tok_spec
        chat = bool(f["data.apply_chat_template"])
        spec = f["train.agent_path"]
        self.tokenizer = load_tokenizer(tok_spec)
        env_renders = False
        if chat and isinstance(self.tokenizer, HFTokenizer):
            env_renders = spec is not None and accepts_chat_template(spec)
            self.tokenizer = HFTokenizer(self.tokenizer.tok, chat_prompt=not env_renders, chat_observations=True)
        elif chat:
            cfg.inactive["data.apply_chat_template"] = "the character tokenizer has no chat template"
        emb = self.model.get_input_embeddings().weight.shape[0]
        if self.tokenizer.vocab_size > emb:
            raise ConfigError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's embedding only "
                              f"{emb} rows; use a matching --tokenizer")
        if cfg.flags["fsdp.packing_samples"] and not self._packed_forward_supported():
            raise ConfigError("--fsdp.packing_samples: this transformers version does not separate packed "
                              "sequences by position_ids; drop the flag to use the padded forward")
        if spec is None:
            raise ConfigError("no environment: give --env MODULE:CLASS (or --train.agent_path, or a --preset)")
        self.env_spec = EnvSpec(spec, cfg.env_config(), dict(cfg.env_kwargs), env_renders)
        try:
            self.env_factory = self.env_spec.factory(self.tokenizer)
        except EnvironmentSpecError as err:
            raise ConfigError(f"--env {spec!r}: {err}") from None
        probe = self.env_factory()
        try:
            self.num_prompts = num_prompts(probe)
        finally:
            probe.close()
        self.max_steps = f["train.max_steps"]
        if not self.max_steps:
            if self.num_prompts is None:
                raise ConfigError("the environment has no finite prompt set; give --train.max_steps")
            self.max_steps = f["train.num_episodes"] * self.num_prompts // f["rollout.batch_size"]
            if self.max_steps <= 0:
                raise ConfigError(f"train.num_episodes {f['train.num_episodes']} passes over {self.num_prompts} prompts "
                                  f"make no full batch of rollout.batch_size {f['rollout.batch_size']}")
        lo, hi = f["actor.eps_clip_low_high"]
        gc = str(f["actor.gradient_checkpoint"]).lower() in ("full", "true")
        settings = LearnerSettings(
            loss_mode=f["actor.loss_mode"], delta=f["actor.flash_gate_delta"], neg_topq=f["actor.flash_neg_topq"],
            loss_agg=f["actor.flash_loss_agg"], loss_scale_factor=f["actor.loss_scale_factor"],
            no_is=f["actor.flash_no_is"], eps_clip=(lo, hi), whiten=not f["algo.advantage.no_whiten"],
            lr=f["actor.adam.lr"], weight_decay=f["actor.adam.weight_decay"], betas=tuple(f["actor.adam.betas"]),
            scheduler=f["actor.lr_scheduler"], warmup_ratio=f["actor.lr_warmup_ratio"],
            min_lr_ratio=f["actor.min_lr_ratio"], total_steps=self.max_steps, max_norm=f["actor.max_norm"],
            entropy_coef=f["actor.entropy_coef"], temperature=f["rollout.temperature"],
            micro_batch_trajectories=f["train.micro_batch_size"], micro_batch_tokens=f["train.micro_batch_tokens"],
            packed_forward=bool(f["fsdp.packing_samples"]), param_dtype=f["fsdp.param_dtype"],
            gradient_checkpointing=gc)
        self._load_checkpoint_weights()  # before any sharding of the model
        if self.dist is not None:
            from flashreinforce.distributed.data_parallel import DataParallelLearner

            self.learner = DataParallelLearner(self.model, settings, self.dist, pad_token_id=self.tokenizer.pad_token_id,
                                               strategy=f["fsdp.strategy"])
        else:
            self.learner = Learner(self.model, settings, pad_token_id=self.tokenizer.pad_token_id)
        self.step = 0
        self.counters: dict[str, float] = {"skipped_updates": 0, "wall_time_s": 0.0}
        if not self._leads:
            return
        buffer_kwargs = dict(batch_groups=f["rollout.batch_size"], group_size=f["rollout.n_samples_per_prompt"],
                             async_queue_size=f["train.async_queue_size"], max_policy_lag=f["train.max_policy_lag"],
                             vocab_size=self.tokenizer.vocab_size)
        prompt_kwargs = dict(num_prompts=self.num_prompts, seed=cfg.seed)
        if f["rollout.engine"] == "vllm":
            from flashreinforce.engines.vllm import import_vllm

            try:
                import_vllm()
            except ImportError as err:
                raise ConfigError(f"--rollout.engine vllm: {err}") from None
        if f["rollout.backend"] == "ray":
            from flashreinforce.distributed.ray import RayRollout, import_ray

            try:
                import_ray()
            except ImportError as err:
                raise ConfigError(f"--rollout.backend ray: {err}") from None
            self._ray = RayRollout.create(address=f["ray.address"], buffer_kwargs=buffer_kwargs,
                                          prompt_kwargs=prompt_kwargs)
            self.buffer = self._ray.buffer
            self.weights = self._ray.weights
        else:
            self.buffer = RolloutBuffer(**buffer_kwargs, prompts=PromptStream(**prompt_kwargs))
            self.weights = LocalWeightStore()
        self.rollout_settings = RolloutSettings(
            max_new_tokens=f["rollout.max_new_tokens"], max_len=f["data.max_len"], max_turns=f["rollout.max_turns"],
            sampling=SamplingParams(f["rollout.temperature"], f["rollout.top_p"], f["rollout.top_k"],
                                    self.tokenizer.eos_token_ids),
            episodes_per_call=f["rollout.vllm_generate_batch_size"], seed=cfg.seed)

    def _packed_forward_supported(self) -> bool:
        try:
            from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
        except ImportError:
            return False
        return True

    @property
    def _leads(self) -> bool:
        """This process runs the rollout side, metrics and checkpoints (always, except torchrun ranks > 0)."""
        return self.dist is None or self.dist.is_leader

    def _load_checkpoint_weights(self) -> None:
        """With ``--resume``: the checkpoint's weights into the (not yet sharded) model, on every rank."""
        cfg = self.cfg
        if not cfg.resume:
            return
        path = latest_checkpoint(self.ckpt_dir) if cfg.resume == "latest" else Path(cfg.resume)
        if path is None:
            raise ConfigError(f"--resume: no checkpoint in {self.ckpt_dir}")
        self._loaded = load_checkpoint(path, model=self.model)
        self._loaded["path"] = path

    def _resume(self) -> None:
        if self._loaded is None:
            return
        state = self._loaded["state"]
        learner_state = dict(self._loaded["learner"])
        if state.get("optimizer_format"):
            learner_state["optimizer_format"] = state["optimizer_format"]
            if not self.learner.sharded:
                raise ConfigError(f"--resume: {self._loaded['path']} holds the optimizer state of a fully_shard "
                                  "learner; resume it under torchrun with --fsdp.strategy fully_shard")
        self.learner.load_state_dict(learner_state)
        self.step = int(state["step"])
        if not self._leads:
            return
        self.buffer.load_state_dict(state["buffer"])
        self.counters.update(state.get("trainer", {}))
        # The metrics history continues from the checkpoint: later lines (from updates whose
        # effect the checkpoint does not hold) are removed.
        for name in ("metrics.jsonl", "eval.jsonl"):
            p = self.out / name
            if p.is_file():
                kept = [ln for ln in p.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step]
                p.write_text("".join(ln + "\n" for ln in kept))
        log.info("resumed from %s at step %d (policy version %d)", self._loaded["path"], self.step,
                 self.learner.version)

    def _save(self) -> Path:
        learner_state = self.learner.state_dict()  # gathered to rank 0 under fully_shard
        state = {"buffer": self.buffer.state_dict(), "trainer": self.counters, "max_steps": self.max_steps}
        if learner_state.get("optimizer_format"):
            state["optimizer_format"] = learner_state["optimizer_format"]
        model = self.learner.full_model() if self.learner.sharded else self.model
        return save_checkpoint(self.ckpt_dir, self.step, model=model, learner_state=learner_state,
                               state=state, tokenizer=self.tokenizer, max_keep=self.cfg.flags["ckpt.max_ckpt_num"])

    def _make_workers(self):
        f = self.cfg.flags
        engine_kind = f["rollout.engine"]
        num_workers = f["vllm.num_engines"] if engine_kind == "vllm" else f["rollout.num_workers"]
        options = self._engine_options()
        if f["rollout.backend"] == "ray":
            from flashreinforce.distributed.ray import WorkerRecipe

            recipe = WorkerRecipe(model_config=self.model.config, engine=engine_kind, tokenizer=self.tokenizer,
                                  env=self.env_spec, settings=self.rollout_settings,
                                  group_size=f["rollout.n_samples_per_prompt"], engine_options=options,
                                  torch_threads=self.cfg.torch_threads)
            gpus = f["ray.num_gpus_per_worker"]
            if gpus is None:
                gpus = f["vllm.tensor_parallel_size"] if engine_kind == "vllm" else 0.0
            return self._ray.backend(recipe, num_workers, num_cpus=f["ray.num_cpus_per_worker"], num_gpus=gpus,
                                     max_restarts=f["ray.max_restarts"], resources=f["ray.worker_resources"],
                                     strategy=f["ray.scheduling_strategy"])
        workers = []
        for i in range(num_workers):
            if engine_kind == "vllm":
                # No weights yet (version -1): the first sync before generating loads the newest ones.
                engine = create_engine("vllm", self.model.config, pad_token_id=self.tokenizer.pad_token_id,
                                       options=options)
            else:
                engine = create_engine("local", self.learner.full_model(self.device), pad_token_id=self.tokenizer.pad_token_id,
                                       version=self.learner.version)
            workers.append(RolloutWorker(i, engine, self.env_factory, self.tokenizer, self.buffer, self.weights,
                                         self.rollout_settings))
        return ThreadRolloutPool(workers)

    def _engine_options(self) -> dict[str, Any]:
        """The vLLM engine's options from the flags (empty for the local engine)."""
        f = self.cfg.flags
        if f["rollout.engine"] != "vllm":
            return {}
        dtype = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}.get(
            f["fsdp.param_dtype"], "auto")
        return {"tensor_parallel_size": f["vllm.tensor_parallel_size"],
                "gpu_memory_utilization": f["vllm.gpu_memory_utilization"], "dtype": dtype, "seed": self.cfg.seed,
                "max_model_len": f["data.max_len"]}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Mean reward and success rate of the current policy on the evaluation prompts."""
        if self._evaluator is None:
            self._evaluator = self._make_evaluator()
        return self._evaluator.evaluate(self.learner.version)

    def _make_evaluator(self) -> Evaluator:
        f = self.cfg.flags
        env_factory = self.env_factory
        seeds = eval_seeds(self.num_prompts, f["eval.num_prompts"])
        if f["eval.dataset"]:  # every row of the evaluation dataset
            env_factory = EnvSpec(self.env_spec.spec, self.cfg.env_config(eval_split=True), self.env_spec.kwargs,
                                  self.env_spec.chat_template).factory(self.tokenizer)
            probe = env_factory()
            try:
                rows = num_prompts(probe)
            finally:
                probe.close()
            seeds = eval_seeds(rows, rows if rows is not None else f["eval.num_prompts"])
        sampling = SamplingParams(f["eval.temperature"], f["eval.top_p"], f["rollout.top_k"],
                                  self.tokenizer.eos_token_ids)
        return Evaluator(env_factory=env_factory, seeds=seeds, model=self.learner.full_model(self.device),
                         tokenizer=self.tokenizer, weights=self.weights, rollout_settings=self.rollout_settings,
                         sampling=sampling, n_samples=f["eval.n_samples_per_prompt"],
                         episodes_per_call=f["rollout.vllm_generate_batch_size"], seed=self.cfg.seed + 1)

    def _write_eval(self, metrics: dict[str, float]) -> None:
        append_eval_record(self.out / "eval.jsonl", self.step, metrics)

    # ------------------------------------------------------------------ signals
    def _on_sigint(self, signum, frame) -> None:
        if self._interrupted.is_set():
            raise KeyboardInterrupt
        self._interrupted.set()
        print("\nflashreinforce: interrupted; saving a checkpoint and stopping (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Train; returns the summary (torchrun ranks > 0 return ``status: follower``)."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from flashreinforce.distributed.data_parallel import distributed_context

            self.dist = distributed_context(self.cfg.device)
            self.device = self.dist.device
        try:
            return self._run() if self._leads else self._run_follower()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Remove the Ray actors and disconnect (stopping only a Ray instance this run started);
        leave the torch.distributed job."""
        try:
            if self._ray is not None:
                self._ray.close()
                self._ray = None
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

    def _run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self._setup()
            self._resume()
        except BaseException:
            if self.dist is not None and getattr(self, "learner", None) is not None:
                self.learner.stop()  # release the other ranks
            raise
        try:
            return self._train()
        finally:
            if self.dist is not None:
                self.learner.stop()

    def _train(self) -> dict[str, Any]:
        cfg, f = self.cfg, self.cfg.flags
        record = cfg.to_json()
        record.update(max_steps=self.max_steps, loss_impl=self.learner.loss_impl, num_prompts=self.num_prompts,
                      device=str(self.device), torch_threads=torch.get_num_threads(),
                      tokenizer_kind=type(self.tokenizer).__name__,
                      learner_ranks=1 if self.dist is None else self.dist.world_size,
                      learner_strategy=None if self.dist is None else f["fsdp.strategy"],
                      rollout_backend=f["rollout.backend"], rollout_engine=f["rollout.engine"])
        (self.out / "config.json").write_text(json.dumps(record, indent=1, default=str))
        for w in cfg.warnings:
            log.warning(w)
        self.weights.publish(self.learner.policy_state(), self.learner.version)
        main_thread = threading.current_thread() is threading.main_thread()
        old_handler = signal.signal(signal.SIGINT, self._on_sigint) if main_thread else None

        from tqdm import tqdm

        bar = tqdm(total=self.max_steps, initial=self.step, disable=not cfg.progress, desc="train",
                   dynamic_ncols=True, file=sys.stderr)
        pool = None
        status = "completed"
        history: list[dict[str, Any]] = []
        try:
            if f["eval.eval_at_start"] and self.step == 0:
                ev = self.evaluate()
                self._write_eval(ev)
                bar.write(f"eval at start: reward {ev['eval_reward_mean']:.3f}, success {ev['eval_success_rate']:.3f}")
            pool = self.pool = self._make_workers()
            pool.start()
            t_run = time.perf_counter()
            t_last = time.perf_counter()
            while self.step < self.max_steps:
                if self._interrupted.is_set():
                    status = "interrupted"
                    break
                t_wait = time.perf_counter()
                batch = None
                while batch is None and not self._interrupted.is_set():
                    batch = self.buffer.take(self.learner.version, timeout=0.25)
                    if batch is None:
                        pool.check()
                if batch is None:
                    status = "interrupted"
                    break
                idle = time.perf_counter() - t_wait
                trajs = batch.trajectories
                version_before = self.learner.version
                try:
                    m = self.learner.step(trajs, batch.group_ids)
                except FloatingPointError as err:
                    log.warning("update skipped: %s", err)
                    self.counters["skipped_updates"] += 1
                    self.buffer.update_done()
                    continue
                self.weights.publish(self.learner.policy_state(), self.learner.version)
                self.buffer.update_done()
                self.step += 1
                now = time.perf_counter()
                step_time = now - t_last
                t_last = now
                metrics = self._metrics(m, trajs, batch, version_before, idle, step_time, now - t_run, pool)
                if f["eval.steps"] and self.step % f["eval.steps"] == 0:
                    ev = self.evaluate()
                    self._write_eval(ev)
                    metrics.update(ev)
                    t_last = time.perf_counter()
                with open(self.out / "metrics.jsonl", "a") as fh:
                    fh.write(json.dumps(metrics) + "\n")
                history.append(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['acceptance_rate']:.2f}",
                                lag=f"{metrics['policy_lag_mean']:.1f}", refresh=False)
                if self.step % f["logger.logging_steps"] == 0 and not cfg.progress:
                    print(f"step {self.step}: reward {metrics['reward_mean']:.3f} acceptance "
                          f"{metrics['acceptance_rate']:.2f} lag {metrics['policy_lag_mean']:.2f} "
                          f"loss {metrics['loss']:.4f}", file=sys.stderr, flush=True)
                if f["ckpt.save_steps"] and self.step % f["ckpt.save_steps"] == 0:
                    self._save()
            self.counters["wall_time_s"] += time.perf_counter() - t_run
        except KeyboardInterrupt:
            status = "aborted"
            raise
        finally:
            bar.close()
            if pool is not None:
                pool.stop()
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if status != "aborted":
                ckpt = self._save()
                log.info("checkpoint saved to %s", ckpt)
        if status == "completed":
            self.hf_dir.mkdir(parents=True, exist_ok=True)
            (self.learner.full_model() if self.learner.sharded else self.model).save_pretrained(str(self.hf_dir))
            self.tokenizer.save_pretrained(self.hf_dir)
        summary = {"status": status, "step": self.step, "policy_version": self.learner.version,
                   "output": str(self.out), "buffer": self.buffer.stats(), "loss_impl": self.learner.loss_impl}
        if history:
            k = max(1, min(10, len(history) // 4))
            summary["reward_first"] = _mean(h["reward_mean"] for h in history[:k])
            summary["reward_last"] = _mean(h["reward_mean"] for h in history[-k:])
        return summary

    def _metrics(self, m: dict, trajs, batch, version_before: int, idle: float, step_time: float, wall: float,
                 pool: RolloutBackend) -> dict[str, Any]:
        lags = [t.policy_lag(version_before) for t in trajs]
        tokens = sum(t.num_tokens for t in trajs)
        stats = self.buffer.stats()
        worker_stats = pool.stats()
        idle_frac = [w["idle_s"] / max(1e-9, w["idle_s"] + w["busy_s"]) for w in worker_stats]
        out = {
            "step": self.step,
            "policy_version": self.learner.version,
            "reward_mean": _mean(t.reward for t in trajs),
            "success_rate": _mean(0.0 if t.failed else 1.0 for t in trajs),
            "acceptance_rate": m["acceptance_rate"],
            "sequence_kl_mean": m["sequence_kl_mean"],
            "policy_lag_mean": _mean(lags),
            "policy_lag_max": max(lags),
            "policy_lag_min": min(lags),
            "trajectories": len(trajs),
            "tokens": tokens,
            "action_tokens": m["policy_tokens"],
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "lr": m["lr"],
            "learner_idle_s": idle,
            "learner_compute_s": m["learner_compute_s"],
            "step_time_s": step_time,
            "tokens_per_s": tokens / step_time if step_time > 0 else float("nan"),
            "rejected_trajectories": stats.get("rejected_trajectories", 0),
            "dropped_stale_trajectories": stats.get("dropped_stale_trajectories", 0),
            "cancelled_groups": stats.get("cancelled_groups", 0),
            "lost_trajectories": stats.get("lost_trajectories", 0),
            "worker_restarts": sum(int(w.get("restarts", 0)) for w in worker_stats),
            "multi_version_trajectories": sum(t.policy_version_max != t.policy_version_min for t in trajs),
            "truncated_fraction": _mean(float(t.truncated) for t in trajs),
            "num_turns_mean": _mean(t.num_turns for t in trajs),
            "response_tokens_mean": _mean(t.num_action_tokens for t in trajs),
            "buffer_in_flight": stats["in_flight"],
            "worker_idle_fraction": _mean(idle_frac),
            "worker_errors": sum(w["errors"] for w in worker_stats),
            "wall_time_s": self.counters["wall_time_s"] + wall,
        }
        for key in ("sequence_kl_max", "retained_token_fraction", "entropy_mean", "clip_fraction", "advantage_abs_mean",
                    "rank_tokens_max", "rank_tokens_min"):
            if key in m:
                out[key] = m[key]
        return out
