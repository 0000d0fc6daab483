"""The engine profile of the slow-tools schedules (benchmarks/profile_tool_engine.py): what its timers'
records and a run's metrics become."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from python_tests.benchmark_scripts import loaded_benchmark


@pytest.fixture(scope="module")
def profile():
    with loaded_benchmark("profile_tool_engine.py") as module:
        yield module


def _write(run: Path, metrics: list[dict], timings: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "engine_timings.jsonl").write_text("".join(json.dumps(t) + "\n" for t in timings))


def test_parts_are_per_update_over_the_whole_run_and_unused_turns_show(profile, tmp_path):
    metrics = [{"step": s, "step_time_s": t, "cpu_time_s": c, "learner_compute_s": lc, "backward_skipped": b,
                "trajectories": 4, "num_turns_mean": 2.0}
               for s, t, c, lc, b in [(1, 99.0, 99.0, 50.0, 1.0),  # the first update: out of the rates
                                      (2, 4.0, 7.0, 1.0, 1.0), (3, 8.0, 13.0, 5.0, 0.0), (4, 6.0, 10.0, 3.0, 1.0)]]
    timings = ([{"part": "_act", "s": 1.0, "rows": 4}] * 10  # 40 turns sampled, 32 used by the four updates
               + [{"part": "_prefill", "s": 0.5, "rows": 4, "tokens": 100}] * 2
               + [{"part": "_continued_prefill", "s": 0.25, "rows": 3, "tokens": 30}] * 4
               + [{"part": "step", "s": 0.01, "rows": r} for r in (4, 4, 2, 2)])
    _write(tmp_path / "stream", metrics, timings)
    r = profile.summarize("stream", tmp_path / "stream")
    assert r["updates"] == 3
    assert r["seconds_per_update"] == pytest.approx(6.0) and r["cpu_seconds_per_update"] == pytest.approx(10.0)
    # The timers ran through all four updates.
    assert r["generate_s_per_update"] == pytest.approx(10.0 / 4)
    assert r["prefill_s_per_update"] == pytest.approx(1.0 / 4)
    assert r["continued_prefill_s_per_update"] == pytest.approx(1.0 / 4)
    assert r["decode_s_per_update"] == pytest.approx(0.04 / 4)
    assert r["prefill_tokens_per_update"] == pytest.approx((200 + 120) / 4)
    assert r["decode_tokens_per_update"] == pytest.approx(12 / 4) and r["decode_rows_per_step"] == pytest.approx(3.0)
    assert r["episodes_per_generate_call"] == pytest.approx(4.0)
    assert (r["turns_sampled"], r["turns_used"]) == (40, 32)
    assert r["learner_s_without_backward"] == pytest.approx(2.0)  # median of 1 and 3; the first update left out
    assert r["learner_s_with_backward"] == pytest.approx(5.0) and r["updates_with_backward"] == 1
    text = profile.table([r])
    assert "| turns sampled in the run / used by its updates | 40 / 32 |" in text
    assert "| engine: rows per decode step | 3.0 |" in text


def test_a_run_without_a_backward_reports_nan_for_that_row(profile, tmp_path):
    metrics = [{"step": s, "step_time_s": 1.0, "cpu_time_s": 1.0, "learner_compute_s": 0.5, "backward_skipped": 1.0,
                "trajectories": 1, "num_turns_mean": 1.0} for s in (1, 2)]
    _write(tmp_path / "sync", metrics, [{"part": "_act", "s": 0.1, "rows": 1}])
    r = profile.summarize("sync", tmp_path / "sync")
    assert math.isnan(r["learner_s_with_backward"]) and r["updates_with_backward"] == 0
    assert r["decode_rows_per_step"] == 0.0 and "| nan |" in profile.table([r])
