"""The arith_tool task (flashreinforce.envs.arith_python_tool): generated problems, disjoint splits, the mix
knobs, the conversation the policy sees, the dataset route, and a whole episode through the sandbox."""

from __future__ import annotations

import collections
import json

import pytest

from flashreinforce.config import parse_train_args
from flashreinforce.config.presets import PRESETS
from flashreinforce.envs.arith import HELDOUT_SEED_OFFSET, problem_for_seed
from flashreinforce.envs.arith_python_tool import DEMONSTRATION, ArithToolEnv, ToolArithSpec
from flashreinforce.envs.registry import EnvConfig, make_environment


def test_problems_follow_the_mix_and_the_digits_and_the_splits_are_disjoint():
    spec = ToolArithSpec.build(seed=3, heldout_size=64)
    heldout = {problem_for_seed(spec, HELDOUT_SEED_OFFSET + i)[0] for i in range(64)}
    train = [problem_for_seed(spec, i)[0] for i in range(2000)]
    assert len(heldout) == 64 and not heldout & set(train)
    ops = collections.Counter(p.op for p in train)
    assert set(ops) == {"*", "+", "-", "%"} and 0.33 < ops["*"] / 2000 < 0.47
    for p in train:
        if p.op == "*":
            assert 10 <= p.a <= 99 and 10 <= p.b <= 99 and p.answer == p.a * p.b
        elif p.op in "+-":
            assert 100 <= p.a <= 999 and 100 <= p.b <= 999 and p.answer >= 0
        else:
            assert 100 <= p.a <= 9999 and 2 <= p.b <= 99 and p.answer == p.a % p.b
    only = ToolArithSpec.build({"*": 1.0}, {"*": [[3, 3], [2, 2]]})
    assert all(problem_for_seed(only, i)[0].a >= 100 for i in range(50))
    with pytest.raises(ValueError, match="mix must map"):
        ToolArithSpec.build({"^": 1.0})
    with pytest.raises(ValueError, match="digits names"):
        ToolArithSpec.build({"*": 1.0}, {"+": [[1, 1], [1, 1]]})


def test_the_conversation_is_system_demonstration_then_the_problem():
    seen = []
    env = ArithToolEnv(apply_chat_template=lambda messages: seen.append(messages) or "rendered")
    assert env.reset(seed=5) == "rendered"
    (messages,) = seen
    assert messages[0]["role"] == "system" and "Python" in messages[0]["content"]
    assert messages[1:5] == list(DEMONSTRATION)
    problem, split = problem_for_seed(env.spec, 5)
    assert messages[5]["role"] == "user" and str(problem.a) in messages[5]["content"] and split == "train"


def test_an_episode_with_the_tool_is_rewarded_and_mental_arithmetic_is_not():
    env = ArithToolEnv()
    env.reset(seed=HELDOUT_SEED_OFFSET)
    problem, _ = problem_for_seed(env.spec, HELDOUT_SEED_OFFSET)
    symbol = {"*": "*", "+": "+", "-": "-", "%": "%"}[problem.op]
    first = env.step(f"```python\nprint({problem.a} {symbol} {problem.b})\n```")
    assert not first.done and f"\n{problem.answer}\n" in first.observation
    final = env.step(f"\\boxed{{{problem.answer}}}")
    assert final.reward == 1.0 and final.info["answer_from_tool"] and final.info["split"] == "heldout"
    env.reset(seed=1)
    guess = env.step("\\boxed{12}")
    assert guess.reward == 0.0 and guess.info["tool_calls"] == 0 and guess.info["failure_kind"] == "wrong_answer"


def test_the_dataset_route_plays_the_rows_with_the_same_protocol(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 12 * 12?", "reward_model": {"ground_truth": "144"}}) + "\n")
    cfg = parse_train_args(["--preset", "arith_tool", "--data.prompt_dataset", str(rows), "--output", "x"], PRESETS)
    env = make_environment(cfg.train.agent_path, EnvConfig.of_run(cfg), **cfg.env_kwargs)
    prompt = env.reset(seed=0)
    assert "What is 12 * 12?" in prompt and "banana" in prompt  # the row, after the demonstration
    env.step("```python\nprint(12 * 12)\n```")
    assert env.step("\\boxed{144}").reward == 1.0


def test_a_slow_tool_adds_its_latency_deterministically():
    env = ArithToolEnv(tool_latency={"median_s": 0.01, "sigma": 0.5})
    delays = []
    for _ in range(2):
        env.reset(seed=7)
        env.step("```python\nprint(1)\n```")
        delays.append(env.step("\\boxed{1}").info["tool_latency_s"])
    assert delays[0] == delays[1] > 0
    with pytest.raises(ValueError, match="tool_latency"):
        ArithToolEnv(tool_latency={"median_s": -1})


def test_a_boxed_expression_is_not_an_answer():
    """math-verify evaluates expressions: without the integer rule, boxing the question scores."""
    from flashreinforce.envs.arith import ArithEnv

    env = ArithToolEnv()
    env.reset(seed=0)
    problem, _ = problem_for_seed(env.spec, 0)
    result = env.step(f"\\boxed{{{problem.a} {problem.op} {problem.b}}}")
    assert result.reward == 0.0 and result.info["failure_kind"] == "not_a_number"
    env.reset(seed=0)
    assert env.step(f"\\boxed{{{problem.answer:,}}}").reward == 1.0  # thousands commas are a number
    strict = ArithEnv(integer_answers=True)
    strict.reset(seed=3)
    p = strict.problem
    assert strict.step(f"\\boxed{{{p.a} {p.op} {p.b}}}").info["failure_kind"] == "not_a_number"
    assert ArithEnv().integer_answers is False  # the arith preset's grading is unchanged
