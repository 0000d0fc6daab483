"""The rollout side of a run: the buffer, the weight store and the rollout workers, local or on Ray.

``rollout.backend local``: the buffer and the weight store live in this process and the workers are
threads of it (:class:`~flashreinforce.trainer.rollout.thread_pool.ThreadRolloutPool`), each with its own engine
copy of the policy. ``rollout.backend ray``: the buffer is a Ray actor, weights travel through Ray's
object store and the workers are Ray actors (:mod:`flashreinforce.distributed.ray`), built through
the run's :class:`~flashreinforce.trainer.run.scale_out.ScaleOut` (the trainer does not import them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flashreinforce.config import ConfigError, TrainerConfig
from flashreinforce.engines import LocalWeightStore, WeightStore, create_engine, engine_kind
from flashreinforce.envs.base import Environment
from flashreinforce.envs.registry import EnvSpec
from flashreinforce.trainer.rollout.buffer import PromptStream, RolloutBuffer
from flashreinforce.trainer.rollout.worker_kinds import worker_class
from flashreinforce.trainer.learning.learner import PolicyLearner
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.worker import RolloutWorker
from flashreinforce.trainer.rollout.backend import RolloutBackend
from flashreinforce.trainer.rollout.thread_pool import ThreadRolloutPool
from flashreinforce.trainer.run.components import engine_run
from flashreinforce.trainer.run.scale_out import ScaleOut, require_scale_out

__all__ = ["RolloutSide", "start_rollout_side"]


@dataclass
class RolloutSide:
    """The buffer and weight store of a run, and the Ray session when the backend is Ray.

    ``buffer`` is a :class:`~flashreinforce.trainer.rollout.buffer.RolloutBuffer` or its Ray client; both
    offer ``take``, ``update_done``, ``stats`` and ``state_dict``/``load_state_dict``.
    """

    buffer: Any
    weights: WeightStore
    ray: Any = None
    scale_out: ScaleOut | None = None

    def make_workers(self, cfg: TrainerConfig, *, learner: PolicyLearner, model_config, tokenizer,
                     env_spec: EnvSpec, env_factory: Callable[[], Environment], settings: RolloutSettings,
                     engine_options: Any, device: torch.device,
                     torch_threads: int | None) -> RolloutBackend:
        """The rollout workers (not started), as many as the engine kind says (``rollout.num_workers``;
        ``vllm.num_engines`` with vLLM), each with its own engine."""
        kind = engine_kind(cfg.rollout.engine)
        num_workers = kind.num_workers(engine_run(cfg, cfg.seed, device), engine_options)
        if self.ray is not None:
            if worker_class(env_factory) is not RolloutWorker:
                raise ConfigError("--agent runs on --rollout.backend local (each worker serves its agents' calls "
                                  "from its own endpoint); give --rollout.backend local")
            recipe = require_scale_out(self.scale_out, "--rollout.backend ray").worker_recipe(
                model_config=model_config, engine=kind.name, tokenizer=tokenizer, env=env_spec,
                settings=settings, group_size=cfg.rollout.n_samples_per_prompt, engine_options=engine_options,
                torch_threads=torch_threads)
            gpus = cfg.ray.num_gpus_per_worker
            if gpus is None:
                gpus = kind.gpus_per_worker(engine_options)
            return self.ray.backend(recipe, num_workers, num_cpus=cfg.ray.num_cpus_per_worker, num_gpus=gpus,
                                    max_restarts=cfg.ray.max_restarts, resources=cfg.ray.worker_resources,
                                    strategy=cfg.ray.scheduling_strategy)
        workers = []
        for i in range(num_workers):
            if kind.takes_policy_copy:
                engine = create_engine(kind.name, learner.full_model(device), pad_token_id=tokenizer.pad_token_id,
                                       version=learner.version, options=engine_options)
            else:  # no weights yet (version -1): the first sync before generating loads the newest ones
                engine = create_engine(kind.name, model_config, pad_token_id=tokenizer.pad_token_id,
                                       options=engine_options)
            workers.append(worker_class(env_factory)(i, engine, env_factory, tokenizer, self.buffer, self.weights,
                                                     settings))
        return ThreadRolloutPool(workers)

    def close(self) -> None:
        """Remove the Ray actors and disconnect (stopping only a Ray instance this run started)."""
        if self.ray is not None:
            ray, self.ray = self.ray, None
            ray.close()


def start_rollout_side(cfg: TrainerConfig, *, num_prompts: int | None, vocab_size: int,
                       seed: int, exclude: Sequence[int] = (), scale_out: ScaleOut | None = None) -> RolloutSide:
    """The buffer (``rollout.batch_size`` groups of ``rollout.n_samples_per_prompt`` per batch,
    ``train.async_queue_size`` batches ahead, or ``train.fixed_policy_lag``; ``train.max_policy_lag``) over the
    shuffled prompt
    stream (without the held-out rows ``exclude``), and the weight store, on the configured backend
    (``ray``: built by ``scale_out``)."""
    buffer_kwargs = dict(batch_groups=cfg.rollout.batch_size, group_size=cfg.rollout.n_samples_per_prompt,
                         async_queue_size=cfg.train.batches_ahead, max_policy_lag=cfg.train.max_policy_lag,
                         vocab_size=vocab_size)
    prompt_kwargs = dict(num_prompts=num_prompts, seed=seed, exclude=list(exclude))
    if cfg.rollout.backend == "ray":
        scale_out = require_scale_out(scale_out, "--rollout.backend ray")
        try:
            scale_out.require_ray()
        except ImportError as err:
            raise ConfigError(f"--rollout.backend ray: {err}") from None
        ray = scale_out.ray_rollout(address=cfg.ray.address, buffer_kwargs=buffer_kwargs, prompt_kwargs=prompt_kwargs)
        return RolloutSide(ray.buffer, ray.weights, ray, scale_out)
    return RolloutSide(RolloutBuffer(**buffer_kwargs, prompts=PromptStream(**prompt_kwargs)), LocalWeightStore())
