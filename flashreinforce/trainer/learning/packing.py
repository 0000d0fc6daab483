"""Packing trajectories for the learner: no padding, ``cu_seqlens`` offsets, reset positions.

``pack`` lays B trajectories end to end: ``input_ids[N]`` with ``position_ids`` restarting at 0 for
each trajectory, ``cu_seqlens[B+1]`` (int32, trajectory i owns ``[cu[i], cu[i+1])``), and per-token
``action_mask`` and ``behavior_log_probs`` aligned with the tokens (the value for token t sits at index
t, as the loss expects). ``micro_batches`` splits a batch, in order, into groups that respect a token
budget and a trajectory count. ``to_padded`` gives the rows of a packed batch as a padded
``[B, T]`` tensor for models without a variable-length attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from flashreinforce.trainer.rollout.trajectory import Trajectory

__all__ = ["PackedBatch", "micro_batches", "pack", "to_padded"]


@dataclass
class PackedBatch:
    """B trajectories packed into N tokens (shapes in the field comments; all on CPU).

    ``rows`` are the indices of these trajectories in the batch they came from.
    """

    input_ids: Tensor  # [N] int64
    position_ids: Tensor  # [N] int64, 0 at the start of each trajectory
    cu_seqlens: Tensor  # [B+1] int32
    action_mask: Tensor  # [N] bool
    behavior_log_probs: Tensor  # [N] float32, 0 on non-action tokens
    rewards: Tensor  # [B] float32
    failures: Tensor  # [B] bool
    rows: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_trajectories(self) -> int:
        return len(self.rows)

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def pack(trajectories: Sequence[Trajectory], rows: Sequence[int] | None = None) -> PackedBatch:
    """Pack ``trajectories`` (in the order given) into one :class:`PackedBatch`."""
    if len(trajectories) == 0:
        raise ValueError("pack: trajectories is empty")
    lengths = [t.num_tokens for t in trajectories]
    for i, t in enumerate(trajectories):
        if not (len(t.action_mask) == len(t.behavior_log_probs) == lengths[i]):
            raise ValueError(f"pack: trajectory {i} has token_ids {lengths[i]}, action_mask {len(t.action_mask)}, "
                             f"behavior_log_probs {len(t.behavior_log_probs)}")
        if lengths[i] == 0:
            raise ValueError(f"pack: trajectory {i} is empty")
    cu = torch.zeros(len(trajectories) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    n = int(cu[-1])
    input_ids = torch.tensor([x for t in trajectories for x in t.token_ids], dtype=torch.int64)
    action_mask = torch.tensor([bool(x) for t in trajectories for x in t.action_mask], dtype=torch.bool)
    blp = torch.tensor([float(x) for t in trajectories for x in t.behavior_log_probs], dtype=torch.float32)
    starts = torch.repeat_interleave(cu[:-1], torch.tensor(lengths))
    position_ids = torch.arange(n, dtype=torch.int64) - starts
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu.to(torch.int32),
        action_mask=action_mask,
        behavior_log_probs=blp.masked_fill(~action_mask, 0.0),
        rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
        failures=torch.tensor([bool(t.failed) for t in trajectories], dtype=torch.bool),
        rows=list(range(len(trajectories))) if rows is None else list(rows),
    )


def micro_batches(trajectories: Sequence[Trajectory], *, max_tokens: int | None = None,
                  max_trajectories: int | None = None) -> list[PackedBatch]:
    """Split in order into packed micro-batches of at most ``max_tokens`` tokens and
    ``max_trajectories`` trajectories (``None``/0: unlimited). A trajectory longer than
    ``max_tokens`` gets a micro-batch of its own (a sequence is never cut)."""
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if max_trajectories is not None and max_trajectories < 0:
        raise ValueError(f"max_trajectories must be >= 0, got {max_trajectories}")
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, t in enumerate(trajectories):
        full_count = bool(max_trajectories) and len(current) >= max_trajectories
        full_tokens = bool(max_tokens) and current and tokens + t.num_tokens > max_tokens
        if full_count or full_tokens:
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += t.num_tokens
    if current:
        groups.append(current)
    return [pack([trajectories[i] for i in g], rows=g) for g in groups]


def to_padded(batch: PackedBatch, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of ``batch`` as ``(input_ids [B, T], attention_mask [B, T] int64, index [N])`` where
    ``padded.flatten()[index]`` gives back the packed order (right padding with ``pad_id``)."""
    cu = batch.cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    b, t = len(lengths), int(lengths.max())
    row = torch.repeat_interleave(torch.arange(b), lengths)
    col = batch.position_ids
    index = row * t + col
    ids = torch.full((b * t,), pad_id, dtype=torch.int64)
    ids[index] = batch.input_ids
    mask = torch.zeros(b * t, dtype=torch.int64)
    mask[index] = 1
    return ids.view(b, t), mask.view(b, t), index
