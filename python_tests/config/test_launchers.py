"""The launchers: ``scripts/train_molt.py`` takes the published ``--recipe`` spelling (and the
positional one); ``examples/run_experiment.py`` passes ``--resume`` / ``--overwrite`` on to this
project's trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _molt(*argv):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_molt.py"), *argv, "--molt-path", "/tmp/m",
                           "--model", "m", "--train-data", "t.jsonl", "--eval-data", "e.jsonl", "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_molt_launcher_takes_the_published_recipe_flag():
    default = _molt()
    assert default.returncode == 0, default.stderr
    assert "is_correction_threshold 0.005" in default.stdout  # r1 by default
    flag = _molt("--recipe", "qwen_math")
    positional = _molt("qwen_math")
    assert flag.returncode == positional.returncode == 0, flag.stderr + positional.stderr
    assert flag.stdout == positional.stdout and "is_correction_threshold 0.003" in flag.stdout
    clash = _molt("r1", "--recipe", "qwen_math")
    assert clash.returncode == 2 and "--recipe" in clash.stderr


def test_the_experiment_launcher_passes_resume_and_overwrite_to_this_trainer(tmp_path):
    def launch(*extra):
        return subprocess.run([sys.executable, str(ROOT / "examples" / "run_experiment.py"), "--setting", "qwen_math",
                               "--train-data", "t.jsonl", "--eval-data", "e.jsonl", "--output", str(tmp_path / "o"),
                               "--dry-run", *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)

    for option in ("--resume", "--overwrite"):
        proc = launch(option)
        assert proc.returncode == 0, proc.stderr
        command = proc.stdout.splitlines()[1].split()
        assert option in command and "--output" in command
    both = launch("--resume", "--overwrite")
    assert both.returncode == 2 and "contradict" in both.stderr
    molt = launch("--resume", "--trainer-path", str(tmp_path))
    assert molt.returncode == 2 and "--resume" in molt.stderr
