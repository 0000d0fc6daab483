"""`flashreinforce train` on the toy preset with the run's reporting on: samples.jsonl, TensorBoard,
summary.json across a resume, and the warning about updates that cannot learn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from python_tests.trainer.cli_runs import train, train_until_ctrl_c

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


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_samples_tensorboard_and_summary_across_ctrl_c_and_resume(tmp_path):
    out = tmp_path / "run"
    reporting = ["--logger.log_samples_steps", "2", "--logger.log_samples_num", "3", "--eval.steps", "4",
                 "--ckpt.save_steps", "0", *(["--logger.tensorboard.dir", str(out / "tb")] if _has("tensorboard") else [])]
    proc = train_until_ctrl_c(*SMALL, "--train.max_steps", "100000", *reporting, output=out, updates=6)
    stderr = proc.stderr
    assert proc.returncode == 130, stderr[-3000:]
    stopped = lines(out / "metrics.jsonl")[-1]["step"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == stopped and summary["exported_model"] is None
    assert summary["latest_checkpoint"].endswith(f"step_{stopped:08d}")
    # Ctrl-C: the policy is evaluated at the update the run stopped after (no evaluation at the start here)
    assert [e["step"] for e in lines(out / "eval.jsonl")] == sorted({*range(4, stopped + 1, 4), stopped})
    assert summary["final_eval"]["step"] == stopped and summary["start_eval"] is None is summary["eval_change"]
    samples = lines(out / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == list(range(2, stopped + 1, 2)) and len(samples) == 3 * (stopped // 2)
    for s in samples:
        # One sampled token: one character, or none when the policy sampled a special token
        # (<pad>/<bos>/<eos> decode to nothing; the toy environment grades that an invalid answer).
        assert s["prompt"].startswith("say ") and len(s["turns"]) == 1 and len(s["turns"][0]["action"]) <= 1
        assert s["reward"] in (0.0, 1.0) and s["failed"] == (s["reward"] == 0.0)
        assert isinstance(s["admitted"], bool) and s["sequence_kl"] >= 0 and s["policy_lag"] >= 0
        assert (s["failure_kind"] in ("wrong_answer", "invalid_answer")) == s["failed"]
    assert "sample at update 2:" in stderr
    assert all(sum(m["failure_kinds"].values()) == round((1 - m["success_rate"]) * 16) for m in lines(out / "metrics.jsonl"))

    final = stopped + 4
    resumed = train(*SMALL, "--output", str(out), "--train.max_steps", str(final), "--resume", *reporting)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == final
    assert summary["exported_model"] == str(out / "hf") and summary["latest_checkpoint"].endswith(f"step_{final:08d}")
    assert [(s["status"], s["last_step"]) for s in summary["sessions"]] == [("interrupted", stopped), ("completed", final)]
    assert summary["final_eval"]["step"] == final  # evaluated at the stop
    # the resumed run's history is the checkpoint's: the evaluation at the Ctrl-C came after it and is gone
    assert [e["step"] for e in lines(out / "eval.jsonl")] == sorted({*range(4, final + 1, 4), final})
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["summary_file"] == str(out / "summary.json")
    steps = [s["step"] for s in lines(out / "samples.jsonl")]
    assert steps == sorted(steps) and set(steps) == set(range(2, final + 1, 2))  # nothing duplicated by the resume
    if _has("tensorboard"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(out / "tb"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("reward_mean")] == list(range(1, final + 1))
        assert [e.step for e in acc.Scalars("eval_reward_mean")] == list(range(4, final + 1, 4))


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
