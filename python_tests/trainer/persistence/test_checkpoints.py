"""Checkpoints: only tensors and plain data are loaded, saving survives a crash at any point, a
broken checkpoint is named and skipped on ``--resume``, and the run history is repaired on resume."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flashreinforce.config import ConfigError
from flashreinforce.trainer.persistence.checkpoints import (CheckpointError, ResumePoint, latest_checkpoint,
                                                            load_checkpoint, trim_history)
from python_tests.trainer.persistence.checkpoint_helpers import save as _save
from python_tests.trainer.persistence.checkpoint_helpers import same as _same
from python_tests.trainer.persistence.checkpoint_helpers import tiny_model as _model
from python_tests.trainer.persistence.checkpoint_helpers import weights as _weights


class _RunsCode:
    """Unpickling this makes a directory: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


# ---------------------------------------------------------------- only tensors and plain data


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    path = _save(tmp_path / "ck", 2, _model())
    marker = tmp_path / "code_ran"
    torch.save({"state": {}, "param_groups": [], "x": _RunsCode(marker)}, path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="optimizer.pt") as info:
        load_checkpoint(path, model=_model(1))
    assert not marker.exists(), "unpickling optimizer.pt ran code"
    assert "tensors" in str(info.value) or "weights_only" in str(info.value)


def test_rng_states_round_trip_as_plain_data(tmp_path):
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    random.random(), np.random.normal(), torch.rand(1)  # move every stream, numpy's cached gaussian included
    path = _save(tmp_path / "ck", 1, _model())
    want = (random.random(), float(np.random.normal()), float(np.random.rand()), torch.rand(3).tolist())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    # the file itself loads under weights_only, without numpy or Python objects
    torch.load(path / "rng.pt", weights_only=True)
    load_checkpoint(path, model=_model(1))
    got = (random.random(), float(np.random.normal()), float(np.random.rand()), torch.rand(3).tolist())
    assert got == want


def test_random_states_of_earlier_versions_still_load_but_nothing_else_does(tmp_path):
    path = _save(tmp_path / "ck", 1, _model())
    np.random.seed(3)
    random.seed(4)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, path / "rng.pt")  # the earlier format: Python tuples and a NumPy array
    want = (random.random(), float(np.random.rand()))
    random.seed(0)
    np.random.seed(0)
    load_checkpoint(path, model=_model(1))
    assert (random.random(), float(np.random.rand())) == want
    marker = tmp_path / "code_ran"
    torch.save({**old, "x": _RunsCode(marker)}, path / "rng.pt")
    with pytest.raises(CheckpointError, match=r"rng\.pt"):
        load_checkpoint(path, model=_model(1))
    assert not marker.exists()


def test_a_checkpoint_round_trips_weights_optimizer_and_state(tmp_path):
    model = _model(3)
    path = _save(tmp_path / "ck", 4, model)
    other = _model(9)
    loaded = load_checkpoint(path, model=other)
    assert _same(_weights(model), _weights(other))
    assert loaded["state"]["step"] == 4 and loaded["learner"]["version"] == 4
    assert loaded["learner"]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert loaded["learner"]["scheduler"]["last_epoch"] == 4


# ---------------------------------------------------------------- crash-safe saving


class _Crash(BaseException):
    """Simulated power loss: nothing after it runs (BaseException: no cleanup handler catches it)."""


def _crash_at(monkeypatch, n: int) -> list[str]:
    """Make the ``n``-th filesystem mutation of a save raise; returns the log of mutations."""
    calls: list[str] = []
    originals = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree, "unlink": os.unlink,
                 "rmdir": os.rmdir}

    def wrap(name):
        def f(*args, **kwargs):
            calls.append(f"{name} {args[0]}")
            if len(calls) == n:
                raise _Crash(f"crash at {name}")
            return originals[name](*args, **kwargs)
        return f

    monkeypatch.setattr(os, "rename", wrap("rename"))
    monkeypatch.setattr(os, "replace", wrap("replace"))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree"))
    monkeypatch.setattr(os, "unlink", wrap("unlink"))
    monkeypatch.setattr(os, "rmdir", wrap("rmdir"))
    return calls


