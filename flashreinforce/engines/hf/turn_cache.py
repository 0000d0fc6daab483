"""Keys and values of finished turns, kept for the next turn of the same conversation.

A multi-turn episode sends its whole conversation again at every turn: the prompt, the turn just
sampled, the environment's answer. Without a cache the engine computes the keys and values of the
prompt and of the sampled turn a second time, though the same weights computed them a moment ago;
in the ``arith_tool`` stream about 40 of the 58 tokens a second turn sends after the shared system
prompt.

:class:`TurnCache` keeps, when a request of :meth:`HFEngine.generate` finishes, the keys and values of
its context (the prompt and every sampled token but the last, which was never fed back) under those
tokens. A later request whose prompt starts with such tokens takes them (and the cache forgets them:
a conversation goes on once) and computes only the rest. Everything is dropped when any weight
changes, so a reused position holds the numbers the current weights give; the cache holds at most
``max_bytes`` (least recently stored dropped first).

:func:`continued_prefill` lays a call out with each request's kept positions right-aligned in a first
block and its new tokens right-aligned in a second one, the padding between masked (positions count
real tokens only, as for the engine's shared prefix): the model then runs the second block alone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["ContinuedPrefill", "TurnCache", "context_states", "continued_prefill"]

#: Per layer: keys and values ``[kv_heads, positions, head_dim]`` of one context.
LayerStates = list[tuple[Tensor, Tensor]]


class TurnCache:
    """Contexts' keys and values by their tokens (see the module docstring).

    ``max_bytes`` > 0: the most the kept tensors may hold. ``tokens_reused``: positions handed out so far.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"TurnCache: max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple[int, ...], tuple[LayerStates, int]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # kept context length -> how many entries have it
        self._weights: tuple | None = None
        self.bytes = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def check_weights(self, key: tuple) -> None:
        """Forget everything unless ``key`` (the engine's weights: identity and version counter of every
        parameter) is the one the kept states were computed with."""
        if key != self._weights:
            self.clear()
            self._weights = key

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0

    def take(self, prompt: Sequence[int]) -> tuple[int, LayerStates | None]:
        """The longest kept context that starts ``prompt`` and leaves at least one of its tokens to compute:
        ``(its length, its states)``, removed from the cache; ``(0, None)`` when there is none."""
        for n in sorted(self._lengths, reverse=True):
            if n >= len(prompt):
                continue
            found = self._entries.pop(tuple(prompt[:n]), None)
            if found is not None:
                self._forget(n, found[1])
                self.tokens_reused += n
                return n, found[0]
        return 0, None

    def put(self, tokens: Sequence[int], states: LayerStates) -> None:
        """Keep ``states`` (every position of ``tokens``) unless they alone exceed the budget."""
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in states)
        key = tuple(tokens)
        if not key or size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._forget(len(key), old[1])
        self._entries[key] = (states, size)
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            tokens_out, (_, dropped) = self._entries.popitem(last=False)
            self._forget(len(tokens_out), dropped)

    def _forget(self, length: int, size: int) -> None:
        self.bytes -= size
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]


@dataclass
class ContinuedPrefill:
    """A call laid out for :func:`continued_prefill`: ``ids [b, W]`` the new tokens, ``mask [b, R + W]``
    (R = the kept block's width), ``positions [b, W]`` of the new tokens."""

    ids: Tensor
    mask: Tensor
    positions: Tensor


def continued_prefill(prompts: Sequence[Sequence[int]], reused: Sequence[int], states: Sequence[LayerStates | None],
                      layers: Sequence, capacity: int, pad_token_id: int,
                      device: torch.device) -> ContinuedPrefill:
    """Fill the preallocated cache ``layers`` (batch ``len(prompts)``, ``capacity`` positions) with each
    request's kept states: request i's first ``reused[i]`` positions (from ``states[i]``, per layer
    ``[kv_heads, >= reused[i], head_dim]``) right-aligned in a block of R = max(reused) positions, zeros
    elsewhere (masked); and lay out the rest of each prompt right-aligned in the next W positions."""
    b = len(prompts)
    kept = max(reused)
    rest = [len(p) - r for p, r in zip(prompts, reused)]
    width = max(rest)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, kept + width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, reused)):
        mask[i, kept - r:kept] = 1
        ids[i, width - rest[i]:] = torch.as_tensor(list(p[r:]), dtype=torch.long)
        mask[i, kept + width - rest[i]:] = 1
    sample = next(s for s in states if s is not None)
    for index, layer in enumerate(layers):
        k0, v0 = sample[index]
        keys = k0.new_zeros((b, k0.shape[0], capacity, k0.shape[-1]))
        values = v0.new_zeros((b, v0.shape[0], capacity, v0.shape[-1]))
        for i, (r, s) in enumerate(zip(reused, states)):
            if r:
                keys[i, :, kept - r:kept] = s[index][0][:, :r]
                values[i, :, kept - r:kept] = s[index][1][:, :r]
        layer.adopt(keys, values, kept)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, kept:]
    return ContinuedPrefill(ids, mask, positions)


def context_states(layers: Sequence, row: int, columns: Tensor) -> LayerStates:
    """Copies of row ``row``'s keys and values at ``columns`` (int64) of every layer."""
    return [(layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns)) for layer in layers]
