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
from typing import Any, Iterable, Mapping

from flashreinforce.config.checks import run_rules
from flashreinforce.objective import LOSS_MODE_REGISTRY, loss_mode_config, owned_flags

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
    mode = LOSS_MODE_REGISTRY.get(flags["actor.loss_mode"])
    if mode is not None:  # the flags another loss mode owns (an unknown mode is check_rules' error)
        for key, owner in owned_flags().items():
            if key in flags and key not in mode.flags:
                del flags[key]
                dropped[key] = f"actor.loss_mode is {mode.name!r}, not {owner!r}"
    where = f"setting {name!r}" + (f" with variants {list(variants)}" if variants else "")
    check_rules(flags, where=where)
    return ResolvedSetting(name=name, variants=variants, description=data.get("description", ""),
                           model=data["model"], agent=data["agent"], max_agent_turns=int(data["max_agent_turns"]),
                           flags=flags, dropped=dropped)


def rule_violations(flags: Mapping[str, Any]) -> list[str]:
    """One message per broken rule of a published setting's flat Molt ``flags`` (empty when all hold).

    The rules every run obeys (:func:`flashreinforce.config.checks.run_rules`, which this project's trainer
    checks on its typed configuration, with the same messages), with ``train.batch_size`` given; Molt's
    ``train.force_on_policy``, which the native trainer is by construction; the rules of the selected loss
    mode (:class:`flashreinforce.objective.LossModeConfig`); and no flag that another loss mode owns.
    """
    v = flags
    errors = run_rules(rollout_batch_size=v["rollout.batch_size"], samples_per_prompt=v["rollout.n_samples_per_prompt"],
                       train_batch_size=v.get("train.batch_size"), max_epochs=v["train.max_epochs"],
                       kl_init_coef=v["algo.kl.init_coef"], max_len=v["data.max_len"],
                       max_new_tokens=v["rollout.max_new_tokens"], derives_batch=False)
    if v.get("train.force_on_policy") is not True:
        errors.append("train.force_on_policy must be true")
    try:
        mode = loss_mode_config(v["actor.loss_mode"])
    except ValueError as err:
        return errors + [str(err)]
    errors.extend(mode.rule_violations(estimator=v.get("algo.advantage.estimator"),
                                       correction_level=v.get("algo.advantage.is_correction_level"),
                                       samples_per_prompt=v.get("rollout.n_samples_per_prompt"), option_values=v))
    foreign = sorted(flag for flag in owned_flags() if flag in v and flag not in mode.flags)
    if foreign:
        errors.append(f"{', '.join(foreign)} have no meaning with actor.loss_mode {mode.name!r}")
    return errors


def check_rules(flags: dict[str, Any], *, where: str = "flags") -> None:
    """Enforce the rules every published run obeys (:func:`rule_violations`, shared with the native
    trainer); raise :class:`SettingError` naming the first broken one."""
    errors = rule_violations(flags)
    if errors:
        raise SettingError(f"{where}: {errors[0]}")


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