def test_a_crash_at_any_point_of_a_save_leaves_a_resumable_checkpoint(tmp_path, monkeypatch):
    # The end of a run re-saves the step of its last periodic checkpoint: the overwrite case.
    first, second = _model(1), _model(2)
    w_first, w_second = _weights(first), _weights(second)
    n = 1
    while True:
        d = tmp_path / f"run{n}" / "checkpoints"
        _save(d, 3, _model(0))
        _save(d, 6, first)
        with monkeypatch.context() as m:
            calls = _crash_at(m, n)
            try:
                _save(d, 6, second, max_keep=2)
                crashed = False
            except _Crash:
                crashed = True
        latest = latest_checkpoint(d)
        assert latest is not None and latest.is_dir(), f"crash at mutation {n} ({calls[-1]}): latest dangles"
        probe = _model(7)
        point = ResumePoint.load(d, "latest", probe)
        assert point.step == 6, (n, calls[-1])
        assert _same(_weights(probe), w_first) or _same(_weights(probe), w_second), (n, calls[-1])
        # the next save cleans up whatever the crash left and keeps the layout
        _save(d, 9, second, max_keep=2)
        names = sorted(p.name for p in d.iterdir())
        assert names == ["latest", "step_00000006", "step_00000009"], (n, calls[-1], names)
        if not crashed:
            break
        n += 1
    print(f"crash points exercised: {n}")
    assert n >= 4, f"a save makes only {n - 1} mutations; the swap was not exercised"


def test_saving_fsyncs_every_file_and_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def record(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    d = tmp_path / "ck"
    path = _save(d, 5, _model())
    # files were synced under their temporary name: compare by file name, directories by final path
    synced_names = {Path(p).name for p in synced}
    for f in path.iterdir():
        assert f.name in synced_names, f"{f.name} not fsynced"
    assert str(d.resolve()) in synced, "the checkpoints directory was not fsynced after the renames"
    assert any("latest" in name for name in synced_names), "the latest pointer was not fsynced"


# ---------------------------------------------------------------- validation and fallback


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("broken,what", [
    ("model.safetensors", "truncate"), ("optimizer.pt", "truncate"), ("scheduler.pt", "truncate"),
    ("state.json", "truncate"), ("rng.pt", "remove"), ("model.safetensors", "remove"),
])
def test_a_broken_file_is_named_and_resume_falls_back_to_the_newest_valid(tmp_path, caplog, broken, what):
    d = tmp_path / "checkpoints"
    good = _model(1)
    _save(d, 3, good)
    bad_dir = _save(d, 6, _model(2))
    if what == "truncate":
        _truncate(bad_dir / broken)
    else:
        (bad_dir / broken).unlink()
    with pytest.raises(CheckpointError, match=broken.replace(".", r"\.")):
        load_checkpoint(bad_dir, model=_model(5))
    # an explicit checkpoint is not replaced by another: a one-line error naming the file
    with pytest.raises(ConfigError, match=broken.replace(".", r"\.")):
        ResumePoint.load(d, str(bad_dir), _model(5))
    probe = _model(5)
    with caplog.at_level(logging.WARNING):
        point = ResumePoint.load(d, "latest", probe)
    assert point.step == 3 and _same(_weights(probe), _weights(good))
    assert any("step_00000006" in r.getMessage() and broken in r.getMessage() for r in caplog.records)


def test_a_dangling_latest_falls_back_with_a_warning(tmp_path, caplog):
    d = tmp_path / "checkpoints"
    _save(d, 3, _model(1))
    shutil.rmtree(_save(d, 6, _model(2)))
    with caplog.at_level(logging.WARNING):
        point = ResumePoint.load(d, "latest", _model(5))
    assert point.step == 3
    assert any("latest" in r.getMessage() and "step_00000006" in r.getMessage() for r in caplog.records)


def test_no_valid_checkpoint_is_a_config_error_listing_the_problems(tmp_path):
    d = tmp_path / "checkpoints"
    _truncate(_save(d, 3, _model(1)) / "optimizer.pt")
    with pytest.raises(ConfigError, match=r"--resume.*step_00000003.*optimizer\.pt"):
        ResumePoint.load(d, "latest", _model(5))
    with pytest.raises(ConfigError, match=r"--resume .*nonexistent"):
        ResumePoint.load(d, str(tmp_path / "nonexistent"), _model(5))


def test_resume_accepts_a_run_or_checkpoints_directory(tmp_path):
    run = tmp_path / "run"
    _save(run / "checkpoints", 2, _model(1))
    assert ResumePoint.load(tmp_path / "elsewhere", str(run), _model(5)).step == 2
    assert ResumePoint.load(tmp_path / "elsewhere", str(run / "checkpoints"), _model(5)).step == 2


# ---------------------------------------------------------------- history


@pytest.mark.parametrize("name", ["metrics.jsonl", "eval.jsonl"])
def test_a_half_written_last_line_is_dropped_with_a_warning(tmp_path, caplog, name):
    lines = [json.dumps({"step": s, "reward_mean": 0.5}) for s in (1, 2, 3, 4)]
    (tmp_path / name).write_text("\n".join(lines) + "\n" + '{"step": 5, "rew')
    with caplog.at_level(logging.WARNING):
        trim_history(tmp_path, 3)
    assert [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()] == [1, 2, 3]
    assert any(name in r.getMessage() and "half-written" in r.getMessage() for r in caplog.records)


def test_a_broken_line_inside_the_history_is_an_error_naming_the_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(ConfigError, match=r"metrics\.jsonl.*line 2"):
        trim_history(tmp_path, 3)

