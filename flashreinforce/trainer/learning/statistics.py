"""What a learner measures on its part of a batch.

:class:`GradientParts` is what one process measured on its part of a batch (a micro-batch loop, a
rank's share; :func:`flashreinforce.trainer.learning.learner.summarize_parts` turns the parts that cover a
batch into the update's loss and statistics). :class:`PendingStats` keeps a part's statistics on the
device until its passes are queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["GradientParts", "PendingStats"]


@dataclass
class GradientParts:
    """What :meth:`Learner.accumulate_gradient_parts` measured on its part of a batch (all detached, CPU).

    rows: batch rows of the part's trajectories. loss, entropy_sum: sums over the part.
    flops: model FLOPs of the part's passes, forward and backward or forward only (:mod:`.flops`).
    per_trajectory: the loss mode's per-trajectory statistics, float64 in ``rows`` order.
    sums: the loss mode's additive counts. error: the loss error met with ``collective_forwards``
    (the passes went on with zero loss).
    """

    rows: list[int]
    loss: float = 0.0
    entropy_sum: float = 0.0
    flops: float = 0.0
    per_trajectory: dict[str, Tensor] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class PendingStats:
    """A part's statistics while its passes are queued: device tensors (and floats), read back at once."""

    losses: list[Tensor] = field(default_factory=list)
    entropy_sums: list[Tensor] = field(default_factory=list)
    per_trajectory: list[tuple[Tensor, dict[str, Tensor]]] = field(default_factory=list)  # (part rows, values)
    sums: dict[str, list] = field(default_factory=dict)

    def read_into(self, out: GradientParts) -> None:
        """Adds the statistics to ``out`` (CPU floats and float64 tensors): one transfer per kind."""
        if self.losses:
            out.loss += float(torch.stack([x.double() for x in self.losses]).sum())
        if self.entropy_sums:
            out.entropy_sum += float(torch.stack([x.double() for x in self.entropy_sums]).sum())
        if self.per_trajectory:
            local = torch.cat([rows for rows, _ in self.per_trajectory])
            for name in out.per_trajectory:
                values = torch.cat([v[name].double() for _, v in self.per_trajectory]).cpu()
                out.per_trajectory[name][local] = values
        for name, values in self.sums.items():
            tensors = [v for v in values if isinstance(v, Tensor)]
            total = sum(v for v in values if not isinstance(v, Tensor))
            if tensors:
                total += float(torch.stack([v.double() for v in tensors]).sum())
            out.sums[name] = out.sums.get(name, 0.0) + total
