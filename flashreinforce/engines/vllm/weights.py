"""A weight version into vLLM's CPU kernels without vLLM's layer-by-layer reload (in vLLM's worker).

vLLM's CPU build multiplies by weights it packed for its GEMM kernels: each linear layer's
``process_weights_after_loading`` hands the plain weight to a oneDNN handler, which reorders it into
memory of its own, and then drops the layer's weight parameter (it keeps an empty one). That packed
copy lives inside the handler's C++ object, out of reach: nothing can write a new version into it in
place. vLLM's own ``reload_weights`` therefore rebuilds every layer: it puts the layer's parameters
back on the meta device, allocates them again, copies the checkpoint tensors into them through the
model's weight loaders, runs the layer's processing (a new handler: a second copy of every weight)
and restores the parameter objects. For SmolLM2-135M in float32 on 2 cores that took about 0.6 s, of
which the handlers were half (``docs/performance.md``).

:func:`load_direct` does the same work with one copy: for each linear layer of the version it points
the layer's weight at the trainer's tensor in shared memory (the parts of a fused projection, such as
``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``, are adjacent there, so their concatenation is a
view; otherwise they are concatenated into a scratch buffer kept for the next version), runs vLLM's
own ``process_weights_after_loading`` on it, which builds the new handler straight from shared
memory, and puts the layer's own (empty) parameter object back, as the reload does. Embeddings, norms
and biases are copied into their parameters in place; a tied output projection shares the embedding's
parameter and is repacked from it. The kernels read exactly what vLLM's reload would give them: the
same processing of the same values.

The trainer's side of the same contract is here too: which tensors a version sends
(:func:`changed_blocks`: whole blocks, so that a fused projection arrives whole) and the order of the
shared buffer (:func:`weight_layout`: the model's own state-dict order, in which a fused projection's
parts are adjacent).

Where the model is not one it knows (a layer of another kind, quantization, a name it cannot place, a
fused projection whose parts did not all arrive), :func:`load_direct` changes nothing and returns
``False``: the caller then uses vLLM's reload. This module imports no vLLM: it recognizes vLLM's layers
by their quantization method's class name and the model's ``packed_modules_mapping`` (vLLM's table of
fused projections, which its LoRA support uses too).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

__all__ = ["DirectPlan", "changed_blocks", "last_sent", "load_direct", "plan_of", "weight_layout"]


# ------------------------------------------------------------------ the trainer's side
def _block_of(name: str) -> str:
    """The block a weight belongs to: its name without the last two parts
    (``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn``)."""
    parts = name.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 else name


def last_sent(sent: Mapping[str, weakref.ref], name: str):
    """The tensor last sent under ``name`` if it is still alive, else ``None``."""
    ref = sent.get(name)
    return ref() if ref is not None else None


def changed_blocks(state_dict: Mapping[str, torch.Tensor],
                   sent: Mapping[str, weakref.ref]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``state_dict`` to send: every tensor of a block in which any tensor is not the
    object last sent (a tensor published again unchanged is the same object). Whole blocks, because
    vLLM fuses sibling projections (q/k/v, gate/up) into one parameter and reprocesses a layer as a
    whole: it must receive all of a fused parameter's parts at once."""
    dirty = {_block_of(n) for n, t in state_dict.items() if last_sent(sent, n) is not t}
    return [(n, t) for n, t in state_dict.items() if _block_of(n) in dirty]


def weight_layout(config: Any, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every tensor of the Hugging Face causal LM of ``config`` (built on the
    meta device: no memory), all in ``dtype``: the layout of a weight buffer prepared before the first
    version. Block by block in the state dict's order, each block's weights before its biases, so that
    the parts of a fused projection (``q_proj``, ``k_proj``, ``v_proj`` of a model with biases too) lie
    one after the other and vLLM's kernel is built from them without a copy."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    items = list(model.state_dict().items())
    blocks = {b: i for i, b in reversed(list(enumerate(_block_of(n) for n, _ in items)))}
    order = sorted(range(len(items)), key=lambda i: (blocks[_block_of(items[i][0])], items[i][0].endswith(".bias"), i))
    return [(items[i][0], tuple(items[i][1].shape), dtype) for i in order]


# ------------------------------------------------------------------ vLLM's worker

_LINEAR_METHODS = ("UnquantizedLinearMethod",)
_EMBEDDING_METHODS = ("UnquantizedEmbeddingMethod",)


@dataclass
class _Linear:
    """A linear layer whose weight is the concatenation (along the output rows) of ``parts``."""
    module: torch.nn.Module
    path: str
    parts: list[str]
    sizes: list[int] | None
    bias_parts: list[str]


@dataclass
class DirectPlan:
    """Where each Hugging Face name of a version goes in vLLM's model (built once per model)."""
    linears: dict[str, _Linear] = field(default_factory=dict)  # module path -> layer
    owner: dict[str, tuple[str, int]] = field(default_factory=dict)  # weight name -> (module path, part)
    bias_owner: dict[str, tuple[str, int]] = field(default_factory=dict)  # bias name -> (module path, part)
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)  # plain parameters, copied in place
    repack: dict[int, list[torch.nn.Module]] = field(default_factory=dict)  # parameter id -> layers packing it
    scratch: dict[tuple, torch.Tensor] = field(default_factory=dict)  # fused weights that were not adjacent


def _method(module: torch.nn.Module) -> str:
    return type(getattr(module, "quant_method", None)).__name__


def _plain_path(path: str) -> str:
    """A module path without vLLM LoRA's ``base_layer`` steps (the names a checkpoint uses)."""
    return ".".join(p for p in path.split(".") if p != "base_layer")


