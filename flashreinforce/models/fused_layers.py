"""The learner's Hugging Face decoder with its RMS norms and SwiGLU activations computed in one pass.

:func:`use_compiled_layers` points the ``forward`` of each RMS norm and SwiGLU MLP module of a Llama-
style decoder (Llama, Qwen2, Qwen3, Mistral: the classes in :data:`NORM_CLASSES` and
:data:`MLP_CLASSES`) at a method that calls :func:`flashreinforce.ops.layers.rms_norm` /
:func:`flashreinforce.ops.layers.silu_mul` where they apply (CPU tensors: float32 norms, float32 or
bfloat16 SwiGLU, CPU autocast on or off; :mod:`flashreinforce.ops.layers`) and the module's own class
``forward`` everywhere else. Under bf16 CPU autocast, a decoder layer's two norms whose outputs feed only
its attention's and its dense MLP's products (:data:`BF16_FED_LAYERS`) hand those products bfloat16
directly in a forward without a backward (:func:`flashreinforce.ops.layers.rms_norm_to_bf16`: the
rounding the products' autocast would do, done once instead of once per product); the final norm,
which feeds the output projection, keeps float32. PEFT's LoRA linear layers
(``peft.tuners.lora.layer.Linear``) go the same way to :func:`flashreinforce.ops.lora_linear.lora_linear`
(the adapter's scaled product summed inside the base product) when a call is plain LoRA: one active
adapter, not merged, no dropout in training, no DoRA or other variant, plain ``nn.Linear`` layers
without hooks or a forward of their own, no extra arguments (other calls run PEFT's forward). The
model code is not forked, the weights and ``state_dict`` are untouched, and a copy of the model
(``copy.deepcopy``) carries the change. Other module classes (Gemma's ``1 + weight`` norm, gated MLPs
with another activation) are left alone.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from flashreinforce.ops.layers import compiled_layers_apply, compiled_layers_available, norm_applies, silu_mul_applies
from flashreinforce.ops.layers import rms_norm as _rms_norm
from flashreinforce.ops.layers import rms_norm_to_bf16 as _rms_norm_to_bf16
from flashreinforce.ops.layers import silu_mul as _silu_mul
from flashreinforce.ops.lora_linear import lora_linear as _lora_linear

__all__ = ["BF16_FED_LAYERS", "MLP_CLASSES", "NORM_CLASSES", "SILU_CLASSES", "compiled_layer_counts",
           "use_compiled_layers"]

#: RMS norm classes computing ``weight * (x * rsqrt(mean(x**2) + variance_epsilon))``.
NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm",
                          "MistralRMSNorm"})
#: MLP classes computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, routed when ``act_fn`` is SiLU.
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "Qwen2MoeMLP", "MistralMLP"})
#: SiLU activation modules: PyTorch's, and transformers' (``ACT2FN["silu"]``).
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})
#: Decoder layers (by their attention and MLP classes) whose ``input_layernorm`` output goes only to the
#: attention's projections and whose ``post_attention_layernorm`` output only to the MLP's: the norms that
#: may hand bf16-autocast products bfloat16. MoE blocks are not here (their routing sums in the input's dtype).
BF16_FED_LAYERS = frozenset({("LlamaAttention", "LlamaMLP"), ("Qwen2Attention", "Qwen2MLP"),
                             ("Qwen3Attention", "Qwen3MLP"), ("MistralAttention", "MistralMLP")})
#: The module attribute that marks such a norm.
_FEEDS_PRODUCTS = "_flashreinforce_feeds_products"


def _hands_bf16(self: torch.nn.Module, x: Tensor) -> bool:
    """Whether this norm may return bfloat16: it feeds only products, bf16 CPU autocast is on and no
    gradient will flow back through it."""
    return (getattr(self, _FEEDS_PRODUCTS, False) and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))


def _norm_forward(self: torch.nn.Module, hidden_states: Tensor) -> Tensor:
    if norm_applies(hidden_states, self.weight):
        if _hands_bf16(self, hidden_states):
            return _rms_norm_to_bf16(hidden_states, self.weight, self.variance_epsilon)
        return _rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _mlp_forward(self: torch.nn.Module, x: Tensor) -> Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if silu_mul_applies(gate, up):
        return self.down_proj(_silu_mul(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def _plain_lora(self: torch.nn.Module, x: Tensor) -> tuple | None:
    """``(A, B, scaling)`` of this PEFT LoRA layer's one active adapter when the call is plain LoRA on
    tensors the routing computes for, else None (PEFT's own forward then runs)."""
    if self.disable_adapters or self.merged:
        return None
    names = [name for name in self.active_adapters if name in self.lora_A]
    if len(names) != 1:
        return None
    name = names[0]
    if name in getattr(self, "lora_variant", {}) or getattr(self, "use_dora", {}).get(name, False):
        return None
    dropout = self.lora_dropout[name]
    if not (type(dropout) is torch.nn.Identity
            or (type(dropout) is torch.nn.Dropout and (dropout.p == 0 or not dropout.training))):
        return None
    base, a, b = self.base_layer, self.lora_A[name], self.lora_B[name]
    for layer in (base, a, b):
        # A layer with hooks or a forward of its own (the hf engine's packed products) keeps PEFT's path,
        # which calls it.
        if (type(layer) is not torch.nn.Linear or layer._forward_hooks or layer._forward_pre_hooks
                or "forward" in vars(layer)):
            return None
    if a.bias is not None or b.bias is not None:
        return None
    tensors = (x, base.weight, a.weight, b.weight) + (() if base.bias is None else (base.bias,))
    if not compiled_layers_apply(*tensors):
        return None
    return a.weight, b.weight, float(self.scaling[name])


def _lora_forward(self: torch.nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    plain = None if (args or kwargs) else _plain_lora(self, x)
    if plain is None:
        return type(self).forward(self, x, *args, **kwargs)
    return _lora_linear(x, self.base_layer.weight, self.base_layer.bias, *plain)


def _is_patched(module: torch.nn.Module, method) -> bool:
    return getattr(vars(module).get("forward"), "__func__", None) is method


def _norm_fits(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in NORM_CLASSES and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _mlp_fits(module: torch.nn.Module) -> bool:
    projections = all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
    return (type(module).__name__ in MLP_CLASSES and projections
            and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES)


def _lora_fits(module: torch.nn.Module) -> bool:
    kind = type(module)
    return kind.__name__ == "Linear" and kind.__module__ == "peft.tuners.lora.layer"


def use_compiled_layers(model: torch.nn.Module, lora: bool = True) -> dict[str, int]:
    """Route ``model``'s RMS norms, SwiGLU MLPs and LoRA linear layers through the fused layer
    operations (in place).

    Returns the count of modules now routed, ``{"norms": n, "mlps": m, "lora": k}`` (all 0 when the
    compiled module lacks the operations: the model is then left as it was). Calling it again changes
    nothing. LoRA layers added after this call are not routed (call it again); ``lora=False`` leaves
    LoRA layers alone (PEFT's forward; for side-by-side measurements).
    """
    counts = {"norms": 0, "mlps": 0, "lora": 0}
    if not compiled_layers_available():
        return counts
    for layer in model.modules():
        parts = (type(getattr(layer, "self_attn", None)).__name__, type(getattr(layer, "mlp", None)).__name__)
        if parts in BF16_FED_LAYERS:
            for name in ("input_layernorm", "post_attention_layernorm"):
                norm = getattr(layer, name, None)
                if norm is not None and _norm_fits(norm):
                    setattr(norm, _FEEDS_PRODUCTS, True)
    for module in model.modules():
        if _norm_fits(module):
            if not _is_patched(module, _norm_forward):
                module.forward = types.MethodType(_norm_forward, module)
            counts["norms"] += 1
        elif _mlp_fits(module):
            if not _is_patched(module, _mlp_forward):
                module.forward = types.MethodType(_mlp_forward, module)
            counts["mlps"] += 1
        elif lora and _lora_fits(module):
            if not _is_patched(module, _lora_forward):
                module.forward = types.MethodType(_lora_forward, module)
            counts["lora"] += 1
    return counts


def compiled_layer_counts(model: torch.nn.Module) -> dict[str, int]:
    """How many of ``model``'s modules :func:`use_compiled_layers` has routed (``norms``, ``mlps``, ``lora``)."""
    modules = list(model.modules())
    return {"norms": sum(_is_patched(m, _norm_forward) for m in modules),
            "mlps": sum(_is_patched(m, _mlp_forward) for m in modules),
            "lora": sum(_is_patched(m, _lora_forward) for m in modules)}
