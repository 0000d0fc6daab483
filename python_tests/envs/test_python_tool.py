"""The Python-tool environment: code extraction, the turn protocol, counters, turn limits."""

from __future__ import annotations

import random

import pytest

from flashreinforce.envs.tasks import Task
from flashreinforce.envs.math_env import MathGrader
from flashreinforce.envs.base import resolve_max_turns
from flashreinforce.envs.python_tool import PythonToolEnv, extract_code
from flashreinforce.envs.sandbox import Sandbox


@pytest.fixture(scope="module")
def grader():
    g = MathGrader(timeout_s=2.0, grace_s=1.0)
    yield g
    g.close()


def _env(grader, tasks, **kwargs):
    # The protocol does not depend on the isolation level (test_sandbox*.py cover that).
    kwargs.setdefault("sandbox", Sandbox(timeout_s=1.0, allow_weak_isolation=True))
    return PythonToolEnv(tasks, grader=grader, **kwargs)


def test_extract_code_forms():
    assert extract_code("```python\nprint(1)\n```") == ("print(1)\n", len("```python\nprint(1)\n```"))
    assert extract_code("```py\nx=2\n``` and ```Python3\ny=3\n```")[0] == "y=3\n"
    assert extract_code("<code>\nprint(2)\n</code>")[0] == "\nprint(2)\n"
    assert extract_code("<code>```python\nprint(3)\n```</code>")[0] == "print(3)"
    assert extract_code("```python\nnever closed") is None
    assert extract_code("```\nplain fence is not code\n```") is None
    assert extract_code("no code") is None
    # the block that ends last wins, whichever form it has
    assert extract_code("<code>a</code> ```python\nb\n```")[0] == "b\n"
    assert extract_code("```python\nb\n``` <code>a</code>")[0] == "a"
    assert extract_code("<code>" * 1000 + "x") is None


def test_tool_episode_runs_code_then_grades_the_answer(grader):
    rng = random.Random()
    a, b = rng.randrange(100, 999), rng.randrange(100, 999)
    env = _env(grader, [Task(f"What is {a} * {b}?", str(a * b))], max_turns=4)
    prompt = env.reset(seed=0)
    assert prompt.startswith("Solve the problem") and prompt.endswith(f"What is {a} * {b}?")
    first = env.step(f"Let me compute.\n```python\nprint({a} * {b})\n```")
    assert not first.done and first.info == {} and first.failed is None
    assert first.observation == f"\n<output>\n{a * b}\n</output>\n"
    final = env.step(f"The product is \\boxed{{{a * b}}}.")
    assert (final.reward, final.done, final.failed) == (1.0, True, False)
    assert final.info.pop("tool_run_s") > 0
    assert final.info == {"tool_calls": 1, "tool_timeouts": 0, "tool_errors": 0, "tool_latency_s": 0.0,
                          "answer_from_tool": True, "turns": 2, "turn_limit": False,
                          "has_boxed": True, "correct": True, "grade_timeout": False, "grade_error": False,
                          "answer_extraction": "boxed"}


def test_errors_and_timeouts_are_reported_and_counted(grader):
    env = _env(grader, [Task("q", "1")], max_turns=5)
    env.reset(seed=0)
    error = env.step("```python\n1/0\n```")
    assert "ZeroDivisionError" in error.observation and not error.done
    timeout = env.step("<code>while True: pass</code>")
    assert "TimeoutError" in timeout.observation and "1 s limit" in timeout.observation
    silent = env.step("```python\nx = 1\n```")
    assert "(no output" in silent.observation
    final = env.step(r"\boxed{2}")
    assert final.done and final.reward == 0.0 and final.failed
    assert (final.info["tool_calls"], final.info["tool_errors"], final.info["tool_timeouts"]) == (3, 1, 1)
    assert final.info["failure_kind"] == "wrong_answer"


def test_boxed_before_code_is_not_final(grader):
    env = _env(grader, [Task("q", "6")], max_turns=3)
    env.reset(seed=0)
    result = env.step("Maybe \\boxed{5}? Let me check.\n```python\nprint(2 * 3)\n```")
    assert not result.done and "6" in result.observation
    assert env.step("So \\boxed{6}").reward == 1.0


def test_turn_without_code_or_answer_ends_the_episode(grader):
    env = _env(grader, [Task("q", "6")])
    env.reset(seed=0)
    result = env.step("I am not sure.")
    assert result.done and result.reward == 0.0 and result.failed
    assert result.info["has_boxed"] is False and result.info["tool_calls"] == 0
    assert (result.info["answer_extraction"], result.info["failure_kind"]) == ("none", "no_answer")


