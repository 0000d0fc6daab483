"""The ``vllm`` rollout engine: vLLM's offline engine in its own processes, on a GPU or a CPU.

:mod:`~flashreinforce.engines.vllm.engine` holds :class:`VLLMEngine` (``vllm`` itself is imported
only when an engine is built), :mod:`~flashreinforce.engines.vllm.kind` its options
(:class:`VLLMOptions`) and its registered kind; beside it, the weight buffers shared with vLLM's
processes (:mod:`~flashreinforce.engines.vllm.shared_weights`), the extension that runs inside
them (:mod:`~flashreinforce.engines.vllm.worker`), the direct load into vLLM's CPU kernels
(:mod:`~flashreinforce.engines.vllm.weights`) and the watch over its processes
(:mod:`~flashreinforce.engines.vllm.process`).
"""

from flashreinforce.engines.vllm.engine import (CPU_INSTALL, GPU_INSTALL, MIN_VLLM_VERSION, VLLMEngine, import_vllm,
                                                kv_bytes_per_token)
from flashreinforce.engines.vllm.kind import VLLM_ENGINE, VLLMEngineKind, VLLMOptions

__all__ = ["CPU_INSTALL", "GPU_INSTALL", "MIN_VLLM_VERSION", "VLLM_ENGINE", "VLLMEngine", "VLLMEngineKind",
           "VLLMOptions", "import_vllm", "kv_bytes_per_token"]
