"""Environments: the :class:`Environment` interface and the ones the project ships."""

from flashreinforce.envs.base import Environment, StepResult

__all__ = ["Environment", "StepResult"]
