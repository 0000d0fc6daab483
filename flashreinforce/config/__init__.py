"""Configuration of a run: the flag table, the command line, the resolution and its rules, the presets."""

from flashreinforce.config.command_line import build_parser, parse_train_args
from flashreinforce.config.flags import FLAGS, ConfigError, Flag
from flashreinforce.config.resolution import ResolvedConfig, resolve

__all__ = ["FLAGS", "ConfigError", "Flag", "ResolvedConfig", "build_parser", "parse_train_args", "resolve"]
