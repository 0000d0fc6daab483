"""The ``flashreinforce`` console script: one subcommand per module of this package.

``flashreinforce COMMAND [ARGS]``; ``python -m flashreinforce.cli COMMAND`` is the same (torchrun
launches it that way). Each command is a function ``(argv) -> exit status`` in :data:`COMMANDS`,
imported only when run, so ``flashreinforce --help`` starts fast. An unknown command is one error
line (with the closest command as a suggestion) and exit status 2.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Sequence

__all__ = ["COMMANDS", "main"]

#: command -> ("module:function", one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flashreinforce.cli.train:train", "train a policy with asynchronous FlashREINFORCE"),
    "eval": ("flashreinforce.cli.eval:eval_command", "score a model or a run's newest checkpoint on held-out prompts"),
    "plot": ("flashreinforce.cli.plot:plot", "draw the training curves of one or more runs into a PNG"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name.ljust(width)}  {desc} (flashreinforce {name} --help)" for name, (_, desc) in COMMANDS.items()]
    return "usage: flashreinforce COMMAND [ARGS]\n\ncommands:\n" + "\n".join(lines) + "\n"


def _unknown_command(command: str) -> str:
    """One line for a command that is not in :data:`COMMANDS`: the closest one, if any, and the list."""
    if command.startswith("-"):
        return (f"unknown option {command!r} before the command; usage: flashreinforce COMMAND [ARGS], "
                f"commands: {', '.join(COMMANDS)} (flashreinforce --help describes them)")
    close = difflib.get_close_matches(command, COMMANDS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"unknown command {command!r}; {hint}commands: {', '.join(COMMANDS)} "
            "(flashreinforce --help describes them)")


def _quiet_openmp_threads() -> None:
    """Let PyTorch's OpenMP threads sleep, rather than spin, between parallel regions.

    libgomp's default keeps them spinning for milliseconds after each PyTorch CPU op, so the fused
    loss called right after one finds both of its cores taken (measured at 4M tokens on 2 cores:
    8.65 ms instead of 5.42 ms; the toy preset ran 15.4 s instead of 16.9 s). A value the user set
    is kept. It only takes effect before torch is first imported, which is the case here.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_openmp_threads()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"flashreinforce: error: {_unknown_command(command)}", file=sys.stderr)
        return 2
    module, _, function = COMMANDS[command][0].partition(":")
    try:
        return getattr(importlib.import_module(module), function)(rest)
    except KeyboardInterrupt:  # a command's own handling aside (train's), one line rather than a traceback
        print(f"flashreinforce {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
