"""`flashreinforce train` run as a user runs it, in a child process: to the end, or stopped with Ctrl-C
once it has logged some updates. Shared by the end-to-end tests of the trainer and of its reporting."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, "-m", "flashreinforce.cli", "train"]

__all__ = ["ROOT", "train", "train_until_ctrl_c"]


def train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``flashreinforce train ARGS`` to its end, its output captured."""
    return subprocess.run([*TRAIN, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def train_until_ctrl_c(*args: str, output: Path, updates: int, start_timeout: float = 120,
                       stop_timeout: float = 120) -> subprocess.CompletedProcess:
    """``flashreinforce train ARGS --output OUTPUT``, sent SIGINT (Ctrl-C) once ``OUTPUT/metrics.jsonl``
    holds ``updates`` rows; the run's exit status and output once it has stopped. Fails the test,
    with the run's output, when the rows do not come within ``start_timeout`` seconds."""
    proc = subprocess.Popen([*TRAIN, *args, "--output", str(output)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = output / "metrics.jsonl", time.monotonic() + start_timeout
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= updates):
            ended = proc.poll() is not None
            if ended or time.monotonic() > deadline:
                proc.kill()
                _, stderr = proc.communicate()
                pytest.fail(f"the run {'ended' if ended else f'ran {start_timeout:g} s'} without logging {updates} "
                            f"updates: {stderr[-3000:]}")
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=stop_timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
