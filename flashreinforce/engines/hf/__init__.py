"""The ``hf`` rollout engine: a Hugging Face causal LM sampled in the worker's process.

:mod:`~flashreinforce.engines.hf.engine` holds :class:`HFEngine`, its options (:class:`HFOptions`)
and its kind; the decode path's
parts sit beside it: the KV cache (:mod:`~flashreinforce.engines.hf.kv_cache`), packed linear
weights (:mod:`~flashreinforce.engines.hf.packed_linear`), grouped decode attention
(:mod:`~flashreinforce.engines.hf.decode_attention`) and the fused CPU decode step
(:mod:`~flashreinforce.engines.hf.fast_decode`).
"""

from flashreinforce.engines.hf.engine import (HF_ENGINE, KV_CACHES, LINEAR_KERNELS, HFEngine, HFEngineKind, HFOptions,
                                              SamplingWorkspace, sample_tokens, sampling_log_probs)

__all__ = ["HF_ENGINE", "KV_CACHES", "LINEAR_KERNELS", "HFEngine", "HFEngineKind", "HFOptions", "SamplingWorkspace",
           "sample_tokens", "sampling_log_probs"]
