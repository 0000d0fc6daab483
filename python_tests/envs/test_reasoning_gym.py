"""reasoning-gym tasks by name (``--env reasoning_gym:TASK``): prompts, the task's own scoring, the
held-out split, ``flashreinforce eval`` and the one-line errors.

reasoning-gym is an optional extra (``pip install -e '.[reasoning-gym]'``), not in the test extra:
without it, the tests that need it are skipped (and say so); the missing-package error is tested
everywhere."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from flashreinforce.config import ConfigError
from flashreinforce.envs.registry import make_environment, num_prompts

needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                              reason="reasoning-gym is not installed (pip install -e '.[reasoning-gym]')")
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@needs_rg
def test_the_prompt_set_is_the_tasks_dataset_scored_by_its_own_score_answer():
    import reasoning_gym

    env = make_environment("reasoning_gym:basic_arithmetic", {}, size=30, seed=5, **SMALL)
    library = reasoning_gym.create_dataset("basic_arithmetic", size=30, seed=5, **SMALL)
    questions = [library[i]["question"] for i in range(30)]
    assert [e["question"] for e in env.items] == list(dict.fromkeys(questions))  # size, seed, config; repeats out
    assert num_prompts(env) == len(env) == len(set(questions))
    prompt = env.reset(seed=3)
    entry = env.entry
    assert entry["question"] in prompt and "<answer>" in prompt and entry["metadata"]["num_terms"] == 2
    assert env.reset(seed=3 + len(env)) == prompt  # rows wrap like a dataset's

    right = env.step(f"Adding up: <answer>{entry['answer']}</answer>")
    assert right.reward == 1.0 and not right.failed and right.done and right.info["answer_extraction"] == "tags"
    wrong_answer = str(int(entry["answer"]) + 1)
    env.reset(seed=3)
    wrong = env.step(f"<answer>{wrong_answer}</answer>")
    assert wrong.reward == library.score_answer(wrong_answer, entry) < 1.0 and wrong.failed
    env.reset(seed=3)
    untagged = env.step(str(entry["answer"]))  # the right number, but not where the prompt asks for it
    assert untagged.reward == 0.0 and untagged.info["failure_kind"] == "no_answer"
    assert untagged.info["answer_extraction"] == "none"


@needs_rg
def test_a_second_task_through_the_chat_template():
    template = lambda messages: "|".join(f"{m['role']}={m['content']}" for m in messages)  # noqa: E731
    env = make_environment("reasoning_gym:leg_counting", {}, apply_chat_template=template, size=4, seed=1,
                           system_prompt="Count the legs.")
    text = env.reset(seed=0)
    assert text == f"system=Count the legs.|user={env.entry['question']}"
    assert env.step(f"<answer>{env.entry['answer']}</answer>").reward == 1.0


@needs_rg
def test_worked_examples_come_before_the_question_and_may_not_be_items():
    template = lambda messages: "|".join(f"{m['role']}={m['content']}" for m in messages)  # noqa: E731
    env = make_environment("reasoning_gym:basic_arithmetic", {}, apply_chat_template=template, size=10, seed=2,
                           system_prompt="Tags.", examples=[["Calculate 30 + 40.", 70]], **SMALL)
    text = env.reset(seed=1)
    assert text == f"system=Tags.|user=Calculate 30 + 40.|assistant=<answer>70</answer>|user={env.entry['question']}"
    plain = make_environment("reasoning_gym:basic_arithmetic", {}, size=10, seed=2, system_prompt=None,
                             examples=[["Calculate 30 + 40.", "70"]], **SMALL)
    assert plain.reset(seed=1) == f"Calculate 30 + 40.\n<answer>70</answer>\n\n{plain.entry['question']}"
    item = env.items[0]["question"]
    with pytest.raises(ConfigError, match=r"examples: .* is a question of the prompt set"):
        make_environment("reasoning_gym:basic_arithmetic", {}, size=10, seed=2, examples=[[item, 1]], **SMALL)
    for bad in ("Calculate 1 + 1.", [["q"]], [["", 1]], [["q", True]]):
        with pytest.raises(ConfigError, match=r"--env.kwargs examples"):
            make_environment("reasoning_gym:basic_arithmetic", {}, size=10, seed=2, examples=bad, **SMALL)


@needs_rg
def test_flashreinforce_eval_plays_the_heldout_rows(tmp_path, capsys):
    from flashreinforce.cli.eval import eval_command
    from flashreinforce.trainer.reporting.heldout import heldout_rows
    from python_tests.cli.test_eval import constant_answer_model

    model = constant_answer_model(tmp_path / "m", "7")
    kwargs = {"size": 40, "seed": 2, **SMALL}
    env = make_environment("reasoning_gym:basic_arithmetic", {}, **kwargs)
    code = eval_command(["--env", "reasoning_gym:basic_arithmetic", "--env.kwargs", json.dumps(kwargs), "--model",
                         str(model), "--eval.num_prompts", "5", "--rollout.max_new_tokens", "2", "--data.max_len",
                         "512", "--no_sampled", "--samples", str(tmp_path / "s.jsonl"), "--seed", "3"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["num_prompts"] == 5 and result["heldout"]["of"] == len(env)
    rows = heldout_rows(len(env), 5, 3)  # what a training run with --seed 3 holds out and never trains on
    played = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    for row, sample in zip(rows, played):
        assert env.items[row]["question"] in sample["prompt"] and sample["reward"] == 0.0  # "77" has no tags


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    from flashreinforce.envs.reasoning_gym_env import ReasoningGymEnv

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package.*\.\[reasoning-gym\]"):
        ReasoningGymEnv("basic_arithmetic")


@needs_rg
def test_bad_names_and_configurations_are_one_line_config_errors(tmp_path, capsys, monkeypatch):
    from flashreinforce.cli.eval import eval_command
    from flashreinforce.trainer.run import components

    with pytest.raises(ConfigError, match=r"reasoning_gym:basic_arithmetc: reasoning-gym has no task "
                                          r"'basic_arithmetc'; close names: basic_arithmetic") as err:
        make_environment("reasoning_gym:basic_arithmetc", {})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="rejects the configuration .*min_terms"):
        make_environment("reasoning_gym:basic_arithmetic", {}, min_terms=5, max_terms=2)
    with pytest.raises(ConfigError, match="rejects the configuration .*no_such_option"):
        make_environment("reasoning_gym:basic_arithmetic", {}, no_such_option=1)
    with pytest.raises(ConfigError, match="size: .*positive integer"):
        make_environment("reasoning_gym:basic_arithmetic", {}, size=0)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(components, "build_model", refuse)  # these are found before the model loads
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "p"}\n')
    for args, message in ((["--env", "reasoning_gym:leg_countin"], "close names: leg_counting"),
                          (["--env", "reasoning_gym:leg_counting", "--data.prompt_dataset", str(rows)],
                           "--data.prompt_dataset: --env reasoning_gym:leg_counting makes its own prompt set")):
        assert eval_command([*args, "--model", "tiny-qwen2"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
