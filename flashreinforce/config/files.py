"""A run's settings on disk: config files (``--config run.yaml`` in, ``OUTPUT/config.yaml`` out, in one
format), the paths they name made absolute, and what ``--resume`` reads and allows.

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
refused with the lines of both; the whole is bounded (:mod:`flashreinforce.config.schema`: nesting
depth, and the number of values once YAML aliases are expanded). Each problem is one line naming
the file.

**Paths** (:func:`absolute_paths`): the paths a configuration names, made absolute, so that a run means
the same files wherever it is resumed. A run records its settings (``OUTPUT/config.yaml``,
``config.json``, each checkpoint) with every relative path it names made absolute against the directory
it started in: resumed from another directory, it reads the same dataset, imports the same reward file
and writes to the same places. Inputs (the dataset, the evaluation dataset, the model and tokenizer when
they are local paths, an environment or reward ``FILE.py``) are made absolute when they exist (a
built-in model name such as ``tiny-qwen2`` is not a path); outputs (``ckpt.path``, ``ckpt.output_dir``,
``logger.tensorboard.dir``) always. Paths inside ``env.kwargs`` are the environment's to interpret.

**Resume**: the run's saved settings as the base, and what a resumed run may change.
``flashreinforce train --output runs/x --resume`` needs nothing else: the settings come from
``runs/x/config.yaml`` (runs written before that file existed: the ``flags`` of ``config.json``).
Flags given with ``--resume``, and edits of ``config.yaml``, are changes, and each setting has one
rule (the resume table of docs/trainer.md):

* **locked** (:data:`LOCKED`): what the run *is* (the model, the environment and its arguments, the
  preset, the reward functions, the data, the loss, the seed, the batch sizes). A change is listed in
  one line and refused unless ``--allow_config_change`` (then it is kept as a warning in
  ``config.json``);
* **takes effect**: everything else (learning rate and schedule, optimizer betas and weight decay,
  clipping, sampling, lengths, workers, the number of updates, evaluation, checkpoints, logging,
  device). The resumed run uses the new value from its first update and says so in one warning line
  listing every change (also in ``config.json``'s warnings); the optimizer's and scheduler's restored
  state does not override it.

Changes are found against the settings the run recorded itself (:func:`changes`): each checkpoint's
own (``state.json``'s ``run_settings``, compared by the trainer), and before anything starts the
flags of ``config.json`` (:func:`recorded_settings`), never ``config.yaml`` against itself. Both sides'
relative paths are made absolute first (:func:`absolute_paths`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flashreinforce.config.schema import MAX_DEPTH, RETIRED_FLAGS, ConfigError, shown, value_problem
from flashreinforce.config.trainer_config import (FLAG_BY_NAME, FLAGS, RUN_OPTIONS, TrainerConfig, file_value, resolve,
                                                  reward_spec, unknown_flag_message)
from flashreinforce.objective import OPTION_FLAGS

__all__ = ["IDENTITY", "INPUT_PATHS", "LOCKED", "OUTPUT_PATHS", "RUN_SETTINGS", "Change", "absolute_paths", "changes",
           "flatten_settings", "locked_changes_error", "parse_settings_text", "read_config_file", "recorded_settings",
           "review", "rule", "saved_settings", "settings_config", "write_config_file"]

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


# ---------------------------------------------------------------------- the paths a configuration names
#: Flags whose value is a file or folder the run reads (made absolute when it exists).
INPUT_PATHS = ("data.prompt_dataset", "eval.dataset", "actor.model_name_or_path")
#: Flags whose value is a folder the run writes (always made absolute).
OUTPUT_PATHS = ("ckpt.path", "ckpt.output_dir", "logger.tensorboard.dir")


def _absolute_if_exists(value: Any, cwd: str) -> Any:
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return value
    path = os.path.join(cwd, value)
    return os.path.normpath(path) if os.path.exists(path) else value


def _file_spec(spec: Any, cwd: str) -> Any:
    """``FILE.py``, ``FILE.py:NAME`` or ``FILE.py:NAME=WEIGHT`` with FILE made absolute (when it
    exists); any other spec (a module, a registered name, a function) unchanged."""
    if not isinstance(spec, str):
        return spec
    for prefix in ("verifiers:", "openenv:"):  # a library's environment given as a file
        if spec.startswith(prefix):
            return prefix + _file_spec(spec[len(prefix):], cwd)
    head, sep, tail = spec.partition(":")
    if not head.endswith(".py"):
        return spec
    return _absolute_if_exists(head, cwd) + sep + tail


def absolute_paths(cfg, cwd: str | None = None) -> list[str]:
    """Make ``cfg``'s relative paths absolute against ``cwd`` (default the current directory), in
    place; returns the names of the settings that changed."""
    cwd = os.path.abspath(cwd or os.getcwd())
    changed = []
    for name in INPUT_PATHS + OUTPUT_PATHS:
        value = cfg[name]
        if name in OUTPUT_PATHS and isinstance(value, str) and value and not os.path.isabs(value):
            new = os.path.normpath(os.path.join(cwd, value))
        else:
            new = _absolute_if_exists(value, cwd)
        if new != value:
            cfg.set(name, new)
            changed.append(name)
    agent = _file_spec(cfg.train.agent_path, cwd)
    if agent != cfg.train.agent_path:
        cfg.set("train.agent_path", agent)
        changed.append("train.agent_path")
    if cfg.tokenizer not in (None, "char"):
        tokenizer = _absolute_if_exists(cfg.tokenizer, cwd)
        if tokenizer != cfg.tokenizer:
            cfg.tokenizer = tokenizer
            changed.append("tokenizer")
    rewards = [_file_spec(r, cwd) for r in cfg.rewards]
    if rewards != list(cfg.rewards):
        cfg.rewards = rewards
        changed.append("rewards")
    return changed


# ---------------------------------------------------------------------- --resume
#: What a run is: the model, its environment and data, the loss (every loss option's flag, from
#: :class:`flashreinforce.objective.LossOptions`).
IDENTITY = ("preset", "actor.model_name_or_path", "tokenizer", "train.agent_path", "env_kwargs", "rewards",
            "data.prompt_dataset", "data.input_key", "data.label_key", "data.apply_chat_template", "actor.loss_mode",
            "algo.advantage.estimator", "rollout.n_samples_per_prompt") + tuple(OPTION_FLAGS.values())
#: Locked on resume: what the run is, and what its saved state was counted in. ``seed``: the prompt
#: order of the passes in progress and the sampling noise; the batch sizes and ``data.max_samples``:
#: the updates a pass makes and the prompt set the saved stream position counts in; ``lora.*`` but
#: dropout: which weights train and how the adapters scale (a checkpoint holds the adapters only).
LOCKED = IDENTITY + ("seed", "rollout.batch_size", "train.batch_size", "data.max_samples", "lora.rank", "lora.alpha",
                     "lora.target_modules", "lora.base_dtype")
#: The run options compared on resume besides the flags (``env_kwargs``/``rewards`` as their file keys).
RUN_SETTINGS = ("preset", "tokenizer", "env_kwargs", "rewards", "seed", "device", "torch_threads")


def rule(name: str) -> str:
    """``'locked'`` or ``'takes effect'``: what a resumed run does with a change of ``name``."""
    if name not in FLAG_BY_NAME and name not in RUN_SETTINGS:
        raise KeyError(name)
    return "locked" if name in LOCKED else "takes effect"


@dataclass(frozen=True)
class Change:
    """One setting that differs between the run's record and now."""

    name: str
    before: Any
    after: Any

    @property
    def rule(self) -> str:
        return rule(self.name)

    @property
    def flag(self) -> str:
        return {"env_kwargs": "env.kwargs", "rewards": "reward"}.get(self.name, self.name)

    def __str__(self) -> str:
        return f"--{self.flag}: the run has {shown(self.before)}, now {shown(self.after)}"


