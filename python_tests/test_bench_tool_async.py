"""The slow-tools benchmark's bookkeeping (benchmarks/bench_tool_async.py): what one run's records
become, the table over seeds, and a rerun that keeps finished runs instead of running them again."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from python_tests.benchmark_scripts import loaded_benchmark


@pytest.fixture(scope="module")
def bench():
    with loaded_benchmark("bench_tool_async.py") as module:
        yield module


def _update(step, *, reward, seconds, idle=0.0, lag=0.0, accept=1.0, kl=0.0, train_time=None):
    return {"step": step, "reward_mean": reward, "step_time_s": seconds, "trajectories": 32, "learner_idle_s": idle,
            "policy_lag_mean": lag, "policy_lag_max": int(math.ceil(lag)), "acceptance_rate": accept,
            "sequence_kl_mean": kl, "grad_norm": 0.5, "env/tool_calls": 1.0, "env/tool_run_s": 0.2,
            "env/tool_latency_s": 0.9, "train_time_s": train_time if train_time is not None else 10.0 * step}


def test_a_runs_rates_leave_the_first_update_out_and_its_accuracy_is_the_stops(bench):
    metrics = [_update(1, reward=0.0, seconds=100.0, idle=50.0),  # start-up: not in the rates
               _update(2, reward=1.0, seconds=10.0, idle=2.0, lag=1.0),
               _update(3, reward=0.5, seconds=30.0, idle=0.0, lag=2.0, accept=0.25, kl=0.3, train_time=140.0)]
    evals = [{"step": 0, "eval_success_rate": 0.2}, {"step": 3, "eval_success_rate": 0.75}]
    r = bench.summarize("stream2", metrics, evals)
    assert r["updates"] == 2
    assert r["seconds_per_update"] == pytest.approx(20.0)
    assert r["trajectories_per_s"] == pytest.approx(64 / 40)
    assert r["learner_idle_share"] == pytest.approx(2 / 40)
    assert r["policy_lag_mean"] == pytest.approx(1.5) and r["policy_lag_max"] == 2
    assert r["reward_mean"] == pytest.approx(0.75) and r["reward_min"] == pytest.approx(0.5)
    assert r["heldout_accuracy"] == pytest.approx(0.75)  # the stop's row, not the start's
    assert r["train_time_s"] == pytest.approx(140.0)
    assert [u["step"] for u in r["per_update"]] == [1, 2, 3]  # the record keeps every update
    assert r["per_update"][2]["acceptance"] == pytest.approx(0.25) and r["per_update"][2]["sequence_kl"] == 0.3


def test_the_cpu_busy_share_weights_updates_by_their_time_and_bounds_any_schedule(bench):
    metrics = [dict(_update(1, reward=0.0, seconds=100.0), cpu_time_s=20.0, cpu_busy_share=0.1),  # left out
               dict(_update(2, reward=1.0, seconds=10.0), cpu_time_s=18.0, cpu_busy_share=0.9),
               dict(_update(3, reward=1.0, seconds=30.0), cpu_time_s=30.0, cpu_busy_share=0.5)]
    r = bench.summarize("sync_threads2", metrics, [])
    assert r["cpu_busy_share"] == pytest.approx((0.9 * 10 + 0.5 * 30) / 40)
    assert r["speedup_bound"] == pytest.approx(40 / (0.9 * 10 + 0.5 * 30))
    assert r["per_update"][1]["cpu_time_s"] == 18.0 and r["cpu_seconds_per_update"] == pytest.approx(24.0)
    # records of a trainer without the cpu metrics: no number rather than a wrong one, and no table row
    old = bench.summarize("sync", [_update(1, reward=0.0, seconds=9.0), _update(2, reward=1.0, seconds=9.0)], [])
    assert math.isnan(old["cpu_busy_share"]) and math.isnan(old["cpu_seconds_per_update"]) and math.isnan(old["per_update"][1]["cpu_time_s"])
    kept = {k: v for k, v in _result(bench, 0, 30.0, 1.0).items() if k not in ("cpu_busy_share", "speedup_bound", "cpu_seconds_per_update")}
    text = bench.table({"sync": [kept]})
    assert "CPU busy share" not in text and "| seconds per update | 30.0 |" in text.splitlines()
    assert "| CPU busy share (of the usable cores) | 1.00 |" in bench.table({"sync": [_result(bench, 0, 30.0, 1.0)]})


def test_a_run_without_a_final_evaluation_says_so_and_one_update_is_refused(bench):
    metrics = [_update(1, reward=0.0, seconds=9.0), _update(2, reward=1.0, seconds=9.0)]
    assert math.isnan(bench.summarize("sync", metrics, [{"step": 0, "eval_success_rate": 1.0}])["heldout_accuracy"])
    with pytest.raises(ValueError, match=r"\[sync\] 1 update"):
        bench.summarize("sync", metrics[:1], [])


def _result(bench, seed, seconds, accuracy):
    row = {key: 1.0 for _, key, _ in bench.ROWS}
    return dict(row, seed=seed, seconds_per_update=seconds, heldout_accuracy=accuracy)


def test_the_table_gives_the_mean_over_seeds_each_seed_and_the_speed_against_sync(bench):
    stale = dict(_result(bench, 1, 16.0, 1.0), policy_lag_max=3)
    assert "| policy lag (max) | 3 (1, 3) |" in bench.table({"stream2": [_result(bench, 0, 16.0, 1.0), stale]})
    text = bench.table({"sync": [_result(bench, 0, 30.0, 1.0), _result(bench, 1, 34.0, 0.5)],
                        "stream2": [_result(bench, 0, 16.0, 0.0), _result(bench, 1, 16.0, 1.0)]})
    lines = text.splitlines()
    assert lines[0] == "| | sync | stream2 |"
    assert "| seeds | 0, 1 | 0, 1 |" in lines
    assert "| seconds per update | 32.0 (30.0, 34.0) | 16.0 (16.0, 16.0) |" in lines
    assert "| held-out accuracy at the stop | 0.750 (1.000, 0.500) | 0.500 (0.000, 1.000) |" in lines
    assert "| policy lag (max) | 1 (1, 1) | 1 (1, 1) |" in lines
    assert lines[-1] == "| against sync | 1.00x | 2.00x |"
    one = bench.table({"stream": [_result(bench, 3, 20.0, 1.0)]})
    assert "| seconds per update | 20.0 |" in one.splitlines() and "against sync" not in one


def test_a_rerun_keeps_finished_runs_and_writes_the_table(bench, tmp_path, monkeypatch):
    for seed in (0, 1):
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "sync.json").write_text(json.dumps(_result(bench, seed, 30.0 + seed, 1.0)))

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(bench, "run", refuse)
    assert bench.main(["--output", str(tmp_path), "--seeds", "0", "1", "--schedules", "sync"]) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["seed"] for r in saved["results"]["sync"]] == [0, 1]
    assert "| seconds per update | 30.5 (30.0, 31.0) |" in (tmp_path / "table.md").read_text()


def test_updates_below_one_are_refused_by_name(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--output", str(tmp_path), "--updates", "0"])
    assert "--updates must be at least 1, got 0" in capsys.readouterr().err


def test_the_warmup_schedules_warm_up_over_the_updates_asked_for_and_the_others_do_not(bench, tmp_path, monkeypatch):
    commands = {}

    def fake_run(cmd, stdout, stderr, cwd):
        run_dir = Path(cmd[cmd.index("--output") + 1])
        run_dir.mkdir(parents=True)
        rows = [_update(1, reward=1.0, seconds=5.0), _update(2, reward=1.0, seconds=5.0)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": 2, "eval_success_rate": 1.0}) + "\n")
        commands[run_dir.name] = cmd
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    argv = ["--output", str(tmp_path), "--updates", "11", "--warmup-updates", "4",
            "--schedules", "sync", "stream2_warmup"]
    assert bench.main(argv) == 0
    warm = commands["stream2_warmup"]
    ratio = float(warm[warm.index("--actor.lr_warmup_ratio") + 1])
    assert math.ceil(ratio * 12) == 4  # the trainer's warmup: ceil(ratio * total updates)
    assert "--train.async_queue_size" in warm and "--actor.lr_warmup_ratio" not in commands["sync"]
    assert warm[warm.index("--eval.steps") + 1] == "12"  # one held-out evaluation, at the last update
    assert json.loads((tmp_path / "seed0" / "stream2_warmup.json").read_text())["heldout_accuracy"] == 1.0


def test_a_warmup_longer_than_the_run_is_refused_by_name(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--output", str(tmp_path), "--updates", "3", "--warmup-updates", "5"])
    assert "--warmup-updates must lie in [1, 4] (the run's updates), got 5" in capsys.readouterr().err


def test_a_kept_result_without_held_out_accuracy_is_evaluated_after_the_run_when_asked(bench, tmp_path, monkeypatch):
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "sync.json").write_text(json.dumps(_result(bench, 0, 30.0, float("nan"))))
    (tmp_path / "seed0" / "stream2.json").write_text(json.dumps(_result(bench, 0, 15.0, 0.5)))
    commands = []

    def fake_eval(cmd, stdout, stderr, cwd):
        commands.append(cmd)
        Path(cmd[cmd.index("--output") + 1]).parent.mkdir(parents=True, exist_ok=True)
        Path(cmd[cmd.index("--output") + 1]).write_text(json.dumps({"accuracy": 0.875}))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(bench.subprocess, "run", fake_eval)
    argv = ["--output", str(tmp_path), "--schedules", "sync", "stream2"]
    assert bench.main(argv) == 0 and commands == []  # not asked: kept as it is
    assert bench.main([*argv, "--evaluate-missing"]) == 0
    assert len(commands) == 1 and commands[0][commands[0].index("--model") + 1] == str(tmp_path / "seed0" / "sync")
    assert "--no_sampled" in commands[0]
    kept = json.loads((tmp_path / "seed0" / "sync.json").read_text())
    assert kept["heldout_accuracy"] == 0.875 and "after the run" in kept["heldout_source"]
    assert json.loads((tmp_path / "seed0" / "stream2.json").read_text())["heldout_accuracy"] == 0.5  # had one
    assert bench.main([*argv, "--evaluate-missing"]) == 0 and len(commands) == 1  # recorded: not evaluated twice


def test_the_warmup_bound_applies_only_when_a_warmup_schedule_runs(bench, tmp_path, monkeypatch):
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "sync.json").write_text(json.dumps(_result(bench, 0, 30.0, 1.0)))
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("a finished run was run again"))
    assert bench.main(["--output", str(tmp_path), "--updates", "1", "--schedules", "sync"]) == 0
