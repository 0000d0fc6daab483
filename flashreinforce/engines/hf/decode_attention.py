"""Decode-step attention for grouped-query models without copying the keys and values per head.

In a decode step each request has one query per attention head, and the H heads share K < H
key/value heads in groups of H / K. transformers' SDPA attention, given an attention mask (the
engine always passes one: padded prompts), repeats every key/value head H / K times before calling
``scaled_dot_product_attention`` (``repeat_kv``: a copy of the whole cache, per layer and step; newer
transformers releases avoid it, 5.17 does not). For a Qwen2.5-0.5B shape (14 query heads on 2 KV
heads) that copy writes 7x the cache at every step, several times the bytes of the weights at
batch 256.

Here the one query of each head is laid out as a *query position* of its key/value head instead:
``[b, H, 1, d]`` becomes ``[b, K, H / K, d]`` (heads are grouped key/value-head-major, as
``repeat_kv`` orders them), attention runs on the K heads directly, with the mask broadcast over
the group, and the result is laid back as ``[b, 1, H, d]``. The arithmetic is the same per query
(the same keys, values, scale and mask), only the batching of the SDPA call differs.

Everything else (prefill, models without groups, a mask with a per-head dimension, dropout,
soft-capping, attention sinks, position biases) goes to transformers' own SDPA attention unchanged.

:func:`use_decode_attention` registers :func:`decode_attention` under :data:`ATTENTION_NAME`
(with SDPA's mask function) and switches a model to it.

:func:`fused_decode_attention` is the same one-query step computed by the compiled core
(``flashreinforce._C.decode_attention``, ``csrc/cpu/decode_attention_impl.h``) on the CPU, for the
engine's own decode step (:mod:`flashreinforce.engines.hf.fast_decode`): each request's keys and values
are read once, straight from the cache's buffers, with every query head of a group scored against a
key row while it is in cache. In a real decode step of 32 SmolLM2 requests PyTorch's SDPA kernel,
built for longer query blocks, took about 0.6 ms a layer (a fifth of the step) and this one about
0.5 ms, the rate at which PyTorch itself reads the same per-request slices from memory; the gain is
larger in bfloat16 and at long contexts (``docs/performance.md``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flashreinforce.compiled import compiled_has

__all__ = ["ATTENTION_NAME", "FUSED_DTYPES", "compiled_attention_available", "decode_attention",
           "fused_decode_attention", "use_decode_attention"]

#: Dtypes :func:`fused_decode_attention` takes.
FUSED_DTYPES = (torch.float32, torch.bfloat16)

#: The name under which :func:`decode_attention` is registered with transformers.
ATTENTION_NAME = "grouped_decode_sdpa"

# Keyword arguments whose presence means transformers' SDPA path must handle the call.
_DELEGATED = ("softcap", "s_aux", "sinks", "position_bias")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def decode_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query [b, H, q, d]``, ``key``/``value
    [b, K, L, d]``, ``attention_mask`` None or ``[b, 1, q, L]`` (bool or additive); returns
    ``([b, q, H, d], None)``. One-query steps of grouped heads are computed per key/value head
    (module docstring); every other call is transformers' SDPA attention."""
    b, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads if kv_heads else 0
    if (q_len != 1 or groups <= 1 or heads != groups * kv_heads or dropout
            or any(kwargs.get(name) is not None for name in _DELEGATED)
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)
    grouped = query.reshape(b, kv_heads, groups, head_dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                         is_causal=False, scale=scaling)
    return out.reshape(b, heads, 1, head_dim).transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=None)
def _register() -> None:
    """Registers :func:`decode_attention` with transformers (once; a failed import is retried)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_decode_attention(model: torch.nn.Module) -> bool:
    """Switches ``model`` (a transformers model using SDPA attention) to :func:`decode_attention`;
    returns whether it did (a model on another attention implementation is left as it is)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        _register()
        model.set_attn_implementation(ATTENTION_NAME)
    except (ImportError, AttributeError, ValueError):  # a transformers without the attention interface
        return False
    return config._attn_implementation == ATTENTION_NAME


