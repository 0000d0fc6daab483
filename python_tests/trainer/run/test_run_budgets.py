"""Every budget of a run holds on every path: skipped updates (a reward so large that every gradient
overflows) count against the time budget and against a bound of their own, ``--train.max_minutes
inf`` means no limit, and a reward no float can hold costs one episode, not the run."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from flashreinforce.cli import main as cli_main
from flashreinforce.envs.base import StepResult
from flashreinforce.envs.toy import ToyCopyEnv

SMALL = ["--preset", "toy", "--rollout.batch_size", "8", "--train.batch_size", "8", "--rollout.num_workers", "1",
         "--ckpt.save_steps", "0", "--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false"]


class HugeRewardToyEnv(ToyCopyEnv):
    """The toy task with a reward of 1e30: finite, but every gradient it makes overflows."""

    def step(self, action):
        r = super().step(action)
        return StepResult(reward=1e30, done=r.done)


class UnrepresentableRewardToyEnv(ToyCopyEnv):
    """The toy task, except that every fourth seed's reward is an int (or a Fraction) no float holds."""

    def reset(self, *, seed):
        self._seed = seed
        return super().reset(seed=seed)

    def step(self, action):
        r = super().step(action)
        if self._seed % 4 == 1:
            return StepResult(reward=10**400, done=r.done)
        if self._seed % 4 == 3:
            return StepResult(reward=Fraction(10**400, 3), done=r.done)
        return StepResult(reward=r.reward, done=r.done, info={"huge": 10**400, "small": 1})


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []


def test_updates_skipped_in_a_row_stop_the_run_with_one_line_and_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli_main(["train", *SMALL, "--env", f"{__name__}:HugeRewardToyEnv", "--train.max_steps", "1000",
                     "--train.max_skipped_updates_in_a_row", "3", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("flashreinforce train: error:")]
    assert "3 updates in a row were skipped" in line and "--train.max_skipped_updates_in_a_row 3" in line
    assert "1e+30" in line  # the rewards' size is named, with what to do about it
    assert (out / "checkpoints" / "latest").exists() and _records(out) == []


def test_skipped_updates_count_against_the_time_budget(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli_main(["train", *SMALL, "--env", f"{__name__}:HugeRewardToyEnv", "--train.max_steps", "1000",
                     "--train.max_skipped_updates_in_a_row", "0", "--train.max_minutes", "0.005",
                     "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and "train.max_minutes 0.005 reached" in summary["stop_reason"]
    assert summary["step"] == 0 and _records(out) == []


def test_max_minutes_inf_means_no_limit(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli_main(["train", *SMALL, "--train.max_steps", "2", "--train.max_minutes", "inf", "--output", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert [r["step"] for r in _records(out)] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    code = cli_main(["train", *SMALL, "--train.max_steps", "2", "--train.max_minutes", "nan",
                     "--output", str(tmp_path / "nan")])
    assert code == 2 and "--train.max_minutes must be a number" in capsys.readouterr().err


def test_a_reward_no_float_holds_quarantines_its_episode_and_the_run_completes(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli_main(["train", *SMALL, "--env", f"{__name__}:UnrepresentableRewardToyEnv", "--train.max_steps", "2",
                     "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    rows = _records(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["quarantined_episodes"] > 0 and rows[-1]["env/small"] == 1.0 and "env/huge" not in rows[-1]


def test_the_step_check_names_a_reward_no_float_holds():
    from flashreinforce.trainer.rollout.episode import EpisodeFault, check_step_result

    for reward in (10**400, -(10**400), Fraction(10**400, 7), 10**6000):
        with pytest.raises(EpisodeFault) as err:
            check_step_result(StepResult(reward=reward, done=True), "Env")
        assert err.value.kind == "reward does not fit in a float" and len(str(err.value)) < 200
    assert check_step_result(StepResult(reward=10**300, done=True), "Env").reward == 10**300


def test_a_failure_to_write_an_update_s_record_leaves_no_checkpoint_past_it(tmp_path, capsys, monkeypatch):
    # What 1,100 idle connections to the agent endpoint once did (OSError: Too many open files while
    # writing metrics.jsonl): a checkpoint saved after the failure vouched for a history without that
    # update's record, and the resumed run's metrics.jsonl never had it.
    import errno

    from flashreinforce.trainer.reporting.metrics import MetricsLog

    real_write = MetricsLog.write

    def write(self, record, **kwargs):
        if record["step"] == 3:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_write(self, record, **kwargs)

    monkeypatch.setattr(MetricsLog, "write", write)
    out = tmp_path / "run"
    args = ["train", *SMALL, "--ckpt.save_steps", "2", "--output", str(out)]
    with pytest.raises(OSError, match="Too many open files"):
        cli_main([*args, "--train.max_steps", "6"])
    assert [r["step"] for r in _records(out)] == [1, 2]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    monkeypatch.setattr(MetricsLog, "write", real_write)
    assert cli_main([*args, "--train.max_steps", "4", "--resume"]) == 0, capsys.readouterr().err[-3000:]
    assert [r["step"] for r in _records(out)] == [1, 2, 3, 4]
