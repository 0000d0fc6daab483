"""A KV cache allocated once per generate call, for transformers' decoders.

transformers' ``DynamicCache`` grows each layer's keys and values with ``torch.cat`` at every
decode step, so a step copies the whole cache so far: O(context) bytes per layer per step, which
at a GPU's batch sizes costs more than reading the weights (batch 256, 1,000 tokens of context, a
Qwen2.5-0.5B-shaped model: about 3 GB copied per step against 1 GB of bf16 weights). Here every
full-attention layer writes its new keys and values into a buffer ``[batch, kv_heads, capacity,
head_dim]`` allocated at its first update, and hands attention a view of the first ``length``
positions: a step writes only its own tokens.

The capacity is the most tokens one call can hold (prompt + shared prefix + new tokens), known
before the first forward. Requests leaving the batch compact the buffers (a copy of the used part
of the kept rows, once per leaving event, not per step).

:func:`preallocated_cache` returns transformers' own ``DynamicCache`` with its plain full-attention
layers replaced by :class:`PreallocatedLayer` (a ``DynamicLayer`` subclass, so the model's mask and
attention code treat it as the dynamic cache it replaces); sliding-window or other special layers
are kept as transformers built them. It returns ``None`` where the installed transformers has no
per-layer cache (before 4.56), and the engine then uses a plain ``DynamicCache``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["PreallocatedLayer", "dynamic_cache", "preallocated_cache", "reusable_layers", "weights_key"]


@functools.lru_cache(maxsize=None)
def _layer_class():
    """The :class:`PreallocatedLayer` class, built on transformers' ``DynamicLayer`` at first use
    (transformers is imported lazily); ``None`` where transformers has no per-layer cache."""
    try:  # transformers >= 4.56: caches are lists of layers
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - older transformers
        return None

    class PreallocatedLayer(DynamicLayer):
        """One layer's keys and values in buffers of ``capacity`` positions, allocated at the first
        update with the batch, heads, head size, dtype and device of the states it receives.

        ``keys``/``values`` are views ``[batch, kv_heads, length, head_dim]`` of the buffers (the
        inner two dimensions contiguous). An update that would pass ``capacity`` raises
        ``ValueError``: the engine sizes the cache, so that is a bug, never silently grown.
        """

        def __init__(self, capacity: int, **kwargs) -> None:
            super().__init__(**kwargs)
            if capacity < 1:
                raise ValueError(f"PreallocatedLayer: capacity must be positive, got {capacity}")
            self.capacity = int(capacity)
            self.length = 0
            self._key_buffer: Tensor | None = None
            self._value_buffer: Tensor | None = None

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            b, heads, _, head_dim = key_states.shape
            self.device = key_states.device
            self._key_buffer = key_states.new_empty((b, heads, self.capacity, head_dim))
            self._value_buffer = value_states.new_empty((b, value_states.shape[1], self.capacity,
                                                         value_states.shape[-1]))
            self.length = 0
            self._refresh_views()
            self.is_initialized = True

        def adopt(self, keys: Tensor, values: Tensor, length: int) -> None:
            """Take ``keys``/``values`` ``[batch, kv_heads, capacity, head_dim]`` as the buffers, their first
            ``length`` positions already written (a prefill that starts from keys and values kept
            elsewhere, :mod:`flashreinforce.engines.hf.turn_cache`)."""
            if keys.shape[2] != self.capacity or values.shape[2] != self.capacity or not 0 <= length <= self.capacity:
                raise ValueError(f"PreallocatedLayer.adopt: buffers of {keys.shape[2]} positions and length {length} "
                                 f"for a capacity of {self.capacity}")
            self.device = keys.device
            self._key_buffer, self._value_buffer = keys, values
            self.length = int(length)
            self.is_initialized = True
            self._refresh_views()

        def _refresh_views(self) -> None:
            self.keys = self._key_buffer[:, :, :self.length]
            self.values = self._value_buffer[:, :, :self.length]

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                raise ValueError(f"PreallocatedLayer: {end} positions do not fit in the capacity of "
                                 f"{self.capacity} this cache was sized for")
            if key_states.shape[0] != self._key_buffer.shape[0]:
                raise ValueError(f"PreallocatedLayer: states of batch {key_states.shape[0]} for a cache of "
                                 f"batch {self._key_buffer.shape[0]}")
            self._key_buffer[:, :, self.length:end].copy_(key_states)
            self._value_buffer[:, :, self.length:end].copy_(value_states)
            self.length = end
            self._refresh_views()
            return self.keys, self.values

        def reserve(self, tokens: int = 1) -> tuple[Tensor, Tensor]:
            """Views ``[batch, kv_heads, tokens, head_dim]`` of the key and value buffers at the next
            ``tokens`` positions, now counted as used (the caller writes them before attention reads
            them: the engine's own decode step writes a step's keys and values there itself)."""
            if not self.is_initialized:
                raise ValueError("PreallocatedLayer.reserve: the cache holds nothing yet (run the prefill first)")
            end = self.length + int(tokens)
            if end > self.capacity:
                raise ValueError(f"PreallocatedLayer: {end} positions do not fit in the capacity of "
                                 f"{self.capacity} this cache was sized for")
            k = self._key_buffer[:, :, self.length:end]
            v = self._value_buffer[:, :, self.length:end]
            self.length = end
            self._refresh_views()
            return k, v

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def get_max_length(self) -> int:
            return self.capacity

        def reset(self) -> None:
            self.length = 0
            if self.is_initialized:
                self._refresh_views()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop: pass the number of tokens to remove as a negative number, "
                                 f"got {tokens_to_remove}")
            if self.is_initialized and tokens_to_remove:
                self.length = max(0, self.length + tokens_to_remove)
                self._refresh_views()

        def _rebuild(self, rows: Tensor | None, repeats: int = 1) -> None:
            """New buffers holding the used positions of ``rows`` (each ``repeats`` times)."""
            used_k = self._key_buffer[:, :, :self.length]
            used_v = self._value_buffer[:, :, :self.length]
            if rows is not None:
                used_k, used_v = used_k[rows], used_v[rows]
            if repeats > 1:
                used_k = used_k.repeat_interleave(repeats, dim=0)
                used_v = used_v.repeat_interleave(repeats, dim=0)
            k = self._key_buffer.new_empty((used_k.shape[0],) + tuple(self._key_buffer.shape[1:]))
            v = self._value_buffer.new_empty((used_v.shape[0],) + tuple(self._value_buffer.shape[1:]))
            k[:, :, :self.length].copy_(used_k)
            v[:, :, :self.length].copy_(used_v)
            self._key_buffer, self._value_buffer = k, v
            self._refresh_views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self._rebuild(None, int(repeats))

        def batch_select_indices(self, indices: Tensor) -> None:
            if self.is_initialized:
                self._rebuild(indices.to(self._key_buffer.device))

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            if self.is_initialized:
                self._rebuild(beam_idx.to(self._key_buffer.device))

        def offload(self) -> None:  # the buffers stay on their device (no offloading of a live call)
            return None

        def prefetch(self) -> None:
            return None

    return PreallocatedLayer


def __getattr__(name: str):
    if name == "PreallocatedLayer":
        return _layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def weights_key(model: torch.nn.Module) -> tuple:
    """Identity and version counter of every parameter of ``model``: equal keys mean no weight was
    replaced or changed in place in between (what kept keys, values and packed weights depend on)."""
    return tuple((id(p), p._version) for p in model.parameters())


def reusable_layers(cache) -> bool:
    """Whether every layer of ``cache`` holds plain keys and values that a later call may copy in:
    transformers' ``DynamicLayer`` or :class:`PreallocatedLayer`, by exact type (a sliding-window or
    other special layer drops or transforms positions: its states are recomputed). Of a
    :func:`preallocated_cache` this means every layer is a :class:`PreallocatedLayer`, since that
    replaces each plain dynamic layer."""
    layers = getattr(cache, "layers", None)
    kinds = _reusable_types()
    return bool(layers) and bool(kinds) and all(type(layer) in kinds for layer in layers)


@functools.lru_cache(maxsize=None)
def _reusable_types() -> tuple[type, ...]:
    """The layer types of :func:`reusable_layers`, found once (it runs on every generate call)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - transformers before per-layer caches
        return ()
    return tuple(t for t in (DynamicLayer, _layer_class()) if t is not None)


def dynamic_cache(model: torch.nn.Module):
    """transformers' ``DynamicCache`` for ``model`` (its layer types from the config, where the
    installed transformers takes one)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def preallocated_cache(model: torch.nn.Module, capacity: int):
    """A ``DynamicCache`` for ``model`` whose full-attention layers hold ``capacity`` positions in
    buffers allocated once (see the module docstring), or ``None`` where that is not available
    (transformers before 4.56, a cache without layers built from the config, or a model whose cache
    has no plain full-attention layer)."""
    layer_class = _layer_class()
    if layer_class is None:
        return None
    from transformers.cache_utils import DynamicLayer

    cache = dynamic_cache(model)
    layers = getattr(cache, "layers", None)  # empty where the layers would only be made lazily
    if not layers or getattr(cache, "offloading", False):
        return None
    replaced = 0
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[i] = layer_class(capacity)
            replaced += 1
    return cache if replaced else None
