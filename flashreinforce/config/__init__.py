"""Configuration of a run: the flag table, its rules and the named presets."""

from flashreinforce.config.flags import (FLAGS, ConfigError, Flag, ResolvedConfig, build_parser, parse_train_args,
                                         resolve)

__all__ = ["FLAGS", "ConfigError", "Flag", "ResolvedConfig", "build_parser", "parse_train_args", "resolve"]
