"""Rollout engines behind one interface (:class:`RolloutEngine`) and weight publication by version.

``local`` (the default) is :class:`HFEngine`, a Hugging Face model sampled in this process. A vLLM
engine (issue 6) will plug in behind the same interface as an optional extra.
"""

from flashreinforce.engines.base import (Generation, GenerationRequest, LocalWeightStore, RolloutEngine,
                                         SamplingParams, WeightStore)
from flashreinforce.engines.hf import HFEngine, sampling_log_probs

__all__ = ["ENGINE_KINDS", "Generation", "GenerationRequest", "HFEngine", "LocalWeightStore", "RolloutEngine",
           "SamplingParams", "WeightStore", "create_engine", "sampling_log_probs"]

#: Engine kinds ``create_engine`` knows; only ``local`` is implemented on this runtime.
ENGINE_KINDS = ("local",)


def create_engine(kind: str, model, *, pad_token_id: int, version: int = -1) -> RolloutEngine:
    """An engine of ``kind`` around ``model`` (the engine's own copy of the policy)."""
    if kind == "local":
        return HFEngine(model, pad_token_id=pad_token_id, version=version)
    raise ValueError(f"rollout engine {kind!r} is not available; known engines: {ENGINE_KINDS} "
                     "(the vLLM engine is planned as an optional extra)")
