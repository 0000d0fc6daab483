"""A local rollout engine on a Hugging Face causal LM (CPU or GPU), with a KV cache.

Requests of one :meth:`HFEngine.generate` call are sampled together (one forward per new token);
a request that has finished (a stop token, its stop rule or its token limit) leaves the batch and
its rows of the KV cache, so the others' steps do not compute it any longer.
Sampling stays on the model's device (:func:`sample_tokens`: inverse CDF of the processed
distribution); the only per-step transfer to the host is each request's token and its
log-probability. The uniform numbers it inverts come from each request's own generator, seeded by
``request.seed`` and drawn once per call (``max_new_tokens`` of them), so a continuation does not
depend on which other requests share its batch (up to float rounding), on a CPU or a GPU alike. The
recorded log-probability of a sampled token is taken from the processed distribution it was drawn
from (see :func:`sampling_log_probs`), never recomputed.

Shared prompt prefix: requests of one call usually start with the same tokens (a chat template's
system prompt and instruction; for a group of samples, the whole prompt). The longest common
prefix, when it has at least ``min_shared_prefix`` tokens, is run once with batch 1 and its KV
cache repeated for every request; the rest of each prompt follows with padding between prefix and
suffix (masked, positions counted without it). On a CPU, where the prefill is compute-bound, this
removes most of the prompt work: for the arith preset (prompts of ~47 tokens, 35 shared) the
prefill of 32 requests does about a third of the work. The prefix's keys and values are kept for the
next call: where its shared prefix starts with the same tokens and no weight changed since (a new
version, or any parameter written in place), those positions are copied instead of computed
(``prefix_tokens_reused``); a stream of small calls (``rollout.episodes_in_flight``) then runs its
system prompt once per weight version instead of once per call. A finished request's context (prompt
and sampled tokens but the last) is kept as well, for the next turn of its conversation
(:mod:`flashreinforce.engines.hf.turn_cache`, ``turn_cache_mb``): that turn computes only its new tokens.

KV cache: by default (``kv_cache="preallocated"``) every full-attention layer's keys and values live
in buffers sized once per call for its longest request (:mod:`flashreinforce.engines.hf.kv_cache`), so
a decode step writes its own token instead of copying the cache so far, as transformers'
``DynamicCache`` does by concatenation; ``"dynamic"`` keeps transformers' cache.

Linear layers on a CPU: where the decode steps are the model's forward (below), by default
(``linear_kernel="auto"``) every ``torch.nn.Linear`` of an engine on the CPU multiplies by a copy of
its weight packed once per version in oneDNN's blocked layout
(:mod:`flashreinforce.engines.hf.packed_linear`), instead of ``F.linear`` reorganizing the weight at
every call; ``"torch"`` keeps ``F.linear``. A GPU engine always uses ``F.linear``.

Decode steps of Llama-family models on a CPU (``fast_decode=True``, the default) are computed by
:class:`flashreinforce.engines.hf.fast_decode.FastDecoder`: fused, packed projection weights and about
fifteen operations per layer instead of the model's generic forward (the prefill stays the model's
own), with the compiled core's decode attention reading the cache in place
(``attention_kernel``); ``fast_decode_in_use`` says whether it runs (other models, LoRA adapters and
GPU engines use the model's forward).

Decode attention: a model on SDPA attention is switched to
:func:`flashreinforce.engines.hf.decode_attention.decode_attention` (``decode_attention=True``, the
default), which computes a decode step of grouped-query heads on the key/value heads themselves
instead of repeating the cache per query head first.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, fields
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from flashreinforce.engines.base import Generation, GenerationRequest, RolloutEngine, SamplingParams
from flashreinforce.dtypes import DTYPE_NAMES, torch_dtype
from flashreinforce.engines.hf.decode_attention import use_decode_attention
from flashreinforce.engines.hf.fast_decode import ATTENTION_KERNELS, FastDecoder
from flashreinforce.engines.hf.kv_cache import dynamic_cache, preallocated_cache, reusable_layers, weights_key
from flashreinforce.engines.hf.packed_linear import PRODUCT_KERNELS, pack_linears, refresh_packed
from flashreinforce.engines.hf.turn_cache import TurnCache, context_states, continued_prefill
from flashreinforce.engines.registry import ENGINE_REGISTRY, EngineKind, EngineRun, register_engine

__all__ = ["HF_ENGINE", "KV_CACHES", "LINEAR_KERNELS", "HFEngine", "HFEngineKind", "HFOptions", "SamplingWorkspace",
           "sample_tokens", "sampling_log_probs"]

#: The KV caches :class:`HFEngine` can use (see the module docstring).
KV_CACHES = ("preallocated", "dynamic")
#: The linear-layer kernels :class:`HFEngine` can use (see the module docstring).
LINEAR_KERNELS = ("auto", "packed", "torch")


def sampling_log_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Log-probabilities ``[b, V]`` (float32) of the distribution sampled from, given raw ``logits [b, V]``.

    Order as in Hugging Face's warpers: temperature, then top-k (keep the k largest logits), then
    top-p (sort by probability, descending; keep a token while the mass of the tokens before it is
    below ``top_p``, so the first is always kept), renormalized; removed tokens get ``-inf``.
    ``temperature == 0`` is greedy: log-probability 0 on the argmax (first on ties), ``-inf`` elsewhere.
    """
    logits = logits.float()
    if params.temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 0.0)
        return out
    scores = logits / params.temperature if params.temperature != 1 else logits
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(scores, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before >= params.top_p
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


class SamplingWorkspace:
    """Buffers of :func:`sample_tokens` for one generate call: the probabilities ``[rows, V]`` in the
    log-probabilities' dtype and their float64 CDF, allocated at the first step and reused (as views
    of their first rows) while the batch shrinks.

    On a CPU the two are fresh allocations of several MiB at every step without it (a SmolLM2 step at
    32 requests: 6 and 12 MiB), and the allocator hands such blocks back to the system and faults
    them in again, which cost about as much as the arithmetic: sampling took 12-14 ms of a 150-165 ms
    decode step, against 3-5 ms with the buffers reused (``docs/performance.md``).
    """

    def __init__(self) -> None:
        self._probs: Tensor | None = None
        self._cdf: Tensor | None = None

    def buffers(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """``(probs, cdf)`` views shaped like ``like [b, V]`` (its dtype and float64, its device)."""
        b, v = like.shape
        p = self._probs
        if p is None or p.shape[0] < b or p.shape[1] != v or p.dtype != like.dtype or p.device != like.device:
            self._probs = torch.empty((b, v), dtype=like.dtype, device=like.device)
            self._cdf = torch.empty((b, v), dtype=torch.float64, device=like.device)
        return self._probs[:b], self._cdf[:b]


def sample_tokens(log_probs: Tensor, uniforms: Tensor, workspace: SamplingWorkspace | None = None) -> Tensor:
    """One token per row ``[b]`` (int64) drawn from ``log_probs [b, V]`` by inverting its CDF at
    ``uniforms [b]`` (float64 in [0, 1), on the same device).

    The probabilities are exponentiated in the log-probabilities' dtype (float32: vectorized, where
    float64's exponential costs several times more at a vocabulary's width) and accumulated in float64,
    left to right. A token of probability 0 is never drawn: the chosen index is the first whose
    cumulative mass exceeds ``u`` times the row's total, kept strictly below the total. ``workspace``
    (one per generate call) holds the two ``[b, V]`` buffers between steps; the tokens are the same
    with or without it.
    """
    if workspace is None:
        cdf = log_probs.exp().double().cumsum_(dim=-1)
    else:
        probs, cdf = workspace.buffers(log_probs)
        torch.exp(log_probs, out=probs)
        cdf.copy_(probs).cumsum_(dim=-1)
    total = cdf[:, -1]
    x = torch.minimum(uniforms.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, x[:, None].contiguous(), right=True)[:, 0]
    return index.clamp_(max=log_probs.shape[-1] - 1)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _same_storage(own: Tensor | None, new: Tensor) -> bool:
    """Whether ``own`` (an engine weight) already is ``new``'s memory: same place, dtype, shape and strides."""
    return (own is not None and own.device == new.device and own.dtype == new.dtype and own.shape == new.shape
            and own.stride() == new.stride() and own.data_ptr() == new.data_ptr())


class HFEngine(RolloutEngine):
    """Rollout engine around ``model`` (a ``transformers`` causal LM), used in inference mode.

    Args:
        model: the engine's own copy of the policy (weights are replaced by :meth:`load_weights`),
            with a config object of its own: the engine may switch its attention implementation.
        pad_token_id: id used for padding (never attended to).
        version: the version of the weights ``model`` holds now.
        min_shared_prefix: run a common prompt prefix of at least this many tokens once per call
            (0: never; see the module docstring).
        dtype: the engine's weights: ``"float32"``, ``"bfloat16"``, ``"float16"``, or ``"auto"``
            (``auto_dtype`` when ``model`` is on a CUDA device, float32 elsewhere); ``None`` keeps
            ``model`` as it is. Loaded weights are cast to it.
        kv_cache: ``"preallocated"`` (buffers sized once per call) or ``"dynamic"`` (transformers'
            ``DynamicCache``, grown by concatenation); see the module docstring. Where the installed
            transformers cannot take the preallocated layers, the dynamic cache is used and
            ``kv_cache_in_use`` says so.
        decode_attention: switch a model on SDPA attention to the grouped decode attention (see the
            module docstring); ``decode_attention_in_use`` says whether it was.
        linear_kernel: ``"auto"`` (packed weights on a CPU where this PyTorch has oneDNN and the
            decode steps are not :class:`FastDecoder`'s, which packs its own; else ``F.linear``),
            ``"packed"`` (packed weights for every forward, an error where unavailable) or ``"torch"``
            (``F.linear``); see the module docstring. ``linear_kernel_in_use`` says which one runs.
        fast_decode: compute decode steps with :class:`FastDecoder` where it supports the model
            (see the module docstring).
        attention_kernel: the attention of :class:`FastDecoder`'s steps: ``"auto"`` (the compiled
            core's decode attention where it takes the dtype, else PyTorch's SDPA), ``"compiled"`` or
            ``"sdpa"``; ``attention_kernel_in_use`` says which one runs (``None`` without the fast
            decode step).
        decode_glue: with the compiled attention, also run the small operations between the fast decode
            step's products in the compiled core (:class:`FastDecoder`'s ``glue``); ``False`` keeps them
            PyTorch's. ``decode_glue_in_use`` says whether they run.
        product_kernel: the matrix products of :class:`FastDecoder`'s steps: ``"auto"`` (the compiled
            core's skinny product where this build and CPU have it for the dtype, else oneDNN's),
            ``"compiled"`` or ``"onednn"``; ``product_kernel_in_use`` says which one runs (``None``
            without the fast decode step).
        turn_cache_mb: keep finished turns' keys and values, up to this many MiB, for the next turn of
            the same conversation (:mod:`flashreinforce.engines.hf.turn_cache`; dropped at any weight
            change); 0: off. Needs the preallocated cache.
    """

    can_pause = True
    #: Decode steps between two questions to ``should_pause`` (a cheap call, but not free).
    pause_check_steps = 8

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int = 0, version: int = -1,
                 min_shared_prefix: int = 8, dtype: str | None = None, auto_dtype: str = "float32",
                 kv_cache: str = "preallocated", decode_attention: bool = True,
                 linear_kernel: str = "auto", fast_decode: bool = True, attention_kernel: str = "auto",
                 decode_glue: bool = True, product_kernel: str = "auto",
                 lora: Mapping[str, Any] | None = None, turn_cache_mb: int = 512) -> None:
        if kv_cache not in KV_CACHES:
            raise ValueError(f"HFEngine: kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
        if linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"HFEngine: linear_kernel must be one of {LINEAR_KERNELS}, got {linear_kernel!r}")
        if attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"HFEngine: attention_kernel must be one of {ATTENTION_KERNELS}, got {attention_kernel!r}")
        if product_kernel not in PRODUCT_KERNELS:
            raise ValueError(f"HFEngine: product_kernel must be one of {PRODUCT_KERNELS}, got {product_kernel!r}")
        self.kv_cache = kv_cache
        #: The cache the last generate call used (``"dynamic"`` where preallocation was unavailable).
        self.kv_cache_in_use: str | None = None
        self.min_shared_prefix = int(min_shared_prefix)
        device = next(model.parameters()).device
        if lora:  # the policy trains LoRA adapters: the engine holds the same layers and loads adapters only
            from flashreinforce.models.lora import LoraSettings, apply_lora, has_lora

            if not has_lora(model):
                apply_lora(model, LoraSettings(**dict(lora)))
        if dtype is not None:
            name = (auto_dtype if device.type == "cuda" else "float32") if dtype == "auto" else dtype
            if name not in DTYPE_NAMES:
                raise ValueError(f"HFEngine: dtype must be one of {sorted(DTYPE_NAMES)} or 'auto', got {name!r}")
            model = model.to(torch_dtype(name))
        self.model = model.eval()
        self.decode_attention_in_use = bool(decode_attention) and use_decode_attention(self.model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._fast = (FastDecoder.build(self.model, attention=attention_kernel, glue=decode_glue,
                                        products=product_kernel)
                      if fast_decode and kv_cache == "preallocated" else None)
        self.fast_decode_in_use = self._fast is not None
        self.attention_kernel_in_use = self._fast.attention if self._fast is not None else None
        self.decode_glue_in_use = self._fast is not None and self._fast.glue
        self.product_kernel_in_use = self._fast.products if self._fast is not None else None
        if self._fast is not None:
            # Packed twice: the second repack's memory comes from pages the process already holds
            # afterwards, where the first weight load would otherwise pay for fresh ones (1.6 s instead
            # of 0.3 s for SmolLM2-135M in float32 on 2 cores); the engine's start pays it instead.
            self._fast.refresh()
            self._fast.refresh(force=True)
        self.linear_kernel_in_use = "torch"
        wants_packed = linear_kernel == "packed" or (linear_kernel == "auto" and self._fast is None)
        if wants_packed and device.type == "cpu":
            if pack_linears(self.model):
                self.linear_kernel_in_use = "packed"
                refresh_packed(self.model)
            elif linear_kernel == "packed":
                raise ValueError("HFEngine: linear_kernel 'packed' needs PyTorch's oneDNN linear ops on the CPU, "
                                 "which this build lacks; use linear_kernel 'auto' or 'torch'")
        self.pad_token_id = int(pad_token_id)
        self.version = int(version)
        # The tensor objects of the last loads, by name (weak: an old version is not kept alive).
        self._loaded: dict[str, weakref.ref] = {}
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.device = next(model.parameters()).device
        #: The last call's shared prefix: (tokens, weights key, per-layer (keys, values) [1, kv_heads, n, d]).
        self._prefix_kv: tuple[list[int], tuple, list[tuple[Tensor, Tensor]]] | None = None
        #: Prefix positions whose keys and values were copied from an earlier call instead of computed.
        self.prefix_tokens_reused = 0
        if not (isinstance(turn_cache_mb, int) and turn_cache_mb >= 0):
            raise ValueError(f"HFEngine: turn_cache_mb must be an integer >= 0, got {turn_cache_mb!r}")
        probe = preallocated_cache(self.model, 1) if kv_cache == "preallocated" else None
        adoptable = probe is not None and reusable_layers(probe)  # every layer preallocated: adopt()
        #: Finished turns' keys and values for the next turn (None: off, or the cache cannot take them).
        self._turns = TurnCache(turn_cache_mb << 20) if turn_cache_mb and adoptable else None

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy the tensors of ``state_dict`` that are not the objects this engine loaded last (a tensor
        published again unchanged, such as a frozen base weight under LoRA, is skipped); the first load
        must hold every weight (a tied output projection may be absent)."""
        t0 = time.perf_counter()
        changed = {k: v for k, v in state_dict.items() if _loaded_object(self._loaded, k) is not v}
        # A tensor whose storage this engine's weight already is (a frozen base weight shared with the
        # learner's model, learning.Learner.full_model) is never copied onto itself: the learner may be
        # reading it (its autograd would see the in-place write).
        own = self.model.state_dict(keep_vars=True)
        copy = {k: v for k, v in changed.items() if not _same_storage(own.get(k), v)}
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(copy, strict=False)
        missing = [k for k in missing if k not in changed]  # those it already holds are not missing
        # Tied output embeddings may be absent from a state dict; anything else is an error. (The tied
        # names once per load: under LoRA most names are missing from an adapters-only load, and
        # walking the parameters once per missing name took about a second.)
        tied = self._tied_keys() if missing else set()
        missing = [k for k in missing if k not in tied and k not in self._loaded]
        if missing or unexpected:
            raise ValueError(f"load_weights: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
        if self.linear_kernel_in_use == "packed":  # the changed weights' packed copies, counted in the load
            refresh_packed(self.model)
        if self._fast is not None:
            self._fast.refresh()
        self._loaded.update({k: weakref.ref(v) for k, v in changed.items()})
        self.version = int(version)
        nbytes = sum(v.numel() * v.element_size() for v in copy.values())
        self.last_load = (time.perf_counter() - t0, int(nbytes))

    def holds(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Record the tensor objects of ``state_dict`` as loaded when ``version`` is the engine's own (it was
        built from a copy of that version): a later load sends only the tensors published anew since."""
        if int(version) == self.version:
            self._loaded.update({k: weakref.ref(v) for k, v in state_dict.items()})

    def _tied_keys(self) -> set[str]:
        if getattr(self.model.config, "tie_word_embeddings", False):
            return {n for n, _ in self.model.named_parameters(remove_duplicate=False) if n.startswith("lm_head")}
        return set()

    def _shared_prefix(self, prompts: list[list[int]]) -> int:
        """Tokens at the start of every prompt to run once (0 when fewer than ``min_shared_prefix``).

        At least one token of every prompt is left out of it, so each request has a suffix whose
        last position gives its first logits.
        """
        if self.min_shared_prefix <= 0 or len(prompts) < 2:
            return 0
        first = prompts[0]
        n = min(len(p) for p in prompts) - 1
        for p in prompts[1:]:
            n = min(n, _common_length(first, p))
            if n < self.min_shared_prefix:
                return 0
        return n

    def _prefill(self, prompts: list[list[int]], steps: int, weights: tuple, fast: FastDecoder | None):
        """A new cache for ``prompts`` and ``steps`` new tokens, their prefill run (the shared prefix once):
        ``(cache, mask [b, context], logits [b, V])``."""
        b = len(prompts)
        shared = self._shared_prefix(prompts)
        lengths = [len(p) - shared for p in prompts]
        width = max(lengths)
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        for i, p in enumerate(prompts):
            ids[i, width - lengths[i]:] = torch.as_tensor(p[shared:], dtype=torch.long)
            mask[i, shared + width - lengths[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Positions count real tokens only, so padding between the prefix and a suffix is invisible.
        pos = ((mask.cumsum(-1) - 1).clamp(min=0))[:, shared:]
        cache = preallocated_cache(self.model, shared + width + steps) if self.kv_cache == "preallocated" else None
        self.kv_cache_in_use = "dynamic" if cache is None else "preallocated"
        if cache is None:
            cache, fast = dynamic_cache(self.model), None
        if shared:
            self._prefill_prefix(prompts[0][:shared], cache, fast, weights)
            cache.batch_repeat_interleave(b)
        return cache, mask, self._forward(ids, mask, pos, cache, fast)

    def _continued_prefill(self, prompts: list[list[int]], found: list, steps: int, weights: tuple,
                           fast: FastDecoder | None):
        """As :meth:`_prefill`, where some requests go on from kept states (``found[i]``: ``(positions, states)``
        from the turn cache); the others start from the last shared prefix where they begin with enough of it."""
        reused, states = [r for r, _ in found], [st for _, st in found]
        saved = self._prefix_kv
        if saved is not None and saved[1] == weights:
            for i, p in enumerate(prompts):
                n = min(_common_length(saved[0], p), len(p) - 1)
                if not reused[i] and n >= max(1, self.min_shared_prefix):
                    reused[i], states[i] = n, [(k[0], v[0]) for k, v in saved[2]]
        width = max(len(p) - r for p, r in zip(prompts, reused))
        cache = preallocated_cache(self.model, max(reused) + width + steps)
        self.kv_cache_in_use = "preallocated"
        laid = continued_prefill(prompts, reused, states, cache.layers, max(reused) + width + steps,
                                 self.pad_token_id, self.device)
        return cache, laid.mask, self._forward(laid.ids, laid.mask, laid.positions, cache, fast)

    def _prefill_prefix(self, tokens: list[int], cache, fast: FastDecoder | None, weights: tuple) -> None:
        """The shared prefix ``tokens`` into ``cache`` (batch 1): its keys and values copied from the last
        call's prefix where that one starts with the same tokens and every weight is unchanged since
        (identity and version counter of every parameter; keys and values of a position depend only on
        the tokens up to it), the rest computed: the same prefix again gets the very numbers it got before.
        ``prefix_tokens_reused`` counts the positions copied."""
        n = len(tokens)
        layers = getattr(cache, "layers", None)
        reusable = reusable_layers(cache)
        saved = self._prefix_kv if reusable else None
        done = 0
        if saved is not None and saved[1] == weights and len(saved[2]) == len(layers):
            done = _common_length(saved[0], tokens)
            if done > 0:
                for layer, (k, v) in zip(layers, saved[2]):
                    layer.update(k[:, :, :done], v[:, :, :done])
                self.prefix_tokens_reused += done
        if done == n:  # the same prefix (its output is never read): nothing to compute or save
            return
        ids = torch.as_tensor(tokens[done:], dtype=torch.long, device=self.device).view(1, n - done)
        mask = torch.ones((1, n), dtype=torch.long, device=self.device)
        positions = torch.arange(done, n, dtype=torch.long, device=self.device).view(1, n - done)
        self._forward(ids, mask, positions, cache, fast)
        if reusable:
            self._prefix_kv = (list(tokens), weights, [(layer.keys.clone(), layer.values.clone()) for layer in layers])

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache, fast: FastDecoder | None = None) -> Tensor:
        if fast is not None:
            return fast.prefill(ids, mask, pos, cache, self._cache_kw)
        kwargs = {self._cache_kw: cache, "use_cache": True, "attention_mask": mask, "position_ids": pos}
        if self._keep_kw:
            kwargs[self._keep_kw] = 1
        return self.model(input_ids=ids, **kwargs).logits[:, -1, :]

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams, *,
                 should_pause: Callable[[], bool] | None = None) -> list[Generation]:
        if not requests:
            return []
        for i, r in enumerate(requests):
            if len(r.token_ids) == 0:
                raise ValueError(f"generate: requests[{i}].token_ids is empty")
            if r.max_new_tokens <= 0:
                raise ValueError(f"generate: requests[{i}].max_new_tokens must be positive, got {r.max_new_tokens}")
        b = len(requests)
        prompts = [list(r.token_ids) for r in requests]
        limits = [r.max_new_tokens for r in requests]
        steps = max(limits)
        # Each request's uniforms, from its own generator: independent of the batch it shares.
        uniforms = torch.zeros((b, steps), dtype=torch.float64)
        for i, r in enumerate(requests):
            gen = torch.Generator().manual_seed(int(r.seed) & 0xFFFF_FFFF_FFFF_FFFF)
            uniforms[i, :limits[i]] = torch.rand(limits[i], generator=gen, dtype=torch.float64)
        uniforms = uniforms.to(self.device)
        stop = set(int(s) for s in params.stop_token_ids)
        out_ids: list[list[int]] = [[] for _ in requests]
        out_lp: list[list[float]] = [[] for _ in requests]
        reasons: list[str | None] = [None] * b
        fast = self._fast if self.kv_cache == "preallocated" else None
        weights = weights_key(self.model)
        if fast is not None:  # weights changed in place outside load_weights are packed again here
            fast.refresh(key=weights)
        turns = self._turns
        found = [(0, None)] * b
        if turns is not None:
            turns.check_weights(weights)
            found = [turns.take(p) for p in prompts]
        if any(r for r, _ in found):  # some requests go on from kept states: the rest of their prompts only
            cache, mask, logits = self._continued_prefill(prompts, found, steps, weights, fast)
        else:
            cache, mask, logits = self._prefill(prompts, steps, weights, fast)
        if self.kv_cache_in_use != "preallocated":  # the fast step needs the preallocated cache
            fast = None
        # The attention mask of every step, allocated once: step t attends to the first context + t columns.
        context = mask.shape[1]
        full_mask = torch.ones((b, context + steps), dtype=torch.long, device=self.device)
        full_mask[:, :context] = mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        live = list(range(b))  # the request of each row of the running batch
        workspace = SamplingWorkspace()
        for step in range(steps):
            logp = sampling_log_probs(logits, params)
            tokens = sample_tokens(logp, uniforms[:, step], workspace)
            chosen = logp.gather(1, tokens[:, None])[:, 0]
            # One transfer per step: the tokens (exact in float64) and their log-probabilities.
            host_tokens, host_lp = torch.stack([tokens.double(), chosen.double()]).cpu().tolist()
            for row, i in enumerate(live):
                tok = int(host_tokens[row])
                out_ids[i].append(tok)
                out_lp[i].append(host_lp[row])
                if tok in stop or (requests[i].stop is not None and requests[i].stop(out_ids[i])):
                    reasons[i] = "stop"
                elif len(out_ids[i]) >= limits[i]:
                    reasons[i] = "length"
            keep = [row for row, i in enumerate(live) if reasons[i] is None]
            if keep and should_pause is not None and (step + 1) % self.pause_check_steps == 0 and should_pause():
                for row in keep:
                    reasons[live[row]] = "paused"
                keep = []
            if turns is not None and len(keep) < len(live):  # the contexts of the turns that ended, kept
                for row in (row for row, i in enumerate(live) if reasons[i] is not None):
                    fed = prompts[live[row]] + out_ids[live[row]][:-1]  # the last token was never fed
                    columns = full_mask[row, :context + step].nonzero().view(-1)
                    if columns.numel() == len(fed):
                        turns.put(fed, context_states(cache.layers, row, columns))
            if not keep:
                break
            if len(keep) < len(live):  # finished requests leave the batch (and its KV cache)
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                cache.batch_select_indices(index)
                full_mask, pos, uniforms = full_mask[index], pos[index], uniforms[index]
                live = [live[row] for row in keep]
                tokens = tokens[index]
            pos = pos[:, -1:] + 1
            # The sampled tokens are fed back from the device (no host-to-device copy per step).
            if fast is not None:
                logits = fast.step(tokens, full_mask[:, :context + step + 1], pos, cache)
            else:
                logits = self._forward(tokens.view(len(live), 1), full_mask[:, :context + step + 1], pos, cache)
        return [Generation(out_ids[i], out_lp[i], reasons[i] or "length", self.version) for i in range(b)]


def _loaded_object(loaded: Mapping[str, weakref.ref], name: str):
    """The tensor last loaded under ``name`` if it is still alive, else ``None``."""
    ref = loaded.get(name)
    return ref() if ref is not None else None


@dataclass(frozen=True)
class HFOptions:
    """The ``hf`` engine's options: :class:`HFEngine`'s arguments of the same names, with its
    defaults (python_tests/engines/test_engine_registry.py holds them equal)."""

    dtype: str | None = None
    auto_dtype: str = "float32"
    lora: Mapping[str, Any] | None = None
    linear_kernel: str = "auto"
    fast_decode: bool = True
    attention_kernel: str = "auto"
    decode_glue: bool = True
    product_kernel: str = "auto"
    turn_cache_mb: int = 512


@register_engine
class HFEngineKind(EngineKind):
    """``--rollout.engine hf``: an :class:`HFEngine` on a copy of the policy, in the worker's process,
    with :class:`HFOptions` (a run sets ``dtype``, the engines' weight dtype)."""

    name = "hf"
    takes_policy_copy = True
    options_type = HFOptions

    def options(self, run: EngineRun) -> HFOptions:
        return HFOptions(dtype=run.dtype)

    def create(self, model, *, pad_token_id: int, version: int, options: HFOptions) -> HFEngine:
        return HFEngine(model, pad_token_id=pad_token_id, version=version, **_fields_of(options))


def _fields_of(options) -> dict[str, Any]:
    """An options dataclass's fields as keyword arguments (not deep-copied, unlike ``asdict``)."""
    return {f.name: getattr(options, f.name) for f in fields(options)}


HF_ENGINE = ENGINE_REGISTRY["hf"]
