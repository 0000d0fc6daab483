"""Resolving a run's configuration from its layers.

Resolution merges, last wins: the flag defaults (the sections' fields), the preset (``--preset``, or
a ``preset:`` key of the config file), the config file (``--config``), then the flags given on the
command line (:meth:`~flashreinforce.config.trainer_config.TrainerConfig.from_layers`); then the
whole is checked (:func:`flashreinforce.config.checks.validate`).
"""

from __future__ import annotations

from typing import Any, Mapping

from flashreinforce.config.checks import parse_worker_resources, validate
from flashreinforce.config.trainer_config import TrainerConfig

__all__ = ["parse_worker_resources", "resolve", "validate"]


def resolve(given: Mapping[str, Any], preset: Mapping[str, Any] | None = None,
            file: Mapping[str, Any] | None = None) -> TrainerConfig:
    """Merge the defaults, ``preset``, ``file`` (flat dotted keys) and ``given``, then check the result.

    Raises:
        ConfigError: a value this runtime cannot honour or a broken rule, naming the flag(s).
    """
    cfg = TrainerConfig.from_layers(given, preset, file)
    validate(cfg)
    return cfg
