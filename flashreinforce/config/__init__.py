"""Configuration of a run: typed sections whose fields are the flags, the whole configuration and its
resolution from layers, its checks, config files and ``--resume``, the command line, the presets.

``TrainerConfig`` is the whole configuration (``config.train.max_steps`` is ``--train.max_steps``);
``parse_train_args`` builds one from a command line, ``resolve`` from layers of flat settings,
``read_config_file`` / ``write_config_file`` speak the ``--config`` format.

Modules: ``schema`` (how a field declares its flag, the check of one value, the bounds of a value,
freezing), ``sections`` (one dataclass per flag section, with its validators), ``trainer_config``
(``TrainerConfig``, the flag table ``FLAGS``, ``resolve``), ``checks`` (``validate``: the whole, the rules
every run obeys, the inactive flags), ``files`` (config files, absolute paths, the resume table),
``command_line`` (the ``flashreinforce train`` parser), ``presets``.
"""

from flashreinforce.config.checks import validate
from flashreinforce.config.command_line import build_parser, parse_train_args
from flashreinforce.config.files import read_config_file, write_config_file
from flashreinforce.config.schema import ConfigError, Flag
from flashreinforce.config.trainer_config import FLAGS, TrainerConfig, resolve

__all__ = ["FLAGS", "ConfigError", "Flag", "TrainerConfig", "build_parser", "parse_train_args",
           "read_config_file", "resolve", "validate", "write_config_file"]
