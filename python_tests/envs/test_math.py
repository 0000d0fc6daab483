"""The math environment: boxed-answer extraction, math-verify grading, bounded grading time."""

from __future__ import annotations

import random
import threading
from fractions import Fraction

import pytest

from flashreinforce.envs.tasks import Task
from flashreinforce.envs.math_env import MathEnv, MathGrader, extract_boxed, grade_answer, shared_grader
from flashreinforce.envs.math_grader import extract_answer, extract_last_number


@pytest.fixture(scope="module")
def grader():
    g = MathGrader(timeout_s=2.0, grace_s=1.0)
    yield g
    g.close()


def _random_latex_group(rng: random.Random, depth: int = 0) -> str:
    """Random brace-balanced LaTeX-like text (with escaped braces that do not nest)."""
    parts = []
    for _ in range(rng.randrange(1, 4)):
        kind = rng.random()
        if kind < 0.3 and depth < 3:
            parts.append("{" + _random_latex_group(rng, depth + 1) + "}")
        elif kind < 0.45:
            parts.append(rng.choice(["\\{", "\\}", "\\\\"]))
        elif kind < 0.6 and depth < 3:
            parts.append("\\frac{" + _random_latex_group(rng, depth + 1) + "}{" + str(rng.randrange(1, 99)) + "}")
        else:
            parts.append(rng.choice(["x", "1", "+", "2^3", " ", "\\pi", "y_1"]))
    return "".join(parts)


