"""A save that cannot be completed (non-finite state, disk full) fails with one line, removes what
it wrote and leaves ``latest`` where it was; resuming afterwards needs no manual cleanup, and the
run history is repaired without a raw ``OSError`` when the disk is still full."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashreinforce.trainer.persistence.checkpoints as checkpoints
from flashreinforce.config import ConfigError
from flashreinforce.trainer.persistence.checkpoints import (CheckpointSaveError, ResumePoint, clean_interrupted_saves,
                                                            save_checkpoint, trim_history)
from flashreinforce.trainer.errors import RunFailure
from python_tests.trainer.persistence.checkpoint_helpers import learner_state, run_state, save, same, tiny_model, weights

ROOT = Path(__file__).resolve().parents[3]


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---------------------------------------------------------------- non-finite state is never saved


def test_non_finite_weights_are_never_saved_and_latest_stays(tmp_path):
    d = tmp_path / "checkpoints"
    save(d, 3, tiny_model(1))
    model = tiny_model(2)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.fill_(math.nan)
    with pytest.raises(CheckpointSaveError) as info:
        save(d, 6, model)
    message = str(info.value)
    assert isinstance(info.value, RunFailure)  # the CLI prints it as one line, exit status 1
    assert "\n" not in message and "model.layers.0.self_attn.k_proj.weight" in message and "non-finite" in message
    assert "latest still names step_00000003" in message
    assert _listing(d) == ["latest", "step_00000003"] and (d / "latest").read_text() == "step_00000003"


def test_non_finite_optimizer_state_is_never_saved_and_latest_stays(tmp_path):
    d = tmp_path / "checkpoints"
    save(d, 3, tiny_model(1))
    state = learner_state(6)
    state["optimizer"]["state"][2]["exp_avg_sq"][0] = math.nan
    with pytest.raises(CheckpointSaveError, match=r"optimizer\.pt: .*non-finite"):
        save_checkpoint(d, 6, model=tiny_model(2), learner_state=state, state=run_state(6))
    assert _listing(d) == ["latest", "step_00000003"]


def test_a_save_of_inconsistent_state_is_refused_before_anything_is_written(tmp_path):
    d = tmp_path / "checkpoints"
    with pytest.raises(CheckpointSaveError, match=r"state\.json: 'step' must be >= 0"):
        save_checkpoint(d, -3, model=tiny_model(2), learner_state=learner_state(0), state=run_state(0))
    assert not d.exists() or _listing(d) == []
    with pytest.raises(CheckpointSaveError, match="there is no earlier checkpoint"):
        save_checkpoint(d, 4, model=tiny_model(2), learner_state=learner_state(3), state=run_state(4))


# ---------------------------------------------------------------- disk full while saving

WRITERS = {
    "model.safetensors": (checkpoints, "save_model"),
    "optimizer.pt": (torch, "save"),
    "state.json": (Path, "write_text"),
    "fsync": (os, "fsync"),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_disk_full_during_a_save_removes_the_partial_copy_and_keeps_latest(tmp_path, monkeypatch, writer):
    d = tmp_path / "checkpoints"
    save(d, 3, tiny_model(1))
    save(d, 6, tiny_model(2))
    owner, name = WRITERS[writer]
    monkeypatch.setattr(owner, name, _disk_full)
    for step in (9, 6):  # a new step, and the replacement of an existing one (the end of a run)
        with pytest.raises(CheckpointSaveError) as info:
            save(d, step, tiny_model(4))
        message = str(info.value)
        assert "\n" not in message and "No space left on device" in message, message
        assert "latest still names step_00000006" in message and "partial copy was removed" in message
        assert _listing(d) == ["latest", "step_00000003", "step_00000006"], (step, _listing(d))
    monkeypatch.undo()
    assert ResumePoint.load(d, "latest", tiny_model(5)).step == 6


def test_disk_full_while_pointing_latest_keeps_the_old_pointer_and_no_temporary_file(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints"
    save(d, 3, tiny_model(1))
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "latest":
            _disk_full()
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointSaveError, match="latest still names step_00000003"):
        save(d, 6, tiny_model(2))
    monkeypatch.undo()
    assert (d / "latest").read_text() == "step_00000003"
    assert not [p for p in _listing(d) if p.startswith(".")]
    assert ResumePoint.load(d, "latest", tiny_model(5)).step == 3


# ---------------------------------------------------------------- resuming after a crash or a failed save


def test_resume_removes_the_leftovers_of_interrupted_saves(tmp_path):
    out = tmp_path / "run"
    d = out / "checkpoints"
    model = tiny_model(1)
    save(d, 3, model)
    for token in ("0123456789ab", "ba9876543210"):  # two half-written copies, as a killed run leaves them
        partial = d / f".step_00000004.tmp-{token}"
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"\0" * 1000)
    (d / ".latest.tmp-0123456789ab").write_text("step_0000")
    (out / ".metrics.jsonl.tmp-0123456789ab").write_text('{"step": 1}\n')
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    point = ResumePoint.load(d, "latest", tiny_model(5))
    clean_interrupted_saves(d)
    trim_history(out, point.step)
    assert _listing(d) == ["latest", "step_00000003"]
    assert _listing(out) == ["checkpoints", "metrics.jsonl"]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    # and the next save of the resumed run is as usual
    save(d, 4, model)
    assert _listing(d) == ["latest", "step_00000003", "step_00000004"]


def test_trimming_the_history_on_a_full_disk_is_one_clear_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(ConfigError) as info:
        trim_history(tmp_path, 3)
    message = str(info.value)
    assert "\n" not in message and "metrics.jsonl" in message and "No space left on device" in message
    assert _listing(tmp_path) == ["metrics.jsonl"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 7  # unchanged, not half-written


def test_trimming_a_history_that_needs_no_change_writes_nothing(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 4)))
    monkeypatch.setattr(os, "fsync", _disk_full)
    trim_history(tmp_path, 3)  # the checkpoint is the last record: nothing to drop, nothing to write
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_history_record_whose_step_is_not_an_integer_is_an_error_naming_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": "2"}\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"metrics\.jsonl line 2: .*'step'"):
        trim_history(tmp_path, 3)


# ---------------------------------------------------------------- a real full disk (a tiny tmpfs)


def _save_on_a_full_disk(root: str) -> None:
    """Run inside a private mount namespace with a tiny tmpfs at ``root``: a first checkpoint fits, the
    second does not; print what is left and whether resuming works."""
    out = Path(root)
    d = out / "checkpoints"
    save(d, 3, tiny_model(1))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "pad": "x" * 200}) + "\n" for s in range(1, 7)))
    error = None
    try:
        save(d, 6, tiny_model(2))
    except CheckpointSaveError as err:
        error = str(err)
    probe = tiny_model(5)
    point = ResumePoint.load(d, "latest", probe)
    clean_interrupted_saves(d)
    trim_history(out, point.step)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"error": error, "listing": _listing(d), "resumed": point.step, "steps": steps,
                      "same": same(weights(probe), weights(tiny_model(1)))}))


def test_a_real_full_disk_fails_the_save_cleanly_and_the_run_resumes(tmp_path):
    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    mount = tmp_path / "tiny_disk"
    mount.mkdir()
    script = (f"from python_tests.trainer.persistence.test_checkpoint_saving import _save_on_a_full_disk; "
              f"_save_on_a_full_disk({str(mount)!r})")
    cmd = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=300k tmpfs {mount} && exec \"$0\" -c \"$1\"",
           sys.executable, script]
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=300k tmpfs {mount}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.strip()}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] and "\n" not in result["error"] and "latest still names step_00000003" in result["error"]
    assert result["listing"] == ["latest", "step_00000003"]
    assert result["resumed"] == 3 and result["steps"] == [1, 2, 3] and result["same"]
