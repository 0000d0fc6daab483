"""reasoning-gym tasks by name (``--env reasoning_gym:TASK``); skipped, and reported so, without the package."""

from __future__ import annotations

import pytest

from flashreinforce.config import ConfigError
from flashreinforce.envs.registry import make_environment

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install -e '.[reasoning-gym]')")

from flashreinforce.envs.reasoning_gym_env import HELDOUT_SEED_OFFSET, ReasoningGymEnv  # noqa: E402


def test_a_task_by_name_is_scored_by_its_own_score_answer():
    env = make_environment("reasoning_gym:basic_arithmetic", {}, size=50, heldout_size=8, min_terms=2, max_terms=2,
                           min_digits=1, max_digits=1)
    assert isinstance(env, ReasoningGymEnv) and env.task_name == "basic_arithmetic"
    prompt = env.reset(seed=3)
    entry = env.entry
    assert entry["question"] in prompt and "<answer>" in prompt
    assert entry["metadata"]["num_terms"] == 2  # min/max_terms reached the task's configuration
    right = env.step(f"So it is <answer>{entry['answer']}</answer>")
    assert right.reward == 1.0 and not right.failed and right.info["answered"] and right.done
    env.reset(seed=3)
    wrong = env.step(f"<answer>{entry['answer']}9</answer>")
    assert wrong.reward < 1.0 and wrong.failed
    env.reset(seed=3)
    untagged = env.step(str(entry["answer"]))
    assert untagged.reward == 0.0 and untagged.info["failure_kind"] == "no_answer"


def test_heldout_items_are_played_by_the_evaluation_seeds_and_never_trained_on():
    env = ReasoningGymEnv("basic_arithmetic", size=200, heldout_size=16, min_terms=2, max_terms=2, min_digits=1,
                          max_digits=1)
    heldout = set()
    for i in range(16):
        env.reset(seed=HELDOUT_SEED_OFFSET + i)
        assert env.split == "heldout"
        heldout.add(env.entry["question"])
    for seed in range(200):
        env.reset(seed=seed)
        assert env.entry["question"] not in heldout
    with pytest.raises(ValueError, match="held-out split has 16"):
        env.reset(seed=HELDOUT_SEED_OFFSET + 16)


def test_the_chat_template_renders_the_system_prompt_and_the_question():
    env = ReasoningGymEnv("leg_counting", size=10, heldout_size=2, apply_chat_template=lambda m: repr(m))
    text = env.reset(seed=0)
    assert "'role': 'system'" in text and env.entry["question"][:20] in text


def test_bad_names_and_configurations_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="reasoning-gym has no task 'no_such_task'"):
        ReasoningGymEnv("no_such_task")
    with pytest.raises(ConfigError, match="rejects the configuration"):
        ReasoningGymEnv("basic_arithmetic", min_terms=5, max_terms=2)