def test_extract_boxed_takes_the_last_box_with_nested_braces():
    assert extract_boxed(r"first \boxed{1}, then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert extract_boxed(r"$\boxed 5$") == "5"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"\boxed{1} and at the end \boxed{2") is None  # cut off mid-answer
    assert extract_boxed(r"\boxed{}") is None
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{3} \boxedx{4}") == "3"


def test_extract_boxed_on_random_nested_content():
    rng = random.Random()
    for _ in range(200):
        content = _random_latex_group(rng).strip()
        if not content:
            continue
        decoy = _random_latex_group(rng)
        text = f"Some words {decoy} \\boxed{{{decoy}}} more words \\boxed{{{content}}} trailing {{}} text"
        assert extract_boxed(text) == content, text


def test_grader_agrees_with_exact_rational_arithmetic(grader):
    rng = random.Random()
    for _ in range(12):
        p, q = rng.randrange(-50, 50), rng.randrange(1, 30)
        gold = Fraction(p, q)
        k = rng.randrange(2, 6)
        if rng.random() < 0.5:
            candidate = Fraction(p * k, q * k) + (0 if rng.random() < 0.5 else Fraction(1, q))
            answer = rf"\frac{{{candidate.numerator * k}}}{{{candidate.denominator * k}}}"
        else:
            candidate = gold if rng.random() < 0.5 else gold + Fraction(1, 7)
            answer = rf"\frac{{{candidate.numerator}}}{{{candidate.denominator}}}"
        ground_truth = rf"\frac{{{p}}}{{{q}}}" if rng.random() < 0.5 else str(gold)
        result = grader.grade(answer, ground_truth)
        assert result.error is None and not result.timed_out
        assert result.correct == (candidate == gold), (answer, ground_truth)


def test_grader_accepts_equivalent_forms_and_lists(grader):
    assert grader.grade("0.5", r"\frac{1}{2}").correct
    assert grader.grade("1+x^2", "x^2+1").correct
    assert grader.grade(r"2^{1/2}", r"\sqrt{2}").correct
    assert not grader.grade("41", "42").correct
    assert grader.grade("7", ["6", "7"]).correct
    assert grader.grade("12", r"so the result is \boxed{12}").correct  # solution-style ground truth
    with pytest.raises(TypeError):
        grader.grade(3, "3")


def test_adversarial_answer_times_out_and_the_grader_recovers(grader):
    # 9^(9^(9^9)) makes sympy compute in native big-integer code, where alarms cannot reach.
    result = grader.grade("9^{9^{9^{9}}}", "5")
    assert not result.correct and result.timed_out
    assert grader.grade("5", "5").correct  # a new child serves the next grade
    assert grader.restarts >= 1


def test_grader_works_from_threads(grader):
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append((i, grader.grade(str(i), str(i))))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for i, _ in results) == [0, 1, 2, 3]
    assert all(r.correct for _, r in results)


def test_inline_grading_catches_bad_input():
    assert grade_answer("3", "3").correct
    bad = grade_answer("\\frac{", "3")
    assert not bad.correct


def test_math_env_single_turn(grader):
    tasks = [Task("What is 1/2 + 1/4?", r"\frac{3}{4}"), Task("What is 2 + 2?", "4")]
    env = MathEnv(tasks, grader=grader)
    assert env.reset(seed=2) == "What is 1/2 + 1/4?"  # seed 2 -> row 2 % 2 == 0
    result = env.step(r"We add: $\boxed{0.75}$")
    assert (result.reward, result.done, result.failed) == (1.0, True, False)
    assert result.info == {"has_boxed": True, "correct": True, "grade_timeout": False, "grade_error": False,
                           "turns": 1, "answer_extraction": "boxed"}  # no failure_kind when correct
    env.reset(seed=1)
    wrong = env.step(r"\boxed{5}")
    assert (wrong.reward, wrong.done, wrong.failed, wrong.info["correct"]) == (0.0, True, True, False)
    assert wrong.info["failure_kind"] == "wrong_answer" and wrong.info["answer_extraction"] == "boxed"
    env.reset(seed=1)
    missing = env.step("four")
    assert missing.done and missing.failed and missing.info["has_boxed"] is False
    assert (missing.info["answer_extraction"], missing.info["failure_kind"]) == ("none", "no_answer")
    env.reset(seed=1)
    hostile = env.step(r"\boxed{9^{9^{9^{9}}}}")
    assert hostile.done and hostile.failed and hostile.info["grade_timeout"] is True
    assert hostile.info["failure_kind"] == "grade_timeout"


def test_math_env_multi_turn_asks_for_a_box(grader):
    env = MathEnv([Task("2+3?", "5")], grader=grader, max_turns=2)
    env.reset(seed=0)
    first = env.step("It is five.")
    assert not first.done and "\\boxed{}" in first.observation and first.reward == 0.0
    second = env.step(r"\boxed{5}")
    assert second.done and second.reward == 1.0 and second.info["turns"] == 2


def test_math_env_validates(grader):
    with pytest.raises(ValueError, match="max_turns"):
        MathEnv([Task("q", "1")], grader=grader, max_turns=0)
    env = MathEnv(grader=grader)
    with pytest.raises(RuntimeError, match="no task"):
        env.reset(seed=0)
    env = MathEnv([Task("q", None)], grader=grader)
    with pytest.raises(ValueError, match="ground_truth"):
        env.reset(seed=0)
    env = MathEnv([Task("q", "1")], grader=grader)
    env.reset(seed=0)
    with pytest.raises(TypeError, match="action"):
        env.step(None)


def test_environments_share_one_grader_pool_and_do_not_close_it():
    first, second = MathEnv([Task("1+1?", "2")]), MathEnv([Task("2+2?", "4")])
    assert first.grader is second.grader is shared_grader(5.0)
    first.reset(seed=0)
    assert first.step(r"\boxed{2}").reward == 1.0
    first.close()
    second.reset(seed=0)
    assert second.step(r"\boxed{4}").reward == 1.0


def test_a_slow_grade_does_not_block_the_other_processes():
    # The fast grade is a cheap one and the limit 3 s, so a loaded machine cannot time it out too.
    pool = MathGrader(timeout_s=3.0, grace_s=1.0, processes=2)
    try:
        children = [pool._acquire(), pool._acquire()]  # start both children before the race
        for child in children:
            assert child.start() is None
            pool._release(child)
        finished = []
        slow = threading.Thread(target=lambda: finished.append(("slow", pool.grade("9^{9^{9^{9}}}", "5"))))
        slow.start()
        fast = pool.grade("2 + 3", "5")
        finished.append(("fast", fast))
        slow.join()
        assert [name for name, _ in finished] == ["fast", "slow"]
        assert fast.correct and finished[1][1].timed_out
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.grade("2", "2")
    with pytest.raises(ValueError, match="processes"):
        MathGrader(processes=0)


def test_extract_last_number_and_extract_answer():
    assert extract_last_number("so 3 apples and then -12.5 pears.") == "-12.5"
    assert extract_last_number("1,234,567 people") == "1234567"
    assert extract_last_number("a ratio of 3/4") == "3/4"
    assert extract_last_number("x2 and v1.2 are names, not numbers") is None
    assert extract_last_number("no digits") is None
    assert extract_answer(r"\boxed{7} or maybe 8") == ("7", "boxed")  # a box wins over a later number
    assert extract_answer("it is 8") == (None, "none")  # box-only by default
    assert extract_answer("it is 8", fallback="last_number") == ("8", "last_number")
    assert extract_answer("it is eight", fallback="last_number") == (None, "none")
    with pytest.raises(ValueError, match="fallback"):
        extract_answer("8", fallback="first_number")


def test_math_env_tells_an_unboxed_answer_from_no_answer(grader):
    env = MathEnv([Task("What is 2 + 2?", "4")], grader=grader)
    env.reset(seed=0)
    unboxed = env.step("The answer is 4.")
    assert unboxed.reward == 0.0 and unboxed.failed
    assert (unboxed.info["answer_extraction"], unboxed.info["failure_kind"]) == ("none", "unboxed_answer")
    env.reset(seed=0)
    nothing = env.step("I do not know.")
    assert nothing.info["failure_kind"] == "no_answer"


def test_math_env_last_number_fallback_grades_unboxed_answers(grader):
    env = MathEnv([Task("What is 2 + 2?", "4")], grader=grader, answer_fallback="last_number")
    env.reset(seed=0)
    right = env.step("2 + 2 = 4")
    assert right.reward == 1.0 and not right.failed and right.info["answer_extraction"] == "last_number"
    assert "failure_kind" not in right.info
    env.reset(seed=0)
    wrong = env.step("2 + 2 = 5")
    assert wrong.reward == 0.0 and wrong.info["failure_kind"] == "wrong_answer"
    env.reset(seed=0)
    boxed = env.step(r"\boxed{4}, not 5")
    assert boxed.reward == 1.0 and boxed.info["answer_extraction"] == "boxed"
    with pytest.raises(ValueError, match="answer_fallback"):
        MathEnv([Task("q", "1")], grader=grader, answer_fallback="first")