def compiled_attention_available(dtype: torch.dtype) -> bool:
    """Whether :func:`fused_decode_attention` takes ``dtype`` with the installed compiled module."""
    return dtype in FUSED_DTYPES and compiled_has("decode_attention")


def _check_fused(query: Tensor, keys: Tensor, values: Tensor, attend: Tensor) -> None:
    """Raises ``ValueError`` naming the argument unless the four tensors fit :func:`fused_decode_attention`."""
    if query.dim() != 4 or keys.dim() != 4 or values.dim() != 4:
        raise ValueError(f"fused_decode_attention: query, keys and values must be 4-D, got {query.dim()}, "
                         f"{keys.dim()} and {values.dim()} dimensions")
    b, kv_heads, groups, head_dim = query.shape
    if keys.shape != values.shape or keys.shape[0] != b or keys.shape[1] != kv_heads or keys.shape[3] != head_dim:
        raise ValueError(f"fused_decode_attention: keys {tuple(keys.shape)} and values {tuple(values.shape)} must "
                         f"both be [batch, kv_heads, length, head_dim] = [{b}, {kv_heads}, length, {head_dim}]")
    if keys.shape[2] < 1:
        raise ValueError("fused_decode_attention: keys hold no position (length 0)")
    if tuple(attend.shape) != (b, keys.shape[2]) or attend.dtype != torch.bool:
        raise ValueError(f"fused_decode_attention: attend must be a bool [batch, length] = [{b}, {keys.shape[2]}] "
                         f"tensor, got {attend.dtype} {tuple(attend.shape)}")
    for name, t in (("query", query), ("keys", keys), ("values", values), ("attend", attend)):
        if t.device.type != "cpu":
            raise ValueError(f"fused_decode_attention: {name} is on {t.device}; the kernel runs on the CPU")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"fused_decode_attention: {name} must be contiguous in its last dimension "
                             f"(stride {t.stride(-1)})")
    if query.dtype not in FUSED_DTYPES or keys.dtype != query.dtype or values.dtype != query.dtype:
        raise ValueError(f"fused_decode_attention: query, keys and values must share one dtype of "
                         f"{[str(d) for d in FUSED_DTYPES]}, got {query.dtype}, {keys.dtype}, {values.dtype}")


def fused_decode_attention(query: Tensor, keys: Tensor, values: Tensor, attend: Tensor, scale: float) -> Tensor:
    """One decode step's attention on the CPU by the compiled core.

    ``query [b, K, G, d]``: the step's query of head ``h * G + g`` at ``[:, h, g]`` (the grouped layout
    of :func:`decode_attention`); ``keys``/``values [b, K, L, d]``: the cache's first ``L`` positions
    (views of its buffers are read in place: any strides with the last dimension contiguous);
    ``attend [b, L]`` (bool): which positions each request attends to; ``scale``: the score scale
    (``1/sqrt(d)`` for most models). float32 or bfloat16, one dtype for all three; scores, softmax and
    sums in float32. Returns ``[b, K, G, d]`` (contiguous, the query's dtype): what
    ``F.scaled_dot_product_attention(query, keys, values, attn_mask=attend[:, None, None, :],
    scale=scale)`` computes, to float rounding, except that a request with no attended position gets
    zeros instead of NaN. Raises ``ValueError`` naming the argument for anything else.
    """
    _check_fused(query, keys, values, attend)
    b, kv_heads, groups, head_dim = query.shape
    out = torch.empty((b, kv_heads, groups, head_dim), dtype=query.dtype)
    if b == 0:
        return out
    from flashreinforce import _C

    _C.decode_attention({
        "dtype": str(query.dtype).removeprefix("torch."), "batch": b, "kv_heads": kv_heads, "groups": groups,
        "head_dim": head_dim, "length": keys.shape[2], "scale": float(scale),
        "num_threads": torch.get_num_threads(),
        "q": query.data_ptr(), "q_strides": tuple(query.stride()[:3]),
        "k": keys.data_ptr(), "k_strides": tuple(keys.stride()[:3]),
        "v": values.data_ptr(), "v_strides": tuple(values.stride()[:3]),
        "mask": attend.data_ptr(), "mask_stride_batch": attend.stride(0), "out": out.data_ptr()})
    return out
