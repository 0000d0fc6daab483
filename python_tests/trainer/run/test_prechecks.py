"""Every path and setting that does not need the model is checked before the model loads (a real model
takes about a minute to load on a CPU): train, resume and eval."""

from __future__ import annotations

import json

import pytest

from flashreinforce.cli.eval import eval_command
from flashreinforce.cli.train import train as train_command
from flashreinforce.trainer.run import components

REWARD = "def first_letter(prompt, completion, target, **row):\n    return float(completion[:1] == target)\n"


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: what is checked must be checked before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(components, "build_model", refuse)


def _rows(path):
    path.write_text("".join(json.dumps({"prompt": f"say {t}:", "target": t}) + "\n" for t in "abcdefgh" * 3))
    return path


def _several_splits(path):
    (path / "train").mkdir(parents=True)
    (path / "test").mkdir()
    (path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return path


def test_train_checks_the_dataset_and_the_reward_before_the_model(tmp_path, capsys, no_model):
    reward = tmp_path / "rewards.py"
    reward.write_text(REWARD)
    base = ["--preset", "toy", "--reward", f"{reward}:first_letter", "--no_progress"]
    code = train_command(base + ["--data.prompt_dataset", str(_several_splits(tmp_path / "hf")),
                                 "--output", str(tmp_path / "a")])
    assert code == 2 and "a datasets folder with several splits (test, train)" in capsys.readouterr().err
    rows = _rows(tmp_path / "rows.jsonl")
    code = train_command(["--preset", "toy", "--reward", f"{tmp_path}/missing.py:first_letter", "--data.prompt_dataset",
                          str(rows), "--output", str(tmp_path / "b")])
    assert code == 2 and "missing.py does not exist" in capsys.readouterr().err
    code = train_command(base + ["--data.prompt_dataset", str(rows), "--eval.dataset", str(tmp_path / "nope.jsonl"),
                                 "--output", str(tmp_path / "c")])
    assert code == 2 and "nope.jsonl" in capsys.readouterr().err
    code = train_command(base + ["--data.prompt_dataset", str(rows), "--model", str(tmp_path / "no_model"),
                                 "--output", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert code == 2 and f"--model '{tmp_path / 'no_model'}': no such file or directory" in err


def test_resume_checks_the_reward_file_and_the_checkpoint_before_the_model(tmp_path, capsys, monkeypatch):
    reward = tmp_path / "rewards.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    args = ["--preset", "toy", "--reward", f"{reward}:first_letter", "--data.prompt_dataset",
            str(_rows(tmp_path / "rows.jsonl")), "--train.max_steps", "1", "--rollout.batch_size", "8",
            "--train.batch_size", "8", "--eval.eval_at_start", "false", "--no_progress", "--output", str(run)]
    assert train_command(args) == 0
    capsys.readouterr()
    reward.unlink()

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(components, "build_model", refuse)
    assert train_command(["--output", str(run), "--resume"]) == 2
    assert f"--reward {reward}:first_letter: {reward} does not exist" in capsys.readouterr().err
    reward.write_text(REWARD)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train_command(args[:-1] + [str(empty), "--resume"]) == 2
    assert "--resume: no checkpoint in" in capsys.readouterr().err


def test_eval_checks_the_dataset_before_the_model(tmp_path, capsys, no_model):
    code = eval_command(["--preset", "toy", "--env", "reward_functions", "--reward",
                         "python_tests.trainer.run.test_prechecks:first_letter", "--data.prompt_dataset",
                         str(_several_splits(tmp_path / "hf"))])
    assert code == 2 and "a datasets folder with several splits" in capsys.readouterr().err


def first_letter(prompt, completion, target, **row):
    return float(completion[:1] == target)
