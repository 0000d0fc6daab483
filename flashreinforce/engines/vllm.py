"""A rollout engine on vLLM (``--rollout.engine vllm``; optional extra ``pip install 'flashreinforce[vllm]'``).

:class:`VLLMEngine` implements :class:`~flashreinforce.engines.RolloutEngine` with vLLM's offline
``LLM`` API. It is imported only when selected; ``vllm`` itself is imported in the constructor, so
``import flashreinforce`` never needs it.

* **Behavior log-probabilities from the engine itself**: the engine is built with
  ``logprobs_mode="processed_logprobs"`` and every request asks for ``logprobs=0`` (the sampled
  token only), so the recorded value is the log-probability of the sampled token under the
  distribution vLLM sampled it from: after temperature, top-k and top-p (vLLM >= 0.10.2; before,
  vLLM returned the raw model distribution). Greedy requests (temperature 0) record 0, as the
  hf engine does.
* **Exact stop set**: ``ignore_eos=True`` plus ``stop_token_ids`` from the trainer, so a turn ends on
  exactly the tokens the hf engine stops on; the stop token is the turn's last action token.
* **Per-request seeds**: each request carries its own ``seed`` (reproducible whatever batch it is in).
* **Weights in place, by version**: :meth:`VLLMEngine.load_weights` sends the published tensors to
  vLLM's workers through ``LLM.collective_rpc`` to :class:`WeightUpdateExtension` (installed with
  ``worker_extension_cls``), which calls the model's own ``load_weights`` (Hugging Face names, fused
  projections handled by vLLM), then resets the prefix cache so no KV computed by old weights is
  reused. Tensors travel as CPU tensors through vLLM's RPC in chunks (:data:`CHUNK_BYTES`); an NCCL
  or CUDA-IPC broadcast is not implemented. Unquantized models only.

The model: a Hugging Face checkpoint directory (weights read by vLLM), or a ``transformers`` config /
causal LM, written as ``config.json`` to a temporary directory and started with dummy weights;
the trainer's first weight sync loads the real ones (an engine whose ``version`` is -1 has none yet).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from flashreinforce.engines.base import Generation, GenerationRequest, RolloutEngine, SamplingParams

__all__ = ["CHUNK_BYTES", "MIN_VLLM_VERSION", "VLLMEngine", "WeightUpdateExtension", "import_vllm"]

log = logging.getLogger(__name__)

#: ``logprobs_mode="processed_logprobs"`` (log-probs of the distribution actually sampled from)
#: exists from this vLLM release on (vllm-project/vllm#22387).
MIN_VLLM_VERSION = (0, 10, 2)

#: Bytes of weights per ``collective_rpc`` call when loading a new version.
CHUNK_BYTES = 512 * 2**20

_EXTENSION = "flashreinforce.engines.vllm.WeightUpdateExtension"


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:  # leading digits only: "2rc1" is 2
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def import_vllm():
    """The ``vllm`` module, checked to be recent enough; ``ImportError`` naming the fix otherwise."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    try:
        import vllm
    except ImportError as err:
        raise ImportError("--rollout.engine vllm needs vLLM: pip install 'flashreinforce[vllm]' "
                          f"(vllm>={'.'.join(map(str, MIN_VLLM_VERSION))}, a CUDA machine)") from err
    if _version_tuple(getattr(vllm, "__version__", "0")) < MIN_VLLM_VERSION:
        raise ImportError(f"vLLM {vllm.__version__} is too old: the engine needs >= "
                          f"{'.'.join(map(str, MIN_VLLM_VERSION))} for logprobs_mode='processed_logprobs'")
    return vllm


