"""The row the model body runs for a packed micro-batch: documents, and the prefixes they share.

A packed micro-batch holds N tokens of B trajectories. Without sharing, the body runs those N tokens
as one row with per-document attention (:class:`flashreinforce.models.attention.DocumentLayout`).
Trajectories of an agentic batch often start with the same tokens (the chat template's system
prompt, a tool list, instructions; for GRPO groups the whole prompt): :func:`forward_row` finds
those shared prefixes from the token ids alone and runs each once. The row then holds S <= N tokens:
every shared prefix once, then the rest of each trajectory, attending to its prefixes' keys and
values. Positions are the trajectories' own positions (a continuation starts where its prefix
ends), so every hidden state equals the one the unshared row gives, and gradients from every
trajectory gather in the prefix: the computation is exact, only cheaper.

The shared parts are the branches of the batch's radix tree of token sequences, kept where at least
two trajectories share ``min_shared_tokens`` tokens beyond the previous kept branch (a shorter
branch is cheaper to recompute than to attend to as one more segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flashreinforce.models.attention import DocumentLayout
from flashreinforce.trainer.learning.packing import PackedBatch

__all__ = ["DEFAULT_MIN_SHARED_TOKENS", "ForwardRow", "forward_row"]

#: The shortest run of tokens shared by several trajectories that is computed once.
DEFAULT_MIN_SHARED_TOKENS = 8


@dataclass
class ForwardRow:
    """One row of S tokens for the model body, and where each packed token's hidden state is in it.

    input_ids, position_ids: ``[S]`` int64 (positions within each token's own trajectory).
    layout: the row's attention structure. token_index: ``[N]`` int64, the row position holding
    packed token t (shared tokens map several packed tokens to one row position).
    """

    input_ids: Tensor
    position_ids: Tensor
    layout: DocumentLayout
    token_index: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def shared_tokens(self) -> int:
        """Packed tokens not recomputed (N - S)."""
        return int(self.token_index.numel()) - self.num_tokens


@dataclass
class _Node:
    start: int  # trajectory positions [start, end) of every member
    end: int
    parent: int  # index of the parent node, -1 for a root
    members: list[int]
    children: list[int]


def _radix_tree(seqs: list[np.ndarray]) -> list[_Node]:
    """The compressed trie of ``seqs``: each node is a run of positions its members share."""
    nodes: list[_Node] = []
    by_first: dict[int, list[int]] = {}
    for m, s in enumerate(seqs):
        by_first.setdefault(int(s[0]), []).append(m)
    # (members, start, parent): members share positions [0, start); parents are numbered before children.
    stack = [(members, 0, -1) for members in reversed(list(by_first.values()))]
    while stack:
        members, start, parent = stack.pop()
        ref = seqs[members[0]]
        limit = min(len(seqs[m]) for m in members)
        lcp = limit - start
        for m in members[1:]:
            diff = np.flatnonzero(ref[start:start + lcp] != seqs[m][start:start + lcp])
            if diff.size:
                lcp = int(diff[0])
        index = len(nodes)
        nodes.append(_Node(start, start + lcp, parent, members, []))
        if parent >= 0:
            nodes[parent].children.append(index)
        end = start + lcp
        groups: dict[int, list[int]] = {}
        for m in members:
            if len(seqs[m]) > end:
                groups.setdefault(int(seqs[m][end]), []).append(m)
        stack.extend((g, end, index) for g in reversed(list(groups.values())))
    return nodes


def forward_row(batch: PackedBatch, *, share_prefixes: bool = True,
                min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS, backend: str = "auto") -> ForwardRow:
    """The row the body runs for ``batch`` (see the module docstring).

    ``share_prefixes=False`` gives the plain packed row (S = N, one root segment per trajectory).
    ``min_shared_tokens``: the shortest shared run computed once (>= 1). ``backend``: the
    attention backend of the layout (:data:`flashreinforce.models.attention.BACKENDS`).
    """
    if min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens must be >= 1, got {min_shared_tokens}")
    cu = batch.cu_seqlens.to(torch.int64)
    lengths = (cu[1:] - cu[:-1]).tolist()
    if not share_prefixes or batch.num_trajectories < 2:
        return ForwardRow(batch.input_ids, batch.position_ids, DocumentLayout.from_lengths(lengths, backend=backend),
                          torch.arange(batch.num_tokens, dtype=torch.int64))
    ids = batch.input_ids.numpy()
    seqs = [ids[int(cu[i]):int(cu[i + 1])] for i in range(len(lengths))]
    nodes = _radix_tree(seqs)

    # Keep the nodes shared by several trajectories over >= min_shared_tokens beyond the nearest kept ancestor.
    kept_start: dict[int, int] = {}  # kept node -> its segment's first position
    anchor = {}  # node -> (nearest kept ancestor or -1, that ancestor's end)
    for index, node in enumerate(nodes):
        above = anchor[node.parent] if node.parent >= 0 else (-1, 0)
        if node.parent >= 0 and node.parent in kept_start:
            above = (node.parent, nodes[node.parent].end)
        anchor[index] = above
        if len(node.members) >= 2 and node.end - above[1] >= min_shared_tokens:
            kept_start[index] = above[1]
    if not kept_start:
        return forward_row(batch, share_prefixes=False, backend=backend)

    # Each trajectory's path: its kept nodes root first, then its own tail (possibly empty).
    deepest = [-1] * len(seqs)
    for index in kept_start:  # nodes are numbered parents first, so deeper nodes come later
        for m in nodes[index].members:
            deepest[m] = index
    # Children of each kept node (and of the virtual root -1): kept nodes and tails, by first member.
    children: dict[int, list[tuple[int, str, int]]] = {}
    for index in kept_start:
        up = anchor[index][0]
        children.setdefault(up, []).append((nodes[index].members[0], "node", index))
    for m, seq in enumerate(seqs):
        tail_start = nodes[deepest[m]].end if deepest[m] >= 0 else 0
        if tail_start < len(seq):
            children.setdefault(deepest[m], []).append((m, "tail", m))

    starts: list[int] = []
    parents: list[int] = []
    pieces_ids: list[Tensor] = []
    pieces_pos: list[Tensor] = []
    node_segment: dict[int, int] = {}
    tail_segment: dict[int, tuple[int, int]] = {}  # trajectory -> (row start, trajectory start)
    row = 0
    order = [(-1, item) for item in sorted(children.get(-1, []))][::-1]
    while order:
        parent_segment, (_, kind, key) = order.pop()
        if kind == "node":
            node = nodes[key]
            member, lo, hi = node.members[0], kept_start[key], node.end
        else:
            member, hi = key, len(seqs[key])
            lo = nodes[deepest[key]].end if deepest[key] >= 0 else 0
        segment = len(starts)
        starts.append(row)
        parents.append(parent_segment)
        first = int(cu[member])
        pieces_ids.append(batch.input_ids[first + lo:first + hi])
        pieces_pos.append(batch.position_ids[first + lo:first + hi])
        if kind == "node":
            node_segment[key] = segment
            order.extend((segment, item) for item in sorted(children.get(key, []), reverse=True))
        else:
            tail_segment[key] = (row, lo)
        row += hi - lo
    ends = starts[1:] + [row]
    layout = DocumentLayout(starts, ends, parents, backend=backend)

    token_index = torch.empty(batch.num_tokens, dtype=torch.int64)
    for m, seq in enumerate(seqs):
        first = int(cu[m])
        path = []
        index = deepest[m]
        while index >= 0:
            path.append(index)
            index = anchor[index][0]
        for index in path:
            seg = node_segment[index]
            lo, hi = kept_start[index], nodes[index].end
            token_index[first + lo:first + hi] = torch.arange(starts[seg], starts[seg] + hi - lo)
        if m in tail_segment:
            row_start, lo = tail_segment[m]
            token_index[first + lo:first + len(seq)] = torch.arange(row_start, row_start + len(seq) - lo)
    return ForwardRow(torch.cat(pieces_ids), torch.cat(pieces_pos), layout, token_index)
