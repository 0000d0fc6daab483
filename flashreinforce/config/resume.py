"""``--resume``: the run's saved settings as the base, and what a resumed run may change.

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
relative paths are made absolute first (:mod:`flashreinforce.config.paths`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flashreinforce.config.files import flatten_settings, read_config_file
from flashreinforce.config.paths import absolute_paths
from flashreinforce.config.schema import ConfigError
from flashreinforce.config.trainer_config import FLAG_BY_NAME, FLAGS, TrainerConfig, file_value, reward_spec
from flashreinforce.config.values import shown
from flashreinforce.objective import OPTION_FLAGS

__all__ = ["IDENTITY", "LOCKED", "RUN_SETTINGS", "Change", "changes", "locked_changes_error", "recorded_settings",
           "review", "rule", "saved_settings", "settings_config"]

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
    from flashreinforce.config.resolution import resolve

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
