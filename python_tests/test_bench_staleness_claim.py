"""The staleness grid's runner never runs one cell twice at once: a running cell holds a lock on its folder,
a second runner on the same output skips that cell, and the lock ends with its holder's process, however
that process ends (benchmarks/bench_staleness.py, ``claim`` and ``run_grid``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from python_tests.benchmark_scripts import loaded_benchmark


@pytest.fixture(scope="module")
def bench():
    with loaded_benchmark("bench_staleness.py") as module:
        yield module


def test_a_held_cell_cannot_be_claimed_again_until_it_is_released(bench, tmp_path):
    cell = tmp_path / "main_K0_gate_s0"
    with bench.claim(cell) as first:
        assert first is True
        with bench.claim(cell) as second:  # another open file: flock refuses it as it would another process
            assert second is False
        assert "pid" in (cell / "LOCK").read_text()
    with bench.claim(cell) as again:
        assert again is True


def _holder(cell: Path) -> subprocess.Popen:
    code = (f"import fcntl, time; fh = open({str(cell / 'LOCK')!r}, 'a+'); "
            "fcntl.flock(fh, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    cell.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_the_lock_of_a_killed_runner_ends_with_it(bench, tmp_path):
    cell = tmp_path / "main_K16_k3_s1"
    holder = _holder(cell)
    try:
        with bench.claim(cell) as mine:
            assert mine is False
    finally:
        holder.kill()
        holder.wait()
    with bench.claim(cell) as mine:
        assert mine is True


def test_the_grid_skips_a_cell_another_runner_holds_and_runs_the_rest(bench, tmp_path, monkeypatch, capsys):
    task = "rg_basic_arithmetic"
    cells = [bench.Cell(task, "main", 0, column, 1, 4e-5, []) for column in ("no_is", "k3")]
    ran: list[str] = []

    def fake_run(args, cell, folder, base, root, counter):
        ran.append(cell.name)
        (folder / "result.json").write_text("{}")
        return 0

    monkeypatch.setattr(bench, "cells", lambda args: cells)
    monkeypatch.setattr(bench, "base_accuracy", lambda args, t: 0.1)
    monkeypatch.setattr(bench, "run_cell", fake_run)
    held = tmp_path / task / cells[0].name
    holder = _holder(held)
    try:
        bench.run_grid(SimpleNamespace(output=str(tmp_path), task=task, grid="main"))
    finally:
        holder.kill()
        holder.wait()
    assert ran == [cells[1].name]
    assert not (held / "result.json").exists()
    out = capsys.readouterr().out
    assert f"{cells[0].name}: another runner holds it" in out and "skipped" in out
    # once the holder is gone, the next pass runs the skipped cell and nothing else
    bench.run_grid(SimpleNamespace(output=str(tmp_path), task=task, grid="main"))
    assert ran == [cells[1].name, cells[0].name]
