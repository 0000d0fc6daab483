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


class OddLetter(SayA):
    """Rewards about half of a random model's answers, so that every update has a gradient."""

    def step(self, action):
        return StepResult(reward=float(ord(action[:1] or "a") % 2), done=True)


def _quick(tmp_path, name):
    config = fr.TrainerConfig.from_preset("toy", output=str(tmp_path / name), progress=False)
    config.rollout.batch_size = 8
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


# ---------------------------------------------------------------------------------------------------------
# A model object, callbacks, the time budget


def _tiny_model():
    import transformers

    from flashreinforce.models.loading import TINY_MODELS

    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_MODELS["tiny-qwen2"]))


def test_train_takes_a_transformers_model_object_and_trains_it_in_place(tmp_path):
    model = _tiny_model()
    before = model.get_input_embeddings().weight.detach().clone()
    summary = fr.train(_quick(tmp_path, "object"), model=model, tokenizer="char", env=OddLetter)
    assert summary["status"] == "completed" and summary["step"] == 2
    assert not model.get_input_embeddings().weight.detach().equal(before)  # the object given was trained
    written = fr.load_config(tmp_path / "object" / "config.yaml")
    assert written.actor.model_name_or_path == "<Qwen2ForCausalLM given in Python>"
    assert (tmp_path / "object" / "hf" / "config.json").is_file()


def test_a_model_object_never_gets_the_preset_s_tokenizer_silently(tmp_path, caplog):
    import logging

    import transformers

    from flashreinforce.models.loading import TINY_MODELS

    def other_vocabulary():  # a model whose vocabulary is not the toy preset's character tokenizer's (100)
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**dict(TINY_MODELS["tiny-qwen2"],
                                                                               vocab_size=300)))

    with pytest.raises(ConfigError, match="pass tokenizer="):  # the preset's "char" is not taken for it
        fr.train(_quick(tmp_path, "preset"), model=other_vocabulary(), env=SayA)
    assert not (tmp_path / "preset").exists()
    with caplog.at_level(logging.WARNING, logger="flashreinforce.trainer"):  # asked for: taken, with a warning
        summary = fr.train(_quick(tmp_path, "asked"), model=other_vocabulary(), tokenizer="char", env=OddLetter)
    assert summary["status"] == "completed"
    assert any("has 300 embedding rows but the tokenizer char only 100 tokens" in r.getMessage()
               for r in caplog.records)


def test_a_model_object_needs_a_tokenizer_and_a_peft_wrapper_is_refused(tmp_path):
    config = _quick(tmp_path, "notok")
    config.tokenizer = None  # the toy preset's is "char"
    with pytest.raises(ConfigError, match="pass tokenizer="):
        fr.train(config, model=_tiny_model(), env=SayA)
    wrapped = _tiny_model()
    wrapped.peft_config = {"default": object()}  # what a PEFT wrapper carries
    with pytest.raises(ConfigError, match=r"PEFT-wrapped .*merge_and_unload\(\)"):
        fr.train(_quick(tmp_path, "peft"), model=wrapped, tokenizer="char", env=SayA)
    with pytest.raises(ConfigError, match="expected a transformers causal language model"):
        fr.train(_quick(tmp_path, "module"), model=__import__("torch").nn.Linear(2, 2), tokenizer="char", env=SayA)


class Recorder(fr.Callback):
    def __init__(self, stop_at=None):
        self.updates, self.saves, self.evals, self.begin, self.end, self.stop_at = [], [], [], None, None, stop_at

    def on_train_begin(self, info):
        self.begin = info

    def on_update(self, metrics):
        self.updates.append(metrics)
        return metrics["step"] == self.stop_at

    def on_eval(self, step, metrics):
        self.evals.append((step, metrics))

    def on_save(self, step, path):
        self.saves.append((step, path))

    def on_train_end(self, summary):
        self.end = summary


