"""Per-document attention over packed rows, for any Hugging Face decoder that uses transformers'
attention interface (Llama, Qwen2, Qwen3, Mistral and the other models written against it).

A packed row holds several documents (trajectories) end to end. Causal attention over the whole
row would let a token see the documents before its own; a block-diagonal ``[S, S]`` mask fixes the
answer but still computes all S² query-key pairs and holds the mask. Here the row is described by a
:class:`DocumentLayout` and each document's queries meet only the keys they may see, so the cost
is the sum over documents of (queries x keys), never S², and no ``[S, S]`` mask exists.

The layout is a forest of *segments*. Segment j covers row positions ``[start_j, end_j)``; its
queries attend to every key of its ancestors (root first) and causally to its own keys. Plain
packing is a forest of roots, one per document. A shared prefix is one more rule of the same kind:
the prefix is a segment computed once, and each document continuing it is a child segment that
attends to the prefix's keys and values, so the prefix's gradient gathers from every document.

Two backends compute the same thing (:data:`BACKENDS`):

* ``sdpa``: ``scaled_dot_product_attention`` over *buckets* of segments. A call costs about as
  much as a couple of thousand query-key pairs on a CPU, so segments of similar size share one
  call, padded to the bucket's largest (queries, keys) with a per-segment mask, as long as the
  padding costs less than a call of its own (:data:`CALL_COST_PAIRS`); a bucket of equal root
  segments is plain ``is_causal``. Long documents get exact buckets, short ones few calls. Any
  device and dtype.
* ``varlen``: PyTorch's variable-length flash attention (``torch.nn.attention.varlen``), one call for
  the whole row with ``cu_seqlens`` offsets of queries and keys (a child's keys gathered per
  document). CUDA, float16/bfloat16, no dropout, no sliding window shorter than a document.

``auto`` takes ``varlen`` where it applies and ``sdpa`` elsewhere (the CPU measurements are in
``docs/performance.md``). :func:`use_document_attention` registers :func:`document_attention`
with transformers under :data:`ATTENTION_NAME`, with a mask function that builds no mask for an
unpadded row, so the model code is not forked; a forward without a ``document_layout`` keyword
argument is transformers' SDPA attention.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ATTENTION_NAME", "BACKENDS", "DocumentLayout", "attend", "document_attention",
           "document_attention_unsupported", "use_document_attention", "varlen_available"]

#: The name under which :func:`document_attention` is registered with transformers.
ATTENTION_NAME = "per_document"  # (a name with "flash" in it would be taken for a flash-attention kernel)
#: The ways of computing a layout's attention (``auto`` picks one per call).
BACKENDS = ("auto", "sdpa", "varlen")


class DocumentLayout:
    """Which keys each query of a packed row of S tokens may attend to.

    Args:
        starts, ends: ``[J]`` row positions of the segments, in row order; they tile ``[0, S)``
            without gaps (``starts[0] == 0``, ``starts[j+1] == ends[j]``, every segment non-empty).
        parents: ``[J]`` index of each segment's parent segment, ``-1`` for a root; a parent comes
            before its children.
        backend: one of :data:`BACKENDS`.

    ``calls`` counts the attention layers that used this layout (the scorer checks it is not 0).
    """

    def __init__(self, starts: Sequence[int], ends: Sequence[int], parents: Sequence[int] | None = None,
                 *, backend: str = "auto") -> None:
        starts, ends = [int(s) for s in starts], [int(e) for e in ends]
        parents = [-1] * len(starts) if parents is None else [int(p) for p in parents]
        if not starts or not (len(starts) == len(ends) == len(parents)):
            raise ValueError(f"DocumentLayout: starts ({len(starts)}), ends ({len(ends)}) and parents "
                             f"({len(parents)}) must be non-empty and of one length")
        if backend not in BACKENDS:
            raise ValueError(f"DocumentLayout: backend must be one of {BACKENDS}, got {backend!r}")
        position = 0
        for j, (s, e, p) in enumerate(zip(starts, ends, parents)):
            if s != position or e <= s:
                raise ValueError(f"DocumentLayout: segment {j} is [{s}, {e}); segments must tile the row in "
                                 f"order, each non-empty (expected it to start at {position})")
            if not -1 <= p < j:
                raise ValueError(f"DocumentLayout: segment {j} has parent {p}; a parent is -1 or an earlier segment")
            position = e
        self.starts, self.ends, self.parents, self.backend = starts, ends, parents, backend
        self.num_tokens = position
        spans: list[tuple[tuple[int, int], ...]] = []
        for j in range(len(starts)):
            p = parents[j]
            spans.append((spans[p] if p >= 0 else ()) + ((starts[j], ends[j]),))
        #: Per segment, the row spans of its keys: its ancestors' (root first), then its own.
        self.key_spans = spans
        self.query_lengths = [e - s for s, e in zip(starts, ends)]
        self.key_lengths = [sum(b - a for a, b in sp) for sp in spans]
        self.calls = 0
        self._device_cache: dict[torch.device, tuple[Tensor, Tensor, Tensor | None]] = {}
        self._plans: dict[tuple[torch.device, int | None], _SdpaPlan] = {}

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], *, backend: str = "auto") -> "DocumentLayout":
        """Plain packing: one root segment per document of ``lengths[i]`` tokens."""
        ends = torch.tensor([int(n) for n in lengths], dtype=torch.int64).cumsum(0).tolist()
        return cls([0] + ends[:-1], ends, None, backend=backend)

    @property
    def num_segments(self) -> int:
        return len(self.starts)

    @property
    def is_plain(self) -> bool:
        """Every segment is a root (no shared prefix)."""
        return all(p < 0 for p in self.parents)

    def query_key_pairs(self) -> int:
        """Query-key pairs the layout needs (its attention cost), causal halves counted in full."""
        return sum(q * k for q, k in zip(self.query_lengths, self.key_lengths))

    def device_offsets(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(cu_seqlens_q [J+1], cu_seqlens_k [J+1], key_index [K] or None)`` int32/int64 on
        ``device``: query and key offsets per segment and the row positions of the gathered keys
        (``None`` for a plain layout, whose keys are the row itself)."""
        cached = self._device_cache.get(device)
        if cached is None:
            cu_q = torch.tensor([0] + self.query_lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
            cu_k = torch.tensor([0] + self.key_lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
            index = None
            if not self.is_plain:
                index = torch.cat([torch.arange(a, b) for sp in self.key_spans for a, b in sp]).to(device)
            cached = (cu_q.to(device), cu_k.to(device), index)
            self._device_cache[device] = cached
        return cached

    def sdpa_plan(self, device: torch.device, window: int | None = None) -> "_SdpaPlan":
        """The ``sdpa`` backend's buckets for this layout (built once per device and window)."""
        key = (device, window)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _SdpaPlan(self, window, device)
        return plan

    def __repr__(self) -> str:
        return (f"DocumentLayout({self.num_segments} segments, {self.num_tokens} tokens, "
                f"{'plain' if self.is_plain else 'shared prefixes'}, backend={self.backend!r})")


# ---------------------------------------------------------------------------------------- backends
#: The cost of one more SDPA call, in query-key pairs: padding segments into a common call pays off
#: while it adds fewer pairs than this (about 0.3 ms per call, forward and backward, against about
#: 0.2 us per pair with 9 heads of 64 on the 2-core development CPU; docs/performance.md).
CALL_COST_PAIRS = 2048


def _lower_right_mask(q_len: int, k_len: int, window: int | None, device: torch.device) -> Tensor | None:
    """``[q_len, k_len]`` bool: query i (the last of the keys' q_len positions) sees key j when
    ``j <= i + k_len - q_len`` and, with a sliding window, ``j > i + k_len - q_len - window``.
    ``None`` when that is SDPA's own ``is_causal`` (equal lengths, no window that cuts)."""
    if q_len == k_len and (window is None or window >= k_len):
        return None
    i = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    j = torch.arange(k_len, device=device)[None, :]
    mask = j <= i
    if window is not None and window < k_len:
        mask &= j > i - window
    return mask


class _Bucket:
    """Segments computed in one SDPA call, each padded to the bucket's ``[queries, keys]``.

    q_index ``[g, Lq]`` / k_index ``[g, Lk]``: row positions of each member's queries / keys
    (padding repeats a valid position); mask ``[g, 1, Lq, Lk]`` bool or ``None`` (then
    ``is_causal``); valid ``[M]``: the flat ``g * Lq`` positions of real queries (``None``: all).
    """

    def __init__(self, layout: DocumentLayout, members: list[int], window: int | None, device: torch.device) -> None:
        q_lens = [layout.query_lengths[j] for j in members]
        k_lens = [layout.key_lengths[j] for j in members]
        lq, lk = max(q_lens), max(k_lens)
        self.num_queries, self.num_keys, self.size = lq, lk, len(members)
        q_rows, k_rows = [], []
        for j, ql, kl in zip(members, q_lens, k_lens):
            start = layout.starts[j]
            q_rows.append(list(range(start, start + ql)) + [start] * (lq - ql))
            keys = [p for a, b in layout.key_spans[j] for p in range(a, b)]
            k_rows.append(keys + [keys[0]] * (lk - kl))
        self.q_index = torch.tensor(q_rows, dtype=torch.int64)
        self.k_index = torch.tensor(k_rows, dtype=torch.int64)
        uniform = len(set(q_lens)) == 1 and len(set(k_lens)) == 1
        self.valid = None
        if not uniform:
            self.valid = torch.tensor([m * lq + i for m, ql in enumerate(q_lens) for i in range(ql)], dtype=torch.int64)
        if uniform:
            single = _lower_right_mask(lq, lk, window, device)
            self.mask = None if single is None else single[None, None]
        else:
            i = torch.arange(lq, device=device)[None, :, None]
            t = torch.arange(lk, device=device)[None, None, :]
            ql = torch.tensor(q_lens, device=device)[:, None, None]
            kl = torch.tensor(k_lens, device=device)[:, None, None]
            last = i + kl - ql  # the key position of query i
            seen = (t < kl) & (t <= last)
            if window is not None:
                seen &= t > last - window
            # A padding query sees its member's first key, so that no softmax row is empty (some
            # kernels turn an empty row into NaN, which would reach the gradients).
            self.mask = torch.where(i < ql, seen, t == 0)[:, None]


def _gather_or_none(index: Tensor, size: int, device: torch.device) -> Tensor | None:
    """``index`` on ``device``, or ``None`` where it is ``arange(size)`` (the row itself)."""
    return None if torch.equal(index, torch.arange(size)) else index.to(device)


class _SdpaPlan:
    """How the ``sdpa`` backend computes a layout: buckets of segments, each bucket's queries and keys
    taken from the row by one gather for all buckets, and the outputs put back in row order by one.

    q_gather ``[sum g*Lq]`` / k_gather ``[sum g*Lk]``: the row positions of every bucket's queries /
    keys, bucket after bucket (``None``: the row itself); q_sizes / k_sizes: each bucket's share of
    them; out_gather ``[S]``: for each row position, its query's place among the buckets' outputs
    (``None``: the same order). One gather each way means one scatter-add each way in the backward,
    instead of a zero-filled row-sized gradient per bucket and their sum.
    """

    def __init__(self, layout: DocumentLayout, window: int | None, device: torch.device) -> None:
        order = sorted(range(layout.num_segments), key=lambda j: (layout.key_lengths[j], layout.query_lengths[j]))
        groups: list[list[int]] = []
        max_q = max_k = 0
        for j in order:
            q, k = layout.query_lengths[j], layout.key_lengths[j]
            if groups:
                g = len(groups[-1])
                nq, nk = max(max_q, q), max(max_k, k)
                # Sorted by keys, so joining only grows the bucket: join while the padding it adds
                # costs less than a call of its own.
                if (g + 1) * nq * nk - g * max_q * max_k - q * k < CALL_COST_PAIRS:
                    groups[-1].append(j)
                    max_q, max_k = nq, nk
                    continue
            groups.append([j])
            max_q, max_k = q, k
        self.buckets = [_Bucket(layout, members, window, device) for members in groups]
        self.q_sizes = [b.q_index.numel() for b in self.buckets]
        self.k_sizes = [b.k_index.numel() for b in self.buckets]
        self.q_gather = _gather_or_none(torch.cat([b.q_index.flatten() for b in self.buckets]), layout.num_tokens,
                                        device)
        self.k_gather = _gather_or_none(torch.cat([b.k_index.flatten() for b in self.buckets]), layout.num_tokens,
                                        device)
        places, offset = [], 0
        for b, size in zip(self.buckets, self.q_sizes):
            places.append(offset + (torch.arange(size) if b.valid is None else b.valid))
            offset += size
        rows = torch.cat([b.q_index.flatten() if b.valid is None else b.q_index.flatten()[b.valid]
                          for b in self.buckets])
        out = torch.empty(layout.num_tokens, dtype=torch.int64)
        out[rows] = torch.cat(places)
        self.out_gather = None if offset == layout.num_tokens and torch.equal(out, torch.arange(offset)) \
            else out.to(device)


def _attend_sdpa(layout: DocumentLayout, q: Tensor, k: Tensor, v: Tensor, scale: float | None, dropout: float,
                 window: int | None) -> Tensor:
    """``q [H, S, D]``, ``k, v [Hkv, S, D]`` -> ``[S, H, D]``, one SDPA call per bucket of segments."""
    plan = layout.sdpa_plan(q.device, window)
    heads, dim = q.shape[0], q.shape[-1]
    gqa = heads != k.shape[0]
    if plan.q_gather is not None:
        q = q.index_select(1, plan.q_gather)
    if plan.k_gather is not None:
        k, v = k.index_select(1, plan.k_gather), v.index_select(1, plan.k_gather)
    many = len(plan.buckets) > 1
    qs, ks, vs = (q.split(plan.q_sizes, 1), k.split(plan.k_sizes, 1), v.split(plan.k_sizes, 1)) if many \
        else ((q,), (k,), (v,))
    outs = []
    for b, qb, kb, vb in zip(plan.buckets, qs, ks, vs):
        qb = qb.unflatten(1, (b.size, b.num_queries)).transpose(0, 1)  # [g, H, Lq, D]
        kb = kb.unflatten(1, (b.size, b.num_keys)).transpose(0, 1)  # [g, Hkv, Lk, D]
        vb = vb.unflatten(1, (b.size, b.num_keys)).transpose(0, 1)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, dropout_p=dropout, is_causal=b.mask is None,
                                             scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(-1, heads, dim))  # [g * Lq, H, D]
    out = torch.cat(outs) if many else outs[0]
    return out if plan.out_gather is None else out.index_select(0, plan.out_gather)


def _varlen() -> tuple[Any, frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available(q: Tensor, dropout: float = 0.0, window: int | None = None, max_keys: int = 0) -> bool:
    """Whether the ``varlen`` backend can compute this call (CUDA, half precision, no dropout, no cutting window)."""
    return (_varlen() is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0
            and (window is None or window >= max_keys))


def _attend_varlen(layout: DocumentLayout, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """``q [H, S, D]``, ``k, v [Hkv, S, D]`` -> ``[S, H, D]`` in one variable-length flash-attention call."""
    fn, params = _varlen()
    cu_q, cu_k, index = layout.device_offsets(q.device)
    q_rows, k_rows, v_rows = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if index is not None:
        k_rows, v_rows = k_rows.index_select(0, index), v_rows.index_select(0, index)
    max_q, max_k = max(layout.query_lengths), max(layout.key_lengths)
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal, aligned to the last key (flash attention's convention)
    else:
        kwargs["is_causal"] = True
    if q.shape[0] != k.shape[0]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[0] // k.shape[0]
            k_rows, v_rows = k_rows.repeat_interleave(rep, 1), v_rows.repeat_interleave(rep, 1)
    return fn(q_rows.contiguous(), k_rows.contiguous(), v_rows.contiguous(), cu_q, cu_k, max_q, max_k, **kwargs)


def attend(layout: DocumentLayout, query: Tensor, key: Tensor, value: Tensor, *, scale: float | None = None,
           dropout: float = 0.0, sliding_window: int | None = None) -> Tensor:
    """Attention of one packed row under ``layout``.

    Args:
        query: ``[H, S, D]``; key, value: ``[Hkv, S, D]`` (``H`` a multiple of ``Hkv``).
        scale: softmax scale (default ``1/sqrt(D)``); dropout: attention dropout probability;
        sliding_window: a key more than ``sliding_window - 1`` positions before its query is not seen.

    Returns ``[S, H, D]`` (transformers' attention-output layout without the batch dimension).
    """
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"attend: query [H, S, D] and key, value [Hkv, S, D] expected, got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[1] != layout.num_tokens or key.shape[1] != layout.num_tokens:
        raise ValueError(f"attend: the row has {query.shape[1]} queries and {key.shape[1]} keys but the layout "
                         f"covers {layout.num_tokens} tokens")
    if query.shape[0] % key.shape[0]:
        raise ValueError(f"attend: {query.shape[0]} query heads are not a multiple of {key.shape[0]} key heads")
    backend = layout.backend
    if backend == "auto":
        backend = "varlen" if varlen_available(query, dropout, sliding_window, max(layout.key_lengths)) else "sdpa"
    if backend == "varlen":
        if _varlen() is None:
            raise ValueError("attend: backend 'varlen' needs torch.nn.attention.varlen (PyTorch >= 2.10)")
        return _attend_varlen(layout, query, key, value, scale)
    return _attend_sdpa(layout, query, key, value, scale, dropout, sliding_window)


# ---------------------------------------------------------------------------- transformers plumbing
def document_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       document_layout: DocumentLayout | None = None, sliding_window: int | None = None,
                       **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature (``query [1, H, S, D]``, ``key, value [1, Hkv, S,
    D]`` -> ``([1, S, H, D], None)``). With ``document_layout`` the row attends per document; without
    it this is transformers' SDPA attention, unchanged (generation, the padded forward)."""
    if document_layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if attention_mask is None and query.shape[2] > 1:
            # An unpadded row without a cache gets no mask from _document_mask; its sliding window, if
            # one cuts, is applied here.
            attention_mask = _lower_right_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError(f"{type(module).__name__}: document attention supports neither logit soft-capping nor "
                         "attention sinks; use --fsdp.packing_samples false")
    if query.shape[0] != 1:
        raise ValueError(f"document attention runs on one packed row, got a batch of {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("document attention: an attention mask was given with a document layout (the layout "
                         "is the mask)")
    document_layout.calls += 1
    out = attend(document_layout, query[0], key[0], value[0], scale=scaling, dropout=dropout,
                 sliding_window=sliding_window)
    return out[None], None


def _document_mask(**kwargs: Any) -> Tensor | None:
    """transformers' SDPA mask function, except that a row without padding and without a cache gets
    no mask at all: :func:`document_attention` applies causality, the documents and any sliding
    window itself, so no ``[S, S]`` mask is built for a packed row."""
    from transformers.masking_utils import sdpa_mask

    padding = kwargs.get("attention_mask")
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    if (kwargs.get("q_length") == kwargs.get("kv_length") and not isinstance(q_offset, Tensor) and q_offset == 0
            and kv_offset == 0 and (padding is None or bool(padding.all()))):
        return None
    return sdpa_mask(**kwargs)


@lru_cache(maxsize=1)
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, document_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _document_mask)


def document_attention_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take document attention, or ``None`` when it can."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(model, "set_attn_implementation"):
        return f"{name} is not a transformers model with a configurable attention implementation"
    current = getattr(config, "_attn_implementation", None)
    if current not in (None, "sdpa", "eager", ATTENTION_NAME):
        return (f"{name} was built with attn_implementation={current!r}; document attention replaces "
                "sdpa (leave --fsdp.attn_implementation unset)")
    if getattr(config, "attn_logit_softcapping", None):
        return f"{name} soft-caps its attention logits, which document attention does not support"
    if getattr(config, "attention_chunk_size", None):
        return f"{name} uses chunked attention, which document attention does not support"
    return None


def use_document_attention(model: torch.nn.Module) -> None:
    """Make ``model`` compute attention with :func:`document_attention` (idempotent).

    Raises ``ValueError`` naming the model class when it cannot (the learner then needs
    ``--fsdp.packing_samples false``). Calls without a ``document_layout`` behave as SDPA.
    """
    problem = document_attention_unsupported(model)
    if problem is not None:
        raise ValueError(f"packed learner forward: {problem}; use --fsdp.packing_samples false")
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
