"""End-to-end runs of `flashreinforce train` on the toy presets (tiny model, CPU, no download):
learning, overlap of rollouts and learner, checkpoint/resume reproducibility, Ctrl-C."""

import json
import shutil
import statistics
from pathlib import Path

import pytest
from safetensors.torch import load_file

from python_tests.trainer.cli_runs import train, train_until_ctrl_c

METRIC_KEYS = ("step", "policy_version", "reward_mean", "acceptance_rate", "sequence_kl_mean", "policy_lag_mean",
               "policy_lag_max", "trajectories", "tokens", "loss", "grad_norm", "lr", "learner_idle_s",
               "step_time_s", "cpu_time_s", "cpu_busy_share", "tokens_per_s", "rejected_trajectories")
QUIET = ["--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false"]


def metrics(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def mean_reward(rows):
    return statistics.mean(r["reward_mean"] for r in rows)


@pytest.mark.slow
def test_toy_preset_learns_with_rollouts_overlapping_the_learner(tmp_path):
    out = tmp_path / "toy"
    proc = train("--preset", "toy", "--output", str(out), "--train.max_steps", "200", "--ckpt.save_steps", "0",
                 "--seed", "0", *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 201))
    for key in METRIC_KEYS:
        assert key in rows[0], key
    # the process did work in every update, and no more than its cores can do (small slack: the two clocks)
    assert all(r["cpu_time_s"] > 0 for r in rows)
    assert 0 < statistics.mean(r["cpu_busy_share"] for r in rows) <= 1.05
    first, last = mean_reward(rows[:10]), mean_reward(rows[-20:])
    assert first < 0.1, f"a fresh model should be near chance, got {first}"
    assert last > 0.5 and last - first > 0.4, f"no clear learning: {first} -> {last}"
    lags = [r["policy_lag_max"] for r in rows]
    assert max(lags) > 0, "rollouts never overlapped the learner"
    assert max(lags) <= 4  # the preset's train.max_policy_lag
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["flags"]["rollout.num_workers"] >= 2 and cfg["loss_impl"] == "fused"
    assert "vllm.sync_backend" in cfg["inactive"]


@pytest.mark.slow
def test_multiturn_preset_learns_and_masks_observations(tmp_path):
    out = tmp_path / "mt"
    proc = train("--preset", "toy_multiturn", "--output", str(out), "--train.max_steps", "150",
                 "--ckpt.save_steps", "0", "--seed", "0", *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert all(r["num_turns_mean"] == 3 for r in rows)
    # 3 turns of 1 sampled token each: observations are in `tokens` but not in `action_tokens`
    assert all(r["action_tokens"] == 3 * r["trajectories"] < r["tokens"] for r in rows)
    first, last = mean_reward(rows[:10]), mean_reward(rows[-20:])
    assert first < 0.1 and last - first > 0.3, f"{first} -> {last}"


@pytest.mark.slow
def test_resume_reproduces_the_same_next_updates(tmp_path):
    # Synchronous schedule with one worker: each batch is a deterministic function of the weights.
    common = ["--preset", "toy", "--rollout.batch_size", "16", "--train.batch_size", "16", "--train.max_steps", "6",
              "--train.async_queue_size", "0", "--rollout.num_workers", "1", "--ckpt.save_steps", "3",
              "--seed", "3", "--actor.adam.lr", "3e-3", *QUIET]
    a = tmp_path / "a"
    proc = train(*common, "--output", str(a))
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "hf")
    proc = train(*common, "--output", str(b), "--resume", str(b / "checkpoints" / "step_00000003"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3, 4, 5, 6]  # history continues, nothing duplicated
    for x, y in zip(ra[3:], rb[3:]):
        for key in ("reward_mean", "loss", "grad_norm", "lr", "tokens", "policy_version", "sequence_kl_mean"):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-9), (x["step"], key)
    wa = load_file(str(a / "hf" / "model.safetensors"))
    wb = load_file(str(b / "hf" / "model.safetensors"))
    for k in wa:
        assert (wa[k] - wb[k]).abs().max() <= 1e-6, k


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = train_until_ctrl_c("--preset", "toy", "--train.max_steps", "100000", "--ckpt.save_steps", "0",
                              "--rollout.batch_size", "16", "--train.batch_size", "16", *QUIET, "--eval.eval_at_start",
                              "true", "--eval.num_prompts", "8", output=out, updates=5)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert json.loads(stdout.strip().splitlines()[-1])["status"] == "interrupted"
    step = metrics(out)[-1]["step"]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{step:08d}"
    state = json.loads((out / "checkpoints" / latest / "state.json").read_text())
    assert state["step"] == state["version"] == step
    # evaluated before training and at the Ctrl-C (the first evaluation by eval.steps would be at update 50)
    assert [json.loads(x)["step"] for x in (out / "eval.jsonl").read_text().splitlines()] == [0, step]
    assert "evaluates the policy and exits with status 130" in stderr and f"eval at stop (update {step})" in stderr
    proc2 = train("--preset", "toy", "--output", str(out), "--train.max_steps", str(step + 2), "--resume",
                  "--rollout.batch_size", "16", "--train.batch_size", "16", *QUIET)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == list(range(1, step + 3))
