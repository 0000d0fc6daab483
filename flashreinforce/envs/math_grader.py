"""Math answer grading with ``math-verify``, and the grading subprocess that bounds it.

This module imports only the standard library (``math_verify`` is imported when grading),
because it also runs as a standalone script: :class:`flashreinforce.envs.math_env.MathGrader`
starts it in a child process and kills that child when a grade takes too long. That is the
only dependable bound: math-verify's own timeout uses ``SIGALRM``, which works only in the
main thread, and cannot interrupt native code (sympy evaluating ``9^{9^{9^{9}}}`` runs in big-
integer C code and ignores the alarm).

Protocol of the child (one JSON object per line):
    parent -> child: ``{"id": int, "answer": str, "gold": [str, ...], "timeout_s": float}``
    child -> parent: ``{"id": int, "correct": bool, "timed_out": bool, "error": str | null}``
The child first writes ``{"ready": true}`` (or ``{"ready": false, "error": ...}``), and exits
when its stdin closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Sequence

__all__ = ["ANSWER_EXTRACTIONS", "Grade", "extract_answer", "extract_boxed", "extract_last_number", "grade_answer"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@dataclass(frozen=True)
class Grade:
    """Outcome of grading one answer.

    correct: the answer matched the ground truth (False on timeout or error).
    timed_out: grading hit its time limit (the answer counts as incorrect).
    error: the reason grading failed (exception text), or None.
    """

    correct: bool
    timed_out: bool = False
    error: str | None = None


def extract_boxed(text: str) -> str | None:
    r"""Return the content of the LAST ``\boxed{...}`` (or ``\fbox{...}``) in ``text``.

    Braces nest (``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``); escaped braces ``\{`` and ``\}``
    are content, not grouping. ``\boxed 5`` (no braces) gives the token up to the next space or
    ``$``. Returns None when there is no box, when the last box is never closed (a response cut
    off mid-answer has no answer, even if an earlier box was complete), or when it is empty.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    end = len(text)
    while True:
        start, command = max((text.rfind(c, 0, end), c) for c in _BOX_COMMANDS)
        if start < 0:
            return None
        i = start + len(command)
        if i < len(text) and text[i].isalpha():
            end = start  # ``\boxedx`` is another command; look for a box before it
            continue
        return _box_content(text, i)


# A plain number as written in prose: optional sign, digits with optional thousands commas, an
# optional decimal part, an optional ``/denominator``. Not preceded by a letter, digit or dot, so
# the ``2`` of ``x2`` or of ``v1.2`` is not a number of its own.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\w])")

#: How an answer was taken from a response: ``boxed`` (the last box), ``last_number`` (no box; the
#: last plain number, only when the environment allows that fallback), ``none`` (nothing to grade).
ANSWER_EXTRACTIONS = ("boxed", "last_number", "none")


