"""The hf engine's decode step for Llama-family models on a CPU: few operations, fused packed weights.

A decode step of a small model on a CPU spends much of its time outside the matrix products:
transformers' generic forward runs about forty tensor operations per layer (norms computed in
several steps, the rotary embedding, mask building, cache bookkeeping) and three separate products
for the query, key and value projections and two for the MLP's gate and up projections, each a
skinny product a few dozen rows tall. :class:`FastDecoder` computes the same step for the layers it
knows (``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` with full attention everywhere) with about
fifteen operations per layer:

* the query, key and value weights are concatenated into one matrix, and the gate and up weights
  into another, each packed once per weight version (``products``: the compiled core's skinny
  product where this build and CPU have it, else oneDNN's blocked layout as
  :mod:`flashreinforce.engines.hf.packed_linear` uses for single layers), so a layer makes four
  products instead of seven;
* RMS norms are one ``F.rms_norm`` call, computed in float32 as transformers does;
* the rotary embedding of the step is computed once (by the model's own rotary module, so every
  rope type it supports is supported) and applied to queries and keys together;
* attention reads the keys and values of the engine's preallocated cache
  (:mod:`flashreinforce.engines.hf.kv_cache`) in place, each query head grouped under its key/value
  head, by the compiled core's decode attention
  (:func:`flashreinforce.engines.hf.decode_attention.fused_decode_attention`; ``attention="sdpa"``, or a
  dtype it does not take, uses PyTorch's ``scaled_dot_product_attention`` instead);
* the padding mask of the step is built once for all layers;
* with the compiled attention, the small operations between the products are the compiled core's too
  (``glue``, :func:`compiled_glue_available`; ``csrc/flashreinforce/decode_step.h``): the residual
  update and RMS norm in one call, the rotary embedding of queries and keys written straight into
  the query buffer and the cache's next slot, and the SwiGLU activation: four calls and four products
  per layer instead of about fifteen PyTorch operations (float32 arithmetic, each result rounded once
  to the model's dtype, where PyTorch rounds after each operation).

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

from flashreinforce.compiled import compiled_has
from flashreinforce.engines.hf.decode_attention import compiled_attention_available, fused_decode_attention
from flashreinforce.engines.hf.kv_cache import weights_key
from flashreinforce.engines.hf.packed_linear import (PackedWeight, compiled_products_available, pack_weight,
                                                     packed_linear_available, packed_matmul, resolve_product_kernel)

__all__ = ["ATTENTION_KERNELS", "SUPPORTED_MODELS", "FastDecoder", "compiled_glue_available", "unsupported_reason"]

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
    if not packed_linear_available(weight.dtype) and not compiled_products_available(weight.dtype):
        return f"neither oneDNN's packed linear nor the compiled skinny product for {weight.dtype} weights here"
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


def compiled_glue_available() -> bool:
    """Whether the installed compiled module has the decode step's small operations."""
    return compiled_has("decode_norm", "decode_rotary", "decode_silu_mul")


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _norm(x: Tensor, update: Tensor | None, weight: Tensor, out: Tensor, eps: float) -> Tensor:
    """``x += update`` (in place, when given), then ``out = weight * rms_norm(x)`` (compiled core)."""
    from flashreinforce import _C

    rows, hidden = x.shape
    _C.decode_norm(_dtype_name(x), rows, hidden, x.data_ptr(), x.stride(0), 0 if update is None else update.data_ptr(),
                   0 if update is None else update.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), float(eps),
                   torch.get_num_threads())
    return out


def _rotary(qkv: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, k_slot: Tensor, v_slot: Tensor,
            heads: int, kv_heads: int, head_dim: int) -> None:
    """The step's rotary embedding: queries into ``q_out [b, heads, d]``, keys and values of ``qkv`` into
    the cache slots ``k_slot``/``v_slot [b, kv_heads, 1, d]`` (compiled core)."""
    from flashreinforce import _C

    _C.decode_rotary(_dtype_name(qkv), qkv.shape[0], heads, kv_heads, head_dim, qkv.data_ptr(), qkv.stride(0),
                     cos.data_ptr(), sin.data_ptr(), cos.stride(0), q_out.data_ptr(), k_slot.data_ptr(), k_slot.stride(0),
                     k_slot.stride(1), v_slot.data_ptr(), v_slot.stride(0), v_slot.stride(1), torch.get_num_threads())


