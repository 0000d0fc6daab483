"""Configuration of a run: typed sections whose fields are the flags, config files, the command
line, the resolution and its rules, the presets.

``TrainerConfig`` is the whole configuration (``config.train.max_steps`` is ``--train.max_steps``);
``parse_train_args`` builds one from a command line, ``resolve`` from layers of flat settings,
``read_config_file`` / ``write_config_file`` speak the ``--config`` format.
"""

from flashreinforce.config.command_line import build_parser, parse_train_args
from flashreinforce.config.files import read_config_file, write_config_file
from flashreinforce.config.flags import FLAGS, ConfigError, Flag
from flashreinforce.config.resolution import resolve, validate
from flashreinforce.config.trainer_config import TrainerConfig

__all__ = ["FLAGS", "ConfigError", "Flag", "TrainerConfig", "build_parser", "parse_train_args",
           "read_config_file", "resolve", "validate", "write_config_file"]
