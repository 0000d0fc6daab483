"""The hf engine's decode step for Llama-family models on a CPU: few operations, fused packed weights.

A decode step of a small model on a CPU spends much of its time outside the matrix products:
transformers' generic forward runs about forty tensor operations per layer (norms computed in
several steps, the rotary embedding, mask building, cache bookkeeping) and three separate products
for the query, key and value projections and two for the MLP's gate and up projections, each a
skinny product a few dozen rows tall. :class:`FastDecoder` computes the same step for the layers it
knows (``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` with full attention everywhere) with about
fifteen operations per layer:

* the query, key and value weights are concatenated into one matrix, and the gate and up weights
  into another, each packed once per weight version in oneDNN's blocked layout (as
  :mod:`flashreinforce.engines.packed_linear` does for single layers), so a layer makes four
  products instead of seven;
* RMS norms are one ``F.rms_norm`` call, computed in float32 as transformers does;
* the rotary embedding of the step is computed once (by the model's own rotary module, so every
  rope type it supports is supported) and applied to queries and keys together;
* attention reads the keys and values of the engine's preallocated cache
  (:mod:`flashreinforce.engines.kv_cache`) in place, each query head grouped under its key/value
  head, by the compiled core's decode attention
  (:func:`flashreinforce.engines.decode_attention.fused_decode_attention`; ``attention="sdpa"``, or a
  dtype it does not take, uses PyTorch's ``scaled_dot_product_attention`` instead);
* the padding mask of the step is built once for all layers.

Only decode steps (one new token per request) use it; the prefill is the model's own layers
(:meth:`FastDecoder.prefill`, with the packed output projection on the last positions), and both
write the same cache. The result agrees with the model's forward to float rounding (tested
against it); the engine's recorded log-probabilities are those of the logits computed here.

:meth:`FastDecoder.build` returns ``None``, with the reason in :func:`unsupported_reason`, for any
other model, a model whose projections are not plain ``torch.nn.Linear`` (LoRA adapters, quantized
layers), a sliding-window layer, or a model not on the CPU; the engine then decodes with the
model's forward. Memory: one packed copy of every projection weight and of the output embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flashreinforce.engines.decode_attention import compiled_attention_available, fused_decode_attention
from flashreinforce.engines.packed_linear import pack_weight, packed_linear_available, packed_matmul

__all__ = ["ATTENTION_KERNELS", "SUPPORTED_MODELS", "FastDecoder", "unsupported_reason"]

#: Attention kernels of a decode step: ``auto`` (the compiled one where it takes the model's dtype),
#: ``compiled`` (an error where it does not) or ``sdpa`` (PyTorch's).
ATTENTION_KERNELS = ("auto", "compiled", "sdpa")

#: Model classes (by name) whose decode step :class:`FastDecoder` computes.
SUPPORTED_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`FastDecoder` cannot decode ``model`` (``None`` when it can)."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        return f"{name} is not one of {SUPPORTED_MODELS}"
    config = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the model has no .model.layers or .model.rotary_emb"
    weight = model.lm_head.weight
    if weight.device.type != "cpu":
        return "the model is not on the CPU"
    if not packed_linear_available(weight.dtype):
        return f"no packed oneDNN linear for {weight.dtype} weights on this build and CPU"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        return "a layer with sliding-window attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    linears = [model.lm_head]
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        linears += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    for lin in linears:
        if not isinstance(lin, torch.nn.Linear) or type(lin) is not torch.nn.Linear:
            return f"a projection of type {type(lin).__name__} (LoRA or quantized layers)"
    return None


def _cat_bias(*linears: torch.nn.Linear) -> Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else lin.weight.new_zeros(lin.out_features)
                      for b, lin in zip(biases, linears)])


@dataclass
class _Layer:
    """One decoder layer's fused weights, packed by :func:`pack_weight`, and their biases (``None``: no
    bias)."""
    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None


class FastDecoder:
    """Decode steps of ``model`` (see the module docstring); build with :meth:`build`."""

    def __init__(self, model: torch.nn.Module, rows_hint: int = 32, attention: str = "auto") -> None:
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"FastDecoder: attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
        dtype = model.lm_head.weight.dtype
        if attention == "compiled" and not compiled_attention_available(dtype):
            raise ValueError(f"FastDecoder: attention 'compiled' needs flashreinforce._C's decode attention for "
                             f"{dtype}, which this build or dtype lacks; use 'auto' or 'sdpa'")
        #: The attention kernel the steps use: ``"compiled"`` or ``"sdpa"``.
        self.attention = "compiled" if attention != "sdpa" and compiled_attention_available(dtype) else "sdpa"
        self.model = model
        self.rows_hint = int(rows_hint)
        inner = model.model
        self.inner = inner
        first = inner.layers[0].self_attn
        config = model.config
        self.head_dim = int(first.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.scaling = float(first.scaling)
        self.intermediate = int(inner.layers[0].mlp.gate_proj.out_features)
        self._layers: list[_Layer] = []
        self._lm_head: Tensor | None = None
        self._key: tuple | None = None

    @classmethod
    def build(cls, model: torch.nn.Module, rows_hint: int = 32, attention: str = "auto") -> "FastDecoder | None":
        """A decoder for ``model``, or ``None`` where :func:`unsupported_reason` gives a reason."""
        if unsupported_reason(model) is not None:
            return None
        return cls(model, rows_hint, attention)

    def _weights_key(self) -> tuple:
        """Identity and version counter of every weight used (a change means packing again)."""
        return tuple((id(p), p._version) for p in self.model.parameters())

    def refresh(self, force: bool = False) -> bool:
        """Pack the fused weights again if any weight of the model changed since (or ``force``);
        whether it did."""
        key = self._weights_key()
        if key == self._key and not force:
            return False
        layers = []
        h = self.rows_hint
        # The old copies go first, so a repack never holds two packed versions of the model at once.
        self._layers, self._lm_head = [], None
        with torch.no_grad():
            for layer in self.inner.layers:
                a, m = layer.self_attn, layer.mlp
                qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
                gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()
                layers.append(_Layer(
                    qkv=pack_weight(qkv, h), qkv_bias=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    o=pack_weight(a.o_proj.weight.detach(), h), o_bias=_cat_bias(a.o_proj),
                    gate_up=pack_weight(gate_up, h), gate_up_bias=_cat_bias(m.gate_proj, m.up_proj),
                    down=pack_weight(m.down_proj.weight.detach(), h), down_bias=_cat_bias(m.down_proj)))
            self._lm_head = pack_weight(self.model.lm_head.weight.detach(), h)
        self._lm_head_bias = _cat_bias(self.model.lm_head)
        self._layers = layers
        self._key = key
        return True

    def prefill(self, ids: Tensor, mask: Tensor, positions: Tensor, cache, cache_kw: str) -> Tensor:
        """Logits ``[b, V]`` at the last position of each row of ``ids [b, s]`` (int64; ``mask [b, L]``
        and ``positions [b, s]`` as for the model's forward), which run through the model's own layers
        and fill ``cache`` (passed as ``cache_kw``, the model's name for it).

        The output projection multiplies the last positions' hidden states, made contiguous, by its
        packed weight: the model's own head would multiply the strided slice ``[b, 1, hidden]`` that
        ``logits_to_keep`` leaves as a batched product with the weight broadcast over the batch, which
        took about 0.2 s of a 1.4 s prefill of 32 SmolLM2 prompts on 2 cores.
        """
        out = self.inner(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{cache_kw: cache})
        last = out.last_hidden_state[:, -1, :].contiguous()
        return packed_matmul(last, self._lm_head, self._lm_head_bias)

    @staticmethod
    def _rms_norm(x: Tensor, norm: torch.nn.Module) -> Tensor:
        # As transformers' RMS norm: normalized in float32, cast back, then scaled by the weight.
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
        return norm.weight * y

    def step(self, tokens: Tensor, mask: Tensor, positions: Tensor, cache) -> Tensor:
        """Logits ``[b, V]`` of one decode step.

        ``tokens [b]`` (int64): each request's newest token; ``mask [b, L]`` (0/1): which of the
        ``L`` positions (the cache's so far and this token's) each request attends to;
        ``positions [b, 1]`` (int64): the new token's position; ``cache``: the preallocated cache the
        prefill filled (its layers receive this step's keys and values). The packed weights are those
        of the last :meth:`refresh` (the engine refreshes after every weight load and before every
        generation, not at each step: the check walks every parameter).
        """
        b = tokens.shape[0]
        d, heads, kv_heads = self.head_dim, self.heads, self.kv_heads
        groups = heads // kv_heads
        x = self.inner.embed_tokens(tokens)  # [b, hidden]
        cos, sin = self.inner.rotary_emb(x[:, None, :], positions)  # [b, 1, d] each
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = d // 2
        # rotate_half(v) * sin == flip of v's halves times sin with its first half negated
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        compiled = self.attention == "compiled"
        if compiled:
            attend = mask != 0  # [b, L] bool
        else:
            additive = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(mask == 0, float("-inf"))
            additive = additive.view(b, 1, 1, -1)
        qk_width = (heads + kv_heads) * d
        for layer, w, cache_layer in zip(self.inner.layers, self._layers, cache.layers):
            h = self._rms_norm(x, layer.input_layernorm)
            qkv = packed_matmul(h, w.qkv, w.qkv_bias)
            qk = qkv[:, :qk_width].view(b, heads + kv_heads, d)
            swapped = qk.view(b, heads + kv_heads, 2, half).flip(2).view(b, heads + kv_heads, d)
            qk = torch.addcmul(qk * cos, swapped, sin_signed)
            q = qk[:, :heads].reshape(b, kv_heads, groups, d)
            k = qk[:, heads:].view(b, kv_heads, 1, d)
            v = qkv[:, qk_width:].reshape(b, kv_heads, 1, d)
            keys, values = cache_layer.update(k, v)
            if compiled:
                attn = fused_decode_attention(q, keys, values, attend, self.scaling)
            else:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=additive, scale=self.scaling)
            x = x + packed_matmul(attn.reshape(b, heads * d), w.o, w.o_bias)
            h = self._rms_norm(x, layer.post_attention_layernorm)
            gate_up = packed_matmul(h, w.gate_up, w.gate_up_bias)
            act = layer.mlp.act_fn(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
            x = x + packed_matmul(act, w.down, w.down_bias)
        x = self._rms_norm(x, self.inner.norm)
        return packed_matmul(x, self._lm_head, self._lm_head_bias)