def _silu_mul(gate_up: Tensor, out: Tensor) -> Tensor:
    """``out = silu(gate) * up`` of the fused ``gate_up [b, 2 I]`` (compiled core)."""
    from flashreinforce import _C

    _C.decode_silu_mul(_dtype_name(gate_up), gate_up.shape[0], out.shape[1], gate_up.data_ptr(), gate_up.stride(0),
                       out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out


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
    qkv: PackedWeight
    qkv_bias: Tensor | None
    o: PackedWeight
    o_bias: Tensor | None
    gate_up: PackedWeight
    gate_up_bias: Tensor | None
    down: PackedWeight
    down_bias: Tensor | None


class FastDecoder:
    """Decode steps of ``model`` (see the module docstring); build with :meth:`build`."""

    def __init__(self, model: torch.nn.Module, rows_hint: int = 32, attention: str = "auto", glue: bool = True,
                 products: str = "auto") -> None:
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"FastDecoder: attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
        dtype = model.lm_head.weight.dtype
        #: The kernel of the step's matrix products: ``"compiled"`` (the core's skinny product) or ``"onednn"``.
        self.products = resolve_product_kernel(dtype, products, "FastDecoder: products")
        if products == "onednn" and not packed_linear_available(dtype):
            raise ValueError(f"FastDecoder: products 'onednn' needs PyTorch's oneDNN packed linear for {dtype}, which "
                             f"this build lacks; use 'auto'")
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
        #: Whether the small operations between the products are the compiled core's (module docstring).
        self.glue = (bool(glue) and self.attention == "compiled" and compiled_glue_available()
                     and getattr(config, "hidden_act", "silu") == "silu" and self.head_dim % 2 == 0)
        self._eps = [(self._eps_of(layer.input_layernorm), self._eps_of(layer.post_attention_layernorm))
                     for layer in inner.layers]
        self._layers: list[_Layer] = []
        self._lm_head: PackedWeight | None = None
        self._key: tuple | None = None

    @classmethod
    def build(cls, model: torch.nn.Module, rows_hint: int = 32, attention: str = "auto",
              glue: bool = True, products: str = "auto") -> "FastDecoder | None":
        """A decoder for ``model``, or ``None`` where :func:`unsupported_reason` gives a reason."""
        if unsupported_reason(model) is not None:
            return None
        return cls(model, rows_hint, attention, glue, products)

    @staticmethod
    def _eps_of(norm: torch.nn.Module) -> float:
        return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def refresh(self, force: bool = False, key: tuple | None = None) -> bool:
        """Pack the fused weights again if any weight of the model changed since (or ``force``);
        whether it did. ``key``: the model's :func:`~flashreinforce.engines.hf.kv_cache.weights_key`
        where the caller has just computed it (default: computed here)."""
        key = weights_key(self.model) if key is None else key
        if key == self._key and not force:
            return False
        layers = []
        h = self.rows_hint

        def pack(w: Tensor) -> PackedWeight:
            return pack_weight(w, h, self.products)

        # The old copies go first, so a repack never holds two packed versions of the model at once.
        self._layers, self._lm_head = [], None
        with torch.no_grad():
            for layer in self.inner.layers:
                a, m = layer.self_attn, layer.mlp
                qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
                gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()
                layers.append(_Layer(
                    qkv=pack(qkv), qkv_bias=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    o=pack(a.o_proj.weight.detach()), o_bias=_cat_bias(a.o_proj),
                    gate_up=pack(gate_up), gate_up_bias=_cat_bias(m.gate_proj, m.up_proj),
                    down=pack(m.down_proj.weight.detach()), down_bias=_cat_bias(m.down_proj)))
            self._lm_head = pack(self.model.lm_head.weight.detach())
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
        eps = FastDecoder._eps_of(norm)
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
        if self.glue:
            return self._glued_step(tokens, mask, positions, cache)
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

    def _glued_step(self, tokens: Tensor, mask: Tensor, positions: Tensor, cache) -> Tensor:
        """:meth:`step` with the compiled core's small operations (``glue``): per layer the residual
        update and norm, the fused products, the rotary embedding written into the cache's next slot,
        the compiled attention, and the SwiGLU activation."""
        b = tokens.shape[0]
        d, heads, kv_heads = self.head_dim, self.heads, self.kv_heads
        x = self.inner.embed_tokens(tokens).contiguous()  # [b, hidden], the residual stream (updated in place)
        cos, sin = self.inner.rotary_emb(x[:, None, :], positions)  # [b, 1, d] each
        cos, sin = cos.to(x.dtype).reshape(b, d).contiguous(), sin.to(x.dtype).reshape(b, d).contiguous()
        attend = mask != 0
        h = torch.empty_like(x)
        q = torch.empty((b, kv_heads, heads // kv_heads, d), dtype=x.dtype)
        act = torch.empty((b, self.intermediate), dtype=x.dtype)
        update = None
        for layer, w, cache_layer, (eps_in, eps_post) in zip(self.inner.layers, self._layers, cache.layers, self._eps):
            _norm(x, update, layer.input_layernorm.weight, h, eps_in)
            qkv = packed_matmul(h, w.qkv, w.qkv_bias)
            k_slot, v_slot = cache_layer.reserve(1)
            _rotary(qkv, cos, sin, q, k_slot, v_slot, heads, kv_heads, d)
            attn = fused_decode_attention(q, cache_layer.keys, cache_layer.values, attend, self.scaling)
            o = packed_matmul(attn.view(b, heads * d), w.o, w.o_bias)
            _norm(x, o, layer.post_attention_layernorm.weight, h, eps_post)
            gate_up = packed_matmul(h, w.gate_up, w.gate_up_bias)
            update = packed_matmul(_silu_mul(gate_up, act), w.down, w.down_bias)
        _norm(x, update, self.inner.norm.weight, h, self._eps_of(self.inner.norm))
        return packed_matmul(h, self._lm_head, self._lm_head_bias)
