"""Turn resolved flags into a trainer command, check the trainer can honour them, and start it.

Two kinds of target share these pieces: a Molt-style checkout (``python -u -m molt.cli.train_rl_ray``
run inside the checkout) and this project's own trainer (``python -u -m flashreinforce.cli train``).
Flags are passed Molt-style: ``--name value``; ``True`` is a bare switch, ``False``/``None`` are left
out, lists expand to several values and ``inf`` is written ``inf``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flashreinforce.experiments.resolve import json_value

#: Environment every launched trainer gets (the published launch conventions, docs/training.md); MAX_AGENT_TURNS is per setting.
BASE_LAUNCH_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "TOKENIZERS_PARALLELISM": "true",
}

MOLT_MODULE = "molt.cli.train_rl_ray"
NATIVE_MODULE = "flashreinforce.cli"


class LaunchError(RuntimeError):
    """The launch cannot go ahead (unsupported flags, missing files); nothing has been created."""


@dataclass(frozen=True)
class TrainerTarget:
    """How to run one trainer: the command prefix, its ``--help`` command and working directory."""

    name: str
    command: tuple[str, ...]
    help_command: tuple[str, ...]
    cwd: Path

    @classmethod
    def molt(cls, checkout: Path) -> "TrainerTarget":
        """A Molt-style trainer checkout at ``checkout`` (its root holds the ``molt`` package)."""
        prefix = (sys.executable, "-u", "-m", MOLT_MODULE)
        return cls("molt", prefix, (sys.executable, "-m", MOLT_MODULE, "--help"), checkout)

    @classmethod
    def native(cls, cwd: Path | None = None) -> "TrainerTarget":
        """This project's trainer (``flashreinforce train``), run from ``cwd`` (default: here)."""
        prefix = (sys.executable, "-u", "-m", NATIVE_MODULE, "train")
        return cls("native", prefix, (sys.executable, "-m", NATIVE_MODULE, "train", "--help"),
                   (cwd or Path.cwd()).resolve())


def flag_arguments(flags: Mapping[str, Any]) -> list[str]:
    """Molt-style command-line arguments for ``flags`` (order preserved)."""
    arguments: list[str] = []
    for key, value in flags.items():
        if value is False or value is None:
            continue
        arguments.append(f"--{key}")
        if value is True:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            arguments.append(str(json_value(item)))
    return arguments


def passed_flags(flags: Mapping[str, Any]) -> list[str]:
    """The flag names that :func:`flag_arguments` puts on the command line."""
    return [key for key, value in flags.items() if value is not False and value is not None]


def launch_env(max_agent_turns: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment for a trainer: ``base`` (default ``os.environ``) plus the launch conventions."""
    env = dict(os.environ if base is None else base)
    env.update(BASE_LAUNCH_ENV)
    env["MAX_AGENT_TURNS"] = str(max_agent_turns)
    return env


def format_command(command: list[str] | tuple[str, ...], max_agent_turns: int) -> str:
    """The command as a shell line, prefixed with its MAX_AGENT_TURNS, for previews and logs."""
    return f"MAX_AGENT_TURNS={max_agent_turns} " + shlex.join(command)


def supported_flags(target: TrainerTarget, env: Mapping[str, str]) -> set[str]:
    """Flag names (without ``--``) that the trainer's ``--help`` lists.

    Raises:
        LaunchError: the help command fails (the trainer is not importable or broken).
    """
    result = subprocess.run(list(target.help_command), cwd=target.cwd, env=dict(env), capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0:
        raise LaunchError(f"the {target.name} trainer's --help failed (exit {result.returncode}) in {target.cwd}:\n"
                          + (result.stderr or result.stdout)[-3000:])
    return set(re.findall(r"--([A-Za-z0-9_][A-Za-z0-9_.\-]*)", result.stdout))


def unsupported_flags(flags: Mapping[str, Any], supported: set[str]) -> list[str]:
    """The flags that would be passed but that the trainer does not list, sorted."""
    return sorted(key for key in passed_flags(flags) if key not in supported)


def check_capabilities(target: TrainerTarget, flags: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """Raise :class:`LaunchError` naming every flag the trainer's ``--help`` does not list."""
    missing = unsupported_flags(flags, supported_flags(target, env))
    if missing:
        raise LaunchError(f"the {target.name} trainer at {target.cwd} does not support "
                          f"{len(missing)} flag(s) of this setting: " + ", ".join(f"--{m}" for m in missing)
                          + ". Nothing was created. Use a trainer with native FlashREINFORCE support "
                          "(this project's own trainer supports every published setting).")


def write_resolved_settings(output: Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` to ``output/resolved_settings.json`` (creating ``output``) and return the path."""
    output.mkdir(parents=True, exist_ok=True)
    path = output / "resolved_settings.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
