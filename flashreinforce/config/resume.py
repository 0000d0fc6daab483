"""``--resume``: the run's saved settings as the base, and what a resumed run may not change.

``flashreinforce train --output runs/x --resume`` needs nothing else: the settings come from
``runs/x/config.yaml`` (runs written before that file existed: the ``flags`` of ``config.json``).
Flags given with ``--resume`` override them (a longer ``--train.max_steps``, another logger). A change
of what the run *is* (:data:`IDENTITY`: the model, the environment and its arguments, the preset, the
reward functions, the data, the loss) is listed and refused unless ``--allow_config_change``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flashreinforce.config.files import flatten_settings, read_config_file
from flashreinforce.config.schema import ConfigError
from flashreinforce.config.trainer_config import FLAG_BY_NAME, TrainerConfig, file_value, reward_spec
from flashreinforce.config.values import shown

__all__ = ["IDENTITY", "identity_changes", "saved_settings"]

#: What a run is: flags and run options a resumed run keeps unless --allow_config_change.
IDENTITY = ("preset", "actor.model_name_or_path", "tokenizer", "train.agent_path", "env_kwargs", "rewards",
            "data.prompt_dataset", "data.input_key", "data.label_key", "data.apply_chat_template", "actor.loss_mode",
            "algo.advantage.estimator", "rollout.n_samples_per_prompt", "actor.flash_gate_delta", "actor.flash_neg_topq",
            "actor.flash_loss_agg", "actor.loss_scale_factor", "actor.flash_no_is", "actor.eps_clip_low_high")


def saved_settings(output: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The settings a run in ``output`` was resolved with, as config-file keys, and the file they
    came from; ``None`` when it has neither ``config.yaml`` nor ``config.json``."""
    out = Path(output)
    if (out / "config.yaml").is_file():
        return read_config_file(out / "config.yaml"), out / "config.yaml"
    record = out / "config.json"
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--resume: cannot read {record} ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("flags"), dict):
        raise ConfigError(f"--resume: {record} holds no flags; give the run's settings again")
    # Flags this version no longer has are dropped; the rest is read like a config file.
    flat = {k: v for k, v in data["flags"].items() if k in FLAG_BY_NAME}
    for key, name in (("preset", "preset"), ("env_kwargs", "env.kwargs"), ("tokenizer", "tokenizer"),
                      ("seed", "seed"), ("rewards", "reward")):
        if data.get(key) is not None:
            flat[name] = data[key]
    return flatten_settings(flat, str(record)), record


def _value(cfg: TrainerConfig, name: str) -> Any:
    """What the run's saved config file holds for ``name`` (so both sides compare alike)."""
    if name == "rewards":
        return [reward_spec(r) for r in cfg.rewards]
    if "." not in name:
        return file_value(getattr(cfg, name))
    return file_value(cfg[name], FLAG_BY_NAME[name].objects)


def identity_changes(saved: TrainerConfig, new: TrainerConfig) -> list[str]:
    """One line per :data:`IDENTITY` entry that differs between the run's saved settings and now."""
    out = []
    for name in IDENTITY:
        before, after = _value(saved, name), _value(new, name)
        if before != after:
            flag = {"env_kwargs": "env.kwargs", "rewards": "reward"}.get(name, name)
            out.append(f"--{flag}: the run has {shown(before)}, now {shown(after)}")
    return out
