"""The trainer's flag table, generated from the configuration sections (one row per field).

Flags keep Molt's dotted names (``--rollout.batch_size``, ``--actor.adam.lr``, ...) so users move
between the two trainers unchanged. The rows come from :mod:`flashreinforce.config.sections` (each
field declares its help, kind and bounds once); parsing the command line is
:mod:`flashreinforce.config.command_line`, merging the layers and checking the result
:mod:`flashreinforce.config.resolution`.
"""

from __future__ import annotations

from flashreinforce.config.schema import ConfigError, Flag
from flashreinforce.config.trainer_config import FLAG_BY_NAME, FLAGS, RUN_OPTIONS

__all__ = ["EXTRA_OPTIONS", "FLAGS", "FLAG_BY_NAME", "ConfigError", "Flag"]

#: Options that are not Molt flags (the run's own options).
EXTRA_OPTIONS = tuple(RUN_OPTIONS)
