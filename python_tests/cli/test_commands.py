"""The ``flashreinforce`` command's dispatch: an unknown command is one error line and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command,hint", [("trian", "did you mean 'train'?"), ("evl", "did you mean 'eval'?"),
                                          ("plto", "did you mean 'plot'?"), ("zzz", None),
                                          ("--trian", "before the command")])
def test_an_unknown_command_is_one_error_line_with_a_suggestion(capsys, command, hint):
    assert main([command]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("flashreinforce: error: "), err
    assert f"{command!r}" in err and "commands: train, eval, plot" in err
    if hint is None:
        assert "did you mean" not in err
    else:
        assert hint in err


def test_the_console_script_exits_with_status_2():
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "trian", "--output", "x"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "flashreinforce: error: unknown command 'trian'; did you mean 'train'? commands: train, eval, plot, serve "
        "(flashreinforce --help describes them)"]


def test_train_help_leads_with_what_a_first_run_needs():
    from flashreinforce.config.command_line import build_parser
    from flashreinforce.config.presets import PRESETS

    lines = build_parser().format_help().splitlines()
    assert lines[0].startswith("usage: flashreinforce train [--preset NAME") and len(lines[0]) <= 100
    first = "\n".join(lines[:40])
    for name in PRESETS:  # every preset with its one line, near the top
        assert f"\n  {name} " in first
    for needle in ("--reward FILE.py:FUNC", "--data.prompt_dataset PATH", "--train.max_minutes", "--eval.dataset",
                   "examples:", "exit status: 0"):
        assert needle in first
    titles = [line for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert titles.index("run:") < titles.index("train:") < titles.index("accepted for Molt compatibility, no effect "
                                                                        "here:") == len(titles) - 1