class WeightUpdateExtension:
    """Methods vLLM mixes into its GPU worker (``worker_extension_cls``); run through ``collective_rpc``.

    ``self.model_runner`` and ``self.device`` are the vLLM worker's own attributes.
    """

    def flashreinforce_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load ``(Hugging Face name, tensor)`` pairs into the running model; returns how many were given."""
        weights = [(name, t.to(self.device, non_blocking=True)) for name, t in named]
        self.model_runner.model.load_weights(weights=weights)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(weights)

    def flashreinforce_parameter_sum(self) -> float:
        """Sum of every parameter (float64), to check from outside that new weights arrived."""
        return float(sum(p.detach().double().sum() for p in self.model_runner.model.parameters()))


def _logprob_of(position, token: int) -> float:
    """The log-probability vLLM recorded for ``token`` at one output position (dict or flat form)."""
    entry = position[token]
    return float(getattr(entry, "logprob", entry))


class VLLMEngine(RolloutEngine):
    """Rollout engine on vLLM (see the module docstring).

    Args:
        model: a Hugging Face checkpoint directory, a ``transformers`` config, or a causal LM.
        version: the weight version ``model`` holds (-1: none yet; a causal LM's weights are loaded
            at construction when ``version >= 0``).
        tensor_parallel_size: GPUs of this engine (``vllm.tensor_parallel_size``).
        gpu_memory_utilization: fraction of each GPU vLLM may take (``vllm.gpu_memory_utilization``).
        dtype: vLLM's compute dtype (``auto``: the checkpoint's; the trainer passes ``fsdp.param_dtype``'s).
        seed: engine seed (requests carry their own seeds).
        max_model_len: longest context (``data.max_len``); ``None``: the model's.
        enforce_eager: no CUDA graphs (faster start, slower decode).
        enable_prefix_caching: reuse KV of shared prefixes (reset at every weight update).
        llm_kwargs: further ``vllm.LLM`` keyword arguments.
    """

    def __init__(self, model: Any, *, version: int = -1, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, dtype: str = "auto", seed: int = 0,
                 max_model_len: int | None = None, enforce_eager: bool = False, enable_prefix_caching: bool = True,
                 llm_kwargs: Mapping[str, Any] | None = None) -> None:
        vllm = import_vllm()
        self._vllm = vllm
        self._tmpdir: str | None = None
        weights = None
        if isinstance(model, (str, Path)):
            path, load_format = str(model), "auto"
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"VLLMEngine: {path} is not a Hugging Face checkpoint directory (no config.json)")
        else:
            config = getattr(model, "config", model)
            if not hasattr(config, "save_pretrained"):
                raise TypeError(f"VLLMEngine: model must be a checkpoint directory, a transformers config or a "
                                f"causal LM, got {type(model).__name__}")
            if isinstance(model, torch.nn.Module) and version >= 0:
                weights = model.state_dict()
            self._tmpdir = tempfile.mkdtemp(prefix="flashreinforce-vllm-")
            config.save_pretrained(self._tmpdir)
            path, load_format = self._tmpdir, "dummy"
        kwargs = dict(model=path, skip_tokenizer_init=True, load_format=load_format, dtype=dtype, seed=seed,
                      tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                      logprobs_mode="processed_logprobs", worker_extension_cls=_EXTENSION,
                      enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager)
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        kwargs.update(llm_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        self.dtype = self._model_dtype()
        self.version = -1 if load_format == "dummy" and weights is None else int(version)
        if weights is not None:
            self.load_weights(weights, version)

    def _model_dtype(self) -> torch.dtype | None:
        """The dtype vLLM runs the model in (weights are cast to it before sending)."""
        try:
            return self.llm.llm_engine.model_config.dtype
        except AttributeError:  # internal layout differs between vLLM releases; send float32 then
            return None

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        sent = 0
        for name, t in state_dict.items():
            t = t.detach()
            full = getattr(t, "full_tensor", None)
            if callable(full):
                t = full()
            t = t.to("cpu", dtype=self.dtype or t.dtype).contiguous()
            chunk.append((name, t))
            size += t.numel() * t.element_size()
            if size >= CHUNK_BYTES:
                sent += self._send(chunk)
                chunk, size = [], 0
        if chunk:
            sent += self._send(chunk)
        if sent == 0:
            raise ValueError("load_weights: empty state_dict")
        self.llm.reset_prefix_cache()  # no KV computed by the old weights is reused
        self.version = int(version)

    def _send(self, chunk: list[tuple[str, torch.Tensor]]) -> int:
        counts = self.llm.collective_rpc("flashreinforce_load_weights", args=(chunk,))
        return int(counts[0]) if counts else len(chunk)

    def parameter_sum(self) -> float:
        """Sum of the engine's parameters (first worker), for tests."""
        return float(self.llm.collective_rpc("flashreinforce_parameter_sum")[0])

    # ------------------------------------------------------------------ sampling
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        if not requests:
            return []
        if self.version < 0:
            raise RuntimeError("VLLMEngine.generate: no weights loaded yet (version -1); call load_weights first")
        vllm = self._vllm
        prompts, sps = [], []
        for i, r in enumerate(requests):
            if len(r.token_ids) == 0:
                raise ValueError(f"generate: requests[{i}].token_ids is empty")
            if r.max_new_tokens <= 0:
                raise ValueError(f"generate: requests[{i}].max_new_tokens must be positive, got {r.max_new_tokens}")
            prompts.append({"prompt_token_ids": [int(t) for t in r.token_ids]})
            sps.append(vllm.SamplingParams(
                n=1, temperature=float(params.temperature), top_p=float(params.top_p),
                top_k=int(params.top_k) if params.top_k > 0 else -1, max_tokens=int(r.max_new_tokens),
                seed=int(r.seed) % (2**63 - 1), logprobs=0, stop_token_ids=[int(t) for t in params.stop_token_ids],
                ignore_eos=True, detokenize=False, skip_special_tokens=False))
        outputs = self.llm.generate(prompts, sps, use_tqdm=False)
        gens = []
        stop = set(int(t) for t in params.stop_token_ids)
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            if not ids:
                raise RuntimeError(f"vLLM returned an empty generation for request {i}")
            if params.temperature == 0:
                lps = [0.0] * len(ids)
            else:
                if c.logprobs is None or len(c.logprobs) < len(ids):
                    raise RuntimeError("vLLM returned no per-token log-probabilities (logprobs=0 was requested)")
                lps = [_logprob_of(c.logprobs[k], tok) for k, tok in enumerate(ids)]
                bad = [x for x in lps if not (math.isfinite(x) and x <= 0.0)]
                if bad:
                    raise RuntimeError(f"vLLM recorded invalid sampling log-probabilities {bad[:3]}")
            reason = "stop" if ids[-1] in stop else "length"
            gens.append(Generation(ids, lps, reason, self.version))
        return gens

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:  # closing must not hide the run's outcome
                    log.exception("vLLM engine shutdown failed")
            self.llm = None
            gc.collect()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
