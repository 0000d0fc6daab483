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
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ATTENTION_NAME", "decode_attention", "use_decode_attention"]

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
