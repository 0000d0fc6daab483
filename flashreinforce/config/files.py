"""Config files: ``--config run.yaml`` in, ``OUTPUT/config.yaml`` out, in one format.

A config file is a YAML (or JSON) mapping whose keys are the flag names, nested by section or
dotted, and the run's options (``preset``, ``env``, ``env.kwargs``, ``model``, ``reward``,
``tokenizer``, ``seed``, ``device``, ``torch_threads``)::

    preset: arith
    train: {max_steps: 20}
    actor.adam.lr: 2.0e-5
    logger:
      tensorboard: {dir: runs/tb}

Every run writes its resolved configuration to ``OUTPUT/config.yaml`` in this format (all flags,
nested), so ``--config OUTPUT/config.yaml`` (or ``--resume``, which reads it) gives the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from flashreinforce.config.schema import ConfigError
from flashreinforce.config.trainer_config import FLAG_BY_NAME, RUN_OPTIONS, TrainerConfig, unknown_flag_message

__all__ = ["flatten_settings", "read_config_file", "write_config_file"]

# Keys a config file may hold besides the flags (run-control options stay on the command line).
_FILE_KEYS = ("preset", "env", "env.kwargs", "model", "reward", "agent", "tokenizer", "seed", "device", "torch_threads")
_PREFIXES = {name.rsplit(".", i)[0] for name in list(FLAG_BY_NAME) + list(_FILE_KEYS)
             for i in range(1, name.count(".") + 1)}


def flatten_settings(data: Mapping[str, Any], source: str = "the config") -> dict[str, Any]:
    """Dotted keys of a nested (or dotted, or mixed) settings mapping; ``ConfigError`` for a key
    that names no flag or option, with the closest names."""
    flat: dict[str, Any] = {}

    def walk(mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise ConfigError(f"{source}: keys must be strings, got {key!r}")
            name = f"{prefix}{key}"
            if name in FLAG_BY_NAME or name in _FILE_KEYS:
                if name == "env" and isinstance(value, Mapping):  # env: {kwargs: {...}}
                    walk(value, "env.")
                    continue
                if name in flat:
                    raise ConfigError(f"{source}: {name} is given twice")
                flat[name] = value
            elif name in _PREFIXES and isinstance(value, Mapping):
                walk(value, name + ".")
            elif name in RUN_OPTIONS:
                raise ConfigError(f"{source}: {name} is a command-line option (give --{name}), not a setting")
            else:
                raise ConfigError(f"{source}: {unknown_flag_message(name).replace('unknown flag --', 'unknown key ')}")

    walk(data, "")
    return flat


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a YAML or JSON config file as dotted keys (``ConfigError`` naming ``--config``)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--config {path}: not valid JSON: {err}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" (line {where.line + 1})" if where is not None else ""
            raise ConfigError(f"--config {path}: not valid YAML{line}: {getattr(err, 'problem', err)}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    return flatten_settings(data, f"--config {path}")


def write_config_file(cfg: TrainerConfig, path: str | Path) -> None:
    """Write ``cfg``'s resolved settings as YAML (atomically: a crash leaves the old file or the new one)."""
    import yaml

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    header = ("# The resolved configuration of this run (flashreinforce train --config FILE reads it; "
              "--resume reads it from the run directory).\n")
    tmp.write_text(header + yaml.safe_dump(cfg.to_file(), sort_keys=False, default_flow_style=False))
    tmp.replace(path)