def test_callbacks_see_every_update_eval_and_save_and_can_stop_the_run(tmp_path):
    config = _quick(tmp_path, "callbacks")
    config.train.max_steps, config.eval.steps, config.ckpt.save_steps = 6, 2, 2
    recorder, plain = Recorder(stop_at=4), []
    summary = fr.train(config, env=SayA, callbacks=[recorder, lambda metrics: plain.append(metrics["step"])])
    assert summary["status"] == "stopped" and summary["step"] == 4
    assert "callback Recorder (on_update)" in summary["stop_reason"]
    assert [m["step"] for m in recorder.updates] == [1, 2, 3, 4] and plain == [1, 2, 3, 4]
    assert "reward_mean" in recorder.updates[0] and "eval_success_rate" in recorder.updates[1]
    assert [s for s, _ in recorder.evals] == [2, 4]
    assert [s for s, _ in recorder.saves] == [2, 4, 4] and recorder.saves[-1][1].name == "step_00000004"
    assert recorder.begin["max_steps"] == 6 and recorder.begin["step"] == 0
    assert recorder.end["status"] == "stopped"
    written = json.loads((tmp_path / "callbacks" / "summary.json").read_text())
    assert written["status"] == "stopped" and written["stop_reason"] == summary["stop_reason"]
    assert written["exported_model"]  # a stopped run is exported like a completed one
    with pytest.raises(ConfigError, match="callbacks: .* neither a function nor an object"):
        fr.train(_quick(tmp_path, "bad"), env=SayA, callbacks=[object()])


def test_train_max_minutes_stops_the_session_after_the_update_that_used_it_up(tmp_path):
    config = _quick(tmp_path, "budget")
    config.train.max_steps, config.train.max_minutes = 50, 1e-9
    summary = fr.train(config, env=SayA)
    assert summary["status"] == "stopped" and summary["step"] == 1
    assert summary["stop_reason"].startswith("train.max_minutes 1e-09 reached")
    again = fr.train(config, env=SayA, resume="latest")  # a new session has its own budget
    assert again["status"] == "stopped" and again["step"] == 2


def test_a_run_that_evaluates_does_so_before_training_and_at_its_stop(tmp_path):
    config = _quick(tmp_path, "before_after")
    config.train.max_steps, config.train.max_minutes = 50, 1e-9  # the budget stops it after update 1
    config.eval.eval_at_start, config.eval.num_prompts = True, 8
    summary = fr.train(config, env=SayA)
    assert summary["status"] == "stopped" and summary["step"] == 1
    out = tmp_path / "before_after"
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1]  # eval.steps 50 never came: the stop evaluated
    written = json.loads((out / "summary.json").read_text())
    assert written["start_eval"]["step"] == 0 and written["final_eval"]["step"] == 1
    assert written["eval_change"]["steps"] == [0, 1] and written["final_eval"]["eval_temperature"] == 0.0
    # training time is the budget's clock (without evaluations and saves), within the wall-clock time
    assert 0 < written["train_time_s"] <= written["training_wall_s"]
    # The evaluation at the stop came after the checkpoint: a resumed run goes on from that checkpoint's records
    # without it, and evaluates again when it stops (here it does not: eval.eval_at_stop false)
    config.eval.eval_at_stop = False
    config.train.max_minutes = 0.0
    config.train.max_steps = 2
    fr.train(config, env=SayA, resume="latest")
    assert [json.loads(x)["step"] for x in (out / "eval.jsonl").read_text().splitlines()] == [0]


def test_the_printed_summary_has_the_reward_of_summary_json(tmp_path):
    config = _quick(tmp_path, "rewardwin")
    config.train.max_steps = 8
    summary = fr.train(config, env=SayA)
    written = json.loads((tmp_path / "rewardwin" / "summary.json").read_text())
    assert (summary["reward_first"], summary["reward_last"], summary["reward_window"]) == (
        written["reward_first"], written["reward_last"], written["reward_window"])
