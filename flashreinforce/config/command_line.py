"""``flashreinforce train``'s command line: the argparse parser built from the flag table, and
:func:`parse_train_args`, which parses and resolves against the presets."""

from __future__ import annotations

import argparse
import json
from typing import Any, Mapping, Sequence

from flashreinforce.config.flags import FLAGS, ConfigError
from flashreinforce.config.resolution import ResolvedConfig, resolve

__all__ = ["build_parser", "parse_train_args"]


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


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected JSON, got {text!r} ({err})") from None


def build_parser(prog: str = "flashreinforce train") -> argparse.ArgumentParser:
    """The ``flashreinforce train`` parser; every option defaults to "not given" (resolution fills in)."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                                description="Train a policy with asynchronous FlashREINFORCE (Molt-compatible flags).")
    g = p.add_argument_group("run")
    g.add_argument("--preset", help="toy or toy_multiturn (tiny model, no download); other flags override it")
    g.add_argument("--env", help="environment (alias of --train.agent_path)")
    g.add_argument("--env.kwargs", dest="env.kwargs", type=_json, help="JSON object of environment constructor arguments")
    g.add_argument("--model", help="policy model (alias of --actor.model_name_or_path)")
    g.add_argument("--tokenizer", help="char, or a local tokenizer directory (default: the model's)")
    g.add_argument("--output", help="run directory: config.json, metrics.jsonl, checkpoints")
    g.add_argument("--resume", nargs="?", const="latest",
                   help="continue from the last checkpoint (or the checkpoint directory given)")
    g.add_argument("--seed", type=int, help="run seed (default 0)")
    g.add_argument("--device", help="learner and engine device: auto, cpu, cuda, cuda:N (default auto)")
    g.add_argument("--torch_threads", type=int, help="torch intra-op threads (default: torch's)")
    g.add_argument("--no_progress", nargs="?", const=True, type=_bool, help="no progress bar")
    g.add_argument("--overwrite", nargs="?", const=True, type=_bool,
                   help="start over in an --output that holds an earlier run: delete its records and checkpoints first")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in FLAGS:
        section = f.name.split(".")[0]
        grp = groups.setdefault(section, p.add_argument_group(section))
        default = f"(default {f.default})" if f.default is not None else ""
        kwargs: dict[str, Any] = {"dest": f.name, "help": f"{f.help} {default}".strip()}
        if f.type == "float":
            kwargs["type"] = _float
        elif f.type == "int":
            kwargs["type"] = int
        elif f.type == "optint":
            kwargs["type"] = _optint
        elif f.type == "bool":
            kwargs.update(nargs="?", const=True, type=_bool)
        elif f.type == "float2":
            kwargs.update(nargs=2, type=_float, metavar=("LOW", "HIGH") if "clip" in f.name else ("B1", "B2"))
        elif f.type == "json":
            kwargs["type"] = _json
        if f.choices:
            kwargs["choices"] = f.choices
        grp.add_argument(f"--{f.name}", **kwargs)
    return p


def parse_train_args(argv: Sequence[str] | None, presets: Mapping[str, Mapping[str, Any]]) -> ResolvedConfig:
    """Parse ``flashreinforce train`` arguments and resolve them against ``presets``."""
    args = vars(build_parser().parse_args(argv))
    preset = None
    if "preset" in args:
        if args["preset"] not in presets:
            raise ConfigError(f"unknown --preset {args['preset']!r}; known presets: {', '.join(sorted(presets))}")
        preset = dict(presets[args["preset"]], preset=args["preset"])
    return resolve(args, preset)
