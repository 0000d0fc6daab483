"""Rollout engines behind one interface (:class:`RolloutEngine`) and weight publication by version.

``hf`` (the default) is :class:`HFEngine`, a Hugging Face model sampled in the worker's process.
``vllm`` is :class:`flashreinforce.engines.vllm.VLLMEngine` (optional extra ``flashreinforce[vllm]``),
imported only when selected.
"""

from typing import Any, Mapping

from flashreinforce.engines.base import (Generation, GenerationRequest, LocalWeightStore, RolloutEngine,
                                         SamplingParams, WeightStore)
from flashreinforce.engines.hf import HFEngine, sampling_log_probs

__all__ = ["ENGINE_KINDS", "Generation", "GenerationRequest", "HFEngine", "LocalWeightStore", "RolloutEngine",
           "SamplingParams", "WeightStore", "create_engine", "sampling_log_probs"]

#: Engine kinds ``create_engine`` knows.
ENGINE_KINDS = ("hf", "vllm")


def create_engine(kind: str, model, *, pad_token_id: int, version: int = -1,
                  options: Mapping[str, Any] | None = None) -> RolloutEngine:
    """An engine of ``kind``.

    ``hf``: ``model`` is the engine's own copy of the policy (a ``transformers`` causal LM);
    ``options``: ``dtype`` and ``auto_dtype`` of :class:`HFEngine`.
    ``vllm``: ``model`` is a Hugging Face checkpoint directory, a ``transformers`` config, or a
    causal LM (its config; and its weights when ``version >= 0``); ``options`` are
    :class:`~flashreinforce.engines.vllm.VLLMEngine` keyword arguments. vLLM is imported here,
    only when selected; without it this raises ``ImportError`` naming the extra to install.
    """
    options = dict(options or {})
    if kind == "hf":
        unknown = set(options) - {"dtype", "auto_dtype"}
        if unknown:
            raise ValueError(f"the hf engine takes the options dtype and auto_dtype, got {sorted(unknown)}")
        return HFEngine(model, pad_token_id=pad_token_id, version=version, **options)
    if kind == "vllm":
        from flashreinforce.engines.vllm import VLLMEngine

        return VLLMEngine(model, version=version, **options)
    raise ValueError(f"rollout engine {kind!r} is not available; known engines: {ENGINE_KINDS}")
