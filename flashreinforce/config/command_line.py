"""``flashreinforce train``'s command line: the argparse parser built from the flag table, and
:func:`parse_train_args`, which reads the config file (``--config``, or the run's own with
``--resume``) and resolves the layers against the presets."""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any, Callable, Mapping, NoReturn, Sequence

from flashreinforce.config.files import (changes, locked_changes_error, read_config_file, recorded_settings,
                                         saved_settings)
from flashreinforce.config.schema import RETIRED_FLAGS, ConfigError, shown, value_problem
from flashreinforce.config.trainer_config import FLAGS, RUN_OPTIONS, TrainerConfig, resolve, unknown_flag_message

__all__ = ["TRAIN_USAGE", "build_parser", "parse_train_args", "resolve_arguments"]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {shown(text)}") from None


def _bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {shown(text)}")


def _optint(text: str) -> int | None:
    if str(text).strip().lower() in ("none", "null", ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {shown(text)}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {shown(text)}") from None


def _json(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected JSON, got {shown(text)} ({err})") from None
    except RecursionError:
        value = None
        problem = "nested too deeply to read"
    else:
        problem = value_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"JSON out of bounds: {problem}")
    return value


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


#: The top of ``flashreinforce train --help``: what a first run needs, before the full list of flags.
TRAIN_USAGE = ("flashreinforce train [--preset NAME | --config FILE] [--model M]\n"
               "         [--reward FILE.py:FUNC --data.prompt_dataset PATH | --env SPEC]\n"
               "         --output DIR [--resume] [--FLAG VALUE ...]")


def _train_description() -> str:
    from flashreinforce.config.presets import PRESET_SUMMARIES, PRESETS

    width = max(len(name) for name in PRESETS)
    presets = "\n".join(f"  {name.ljust(width)}  {PRESET_SUMMARIES.get(name, '')}".rstrip() for name in PRESETS)
    return f"""Train a policy with asynchronous FlashREINFORCE. Flags are Molt's (--section.name VALUE); the
ones a first run needs are here, every flag is listed below.

start from a preset (--preset NAME; your flags override it):
{presets}

your own task:
  --model M                   a Hugging Face folder, a .gguf file, an alias or a run directory
                              (never downloaded)
  --reward FILE.py:FUNC       reward(prompt, completion, **row) -> float, over the rows of
  --data.prompt_dataset PATH  a JSONL, JSON or Parquet file or a datasets save_to_disk folder
  --env MODULE:CLASS          an Environment class instead of reward functions

how long and how fast:
  --train.max_steps N, --train.max_minutes M (a time budget), --rollout.batch_size B,
  --actor.adam.lr LR, --rollout.max_new_tokens N
evaluation (the prompts are held out of --data.prompt_dataset unless --eval.dataset is given):
  --eval.steps N, --eval.num_prompts N, --eval.dataset PATH
the run: --output DIR (required), --resume, --overwrite, --config FILE.yaml, --no_progress

examples:
  flashreinforce train --preset toy --output runs/toy
  flashreinforce train --preset arith --data.prompt_dataset rows.jsonl --reward rewards.py:correct \\
      --train.max_minutes 15 --output runs/mine
  flashreinforce train --output runs/mine --resume          # continue it (reads runs/mine/config.yaml)

exit status: 0 done (also when --train.max_minutes ran out), 1 the run could not go on (a checkpoint
is saved; the message says why), 2 a bad flag, file or setting (nothing started), 130 Ctrl-C, 143
SIGTERM (answered like Ctrl-C: a checkpoint is saved)."""


def build_parser(prog: str = "flashreinforce train", *, shown: Callable[[str], bool] | None = None,
                 description: str | None = None, usage: str | None = None) -> argparse.ArgumentParser:
    """The ``flashreinforce train`` parser; every option defaults to "not given" (resolution fills in).

    ``shown``: which flags and options ``--help`` lists (all by default); the others are still accepted.
    ``description`` / ``usage``: another command's (``flashreinforce eval``); by default the train
    command's short usage line and its guide to a first run (:data:`TRAIN_USAGE`).
    """
    def hidden(name: str) -> bool:
        return shown is not None and not shown(name)

    p = _Parser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                usage=usage or (TRAIN_USAGE if description is None else None),
                formatter_class=argparse.RawDescriptionHelpFormatter if description is None else argparse.HelpFormatter,
                description=description or _train_description())
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
    for f in FLAGS:  # the sections in order, the flags that change nothing here last
        if not f.no_effect:
            groups.setdefault(f.name.split(".")[0], p.add_argument_group(f.name.split(".")[0]))
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
    molt = groups.setdefault("accepted for Molt compatibility, no effect here",
                             p.add_argument_group("accepted for Molt compatibility, no effect here"))
    for name, instead in RETIRED_FLAGS.items():  # a published command line keeps working, with a warning
        molt.add_argument(f"--{name}", dest=name, metavar="VALUE",
                          help=argparse.SUPPRESS if hidden(name) else f"ignored, with a warning: {instead}")
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
    ``--resume``, the run's ``config.yaml``), then the flags. With ``--resume``, a change of a locked
    setting against what the run recorded (``config.json``) is refused here, before anything starts,
    unless ``--allow_config_change``; the trainer checks again against the checkpoint it resumes
    (:mod:`flashreinforce.config.files`)."""
    args = dict(args)
    file_layer: dict[str, Any] = {}
    recorded = None
    if "config" in args:
        file_layer = read_config_file(args["config"])
    elif args.get("resume") and args.get("output"):
        found = saved_settings(args["output"])
        if found is not None:
            file_layer, source = found
            args["config"] = str(source)
            recorded = recorded_settings(args["output"])
    preset = _preset_layer(args.get("preset", file_layer.get("preset")), presets)
    cfg = resolve(args, preset, file_layer)
    if recorded is not None and not cfg.allow_config_change:
        saved = resolve({}, _preset_layer(recorded.get("preset"), presets), recorded)
        locked = [c for c in changes(saved, cfg) if c.rule == "locked"]
        if locked:
            raise locked_changes_error(locked, args["output"], "against its config.json")
    return cfg
