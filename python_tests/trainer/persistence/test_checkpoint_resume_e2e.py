"""``flashreinforce train`` with refused checkpoints and a full disk, end to end (toy preset, CPU):
the user gets one line (no traceback) saying which checkpoint, why and what to do; ``--resume``
falls back to the newest valid checkpoint; a run whose disk filled up resumes without manual cleanup."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--preset", "toy", "--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false",
         "--rollout.batch_size", "16", "--train.batch_size", "16"]
TRAIN = [sys.executable, "-m", "flashreinforce.cli", "train", *SMALL]


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("flashreinforce train: error:")]
    return line


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_refused_checkpoint_is_one_line_and_resume_falls_back(tmp_path):
    out = tmp_path / "run"
    first = _train("--output", str(out), "--train.max_steps", "2", "--ckpt.save_steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    bad = out / "checkpoints" / "step_00000002"
    opt = torch.load(bad / "optimizer.pt", weights_only=True)
    opt["state"][0]["exp_avg"][0] = math.nan
    torch.save(opt, bad / "optimizer.pt")
    # the broken checkpoint named explicitly: refused, nothing trained, one line saying what to do
    explicit = _train("--output", str(out), "--train.max_steps", "3", "--resume", str(bad))
    assert explicit.returncode == 2
    line = _error_line(explicit.stderr)
    assert "step_00000002" in line and "optimizer.pt" in line and "non-finite" in line
    assert f"--resume {out / 'checkpoints'}" in line
    assert _steps(out) == [1, 2]
    # --resume: one warning line for the refused one, then the run goes on from step 1
    resumed = _train("--output", str(out), "--train.max_steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    (warning,) = [ln for ln in resumed.stderr.splitlines() if "refused the checkpoint" in ln]
    assert "step_00000002" in warning and "non-finite" in warning and "older" in warning
    assert _steps(out) == [1, 2, 3]
    # a checkpoint past this run's length: refused, not reported as a completed run
    short = _train("--output", str(out), "--train.max_steps", "2", "--resume")
    assert short.returncode == 2 and "past this run's 2 updates" in _error_line(short.stderr)


_FULL_DISK_RUN = """
set -e
mount -t tmpfs -o size=2600k tmpfs "$1"
shift
set +e
"$@" --output "$DISK/run" --train.max_steps 4 --ckpt.save_steps 1 >"$LOGS/first.out" 2>"$LOGS/first.err"
echo $? >"$LOGS/first.rc"
ls -A "$DISK/run/checkpoints" >"$LOGS/first.listing"
mount -o remount,size=16m "$DISK"
"$@" --output "$DISK/run" --train.max_steps 3 --ckpt.save_steps 10 --resume >"$LOGS/second.out" 2>"$LOGS/second.err"
echo $? >"$LOGS/second.rc"
ls -A "$DISK/run/checkpoints" >"$LOGS/second.listing"
cp "$DISK/run/metrics.jsonl" "$LOGS/metrics.jsonl"
"""


@pytest.mark.slow
def test_a_run_whose_disk_fills_up_stops_with_one_line_and_resumes_without_cleanup(tmp_path):
    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    disk, logs = tmp_path / "disk", tmp_path / "logs"
    disk.mkdir()
    logs.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {disk}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.strip()}")
    # a 2.6 MB disk holds the first checkpoint (1.6 MB) and not the second
    proc = subprocess.run(["unshare", "-m", "sh", "-c", _FULL_DISK_RUN, "sh", str(disk), *TRAIN], cwd=ROOT,
                          env={**os.environ, "DISK": str(disk), "LOGS": str(logs)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first_err = (logs / "first.err").read_text()
    assert (logs / "first.rc").read_text().strip() == "1", first_err[-3000:]
    line = _error_line(first_err)
    assert "step_00000002 not saved" in line and "latest still names step_00000001" in line
    assert (logs / "first.listing").read_text().split() == ["latest", "step_00000001"]  # no leftovers
    assert (logs / "second.rc").read_text().strip() == "0", (logs / "second.err").read_text()[-3000:]
    assert "Traceback" not in (logs / "second.err").read_text()
    assert (logs / "second.listing").read_text().split() == ["latest", "step_00000001", "step_00000003"]
    assert [json.loads(x)["step"] for x in (logs / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_updates_without_an_optimizer_step_are_checkpointed_and_resumed(tmp_path):
    # With --actor.step_on_zero_gradient false an update the gate admitted nothing of makes no optimizer
    # step, so AdamW's step count falls behind the policy version: the checkpoint records by how much
    # (the save used to refuse it: "the largest step count 27 differs from the policy version 30").
    out = tmp_path / "run"
    hold = ["--actor.step_on_zero_gradient", "false", "--actor.flash_gate_delta", "0", "--train.fixed_policy_lag", "1",
            "--ckpt.save_steps", "1"]
    first = _train("--output", str(out), "--train.max_steps", "3", *hold)
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = sum(int(m["optimizer_step_skipped"]) for m in metrics)
    assert skipped >= 1 and all(m["optimizer_step_skipped"] == float(m["grad_norm"] == 0.0) for m in metrics)
    state = json.loads((out / "checkpoints" / "step_00000003" / "state.json").read_text())
    assert state["version"] == 3 and state["optimizer_steps_skipped"] == skipped
    steps = [int(v["step"]) for v in torch.load(out / "checkpoints" / "step_00000003" / "optimizer.pt",
                                                weights_only=True)["state"].values()]
    assert set(steps) <= {3 - skipped}
    resumed = _train("--output", str(out), "--train.max_steps", "4", "--resume", *hold)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out) == [1, 2, 3, 4]
    again = json.loads((out / "checkpoints" / "step_00000004" / "state.json").read_text())
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert again["optimizer_steps_skipped"] == skipped + int(last["optimizer_step_skipped"])
