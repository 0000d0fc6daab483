"""The arithmetic environment: deterministic problems, disjoint splits, difficulty knobs, grading."""

from __future__ import annotations

import itertools

import pytest

from flashreinforce.envs.arith import (HELDOUT_SEED_OFFSET, ArithEnv, ArithProblem, ArithSpec, final_answer,
                                       problem_for_seed)
from flashreinforce.trainer.reporting.evaluation import EVAL_SEED_OFFSET


class ExactGrader:
    """Stands in for MathGrader where a test checks the environment's plumbing, not math-verify."""

    def __init__(self):
        self.calls = []

    def grade(self, answer, gold):
        self.calls.append((answer, gold))

        class G:
            correct = answer == gold
        return G()


def test_heldout_seeds_are_the_trainers_eval_seeds():
    assert HELDOUT_SEED_OFFSET == EVAL_SEED_OFFSET


def test_problems_are_a_function_of_the_seed_only():
    a, b = ArithEnv(grader=ExactGrader(), digits=2), ArithEnv(grader=ExactGrader(), digits=2)
    seeds = [0, 1, 7, 12345, HELDOUT_SEED_OFFSET, HELDOUT_SEED_OFFSET + 17]
    first = [a.reset(seed=s) for s in seeds]
    assert [b.reset(seed=s) for s in reversed(seeds)] == list(reversed(first))
    assert len(set(first)) == len(first)
    # Another problem seed gives another problem set.
    c = ArithEnv(grader=ExactGrader(), digits=2, problem_seed=1)
    assert [c.reset(seed=s) for s in seeds] != first


def test_train_and_heldout_splits_are_disjoint_and_heldout_is_distinct():
    spec = ArithSpec(digits=1, operations="+-*/", negative=True, heldout_size=128)
    heldout = [problem_for_seed(spec, HELDOUT_SEED_OFFSET + i) for i in range(128)]
    assert {split for _, split in heldout} == {"heldout"}
    heldout_set = {p for p, _ in heldout}
    assert len(heldout_set) == 128
    train = [problem_for_seed(spec, i) for i in range(3000)]
    assert {split for _, split in train} == {"train"}
    train_set = {p for p, _ in train}
    assert not (train_set & heldout_set)
    # Every problem is in one split: 3000 draws cover the 324 - 128 train problems.
    assert len(train_set) == spec.num_problems() - 128
    with pytest.raises(ValueError, match="held-out problem 128 requested.*heldout_size"):
        problem_for_seed(spec, HELDOUT_SEED_OFFSET + 128)


@pytest.mark.parametrize("kwargs", [
    dict(digits=1, operations="+-*/", negative=True),
    dict(digits=1, operations="-", negative=False),
    dict(digits=(2, 2), second_digits=1, operations="+-"),
    dict(digits=2, second_digits=(1, 1), operations="*/"),
])
def test_num_problems_counts_what_draw_can_produce(kwargs):
    spec = ArithSpec(**kwargs, heldout_size=1)
    (alo, ahi), (blo, bhi) = spec.operand_ranges
    every = set()
    for op, a, b in itertools.product(spec.operations, range(alo, ahi + 1), range(blo, bhi + 1)):
        if op == "/":
            every.add(ArithProblem(a * b, "/", b))
        elif op == "-" and not spec.negative and b > a:
            every.add(ArithProblem(b, "-", a))
        else:
            every.add(ArithProblem(a, op, b))
    assert spec.num_problems() == len(every)


def test_difficulty_knobs_bound_the_operands():
    spec = ArithSpec(digits=(2, 3), second_digits=1, operations="+-*/", negative=False, heldout_size=10)
    for i in range(2000):
        p, _ = problem_for_seed(spec, i)
        assert p.op in "+-*/"
        if p.op == "/":
            assert 1 <= p.b <= 9 and 10 <= p.a // p.b <= 999 and p.a % p.b == 0
        elif p.op == "-":
            assert p.a >= p.b and p.answer >= 0
        else:
            assert 10 <= p.a <= 999 and 1 <= p.b <= 9
    ops = {problem_for_seed(ArithSpec(operations="*", heldout_size=5), i)[0].op for i in range(50)}
    assert ops == {"*"}
    negatives = [problem_for_seed(ArithSpec(operations="-", negative=True, heldout_size=5), i)[0].answer
                 for i in range(200)]
    assert min(negatives) < 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(digits=0), "digits"), (dict(digits=[3, 2]), "digits"), (dict(second_digits="2"), "second_digits"),
    (dict(operations="+^"), "operations"), (dict(operations=""), "operations"), (dict(operations="++"), "operations"),
    (dict(digits=1, operations="+", heldout_size=41), "heldout_size 41 is more than half of the 81"),
])
def test_bad_knobs_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithEnv(grader=ExactGrader(), **kwargs)


def test_template_must_name_the_operands():
    with pytest.raises(ValueError, match="template must contain {b}"):
        ArithEnv(grader=ExactGrader(), template="What is {a} {op}?")
    env = ArithEnv(grader=ExactGrader(), template="Compute {a}{op}{b}.", operations="+")
    p, _ = problem_for_seed(env.spec, 3)
    assert env.reset(seed=3) == f"Compute {p.a}+{p.b}."


@pytest.mark.parametrize("text, answer", [
    ("7 + 7 = 14", "14"), ("The answer is 16.", "16"), ("15 - 43 = -28", "-28"), ("59-63=-4", "-4"),
    ("So 1,024 in all.", "1024"), ("It is \\boxed{12}, not 13", "12"), ("x = 2.5", "2.5"), ("3/4", "3/4"),
    ("no digits here", None), ("", None), ("7 + 7 = 12\n\nIn this problem, 7 and 7 make", "7"),
])
def test_final_answer_is_the_last_box_else_the_last_number(text, answer):
    assert final_answer(text) == answer


def test_step_rewards_the_correct_final_answer_only():
    env = ArithEnv(grader=ExactGrader(), operations="+")
    p, _ = problem_for_seed(env.spec, 5)
    env.reset(seed=5)
    right = env.step(f"{p.a} + {p.b} = {p.a + p.b}")
    assert (right.reward, right.failed, right.done) == (1.0, False, True)
    assert right.info == {"correct": True, "has_answer": True, "split": "train", "answer_extraction": "last_number"}
    env.reset(seed=5)
    wrong = env.step(f"{p.a} + {p.b} = \\boxed{{{p.a + p.b + 1}}}")
    assert (wrong.reward, wrong.failed) == (0.0, True)
    assert wrong.info["failure_kind"] == "wrong_answer" and wrong.info["answer_extraction"] == "boxed"
    env.reset(seed=HELDOUT_SEED_OFFSET)
    none = env.step("I cannot say.")
    assert none.reward == 0.0 and none.info == {"correct": False, "has_answer": False, "split": "heldout",
                                                "answer_extraction": "none", "failure_kind": "no_answer"}


def test_grading_uses_math_verify():
    pytest.importorskip("math_verify")
    env = ArithEnv(operations="/", digits=1)  # the process-wide MathGrader
    p, _ = problem_for_seed(env.spec, 2)
    env.reset(seed=2)
    assert env.step(f"The result is {p.answer}.0").reward == 1.0  # 8.0 == 8 for math-verify
    env.reset(seed=2)
    assert env.step(f"\\boxed{{{p.answer * 2}/2}}").reward == 1.0  # an expression in the box
    env.reset(seed=2)
    assert env.step(f"{p.answer + 1}").reward == 0.0


def test_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="before reset"):
        ArithEnv(grader=ExactGrader()).step("1")
