"""``--train.fixed_policy_lag K``: every trajectory is sampled by the policy exactly K versions before
the one that trains on it, after the first K updates (which use version 0); K = 0 is synchronous
on-policy training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.config import ConfigError, parse_train_args
from flashreinforce.config.presets import PRESETS

ROOT = Path(__file__).resolve().parents[3]


def _train(out: Path, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--output", str(out),
           "--ckpt.save_steps", "0", "--no_progress", "--logger.log_samples_steps", "1", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lag", [0, 1, 4])
def test_every_trajectory_is_sampled_exactly_k_versions_back(tmp_path, lag):
    steps = 12
    # Evaluations pause the rollouts between updates: the lag's gate must not wait on a paused buffer.
    rows = _train(tmp_path / "run", "--train.fixed_policy_lag", str(lag), "--train.max_steps", str(steps),
                  "--eval.steps", "5", "--eval.eval_at_start", "false", "--rollout.inflight_weight_updates", "true")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        want = min(r["step"] - 1, lag)  # update u trains at version u - 1 on trajectories of version max(0, u-1-K)
        assert r["policy_lag_min"] == r["policy_lag_max"] == want, (r["step"], r["policy_lag_min"], r["policy_lag_max"])
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["policy_lag"] == min(s["step"] - 1, lag) for s in samples)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert "train.async_queue_size" in config["inactive"] and "rollout.inflight_weight_updates" in config["inactive"]
    if lag == 0:
        # Synchronous on-policy: the engine sampled with the learner's own weights, so the gate's
        # statistic is the numerical difference of two evaluations of the same policy.
        assert all(r["acceptance_rate"] == 1.0 for r in rows)
        assert max(r["sequence_kl_max"] for r in rows) < 1e-4


def test_a_gate_that_drops_most_of_the_stale_batches_warns_once_and_summary_json_says_so(tmp_path):
    """A delta far below any drift drops (nearly) every trajectory: the run goes on, the console warns
    once, and summary.json lists the warning with the update it fired at."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--output", str(out),
           "--ckpt.save_steps", "0", "--no_progress", "--train.fixed_policy_lag", "2", "--train.max_steps", "8",
           "--eval.steps", "0", "--eval.eval_at_start", "false", "--actor.flash_gate_delta", "1e-30",
           "--logger.warn_gate_drop_steps", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    low = [r["step"] for r in rows if r["acceptance_rate"] < 0.5]
    assert len(low) >= 4, [r["acceptance_rate"] for r in rows]
    assert proc.stderr.count("warning: the trust gate admitted less than 0.5") == 1
    warnings = json.loads((out / "summary.json").read_text())["warnings"]
    assert [w["kind"] for w in warnings] == ["trust_gate_drops_most"]
    first_run_of_four = next(s for s in low if all(s - i in low for i in range(4)))
    assert warnings[0]["step"] == first_run_of_four and "--actor.scale_step_by_acceptance true" in warnings[0]["message"]


def test_a_lag_that_max_policy_lag_would_drop_is_refused():
    with pytest.raises(ConfigError, match="max_policy_lag 2 would drop every trajectory of --train.fixed_policy_lag 3"):
        parse_train_args(["--preset", "toy", "--output", "x", "--train.fixed_policy_lag", "3",
                          "--train.max_policy_lag", "2"], PRESETS)
    cfg = parse_train_args(["--preset", "toy", "--output", "x", "--train.fixed_policy_lag", "3"], PRESETS)
    assert cfg.train.batches_ahead == 3
    with pytest.raises(ConfigError, match="fixed_policy_lag"):
        parse_train_args(["--preset", "toy", "--output", "x", "--train.fixed_policy_lag", "-1"], PRESETS)


def test_a_presets_lower_staleness_bound_gives_way_to_a_fixed_lag():
    """The arith preset bounds the lag at 2; a fixed lag of 8 given on the command line drops that bound
    (with a warning saying so) rather than refusing the run, and a bound given along with it is checked."""
    cfg = parse_train_args(["--preset", "arith", "--output", "x", "--train.fixed_policy_lag", "8"], PRESETS)
    assert cfg.train.max_policy_lag is None and cfg.train.batches_ahead == 8
    assert "train.max_policy_lag 2" in cfg.inactive["train.max_policy_lag"]
    assert any("below train.fixed_policy_lag 8: dropped" in w for w in cfg.warnings)
    kept = parse_train_args(["--preset", "arith", "--output", "x", "--train.fixed_policy_lag", "1"], PRESETS)
    assert kept.train.max_policy_lag == 2  # not below the lag: kept
    with pytest.raises(ConfigError, match="max_policy_lag 2 would drop"):
        parse_train_args(["--preset", "arith", "--output", "x", "--train.fixed_policy_lag", "8",
                          "--train.max_policy_lag", "2"], PRESETS)
