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

A file must be UTF-8 text; a key given twice in one mapping (a section written twice included) is
refused with the lines of both; the whole is bounded (:mod:`flashreinforce.config.values`: nesting
depth, and the number of values once YAML aliases are expanded). Each problem is one line naming
the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from flashreinforce.config.schema import RETIRED_FLAGS, ConfigError
from flashreinforce.config.trainer_config import FLAG_BY_NAME, RUN_OPTIONS, TrainerConfig, unknown_flag_message
from flashreinforce.config.values import MAX_DEPTH, shown, value_problem

__all__ = ["flatten_settings", "parse_settings_text", "read_config_file", "write_config_file"]

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
                raise ConfigError(f"{source}: keys must be strings, got {shown(key)}")
            name = f"{prefix}{key}"
            if name in FLAG_BY_NAME or name in _FILE_KEYS or name in RETIRED_FLAGS:
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


class _DuplicateKey(Exception):
    pass


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {shown(key)} is given twice in one object")
        out[key] = value
    return out


def _yaml_loader():
    """A ``yaml.SafeLoader`` that refuses a key given twice in one mapping (the last one would win
    silently, and a section written twice would lose the first one's keys)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *base: later keys override it
                        continue
                    key = (key_node.tag, key_node.value) if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                    line = key_node.start_mark.line + 1
                    if key in seen:
                        raise _DuplicateKey(f"key {shown(key_node.value)} is given twice in one mapping (lines "
                                            f"{seen[key]} and {line})")
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return Loader


def parse_settings_text(text: str, path: str | Path, flag: str = "--config") -> Any:
    """The data of a YAML (or, for a ``.json`` path, JSON) settings text, bounded and without
    duplicate keys; ``ConfigError`` naming ``flag`` and ``path`` in one line."""
    where = f"{flag} {path}"
    try:
        if str(path).endswith(".json"):
            try:
                data = json.loads(text, object_pairs_hook=_json_object)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{where}: not valid JSON: {err}") from None
        else:
            import yaml

            try:
                data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader)
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                line = f" (line {mark.line + 1})" if mark is not None else ""
                problem = str(getattr(err, "problem", None) or err).replace("\n", " ")
                raise ConfigError(f"{where}: not valid YAML{line}: {problem[:300]}") from None
    except _DuplicateKey as err:
        raise ConfigError(f"{where}: {err}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read (settings may nest {MAX_DEPTH} levels)") from None
    problem = value_problem(data)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return data


def read_config_file(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """The settings of a YAML or JSON config file as dotted keys (``ConfigError`` naming ``flag``)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{flag} {path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}, line "
                          f"{line}); save it as UTF-8") from None
    data = parse_settings_text(text, path, flag)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{flag} {path}: expected a mapping of settings, got {type(data).__name__}")
    return flatten_settings(data, f"{flag} {path}")


def write_config_file(cfg: TrainerConfig, path: str | Path) -> None:
    """Write ``cfg``'s resolved settings as YAML (atomically: a crash leaves the old file or the new one)."""
    import yaml

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    header = ("# The resolved configuration of this run (flashreinforce train --config FILE reads it; "
              "--resume reads it from the run directory).\n")
    tmp.write_text(header + yaml.safe_dump(cfg.to_file(), sort_keys=False, default_flow_style=False))
    tmp.replace(path)
