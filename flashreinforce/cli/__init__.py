"""The ``flashreinforce`` console script: one subcommand per module of this package.

``flashreinforce COMMAND [ARGS]``; ``python -m flashreinforce.cli COMMAND`` is the same (torchrun
launches it that way). Each command is a function ``(argv) -> exit status`` in :data:`COMMANDS`,
imported only when run, so ``flashreinforce --help`` starts fast. An unknown command is one error
line (with the closest command as a suggestion) and exit status 2.

A command's exit status is the process's, also when a rollout thread is still inside a call when
the command ends (a generation, or an environment call abandoned by a stopping run): Python's
interpreter teardown cannot stop such a thread, and once the call returns into PyTorch's C++ code
the thread is torn down under it, which aborts the process ("terminate called without an active
exception", status 134). In that case the process leaves with ``os._exit`` after flushing its
output instead (:func:`exit_past_running_calls`), once the engines' exit hooks have ended their
processes and removed their shared-memory files (``atexit`` does not run then). A successful command
says so in one line ("not waiting for N rollout thread(s)"); a failing one does not, so that the
line saying why it failed stays the last line of its output. Only the command itself does that
(:func:`console`, the console script and ``python -m flashreinforce.cli``): :func:`main` called from
Python returns its status and never ends the caller's process.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import sys
import threading
import traceback
from typing import Sequence

__all__ = ["COMMANDS", "ROLLOUT_THREAD_PREFIX", "console", "exit_past_running_calls", "main"]

#: The names of the threads that run rollouts and their environment calls start with this.
ROLLOUT_THREAD_PREFIX = "rollout-worker-"

#: command -> ("module:function", one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flashreinforce.cli.train:train", "train a policy with asynchronous FlashREINFORCE"),
    "eval": ("flashreinforce.cli.eval:eval_command", "score a model or a run's newest checkpoint on held-out prompts"),
    "plot": ("flashreinforce.cli.plot:plot", "draw the training curves of one or more runs into a PNG"),
    "serve": ("flashreinforce.cli.serve:serve", "serve a trained run on an OpenAI-compatible endpoint (tool calls "
                                                "rendered and parsed as in training)"),
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


#: libgomp's spin count the console script sets (``GOMP_SPINCOUNT``) unless the user set a wait policy:
#: PyTorch's OpenMP threads spin this many rounds after a parallel region, then sleep.
OPENMP_SPIN_COUNT = "10000"


def _quiet_openmp_threads() -> None:
    """Let PyTorch's OpenMP threads spin only briefly between parallel regions, then sleep.

    libgomp's default keeps them spinning for milliseconds after each PyTorch CPU op (300,000
    rounds), taking the cores from whatever runs next on other threads (the fused loss after a
    PyTorch op, a rollout beside the learner). Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``, this
    script's earlier default) makes every parallel region wake its threads, which a decode step, with
    about 270 short regions, pays for: its bf16 step took 53-54 ms instead of 44-46 ms (SmolLM2, 32
    requests, 2 cores). A short spin (``GOMP_SPINCOUNT=10000``) kept the decode step at 44-46 ms, and
    the toy preset and an async ``arith`` run took as long as with PASSIVE (docs/trainer.md). A wait
    policy or spin count the user set is kept. It only takes effect before torch is first imported,
    which is the case here.
    """
    if "torch" not in sys.modules:
        set_openmp_spin_default()


def set_openmp_spin_default(env=None) -> None:
    """Put the console script's OpenMP waiting (``GOMP_SPINCOUNT=10000``) into ``env`` (default
    ``os.environ``) unless it names a wait policy or a spin count already. libgomp, the OpenMP
    runtime of PyTorch's Linux wheels, reads it once when it loads: set it before ``import torch``,
    or for child processes. (Another runtime ignores it; LLVM's and Intel's have ``KMP_BLOCKTIME``.)"""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


def console() -> None:
    """The console script: :func:`main`, leaving the process with its status even past a rollout
    thread still inside a call."""
    sys.exit(main(leave_process=True))


def main(argv: Sequence[str] | None = None, *, leave_process: bool = False) -> int:
    """Run ``flashreinforce COMMAND ARGS`` (``argv``: default ``sys.argv[1:]``); returns the exit status.
    ``leave_process``: end the process with ``os._exit`` when a rollout thread is still running (the
    console script); from Python (tests, notebooks) the status is returned and the process lives on."""
    leave = exit_past_running_calls if leave_process else (lambda code: None)
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
        code = getattr(importlib.import_module(module), function)(rest)
    except KeyboardInterrupt:  # a command's own handling aside (train's), one line rather than a traceback
        print(f"flashreinforce {command}: interrupted (Ctrl-C)", file=sys.stderr)
        leave(130)
        return 130
    except Exception:
        if leave_process and _running_calls():
            traceback.print_exc()
            leave(1)
        raise
    leave(code)
    return code


def _running_calls() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.is_alive() and t.name.startswith(ROLLOUT_THREAD_PREFIX)]


def exit_past_running_calls(code: int) -> None:
    """Leave the process now with ``code`` when a rollout thread is still running (see the module
    docstring), after flushing stdout, stderr and the logs; return when none is."""
    left = _running_calls()
    if not left:
        return
    names = ", ".join(t.name for t in left[:4]) + (", ..." if len(left) > 4 else "")
    if code == 0:
        # A failing command has printed its own reason, which stays the last line of its output.
        print(f"flashreinforce: not waiting for {len(left)} rollout thread(s) still running ({names}); exiting "
              f"with status {code}", file=sys.stderr)
    engines = sys.modules.get("flashreinforce.engines.base")
    if engines is not None:  # what an engine must not leave behind (its processes, shared memory): atexit won't run
        engines.run_exit_hooks()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)
