r"""Arithmetic problems generated from a seed, graded with math-verify on the final answer.

``ArithEnv`` asks one question per episode (``What is 47 + 8? Answer with just the number.``)
and gives reward 1.0 when the final answer of the response equals the exact result, else 0.0
(``failed = not correct``). math-verify evaluates what it is given, so ``\boxed{47 + 8}`` counts as
55 and ``8.0`` as 8; with ``integer_answers=True`` only an integer written out (digits, an optional
sign and thousands commas) is graded, anything else is ``not_a_number``. The *final answer* is the content of the last ``\boxed{}`` when the
response has one, otherwise the last number in it (``"7 + 7 = 14."`` gives ``14``; a response
cut off in the middle of its explanation usually ends with some other number and is wrong). The
comparison is math-verify's, run by the project's :class:`~flashreinforce.envs.math_env.MathGrader`
(child processes with a hard time limit).

Problems (:class:`ArithSpec`, all deterministic functions of ``seed``):

* difficulty: ``digits`` and ``second_digits`` (digits of each operand: ``2`` is 1 to 2 digits,
  ``[2, 2]`` exactly 2), ``operations`` (a subset of ``+-*/``; ``/`` is exact division: the
  quotient and the divisor have the operand digits, the dividend is their product), ``negative``
  (whether ``a - b`` may be negative; by default the larger operand comes first);
* a **held-out split** of ``heldout_size`` distinct problems, drawn first from the seed; the
  **train split** is every other problem: train problems are drawn from a per-index stream that
  rejects held-out ones, so the splits are disjoint by construction.

Seeds: ``reset(seed=i)`` plays train problem ``i``; ``reset(seed=HELDOUT_SEED_OFFSET + i)`` plays
held-out problem ``i``. The trainer hands out train seeds counting from 0 and evaluates on seeds
from :data:`flashreinforce.trainer.reporting.evaluation.EVAL_SEED_OFFSET` (the same number), so training
never sees a held-out problem and ``flashreinforce eval`` scores the held-out split.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.math_grader import extract_boxed, is_plain_integer

__all__ = ["HELDOUT_SEED_OFFSET", "ArithEnv", "ArithProblem", "ArithSpec", "final_answer", "problem_for_seed"]

#: Seeds from here on play the held-out split (equal to the trainer's evaluation seed offset).
HELDOUT_SEED_OFFSET = 1_000_000_000

DEFAULT_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
OPERATIONS = "+-*/"

# A number: optional sign (not a binary minus: no digit, letter or ')' right before it), digits
# with optional thousands separators, optional decimals or a fraction bar.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?")


def final_answer(text: str) -> str | None:
    r"""The final answer of a response: the last ``\boxed{}`` content, else the last number (commas
    removed), else ``None``. ``"15 - 43 = -28"`` gives ``"-28"``; ``"So 1,024."`` gives ``"1024"``."""
    return _final_answer(text)[0]


def _final_answer(text: str) -> tuple[str | None, str]:
    """``(answer, how)``: :func:`final_answer` and how it was found (``boxed``, ``last_number``, ``none``)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None, "none"
    return "".join(numbers[-1].replace(",", "").split()), "last_number"


@dataclass(frozen=True)
class ArithProblem:
    """One problem: ``a op b`` with its exact ``answer`` (an integer for these operations; ``%`` is the
    remainder, used by the tool task's generator)."""

    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        if self.op == "*":
            return self.a * self.b
        if self.op == "%":  # the remainder of a divided by b (flashreinforce.envs.arith_python_tool)
            return self.a % self.b
        q = Fraction(self.a, self.b)
        if q.denominator != 1:
            raise ValueError(f"{self.a} / {self.b} is not exact")
        return int(q)


def _digit_range(value: Any, name: str) -> tuple[int, int]:
    """``3`` -> ``(1, 3)`` (1 to 3 digits); ``[2, 3]`` -> ``(2, 3)``."""
    if isinstance(value, int) and not isinstance(value, bool):
        lo, hi = 1, value
    elif isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value):
        lo, hi = value
    else:
        raise ValueError(f"{name} must be an integer or a [min, max] pair of integers, got {value!r}")
    if not 1 <= lo <= hi <= 9:
        raise ValueError(f"{name} must lie within 1..9 digits with min <= max, got {value!r}")
    return int(lo), int(hi)


