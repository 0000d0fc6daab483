"""Resolve a published experiment setting (plus variants) into one flat dictionary of Molt flags.

The settings live as JSON data next to this module (``settings/*.json``): ``common.json`` holds
the flags shared by every setting; each other file is one setting with its model, agent kind,
agent turn limit, flag overrides and named variants. Resolution merges, in order, the shared flags,
the setting's flags, then each selected variant (the last value wins), and then enforces the rules
of the published runs (see :func:`check_rules`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

SETTINGS_DIR = Path(__file__).resolve().parent / "settings"
_SHARED = "common"


class SettingError(ValueError):
    """A setting, a variant or a resolved flag set that breaks a rule of the published runs."""


@dataclass(frozen=True)
class ResolvedSetting:
    """One setting with its variants applied.

    flags: Molt dotted flag name -> value (bool, int, float, str or list); ``inf`` is ``math.inf``.
    dropped: flags removed during resolution, each with the reason (reported, never silently lost).
    """

    name: str
    variants: tuple[str, ...]
    description: str
    model: str
    agent: str
    max_agent_turns: int
    flags: dict[str, Any]
    dropped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe view: infinities are written as the string ``"inf"``."""
        return {
            "setting": self.name,
            "variants": list(self.variants),
            "description": self.description,
            "model": self.model,
            "agent": self.agent,
            "max_agent_turns": self.max_agent_turns,
            "flags": {k: json_value(v) for k, v in self.flags.items()},
            "dropped_flags": dict(self.dropped),
        }


def setting_names() -> list[str]:
    """Names of the published settings, sorted."""
    return sorted(p.stem for p in SETTINGS_DIR.glob("*.json") if p.stem != _SHARED)


def variant_names(setting: str) -> list[str]:
    """Names of the variants of ``setting``, in file order."""
    return list(_read_setting(setting).get("variants", {}))


def load_setting(name: str, variants: Iterable[str] = ()) -> ResolvedSetting:
    """Merge shared flags, the setting, then ``variants`` in order; enforce the rules.

    Raises:
        SettingError: unknown setting or variant (the message lists the valid names), or a rule broken.
    """
    data = _read_setting(name)
    variants = tuple(variants)
    known = data.get("variants", {})
    flags: dict[str, Any] = dict(_read_json(SETTINGS_DIR / f"{_SHARED}.json")["flags"])
    flags.update(data["flags"])
    for variant in variants:
        if variant not in known:
            raise SettingError(f"unknown variant {variant!r} of setting {name!r}; valid variants: "
                               f"{', '.join(known) or '(none)'}")
        flags.update(known[variant])
    flags = {key: _parse_value(value) for key, value in flags.items()}

    dropped: dict[str, str] = {}
    if flags["actor.loss_mode"] != "flash_reinforce":
        for key in [k for k in flags if k.startswith("actor.flash_")]:
            del flags[key]
            dropped[key] = f"actor.loss_mode is {flags['actor.loss_mode']!r}, not 'flash_reinforce'"
    where = f"setting {name!r}" + (f" with variants {list(variants)}" if variants else "")
    check_rules(flags, where=where)
    return ResolvedSetting(name=name, variants=variants, description=data.get("description", ""),
                           model=data["model"], agent=data["agent"], max_agent_turns=int(data["max_agent_turns"]),
                           flags=flags, dropped=dropped)


def check_rules(flags: dict[str, Any], *, where: str = "flags") -> None:
    """Enforce the invariants every published run obeys (SETTINGS.md); raise :class:`SettingError`.

    One full-batch update per collected batch (``rollout.batch_size * n_samples_per_prompt ==
    train.batch_size``, ``train.max_epochs == 1``, ``train.force_on_policy``), no reference-model KL,
    room for the prompt (``data.max_len > rollout.max_new_tokens``); FlashREINFORCE proper uses one
    sample per prompt, no external importance correction and q in [0, 1]; other loss modes are
    compared with GRPO advantages.
    """
    def need(condition: bool, message: str) -> None:
        if not condition:
            raise SettingError(f"{where}: {message}")

    need(flags["rollout.batch_size"] * flags["rollout.n_samples_per_prompt"] == flags["train.batch_size"],
         "rollout.batch_size * rollout.n_samples_per_prompt must equal train.batch_size "
         f"({flags['rollout.batch_size']} * {flags['rollout.n_samples_per_prompt']} != {flags['train.batch_size']})")
    need(flags["train.max_epochs"] == 1, f"train.max_epochs must be 1, got {flags['train.max_epochs']}")
    need(flags["train.force_on_policy"] is True, "train.force_on_policy must be true")
    need(flags["algo.kl.init_coef"] == 0, f"algo.kl.init_coef must be 0 (no reference model), got {flags['algo.kl.init_coef']}")
    need(flags["data.max_len"] > flags["rollout.max_new_tokens"],
         f"data.max_len ({flags['data.max_len']}) must exceed rollout.max_new_tokens ({flags['rollout.max_new_tokens']})")
    if flags["actor.loss_mode"] == "flash_reinforce":
        need(flags["algo.advantage.is_correction_level"] == "off",
             "algo.advantage.is_correction_level must be 'off' with actor.loss_mode flash_reinforce "
             "(the native loss does its own behavior correction)")
        need(flags["rollout.n_samples_per_prompt"] == 1, "actor.loss_mode flash_reinforce uses one sample per prompt")
        q = flags["actor.flash_neg_topq"]
        need(0.0 <= q <= 1.0, f"actor.flash_neg_topq must be in [0, 1], got {q}")
        delta = flags["actor.flash_gate_delta"]
        need(not math.isnan(delta) and delta >= 0, f"actor.flash_gate_delta must be >= 0 (inf allowed), got {delta}")
    else:
        need(not any(k.startswith("actor.flash_") for k in flags),
             f"actor.flash_* flags have no meaning with actor.loss_mode {flags['actor.loss_mode']!r}")
        need(flags["algo.advantage.estimator"] == "grpo",
             f"actor.loss_mode {flags['actor.loss_mode']!r} is compared with algo.advantage.estimator grpo, "
             f"got {flags['algo.advantage.estimator']!r}")


def json_value(value: Any) -> Any:
    """JSON-safe form of a flag value (infinite floats become ``"inf"``/``"-inf"``)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, list):
        return [json_value(v) for v in value]
    return value


def _parse_value(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(value, list):
        return [_parse_value(v) for v in value]
    return value


def _read_setting(name: str) -> dict[str, Any]:
    names = setting_names()
    if name not in names:
        raise SettingError(f"unknown setting {name!r}; valid settings: {', '.join(names)}")
    return _read_json(SETTINGS_DIR / f"{name}.json")


def _read_json(path: Path) -> dict[str, Any]:
    with path.open() as handle:
        return json.load(handle)
