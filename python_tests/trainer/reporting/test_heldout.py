"""The held-out split of a finite prompt set: evaluation rows the run never trains on, the same rows
on --resume and for ``flashreinforce eval`` of the run, recorded in the run directory."""

from __future__ import annotations

import json

import pytest

import flashreinforce as fr
from flashreinforce.config import ConfigError
from flashreinforce.trainer import Trainer
from flashreinforce.trainer.rollout.buffer import PromptStream
from flashreinforce.trainer.reporting.heldout import HELDOUT_FILE, heldout_rows, read_split

ROWS = [{"prompt": f"say {t}:", "target": t, "row": i} for i, t in enumerate("abcdefgh" * 5)]  # 40 rows


def first_letter(prompt, completion, target, **row):
    return float(completion[:1] == target)


def _config(tmp_path, name, *, steps=3, evals=True):
    config = fr.TrainerConfig.from_preset("toy", output=str(tmp_path / name), progress=False)
    config.rollout.batch_size = 8
    config.train.max_steps = steps
    config.eval.steps = 1 if evals else 0
    config.eval.eval_at_start = evals
    config.eval.num_prompts = 5
    config.rewards = [first_letter]
    config.train.agent_path = "reward_functions"
    config.env_kwargs = {}
    config.data.prompt_dataset = ROWS
    return config


def _handed_out(trainer: Trainer) -> set[int]:
    stream = trainer.buffer.prompts
    return {stream.seed_of(pid) for pid in range(stream.next_id)}


def test_heldout_rows_are_drawn_from_the_seed_and_the_set_size():
    rows = heldout_rows(1000, 64, seed=3)
    assert len(rows) == 64 == len(set(rows)) and rows == sorted(rows) and all(0 <= r < 1000 for r in rows)
    assert rows == heldout_rows(1000, 64, seed=3) and rows != heldout_rows(1000, 64, seed=4)
    assert rows != list(range(64))  # not the first rows: a dataset sorted by difficulty is not skewed
    assert len(heldout_rows(40, 64, seed=0)) == 8  # at most one row in five
    assert heldout_rows(4, 64, seed=0) == []


def test_prompt_stream_never_hands_out_an_excluded_row():
    stream = PromptStream(num_prompts=10, seed=1, exclude=[2, 7])
    seeds = [stream.next()[1] for _ in range(8 * 5)]  # five passes
    assert set(seeds) == set(range(10)) - {2, 7}
    assert all(sorted(seeds[k:k + 8]) == [0, 1, 3, 4, 5, 6, 8, 9] for k in range(0, 40, 8))
    with pytest.raises(ValueError, match="leaves no row"):
        PromptStream(num_prompts=2, exclude=[0, 1])


def test_without_eval_dataset_the_evaluation_is_held_out_of_training(tmp_path):
    trainer = Trainer(_config(tmp_path, "split"))
    summary = trainer.run()
    assert summary["status"] == "completed"
    split = read_split(tmp_path / "split")
    assert split is not None and split.num_prompts == 40 and len(split.rows) == 5
    assert trainer.evaluation_seeds == list(split.rows)  # the evaluation plays exactly the held-out rows
    assert trainer._evaluator is None  # its engine is released after each evaluation
    handed = _handed_out(trainer)
    assert handed and not handed & set(split.rows)  # and training never got one of them
    record = json.loads((tmp_path / "split" / "config.json").read_text())
    assert record["heldout_prompts"] == 5 and record["num_prompts"] == 35
    assert (tmp_path / "split" / HELDOUT_FILE).is_file()


def test_resume_keeps_the_recorded_split_even_with_other_eval_settings(tmp_path):
    Trainer(_config(tmp_path, "resume", steps=2)).run()
    first = read_split(tmp_path / "resume")
    config = _config(tmp_path, "resume", steps=4)
    config.resume = "latest"
    config.eval.num_prompts = 7  # would draw another split: the recorded one wins
    config.seed = 5  # locked on resume: allowed here, the split must still be the recorded one
    config.allow_config_change = True
    trainer = Trainer(config)
    assert trainer.run()["status"] == "completed"
    assert read_split(tmp_path / "resume") == first
    assert trainer.evaluation_seeds == list(first.rows)
    assert not _handed_out(trainer) & set(first.rows)


def test_a_split_for_another_prompt_set_is_refused_on_resume(tmp_path):
    Trainer(_config(tmp_path, "other", steps=1)).run()
    config = _config(tmp_path, "other", steps=2)
    config.resume = "latest"
    config.allow_config_change = True
    config.data.prompt_dataset = ROWS[:30]
    with pytest.raises(ConfigError, match=r"heldout.json: the run held out rows of a prompt set of 40 rows, but the "
                                          r"prompt set now has 30"):
        Trainer(config).run()


def test_no_split_without_evaluation_and_a_too_small_set_is_an_error(tmp_path):
    trainer = Trainer(_config(tmp_path, "noeval", evals=False))
    trainer.run()
    assert trainer.split is None and not (tmp_path / "noeval" / HELDOUT_FILE).exists()
    assert trainer.buffer.prompts.num_prompts == 40  # every row is trained on
    config = _config(tmp_path, "tiny")
    config.data.prompt_dataset = ROWS[:4]
    with pytest.raises(ConfigError, match="holds out prompts the run never trains on, at most one in 5, but the "
                                          "prompt set has only 4: give --eval.dataset"):
        Trainer(config).run()
