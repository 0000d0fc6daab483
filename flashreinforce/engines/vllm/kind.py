"""The ``vllm`` engine's options (:class:`VLLMOptions`) and its kind, registered as ``--rollout.engine vllm``.

The kind builds the options from what the run hands it (:class:`~flashreinforce.engines.registry.EngineRun`:
run-wide values and the ``vllm`` flag section's values); the engine receives only the options.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from flashreinforce.engines.registry import ENGINE_REGISTRY, EngineKind, EngineRun, register_engine
from flashreinforce.engines.vllm.engine import VLLMEngine, import_vllm

__all__ = ["VLLM_ENGINE", "VLLMEngineKind", "VLLMOptions"]


@dataclass(frozen=True)
class VLLMOptions:
    """The ``vllm`` engine's options: :class:`VLLMEngine`'s arguments of the same names, with its
    defaults (python_tests/engines/test_engine_registry.py holds them equal), and ``num_engines``,
    the rollout workers of a run (one engine each; not an engine argument)."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    cpu_threads: int | None = None
    pause_check_tokens: int = 128
    weight_sync: str = "auto"
    cpu_weight_load: str = "direct"
    lora: Mapping[str, Any] | None = None
    llm_kwargs: Mapping[str, Any] | None = None
    num_engines: int = 1


@register_engine
class VLLMEngineKind(EngineKind):
    """``--rollout.engine vllm``: a :class:`VLLMEngine` per rollout worker (``vllm.num_engines``),
    built from the policy's config (weights arriving with the first sync), with :class:`VLLMOptions`
    from the run and its ``vllm`` flag section."""

    name = "vllm"
    takes_policy_copy = False
    options_type = VLLMOptions

    def check_installed(self) -> None:
        import_vllm()

    def options(self, run: EngineRun) -> VLLMOptions:
        v = run.section
        return VLLMOptions(
            tensor_parallel_size=v["tensor_parallel_size"], gpu_memory_utilization=v["gpu_memory_utilization"],
            dtype=run.dtype, seed=run.seed, max_model_len=run.max_len, max_num_seqs=run.episodes_per_call,
            enforce_eager=v["enforce_eager"], kv_cache_bytes=int(v["kv_cache_gib"] * 2**30) or None,
            cpu_threads=v["cpu_threads"] or None, pause_check_tokens=run.inflight_check_tokens,
            weight_sync=v["weight_sync"], num_engines=int(v["num_engines"]))

    def num_workers(self, run: EngineRun, options: VLLMOptions) -> int:
        return int(options.num_engines)

    def gpus_per_worker(self, options: VLLMOptions) -> float:
        return float(options.tensor_parallel_size) if torch.cuda.is_available() else 0.0

    def create(self, model, *, pad_token_id: int, version: int, options: VLLMOptions) -> VLLMEngine:
        arguments = {f.name: getattr(options, f.name) for f in fields(options) if f.name != "num_engines"}
        if arguments["dtype"] in ("fp32", "bf16", "fp16"):
            arguments["dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[arguments["dtype"]]
        return VLLMEngine(model, version=version, **arguments)


VLLM_ENGINE = ENGINE_REGISTRY["vllm"]
