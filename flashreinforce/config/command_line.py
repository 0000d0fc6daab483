"""``flashreinforce train``'s command line: the argparse parser built from the flag table, and
:func:`parse_train_args`, which reads the config file (``--config``, or the run's own with
``--resume``) and resolves the layers against the presets."""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any, Callable, Mapping, NoReturn, Sequence

from flashreinforce.config.files import read_config_file
from flashreinforce.config.resolution import resolve
from flashreinforce.config.resume import identity_changes, saved_settings
from flashreinforce.config.schema import ConfigError
from flashreinforce.config.trainer_config import FLAGS, RUN_OPTIONS, TrainerConfig, unknown_flag_message

__all__ = ["build_parser", "parse_train_args", "resolve_arguments"]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (inf allowed), got {text!r}") from None


def _bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _optint(text: str) -> int | None:
    if str(text).strip().lower() in ("none", "null", ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {text!r}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected JSON, got {text!r} ({err})") from None


class _Parser(argparse.ArgumentParser):
    """One line per error (with the closest flag names for a mistyped one), not the usage."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            words = [w for w in message.split(":", 1)[1].split() if w.startswith("--")]
            if words:
                message = unknown_flag_message(words[0][2:])
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _presets_help() -> str:
    from flashreinforce.config.presets import PRESETS

    return f"a named preset: {', '.join(PRESETS)}; other settings override it"


def build_parser(prog: str = "flashreinforce train", *, shown: Callable[[str], bool] | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    """The ``flashreinforce train`` parser; every option defaults to "not given" (resolution fills in).

    ``shown``: which flags and options ``--help`` lists (all by default); the others are still accepted.
    """
    def hidden(name: str) -> bool:
        return shown is not None and not shown(name)

    p = _Parser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                description=description or "Train a policy with asynchronous FlashREINFORCE (Molt-compatible flags).")
    g = p.add_argument_group("run")
    run_kwargs: dict[str, dict[str, Any]] = {
        "config": {}, "preset": {"help": _presets_help()}, "env": {}, "env.kwargs": {"type": _json, "dest": "env.kwargs"},
        "model": {}, "reward": {"action": "append"}, "agent": {}, "tokenizer": {}, "output": {},
        "resume": {"nargs": "?", "const": "latest"}, "seed": {"type": _int}, "device": {},
        "torch_threads": {"type": _int}}
    for name in ("no_progress", "overwrite", "allow_config_change"):
        run_kwargs[name] = {"nargs": "?", "const": True, "type": _bool}
    for name, kwargs in run_kwargs.items():
        kwargs.setdefault("help", RUN_OPTIONS[name])
        if hidden(name):
            kwargs["help"] = argparse.SUPPRESS
        g.add_argument(f"--{name}", **kwargs)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in FLAGS:
        title = "accepted for Molt compatibility, no effect here" if f.no_effect else f.name.split(".")[0]
        grp = groups.setdefault(title, p.add_argument_group(title))
        default = f"(default {f.default})" if f.default is not None else ""
        kwargs: dict[str, Any] = {"dest": f.name, "help": f"{f.help} {default}".strip()}
        if f.no_effect:
            kwargs["help"] = f"{f.help}: {f.no_effect}"
        if f.type == "float":
            kwargs["type"] = _float
        elif f.type == "int":
            kwargs["type"] = _optint if f.nullable else _int
        elif f.type == "bool":
            kwargs.update(nargs="?", const=True, type=_bool)
        elif f.type == "float2":
            kwargs.update(nargs=2, type=_float, metavar=("LOW", "HIGH") if "clip" in f.name else ("B1", "B2"))
        elif f.type == "json":
            kwargs["type"] = _json
        if f.choices:
            kwargs["choices"] = f.allowed()  # asked of the registry when the flag names one
        if hidden(f.name):
            kwargs["help"] = argparse.SUPPRESS
        grp.add_argument(f"--{f.name}", **kwargs)
    return p


def _preset_layer(name: str | None, presets: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    if name is None:
        return None
    if name not in presets:
        close = difflib.get_close_matches(str(name), list(presets), n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown --preset {name!r}{hint}; known presets: {', '.join(sorted(presets))}")
    return dict(presets[name], preset=name)


def parse_train_args(argv: Sequence[str] | None, presets: Mapping[str, Mapping[str, Any]]) -> TrainerConfig:
    """Parse ``flashreinforce train`` arguments and resolve them (:func:`resolve_arguments`)."""
    return resolve_arguments(vars(build_parser().parse_args(argv)), presets)


def resolve_arguments(args: dict[str, Any], presets: Mapping[str, Mapping[str, Any]]) -> TrainerConfig:
    """Resolve parsed arguments (argparse's dict): the preset, the config file (``--config``; with
    ``--resume``, the run's ``config.yaml``), then the flags."""
    args = dict(args)
    file_layer: dict[str, Any] = {}
    saved = None
    if "config" in args:
        file_layer = read_config_file(args["config"])
    elif args.get("resume") and args.get("output"):
        found = saved_settings(args["output"])
        if found is not None:
            file_layer, source = found
            saved = resolve({}, _preset_layer(file_layer.get("preset"), presets), file_layer)
            args["config"] = str(source)
    preset = _preset_layer(args.get("preset", file_layer.get("preset")), presets)
    cfg = resolve(args, preset, file_layer)
    if saved is not None:
        changes = identity_changes(saved, cfg)
        if changes and not cfg.allow_config_change:
            raise ConfigError(f"--resume: this would change what the run in {args['output']} is: "
                              + "; ".join(changes) + ". Give --allow_config_change to continue anyway, or another "
                              "--output for a new run")
        if changes:
            cfg.warnings.append("--resume --allow_config_change: " + "; ".join(changes))
    return cfg