def extract_last_number(text: str) -> str | None:
    """The last plain number of ``text`` (``-12``, ``3.5``, ``1,234`` -> ``1234``, ``3/4``), or None.

    This is the fallback of graders that accept an unboxed final number; it is also how the math
    environments tell a response that has a number but no box from one that has no answer at all.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return None if last is None else last.group(0).replace(",", "").lstrip("+")


def extract_answer(text: str, *, fallback: str | None = None) -> tuple[str | None, str]:
    r"""``(answer, how)``: the answer to grade and how it was found (one of :data:`ANSWER_EXTRACTIONS`).

    The last ``\boxed{}`` wins; without one, ``fallback="last_number"`` takes the last plain number
    (:func:`extract_last_number`); otherwise ``(None, "none")``.
    """
    if fallback not in (None, "last_number"):
        raise ValueError(f"fallback must be None or 'last_number', got {fallback!r}")
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    if fallback == "last_number":
        number = extract_last_number(text)
        if number is not None:
            return number, "last_number"
    return None, "none"


_PLAIN_INTEGER = re.compile(r"\s*[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)\s*")


def is_plain_integer(text: str) -> bool:
    """Whether ``text`` is an integer written out (digits, optional sign and thousands commas): not an
    expression. math-verify evaluates expressions, so ``\\boxed{65 * 39}`` would otherwise grade as 2535."""
    return bool(_PLAIN_INTEGER.fullmatch(text))


def first_box_end(text: str) -> int | None:
    r"""The index just after the closing brace of the FIRST complete ``oxed{...}`` (or ``box{...}``)
    of ``text``, or None when none is complete yet (monotone: a longer text keeps the same end)."""
    start = 0
    while True:
        found = [(text.find(c, start), c) for c in _BOX_COMMANDS]
        found = [(i, c) for i, c in found if i >= 0]
        if not found:
            return None
        i, command = min(found)
        j = i + len(command)
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            close = _closing_brace(text, j)
            # None: the first box is still open, so nothing after it can end the turn
            return None if close is None else close + 1
        start = j


def _box_content(text: str, i: int) -> str | None:
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        j = i
        while j < n and not text[j].isspace() and text[j] != "$":
            j += 1
        return text[i:j] or None
    close = _closing_brace(text, i)
    if close is None:
        return None
    return text[i + 1:close].strip() or None


def _closing_brace(text: str, i: int) -> int | None:
    """The index of the brace closing the ``{`` at ``text[i]``, or None when it is never closed.
    A backslash escapes the next character (``\\{``, ``\\}``, ``\\\\`` do not count)."""
    depth, j, n = 0, i, len(text)
    while j < n:
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return None


def _as_gold_list(ground_truth: str | Sequence[str]) -> list[str]:
    if isinstance(ground_truth, str):
        golds = [ground_truth]
    elif isinstance(ground_truth, (list, tuple)) and all(isinstance(g, str) for g in ground_truth):
        golds = list(ground_truth)
    else:
        raise TypeError(f"ground_truth must be a str or a list of str, got {ground_truth!r}")
    if not golds:
        raise ValueError("ground_truth must not be an empty list")
    return golds


_LOGGING_QUIETED = False


def _quiet_math_verify_logging() -> None:
    # We pass timeout=None to math-verify (our own timer bounds the whole grade), and it warns
    # about that once per process; that warning is expected here, so drop it.
    global _LOGGING_QUIETED
    if not _LOGGING_QUIETED:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(lambda record: "Timeout is disabled" not in record.getMessage())
        _LOGGING_QUIETED = True


_gold_cache: dict[str, list] = {}


def _parse_gold(gold: str) -> list:
    from math_verify import parse

    parsed = _gold_cache.get(gold)
    if parsed is None:
        # A ground truth may be a full solution ending in a boxed answer; grade against the box.
        boxed = extract_boxed(gold) if "\\boxed" in gold or "\\fbox" in gold else None
        parsed = parse("\\boxed{" + (boxed if boxed is not None else gold) + "}", parsing_timeout=None)
        if len(_gold_cache) >= 4096:
            _gold_cache.pop(next(iter(_gold_cache)))
        _gold_cache[gold] = parsed
    return parsed


def _normalize(text: str) -> str:
    return "".join(text.split()).strip("$")


class _GradeTimeout(Exception):
    pass


def grade_answer(answer: str, ground_truth: str | Sequence[str], *, timeout_s: float | None = 5.0) -> Grade:
    r"""Grade an extracted answer (the content of a box, e.g. ``"\frac{1}{2}"``) in this process.

    The answer and every ground truth are parsed with ``math_verify.parse`` (wrapped in
    ``\boxed{}``) and compared with ``math_verify.verify``; a list of ground truths accepts any.
    A ground truth that math-verify cannot parse is compared as text (whitespace removed).
    Exceptions become ``Grade(correct=False, error=...)``; nothing is raised for bad answers.

    timeout_s: bound in seconds on the whole grade, enforced with ``SIGALRM``; only in the main
        thread (elsewhere the grade runs unbounded) and only for Python code. Use
        ``flashreinforce.envs.math_env.MathGrader`` for a hard bound that holds in any thread.
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be str, got {type(answer).__name__}")
    golds = _as_gold_list(ground_truth)
    _quiet_math_verify_logging()
    use_alarm = (timeout_s is not None and timeout_s > 0
                 and threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"))
    previous = None
    if use_alarm:
        def on_alarm(signum, frame):
            raise _GradeTimeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        from math_verify import parse, verify

        predicted = parse("\\boxed{" + answer + "}", parsing_timeout=None)
        for gold in golds:
            gold_parsed = _parse_gold(gold)
            if not gold_parsed:
                if _normalize(gold) == _normalize(answer):
                    return Grade(True)
                continue
            if predicted and verify(gold_parsed, predicted, timeout_seconds=None):
                return Grade(True)
        return Grade(False)
    except _GradeTimeout:
        return Grade(False, timed_out=True, error=f"grading exceeded {timeout_s} s")
    except Exception as exc:  # noqa: BLE001 - any failure of the grader means "not correct"
        return Grade(False, error=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _serve(config: dict) -> None:
    """Grading loop of the child process (see the module docstring)."""
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints of libraries go to stderr, never into the protocol stream
    try:
        import resource

        memory = config.get("memory_bytes")
        if memory:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        import math_verify  # noqa: F401 - fail early, before announcing readiness
    except BaseException as exc:  # noqa: BLE001
        protocol.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        protocol.flush()
        return
    protocol.write(json.dumps({"ready": True}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            grade = grade_answer(request["answer"], request["gold"], timeout_s=request["timeout_s"])
        except MemoryError:
            grade = Grade(False, error="MemoryError: grading exceeded the grader's memory limit")
        except Exception as exc:  # noqa: BLE001 - bad request types
            grade = Grade(False, error=f"{type(exc).__name__}: {exc}"[:500])
        protocol.write(json.dumps({"id": request["id"], "correct": grade.correct,
                                   "timed_out": grade.timed_out, "error": grade.error}) + "\n")
        protocol.flush()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[-1]))
