"""The paths a configuration names, made absolute, so that a run means the same files wherever it is
resumed.

A run records its settings (``OUTPUT/config.yaml``, ``config.json``, each checkpoint) with every
relative path it names made absolute against the directory it started in: resumed from another
directory, it reads the same dataset, imports the same reward file and writes to the same places.
Inputs (the dataset, the evaluation dataset, the model and tokenizer when they are local paths, an
environment or reward ``FILE.py``) are made absolute when they exist (a built-in model name such as
``tiny-qwen2`` is not a path); outputs (``ckpt.path``, ``ckpt.output_dir``,
``logger.tensorboard.dir``) always. Paths inside ``env.kwargs`` are the environment's to interpret.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["INPUT_PATHS", "OUTPUT_PATHS", "absolute_paths"]

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
