"""Rollout worker actors: each builds its own engine and environments from a :class:`WorkerRecipe`
and runs the same :class:`~flashreinforce.trainer.rollout.worker.RolloutWorker` loop as the local backend,
against the buffer actor (:class:`~flashreinforce.distributed.ray.buffer.WorkerBufferClient`) and the
weight registry (:class:`~flashreinforce.distributed.ray.weights.RayWeightStore`)."""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from flashreinforce.distributed.ray.buffer import WorkerBufferClient
from flashreinforce.distributed.ray.calls import import_ray
from flashreinforce.distributed.ray.weights import RayWeightStore
from flashreinforce.trainer.rollout.settings import RolloutSettings

__all__ = ["RolloutWorkerActor", "WorkerRecipe"]


@dataclass
class WorkerRecipe:
    """What a remote rollout worker builds itself from (picklable; no model weights).

    model_config: the policy's ``transformers`` config (weights come from the weight store).
    engine / engine_options: :func:`~flashreinforce.engines.create_engine`'s kind and options.
    tokenizer: the run's tokenizer object. env: the :class:`~flashreinforce.envs.registry.EnvSpec`.
    settings: the :class:`~flashreinforce.trainer.rollout.settings.RolloutSettings`. group_size: samples per prompt
    (the buffer's). engine_options: the engine's typed options (its kind's ``options_type``), or a
    mapping of some of them. torch_threads: intra-op threads
    of the worker process (``None``: torch's default). max_prompts_per_call: the worker's share of
    the prompts that may be in flight (set by the pool, see
    :func:`~flashreinforce.trainer.rollout.backend.fair_share`).
    """

    model_config: Any
    engine: str
    tokenizer: Any
    env: Any
    settings: RolloutSettings
    group_size: int = 1
    engine_options: Any = None
    torch_threads: int | None = None
    max_prompts_per_call: int | None = None


def engine_model_config(config: Any) -> Any:
    """A copy of the policy's ``transformers`` config for an engine copy of the model: the learner's
    per-document attention (registered in the learner's process only, and only for its packed rows)
    is replaced by transformers' default choice, the attention the policy was built with unless
    ``--fsdp.attn_implementation`` named another one."""
    from flashreinforce.models.attention import ATTENTION_NAME

    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return config
    config = copy.deepcopy(config)
    config._attn_implementation_internal = None
    return config


class RolloutWorkerActor:
    """Ray actor body: one rollout worker with its own engine and environments (threaded actor:
    ``run`` holds one thread, ``stop`` / ``stats`` / ``pid`` answer on others)."""

    def __init__(self, worker_id: int, recipe_ref: list, buffer_handle, registry_handle) -> None:
        import transformers

        from flashreinforce.engines import create_engine, engine_kind
        from flashreinforce.trainer.rollout.worker import RolloutWorker

        ray = import_ray()
        # The recipe comes by reference (the driver keeps it alive), so a restarted actor finds it again.
        recipe: WorkerRecipe = ray.get(recipe_ref[0])
        if recipe.torch_threads:
            torch.set_num_threads(int(recipe.torch_threads))
        device = torch.device("cuda:0") if ray.get_gpu_ids() and torch.cuda.is_available() else torch.device("cpu")
        try:
            env_factory = recipe.env.factory(recipe.tokenizer)
        except Exception as err:  # typically: the --env module is not installed on this node
            node = ray.get_runtime_context().get_node_id()
            raise RuntimeError(f"rollout worker {worker_id} on Ray node {node} ({ray.util.get_node_ip_address()}) "
                               f"cannot load --env {recipe.env.spec!r}: {type(err).__name__}: {err} (--env must be "
                               "importable on every node that runs rollout workers)") from err
        if engine_kind(recipe.engine).takes_policy_copy:  # weights arrive with the first sync
            model = transformers.AutoModelForCausalLM.from_config(engine_model_config(recipe.model_config))
            model = model.to(device=device, dtype=torch.float32)
        else:
            model = recipe.model_config
        engine = create_engine(recipe.engine, model, pad_token_id=recipe.tokenizer.pad_token_id, version=-1,
                               options=recipe.engine_options)
        buffer = WorkerBufferClient(buffer_handle, worker_id, recipe.group_size)
        self.worker = RolloutWorker(worker_id, engine, env_factory, recipe.tokenizer, buffer,
                                    RayWeightStore(registry_handle), recipe.settings)
        self.worker.max_prompts_per_call = recipe.max_prompts_per_call
        self._stop = threading.Event()
        self._running = threading.Lock()
        self.device = str(device)

    def ready(self) -> dict[str, Any]:
        """Where this worker runs: pid, device, Ray node id and the node's IP address."""
        ray = import_ray()
        return {"pid": os.getpid(), "device": self.device, "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def pid(self) -> int:
        return os.getpid()

    def run(self, incarnation: int) -> dict[str, float]:
        """Roll out until stopped or the buffer closes (as incarnation ``incarnation``).

        One loop at a time: should an earlier incarnation's loop still run in this process (the actor
        was only unreachable for a while), it ends at its next request
        (:class:`~flashreinforce.distributed.ray.buffer.StaleIncarnation`) and this one waits for it.
        """
        with self._running:
            self.worker.buffer.incarnation = int(incarnation)
            self._stop.clear()
            self.worker.run(self._stop)
            return self.stats()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        out = dict(self.worker.stats())
        out["last_error"] = self.worker.last_error
        return out

    def close(self) -> None:
        self.worker.close()
