"""The Python entry point (flashreinforce.train, TrainerConfig, load_config): the command's run from
Python objects, plain reward functions, in-memory datasets, and the same refusals."""

from __future__ import annotations

import importlib.util
import json

import pytest

import flashreinforce as fr
from flashreinforce.config import ConfigError
from flashreinforce.envs import Environment, StepResult

ROWS = [{"prompt": f"say {t}:", "target": t} for t in "abcdefgh" * 2]


def first_letter(prompt, completion, target, **row):
    return float(completion[:1] == target)


class SayA(Environment):
    def reset(self, *, seed):
        return "say a:"

    def step(self, action):
        return StepResult(reward=float(action[:1] == "a"), done=True)


def _quick(tmp_path, name):
    config = fr.TrainerConfig.from_preset("toy", output=str(tmp_path / name), progress=False)
    config.rollout.batch_size = config.train.batch_size = 8
    config.train.max_steps = 2
    config.eval.eval_at_start = False
    return config


def test_train_with_reward_functions_over_rows(tmp_path):
    config = _quick(tmp_path, "rewards")
    summary = fr.train(config, rewards=[first_letter, (lambda prompt, completion, **row: -0.01, 0.5)], dataset=ROWS)
    assert summary["status"] == "completed" and summary["step"] == 2
    assert config.rewards == [] and config.data.prompt_dataset is None  # the caller's config is not changed
    written = (tmp_path / "rewards" / "config.yaml").read_text()
    assert "reward_functions" in written and f"{__name__}:first_letter" in written
    assert "<list given in Python>" in written
    records = [json.loads(x) for x in (tmp_path / "rewards" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


def test_train_with_an_environment_class_and_settings_as_a_mapping(tmp_path):
    settings = {"preset": "toy", "rollout": {"batch_size": 8}, "train.batch_size": 8, "train.max_steps": 1,
                "eval": {"eval_at_start": False}}
    summary = fr.train(settings, env=SayA, output=str(tmp_path / "env"), progress=False)
    assert summary["status"] == "completed"
    assert fr.load_config(tmp_path / "env" / "config.yaml").train.agent_path == f"{__name__}:SayA"


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets is not installed")
def test_train_over_a_datasets_dataset(tmp_path):
    import datasets

    summary = fr.train(_quick(tmp_path, "hf"), rewards=[first_letter], dataset=datasets.Dataset.from_list(ROWS))
    assert summary["status"] == "completed"


def test_the_same_refusals_as_the_command(tmp_path):
    with pytest.raises(ConfigError, match="unknown option 'max_steps'"):
        fr.train(_quick(tmp_path, "a"), max_steps=3)
    with pytest.raises(ConfigError, match="give env or rewards, not both"):
        fr.train(_quick(tmp_path, "b"), env=SayA, rewards=[first_letter], dataset=ROWS)
    with pytest.raises(ConfigError, match="Environment subclass"):
        fr.train(_quick(tmp_path, "c"), env=lambda: SayA())
    config = _quick(tmp_path, "d")
    config.rollout.batch_size = 0
    with pytest.raises(ConfigError, match="--rollout.batch_size must be positive"):
        fr.train(config)
    with pytest.raises(ConfigError, match="reward scores completions of the rows of --data.prompt_dataset"):
        fr.train(_quick(tmp_path, "e"), rewards=[first_letter])
    with pytest.raises(ConfigError, match="unknown key train.max_stepz"):
        fr.load_config({"train": {"max_stepz": 1}})