def _operand_range(digits: tuple[int, int]) -> tuple[int, int]:
    lo, hi = digits
    return (1 if lo == 1 else 10 ** (lo - 1)), 10 ** hi - 1


@dataclass(frozen=True)
class ArithSpec:
    """The problem distribution and its splits.

    digits: digits of the first operand: ``n`` means 1 to ``n`` digits (1 digit is 1..9; zero is
    never an operand), ``(lo, hi)`` means ``lo`` to ``hi`` digits. second_digits: the same for the
    second operand (default: as ``digits``). operations: distinct characters of ``+-*/`` (for
    ``/`` the quotient has the first operand's digits and the divisor the second's). negative:
    allow ``a - b < 0`` (else the larger operand is put first). seed: fixes both splits.
    heldout_size: distinct held-out problems, at most half of all problems (default: a quarter of
    them, at most 500).
    """

    digits: int | tuple[int, int] = 1
    second_digits: int | tuple[int, int] | None = None
    operations: str = "+-*"
    negative: bool = False
    seed: int = 0
    heldout_size: int | None = None

    def __post_init__(self) -> None:
        first = _digit_range(self.digits, "digits")
        second = first if self.second_digits is None else _digit_range(self.second_digits, "second_digits")
        object.__setattr__(self, "digits", first)
        object.__setattr__(self, "second_digits", second)
        ops = self.operations
        if not isinstance(ops, str) or not ops or any(c not in OPERATIONS for c in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"operations must be distinct characters of {OPERATIONS!r}, got {ops!r}")
        if self.heldout_size is None:
            object.__setattr__(self, "heldout_size", max(1, min(500, self.num_problems() // 4)))
        if not isinstance(self.heldout_size, int) or self.heldout_size < 1:
            raise ValueError(f"heldout_size must be a positive integer, got {self.heldout_size!r}")
        if self.heldout_size * 2 > self.num_problems():
            raise ValueError(f"heldout_size {self.heldout_size} is more than half of the {self.num_problems()} "
                             f"problems with digits={list(first)}, second_digits={list(second)}, "
                             f"operations={ops!r}; lower heldout_size or raise the difficulty")

    @property
    def operand_ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Smallest and largest value (inclusive) of the first and of the second operand."""
        return _operand_range(self.digits), _operand_range(self.second_digits)

    def num_problems(self) -> int:
        """How many distinct problems the spec can generate."""
        (alo, ahi), (blo, bhi) = self.operand_ranges
        total = 0
        for op in self.operations:
            if op == "-" and not self.negative:
                # Pairs are ordered larger first, so (x, y) and (y, x) are one problem.
                lo, hi = max(alo, blo), min(ahi, bhi)
                overlap = max(0, hi - lo + 1)
                total += (ahi - alo + 1) * (bhi - blo + 1) - overlap * (overlap - 1) // 2
            else:  # +, *, negative -, and / (quotient and divisor are the operands)
                total += (ahi - alo + 1) * (bhi - blo + 1)
        return total

    def draw(self, rng: random.Random) -> ArithProblem:
        """One problem: an operation chosen uniformly, then each operand uniformly in its range."""
        (alo, ahi), (blo, bhi) = self.operand_ranges
        op = rng.choice(self.operations)
        a, b = rng.randint(alo, ahi), rng.randint(blo, bhi)
        if op == "/":  # exact division: the dividend is quotient times divisor
            return ArithProblem(a * b, "/", b)
        if op == "-" and not self.negative and b > a:
            a, b = b, a
        return ArithProblem(a, op, b)


_splits_lock = threading.Lock()
_heldout_cache: dict[ArithSpec, tuple[list[ArithProblem], frozenset[ArithProblem]]] = {}


def _heldout(spec: ArithSpec) -> tuple[list[ArithProblem], frozenset[ArithProblem]]:
    """The held-out problems in order, and as a set (computed once per spec and process)."""
    with _splits_lock:
        got = _heldout_cache.get(spec)
        if got is None:
            rng = random.Random(f"arith-heldout:{spec.seed}")
            seen: dict[ArithProblem, None] = {}
            while len(seen) < spec.heldout_size:
                seen.setdefault(spec.draw(rng), None)
            problems = list(seen)
            got = (problems, frozenset(problems))
            _heldout_cache[spec] = got
        return got


def problem_for_seed(spec: ArithSpec, seed: int) -> tuple[ArithProblem, str]:
    """The problem an episode seed plays and its split (``"train"`` or ``"heldout"``)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    heldout, heldout_set = _heldout(spec)
    if seed >= HELDOUT_SEED_OFFSET:
        index = seed - HELDOUT_SEED_OFFSET
        if index >= len(heldout):
            raise ValueError(f"held-out problem {index} requested, but the held-out split has {len(heldout)} "
                             "problems; lower eval.num_prompts or raise env.kwargs heldout_size")
        return heldout[index], "heldout"
    rng = random.Random(f"arith-train:{spec.seed}:{seed}")
    while True:
        problem = spec.draw(rng)
        if problem not in heldout_set:
            return problem, "train"


def _as_pair(value):
    # JSON (--env.kwargs) gives lists; the spec is hashable, so pairs become tuples.
    return tuple(value) if isinstance(value, list) else value


class ArithEnv(Environment):
    """Single-turn arithmetic (see the module docstring).

    Args:
        digits, second_digits, operations, negative, heldout_size: the difficulty and splits
            (:class:`ArithSpec`). problem_seed: the seed of the problem set (default 0; the
            run's ``--seed`` does not change the problems).
        template: the question, with ``{a}``, ``{op}`` and ``{b}``. The chat template of the model
            is applied by the trainer's tokenizer (``data.apply_chat_template``), not here.
        grader: a :class:`~flashreinforce.envs.math_env.MathGrader` (default: the process-wide one).
        timeout_s: grading time limit of the default grader.
        integer_answers: grade only an integer written out (see the module docstring).

    ``info`` of the step: ``correct``, ``has_answer``, ``split`` (``train``/``heldout``).
    """

    default_max_turns = 1  # one question, one answer

    def __init__(self, *, digits: int | Sequence[int] = 1, second_digits: int | Sequence[int] | None = None,
                 operations: str = "+-*", negative: bool = False, heldout_size: int | None = None, problem_seed: int = 0,
                 template: str = DEFAULT_TEMPLATE, grader: Any = None, timeout_s: float = 5.0,
                 integer_answers: bool = False) -> None:
        self.spec = ArithSpec(digits=_as_pair(digits), second_digits=_as_pair(second_digits), operations=operations,
                              negative=negative, seed=problem_seed, heldout_size=heldout_size)
        for key in ("{a}", "{op}", "{b}"):
            if key not in template:
                raise ValueError(f"template must contain {key}, got {template!r}")
        self.template = template
        if grader is None:
            from flashreinforce.envs.math_env import shared_grader

            grader = shared_grader(timeout_s)
        self.grader = grader
        self.integer_answers = bool(integer_answers)
        self.problem: ArithProblem | None = None
        self.split: str | None = None

    def prompt(self, problem: ArithProblem) -> str:
        """The question text of ``problem``."""
        return self.template.replace("{a}", str(problem.a)).replace("{op}", problem.op).replace("{b}", str(problem.b))

    def reset(self, *, seed: int) -> str:
        self.problem, self.split = problem_for_seed(self.spec, seed)
        return self.prompt(self.problem)

    def score(self, response: str) -> tuple[bool, str | None]:
        """Whether ``response``'s final answer equals the current problem's answer, and that answer."""
        correct, answer, _ = self._score(response)
        return correct, answer

    def _score(self, response: str) -> tuple[bool, str | None, str]:
        if self.problem is None:
            raise RuntimeError("score() called before reset()")
        answer, how = _final_answer(response)
        if answer is None or (self.integer_answers and not is_plain_integer(answer)):
            return False, answer, how
        return bool(self.grader.grade(answer, str(self.problem.answer)).correct), answer, how

    def step(self, action: str) -> StepResult:
        if self.problem is None:
            raise RuntimeError("step() called before reset()")
        correct, answer, extraction = self._score(action)
        info = {"correct": correct, "has_answer": answer is not None, "split": self.split,
                "answer_extraction": extraction}
        if not correct:  # why the reward is 0, counted per batch in metrics.jsonl (failure_kinds)
            info["failure_kind"] = ("no_answer" if answer is None else "not_a_number"
                                    if self.integer_answers and not is_plain_integer(answer) else "wrong_answer")
        return StepResult(reward=1.0 if correct else 0.0, done=True, failed=not correct, info=info)