def plan_of(model: torch.nn.Module) -> DirectPlan | None:
    """The :class:`DirectPlan` of a vLLM model on the CPU, built at the first call and kept on the model;
    ``None`` where a layer is of a kind this module does not know (the caller then uses vLLM's reload)."""
    cached = getattr(model, "_flashreinforce_direct_plan", False)
    if cached is not False:
        return cached
    plan: DirectPlan | None = DirectPlan()
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    for path, module in model.named_modules():
        method = _method(module)
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        name = _plain_path(path)
        if hasattr(module, "cpu_linear") and method in _LINEAR_METHODS:
            if getattr(module, "tp_size", 1) not in (1, None) or "weight" not in own:
                plan = None
                break
            parent, _, last = name.rpartition(".")
            sources = packed.get(last, [last])
            prefix = f"{parent}." if parent else ""
            parts = [f"{prefix}{s}.weight" for s in sources]
            sizes = list(getattr(module, "output_partition_sizes", []) or []) or None
            if sizes is not None and len(sizes) != len(parts):
                plan = None
                break
            bias_parts = [f"{prefix}{s}.bias" for s in sources] if own.get("bias") is not None else []
            plan.linears[name] = _Linear(module, name, parts, sizes, bias_parts)
            for k, p in enumerate(parts):
                plan.owner[p] = (name, k)
            for k, p in enumerate(bias_parts):
                plan.bias_owner[p] = (name, k)
            continue
        if method not in ("NoneType", *_EMBEDDING_METHODS):
            plan = None  # quantized or otherwise processed weights: vLLM's reload knows them
            break
        for pname, param in own.items():
            plan.params[f"{name}.{pname}" if name else pname] = param
            if method in _EMBEDDING_METHODS and hasattr(module, "cpu_linear") and pname == "weight":
                plan.repack.setdefault(id(param), []).append(module)
    model._flashreinforce_direct_plan = plan
    return plan


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The concatenation of ``parts`` (2-D, contiguous, same dtype and width) along their rows as one
    view, when each starts where the previous one ends in one storage; else ``None``."""
    first = parts[0]
    if any(p.dim() != 2 or not p.is_contiguous() or p.dtype != first.dtype or p.shape[1] != first.shape[1]
           or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in parts):
        return None
    offset = first.storage_offset()
    for p in parts:
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())


def _repack(module: torch.nn.Module, weight: torch.Tensor | None) -> None:
    """Run vLLM's processing of ``module`` (its kernel built anew from ``weight``, or from the module's
    own weight parameter when ``None``), keeping the module's parameter object as it was."""
    kept = module._parameters["weight"]
    module.cpu_linear = None  # the old handler goes first: its memory is reused for the new one
    if weight is not None:
        module._parameters["weight"] = torch.nn.Parameter(weight, requires_grad=False)
    module.quant_method.process_weights_after_loading(module)
    now = module._parameters["weight"]
    if weight is not None:
        # A packed kernel leaves an empty weight; one that multiplies by the plain weight must not read
        # shared memory that the next version overwrites: it gets a copy of its own.
        aliased = now.numel() and now.data_ptr() == weight.data_ptr()
        kept.data = now.detach().clone() if aliased else now.detach()
        module._parameters["weight"] = kept


@torch.no_grad()
def load_direct(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> bool:
    """Load ``weights`` (Hugging Face names, tensors of the model's dtype; typically views of shared
    memory, read once here) into vLLM ``model`` on the CPU, as the module docstring says. Returns
    ``False``, having changed nothing, where it cannot place every tensor; ``True`` when loaded."""
    plan = plan_of(model)
    if plan is None:
        return False
    fused: dict[str, dict[int, torch.Tensor]] = {}
    biases: dict[str, dict[int, torch.Tensor]] = {}
    plain: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}  # by parameter (a tied one comes twice)
    for name, t in weights:
        if name in plan.owner:
            path, k = plan.owner[name]
            fused.setdefault(path, {})[k] = t
        elif name in plan.bias_owner:
            path, k = plan.bias_owner[name]
            biases.setdefault(path, {})[k] = t
        elif name in plan.params:
            param = plan.params[name]
            if tuple(param.shape) != tuple(t.shape) or param.dtype != t.dtype:
                return False
            plain.setdefault(id(param), (param, t))
        else:
            return False
    ready: list[tuple[_Linear, list[torch.Tensor]]] = []
    for path, got in fused.items():
        layer = plan.linears[path]
        if len(got) != len(layer.parts) or (layer.bias_parts and len(biases.get(path, {})) != len(layer.bias_parts)):
            return False  # a fused projection must arrive whole (the loader sends whole blocks)
        parts = [got[k] for k in range(len(layer.parts))]
        dtype = layer.module._parameters["weight"].dtype
        if any(p.dtype != dtype or p.dim() != 2 for p in parts) or (
                layer.sizes is not None and [p.shape[0] for p in parts] != layer.sizes):
            return False
        ready.append((layer, parts))
    if any(path not in fused for path in biases):
        return False
    # Every tensor has its place: from here on the model changes.
    for param, t in plain.values():
        param.data.copy_(t)
    for layer, parts in ready:
        weight = _adjacent(parts)
        if weight is None:
            rows = sum(p.shape[0] for p in parts)
            key = (rows, parts[0].shape[1], parts[0].dtype)
            weight = plan.scratch.get(key)
            if weight is None:
                weight = plan.scratch[key] = torch.empty((rows, parts[0].shape[1]), dtype=parts[0].dtype)
            torch.cat(parts, out=weight)
        bias_got = biases.get(layer.path, {})
        if bias_got:
            torch.cat([bias_got[k] for k in range(len(layer.bias_parts))], out=layer.module.bias.data)
        _repack(layer.module, weight)
    for key in plain:
        for module in plan.repack.get(key, ()):
            _repack(module, None)
    return True