def test_turn_limit_ends_the_episode_without_running_code(grader):
    env = _env(grader, [Task("q", "6")], max_turns=2)
    env.reset(seed=0)
    assert not env.step("```python\nprint(1)\n```").done
    last = env.step("```python\nprint(2)\n```")
    assert last.done and last.failed and last.info["turn_limit"] is True and last.info["tool_calls"] == 1
    assert last.info["failure_kind"] == "turn_limit"  # the last code run worked
    env.reset(seed=0)  # counters restart with the episode
    assert env.step(r"\boxed{6}").info["tool_calls"] == 0


def test_max_turns_default_comes_from_max_agent_turns(grader, monkeypatch):
    monkeypatch.setenv("MAX_AGENT_TURNS", "3")
    assert resolve_max_turns(10) == 3 and _env(grader, [Task("q", "1")]).max_turns == 3
    monkeypatch.delenv("MAX_AGENT_TURNS")
    assert resolve_max_turns(10) == 10 and _env(grader, [Task("q", "1")]).max_turns == 10
    monkeypatch.setenv("MAX_AGENT_TURNS", "zero")
    with pytest.raises(ValueError, match="MAX_AGENT_TURNS"):
        resolve_max_turns(10)


def test_system_prompt_goes_into_chat_messages(grader):
    messages = ({"role": "user", "content": "What is 3!?"},)
    seen = []

    def template(msgs):
        seen.append(msgs)
        return "|".join(f"{m['role']}={m['content']}" for m in msgs) + "|assistant="

    env = _env(grader, [Task(messages, "6")], apply_chat_template=template, system_prompt="Use tools.")
    assert env.reset(seed=0) == "system=Use tools.|user=What is 3!?|assistant="
    own = ({"role": "system", "content": "Mine."}, {"role": "user", "content": "q"})
    env = _env(grader, [Task(own, "6")], apply_chat_template=template, system_prompt="Use tools.")
    assert env.reset(seed=0) == "system=Mine.|user=q|assistant="  # the dataset's own system message wins
    env = _env(grader, [Task("plain", "6")], system_prompt=None)
    assert env.reset(seed=0) == "plain"


def test_custom_observation_template(grader):
    env = _env(grader, [Task("q", "1")], observation_template="<|user|>{observation}<|assistant|>")
    env.reset(seed=0)
    assert env.step("```python\nprint('hi')\n```").observation == "<|user|>hi<|assistant|>"
    with pytest.raises(ValueError, match="observation_template"):
        _env(grader, [Task("q", "1")], observation_template="no placeholder")


def test_turn_limit_after_a_failing_tool_names_the_tool(grader):
    env = _env(grader, [Task("q", "6")], max_turns=2)
    env.reset(seed=0)
    env.step("```python\n1/0\n```")
    assert env.step("```python\nprint(6)\n```").info["failure_kind"] == "tool_error"
    env.reset(seed=0)
    env.step("<code>while True: pass</code>")
    assert env.step("```python\nprint(6)\n```").info["failure_kind"] == "tool_timeout"


def test_sandbox_isolation_options_are_plain_kwargs(grader):
    # --env.kwargs is JSON, so the sandbox's options and the opt-in to weaker isolation are plain values.
    from flashreinforce.envs.sandbox import IsolationError, probe_isolation

    weak = {"landlock": False, "namespaces": False}  # at most seccomp: below the default minimum
    with pytest.raises(IsolationError, match="allow_weak_isolation"):
        PythonToolEnv([Task("q", "42")], grader=grader, sandbox_options=weak)
    env = PythonToolEnv([Task("q", "42")], grader=grader, sandbox_options={**weak, "timeout_s": 2},
                        allow_weak_isolation=True)
    assert env.sandbox.isolation.level == probe_isolation(**weak).level and env.sandbox.timeout_s == 2.0
    env.reset(seed=0)
    assert env.step("```python\nprint(6 * 7)\n```").observation == "\n<output>\n42\n</output>\n"
    with pytest.raises(ValueError, match="sandbox_options"):
        PythonToolEnv([Task("q", "1")], grader=grader, sandbox=Sandbox(timeout_s=1.0, allow_weak_isolation=True),
                      allow_weak_isolation=True)
    with pytest.raises(TypeError, match="bogus"):
        PythonToolEnv([Task("q", "1")], grader=grader, sandbox_options={"bogus": 1})