def _value(cfg: TrainerConfig, name: str) -> Any:
    """A setting as the run's config file holds it (so both sides compare alike)."""
    if name == "rewards":
        return [reward_spec(r) for r in cfg.rewards]
    if "." not in name:
        return file_value(getattr(cfg, name))
    return file_value(cfg.value(name), FLAG_BY_NAME[name].objects)


def changes(saved: TrainerConfig, new: TrainerConfig) -> list[Change]:
    """Every setting (flag or run option) that differs between ``saved`` and ``new``, their relative
    paths made absolute against the current directory first (copies; neither is changed)."""
    saved, new = saved.copy(), new.copy()
    absolute_paths(saved)
    absolute_paths(new)
    out = []
    for name in RUN_SETTINGS + tuple(f.name for f in FLAGS):
        before, after = _value(saved, name), _value(new, name)
        if before != after:
            out.append(Change(name, before, after))
    return out


def locked_changes_error(found: list[Change], output: Any, against: str) -> ConfigError:
    """The one-line refusal of locked changes (``against``: what they were compared with)."""
    return ConfigError(f"--resume: this would change what the run in {output} is ({against}): "
                       + "; ".join(map(str, found)) + ". Give --allow_config_change to continue anyway, or another "
                       "--output for a new run")


def saved_settings(output: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The settings a run in ``output`` was resolved with, as config-file keys, and the file they
    came from (``config.yaml``, else ``config.json``); ``None`` when it has neither. This is the
    file layer of a resumed run, which the user may have edited."""
    out = Path(output)
    if (out / "config.yaml").is_file():
        return read_config_file(out / "config.yaml", "--resume"), out / "config.yaml"
    found = recorded_settings(out)
    return None if found is None else (found, out / "config.json")


def recorded_settings(output: str | Path) -> dict[str, Any] | None:
    """The settings ``config.json`` records (the flags the run last started with), as config-file
    keys; ``None`` without that file."""
    record = Path(output) / "config.json"
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise ConfigError(f"--resume: cannot read {record} ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("flags"), dict):
        raise ConfigError(f"--resume: {record} holds no flags; give the run's settings again")
    return settings_of_record(data, str(record))


def settings_of_record(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Config-file keys from a ``config.json`` record (``flags`` and the run options); flags this
    version no longer has are dropped."""
    flat = {k: v for k, v in data["flags"].items() if k in FLAG_BY_NAME}
    for key, name in (("preset", "preset"), ("env_kwargs", "env.kwargs"), ("tokenizer", "tokenizer"),
                      ("seed", "seed"), ("rewards", "reward")):  # its device and threads are the facts found
        if data.get(key) is not None:
            flat[name] = data[key]
    return flatten_settings(flat, source)


def settings_config(settings: Mapping[str, Any], source: str) -> TrainerConfig:
    """The configuration that config-file ``settings`` (nested or dotted, with their ``preset``) resolve to."""
    from flashreinforce.config.presets import PRESETS

    flat = flatten_settings(settings, source)
    name = flat.get("preset")
    preset = dict(PRESETS[name], preset=name) if name in PRESETS else None
    return resolve({}, preset, flat)


def review(cfg: TrainerConfig, saved: TrainerConfig, output: Any, against: str) -> list[str]:
    """The resume table applied to ``cfg`` against the run's ``saved`` settings: locked changes are
    refused (:class:`ConfigError`, one line) unless ``cfg.allow_config_change``. Returns the warnings
    the run records (``cfg`` is not changed): the locked changes allowed, and in one line the changes
    that take effect."""
    found = changes(saved, cfg)
    locked = [c for c in found if c.rule == "locked"]
    if locked and not cfg.allow_config_change:
        raise locked_changes_error(locked, output, against)
    warnings = []
    if locked:
        warnings.append("--resume --allow_config_change: " + "; ".join(map(str, locked)))
    effective = [c for c in found if c.rule == "takes effect"]
    if effective:
        warnings.append("--resume: changed since the run's checkpoint, in effect from its next update: "
                        + "; ".join(map(str, effective)))
    return warnings
