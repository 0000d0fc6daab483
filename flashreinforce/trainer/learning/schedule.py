"""Learning-rate schedules of the learner (``actor.lr_scheduler``), as a multiplier of the base rate."""

from __future__ import annotations

import math

import torch

__all__ = ["SCHEDULERS", "apply_settings", "lr_factor", "make_scheduler"]

#: Known ``actor.lr_scheduler`` values.
SCHEDULERS = ("cosine_with_min_lr", "constant", "constant_with_warmup")


def lr_factor(step: int, settings) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based).

    ``settings`` has ``scheduler``, ``warmup_ratio``, ``min_lr_ratio`` and ``total_steps`` (a
    :class:`~flashreinforce.trainer.learning.learner.LearnerSettings`).

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


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, settings) -> None:
    """Make this run's optimizer settings those in force after a checkpoint's optimizer and scheduler
    state were restored: that state holds the learning rate, betas and weight decay the run had when
    it saved, and would silently win over changed ones.

    The base rate is ``settings.lr`` and the rate of the next step ``settings.lr`` times
    :func:`lr_factor` at the restored position under this run's schedule (its scheduler, warmup,
    floor and length), which is what an uninterrupted run with these settings would use there.
    """
    factor = lr_factor(scheduler.last_epoch, settings)
    for group in optimizer.param_groups:
        group["initial_lr"] = settings.lr
        group["lr"] = settings.lr * factor
        group["betas"] = tuple(settings.betas)
        group["weight_decay"] = settings.weight_decay
    scheduler.base_lrs = [settings.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
