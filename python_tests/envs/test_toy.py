"""The toy environments: rewards, feedback observations and the failure kinds they report."""

from __future__ import annotations

import pytest

from flashreinforce.envs.toy import ToyCopyChainEnv, ToyCopyEnv


def _target(prompt: str) -> str:
    return prompt.split("say ")[-1][0]


def test_toy_reports_why_an_answer_failed():
    env = ToyCopyEnv(alphabet="abc")
    prompt = env.reset(seed=3)
    right = env.step(_target(prompt))
    assert (right.reward, right.failed) == (1.0, False) and "failure_kind" not in right.info
    env.reset(seed=3)
    other = next(c for c in "abc" if c != _target(prompt))
    wrong = env.step(other + "xyz")
    assert (wrong.reward, wrong.failed, wrong.info["failure_kind"]) == (0.0, True, "wrong_answer")
    for junk in ("9", " a", ""):
        env.reset(seed=3)
        assert env.step(junk).info["failure_kind"] == "invalid_answer", repr(junk)


@pytest.mark.parametrize("answers,kind", [("ok", None), ("wrong", "wrong_answer"), ("junk", "invalid_answer")])
def test_multiturn_toy_failure_kind_covers_every_turn(answers, kind):
    env = ToyCopyChainEnv(alphabet="ab", turns=3)
    text = env.reset(seed=11)
    for turn in range(3):
        target = _target(text)
        if answers == "ok" or turn < 2:
            action = target
        else:
            action = ("a" if target == "b" else "b") if answers == "wrong" else "?"
        result = env.step(action)
        text = result.observation
    assert result.done and result.info.get("failure_kind") == kind
    assert result.failed is (kind is not None)
