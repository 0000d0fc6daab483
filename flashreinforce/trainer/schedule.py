"""Learning-rate schedules of the learner (``actor.lr_scheduler``), as a multiplier of the base rate."""

from __future__ import annotations

import math

import torch

__all__ = ["SCHEDULERS", "lr_factor", "make_scheduler"]

#: Known ``actor.lr_scheduler`` values.
SCHEDULERS = ("cosine_with_min_lr", "constant", "constant_with_warmup")


def lr_factor(step: int, settings) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based).

    ``settings`` has ``scheduler``, ``warmup_ratio``, ``min_lr_ratio`` and ``total_steps`` (a
    :class:`~flashreinforce.trainer.learner.LearnerSettings`).

    ``cosine_with_min_lr``: linear warmup over ``ceil(warmup_ratio * total_steps)`` steps, then a
    half cosine from 1 down to ``min_lr_ratio`` at ``total_steps``. ``constant``: 1 (warmup ignored,
    as in Hugging Face's ``constant``). ``constant_with_warmup``: linear warmup, then 1.
    """
    warmup = math.ceil(settings.warmup_ratio * settings.total_steps)
    if settings.scheduler == "constant":
        return 1.0
    if step < warmup:
        return (step + 1) / warmup
    if settings.scheduler == "constant_with_warmup":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, settings.total_steps - warmup))
    return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, settings) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler stepping ``optimizer``'s learning rate by :func:`lr_factor` once per update."""
    if settings.scheduler not in SCHEDULERS:
        raise ValueError(f"actor.lr_scheduler must be one of {SCHEDULERS}, got {settings.scheduler!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, settings))
