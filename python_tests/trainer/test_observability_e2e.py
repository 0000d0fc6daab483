"""`flashreinforce train` on the toy preset with the run's reporting on: samples.jsonl, TensorBoard,
summary.json across a resume, and the warning about updates that cannot learn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--preset", "toy", "--rollout.batch_size", "16", "--train.batch_size", "16", "--no_progress",
         "--eval.eval_at_start", "false", "--seed", "0"]

ZERO_ENV = '''
from flashreinforce.envs.base import Environment, StepResult


class NeverPays(Environment):
    """Pays nothing, whatever the answer."""

    def reset(self, *, seed):
        return f"what is {seed % 7} + 1?"

    def step(self, action):
        return StepResult(reward=0.0, done=True, failed=True, info={"failure_kind": "no_answer"})
'''


def train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_toy_run_writes_samples_tensorboard_and_a_summary_that_resume_continues(tmp_path):
    out = tmp_path / "run"
    first = train(*SMALL, "--output", str(out), "--train.max_steps", "8", "--ckpt.save_steps", "4", "--eval.steps", "4",
                  "--logger.log_samples_steps", "2", "--logger.log_samples_num", "3",
                  *(["--logger.tensorboard.dir", str(out / "tb")] if _has("tensorboard") else []))
    assert first.returncode == 0, first.stderr[-3000:]
    samples = lines(out / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [2, 4, 6, 8] and len(samples) == 12
    for s in samples:
        assert s["prompt"].startswith("say ") and len(s["turns"]) == 1 and len(s["turns"][0]["action"]) == 1
        assert s["reward"] in (0.0, 1.0) and s["failed"] == (s["reward"] == 0.0)
        assert isinstance(s["admitted"], bool) and s["sequence_kl"] >= 0 and s["policy_lag"] >= 0
        assert (s["failure_kind"] in ("wrong_answer", "invalid_answer")) == s["failed"]
    assert "sample at update 2:" in first.stderr
    metrics = lines(out / "metrics.jsonl")
    assert all(sum(m["failure_kinds"].values()) == round((1 - m["success_rate"]) * 16) for m in metrics)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 8 and summary["exported_model"] == str(out / "hf")
    assert summary["final_eval"]["step"] == 8 and summary["latest_checkpoint"].endswith("step_00000008")
    assert json.loads(first.stdout.strip().splitlines()[-1])["summary_file"] == str(out / "summary.json")

    second = train(*SMALL, "--output", str(out), "--train.max_steps", "12", "--ckpt.save_steps", "4",
                   "--eval.steps", "4", "--logger.log_samples_steps", "2", "--logger.log_samples_num", "3", "--resume",
                   *(["--logger.tensorboard.dir", str(out / "tb")] if _has("tensorboard") else []))
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 12 and [s["last_step"] for s in summary["sessions"]] == [8, 12]
    assert [s["step"] for s in lines(out / "samples.jsonl")] == [s for s in (2, 4, 6, 8, 10, 12) for _ in range(3)]
    if _has("tensorboard"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(out / "tb"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("reward_mean")] == list(range(1, 13))
        assert [e.step for e in acc.Scalars("eval_reward_mean")] == [4, 8, 12]


@pytest.mark.slow
def test_a_run_that_cannot_learn_is_told_once(tmp_path):
    env = tmp_path / "never_pays.py"
    env.write_text(ZERO_ENV)
    out = tmp_path / "zero"
    proc = train(*SMALL, "--env", str(env), "--env.kwargs", "{}", "--output", str(out), "--train.max_steps", "6",
                 "--ckpt.save_steps", "0", "--eval.steps", "0", "--logger.warn_zero_variance_steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("had no reward variance") == 1
    warning = proc.stderr[proc.stderr.index("warning: the first 3 updates"):]
    assert "every reward was 0" in warning and "no_answer (48 of 48 failed trajectories)" in warning
    assert "a sample: prompt 'what is" in warning
    assert all(m["failure_kinds"] == {"no_answer": 16} for m in lines(out / "metrics.jsonl"))


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
