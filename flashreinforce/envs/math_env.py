r"""The math environment: a problem in, a ``\boxed{}`` answer out, graded with math-verify.

``MathEnv`` is single-turn by default: the policy answers once, and the LAST ``\boxed{...}``
of the answer (nested braces allowed) is compared with the task's ground truth by
``math_verify.parse`` / ``math_verify.verify``. Reward 1.0 if correct, else 0.0, and
``failed = not correct``. The final step's ``info`` holds ``has_boxed``, ``correct``,
``grade_timeout`` and ``grade_error`` (booleans), ``turns``, ``answer_extraction`` (how the graded
answer was found: ``boxed``, ``last_number`` with ``answer_fallback="last_number"``, or ``none``)
and, when the answer is not correct, ``failure_kind``: ``no_answer`` (no box and no number),
``unboxed_answer`` (a number but no box, so nothing was graded), ``wrong_answer``,
``grade_timeout`` or ``grade_error``. The trainer counts these per batch (``failure_kinds`` and
``no_answer_fraction`` in ``metrics.jsonl``).

Grading runs in :class:`MathGrader` child processes with a hard wall-clock limit (one small
pool per program, see :func:`shared_grader`), so an adversarial answer (``9^{9^{9^{9}}}``)
can neither hang nor crash a rollout worker, and it works from any thread (math-verify's own
timeout needs the main thread). A grade that times out or fails counts as incorrect and is
counted in ``info``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from typing import Sequence

from flashreinforce.envs.base import StepResult, resolve_max_turns
from flashreinforce.envs.tasks import ChatTemplate, Task, TaskEnvironment
from flashreinforce.envs.math_grader import Grade, extract_answer, extract_boxed, extract_last_number, grade_answer
from flashreinforce.envs.registry import register_environment

__all__ = ["MathEnv", "MathGrader", "Grade", "extract_answer", "extract_boxed", "grade_answer", "grade_failure_kind",
           "shared_grader"]

# Runs math_grader.py as a script without putting its directory (which holds a ``math.py``
# that would shadow the standard library) or the working directory on sys.path.
_BOOT = "import runpy, sys; sys.path = [p for p in sys.path if p]; runpy.run_path(sys.argv[1], run_name='__main__')"
_GRADER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_grader.py")


def require_math_verify(who: str) -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(f"{who} needs the math-verify package: pip install 'math-verify>=0.7'")


class _GraderChild:
    """One grading child process; used by one thread at a time (the pool hands it out)."""

    def __init__(self, owner: "MathGrader") -> None:
        self.owner = owner
        self.proc: subprocess.Popen | None = None
        self.buffer = b""
        self.next_id = 0
        self.started = False
        self.finalizer = None

    def start(self) -> str | None:
        """Starts the process; returns an error message, or None when it is ready."""
        if self.started:
            self.owner._count_restart()
        self.started = True
        config = json.dumps({"memory_bytes": self.owner.memory_mb * 1024 * 1024})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, _GRADER_SCRIPT, config], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
        self.buffer = b""
        self.finalizer = weakref.finalize(self, _stop_process, self.proc)
        line = self.read_line(time.monotonic() + self.owner.startup_timeout_s)
        try:
            message = json.loads(line) if line is not None else None
        except ValueError:
            message = None
        if not (isinstance(message, dict) and message.get("ready")):
            error = message.get("error") if isinstance(message, dict) else None
            self.stop()
            return f"the grader process did not start: {error or 'no answer'}"
        return None

    def stop(self) -> None:
        if self.finalizer is not None:
            self.finalizer()  # kills and reaps the process once
            self.finalizer = None
        self.proc = None
        self.buffer = b""

    def read_line(self, deadline: float) -> bytes | None:
        """Reads one protocol line; None on timeout or end of file."""
        proc = self.proc
        if proc is None or proc.stdout is None:
            return None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(timeout=remaining):
                    return None
                data = os.read(fd, 65536)
                if not data:
                    return None
                self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def grade(self, answer: str, gold: list[str]) -> Grade:
        owner = self.owner
        if self.proc is None or self.proc.poll() is not None:
            error = self.start()
            if error is not None:
                return Grade(False, error=error)
        self.next_id += 1
        request = {"id": self.next_id, "answer": answer, "gold": gold, "timeout_s": owner.timeout_s}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, AttributeError) as exc:
            self.stop()
            return Grade(False, error=f"the grader process died: {exc}")
        line = self.read_line(time.monotonic() + owner.timeout_s + owner.grace_s)
        if line is None:
            died = self.proc is None or self.proc.poll() is not None
            self.stop()
            if died:
                return Grade(False, error="the grader process died while grading (memory limit?)")
            return Grade(False, timed_out=True, error=f"grading exceeded {owner.timeout_s} s; grader restarted")
        try:
            reply = json.loads(line)
            if reply.get("id") != request["id"]:
                raise ValueError(f"reply for request {reply.get('id')}, expected {request['id']}")
        except (ValueError, AttributeError) as exc:
            self.stop()
            return Grade(False, error=f"bad reply from the grader process: {exc}")
        return Grade(bool(reply["correct"]), bool(reply["timed_out"]), reply["error"])


class MathGrader:
    """Grades answers with math-verify in child processes, with a hard time limit. Thread-safe.

    Up to ``processes`` grades run at once, each in its own child process (children start on
    demand and are reused); further callers wait for a free child.

    Args:
        timeout_s: limit on one grade in seconds. The child bounds it with an alarm; if the
            answer has not come ``grace_s`` later (native code ignores alarms), the child is
            killed and restarted on its next use, and the grade is ``timed_out``.
        processes: the most child processes (concurrent grades), >= 1.
        memory_mb: address-space limit of each child (RLIMIT_AS), so a huge number cannot
            exhaust the machine's memory (the grade then fails with an error).
        startup_timeout_s: how long to wait for a (re)started child to import math-verify.
        grace_s: extra seconds allowed past ``timeout_s`` before the kill.

    ``restarts`` counts children restarted after a timeout or a crash. :meth:`close` stops the
    children (they are also stopped when garbage collected or at exit, and a child exits on
    its own when its parent dies, since its stdin closes).
    """

    def __init__(self, *, timeout_s: float = 5.0, processes: int = 1, memory_mb: int = 2048,
                 startup_timeout_s: float = 120.0, grace_s: float = 2.0) -> None:
        require_math_verify("MathGrader")
        for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(grace_s, (int, float)) or grace_s < 0:
            raise ValueError(f"grace_s must be a number >= 0, got {grace_s!r}")
        if not isinstance(memory_mb, int) or isinstance(memory_mb, bool) or memory_mb < 256:
            raise ValueError(f"memory_mb must be an integer >= 256, got {memory_mb!r}")
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"processes must be an integer >= 1, got {processes!r}")
        self.timeout_s = float(timeout_s)
        self.processes = processes
        self.memory_mb = memory_mb
        self.startup_timeout_s = float(startup_timeout_s)
        self.grace_s = float(grace_s)
        self.restarts = 0
        self._cond = threading.Condition()
        self._idle: list[_GraderChild] = []
        self._children: list[_GraderChild] = []
        self._closed = False

    def _count_restart(self) -> None:
        with self._cond:
            self.restarts += 1

    def _acquire(self) -> _GraderChild:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("MathGrader is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._children) < self.processes:
                    child = _GraderChild(self)
                    self._children.append(child)
                    return child
                self._cond.wait()

    def _release(self, child: _GraderChild) -> None:
        with self._cond:
            if self._closed:
                child.stop()
            else:
                self._idle.append(child)
            self._cond.notify()

    def grade(self, answer: str, ground_truth: str | Sequence[str]) -> Grade:
        r"""Grade an extracted answer (the content of the box) against the ground truth.

        Never raises for the answer's content; failures come back as ``Grade(correct=False,
        timed_out=..., error=...)``. Raises TypeError for arguments of the wrong type and
        RuntimeError after :meth:`close`.
        """
        if not isinstance(answer, str):
            raise TypeError(f"answer must be str, got {type(answer).__name__}")
        gold = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
        if not gold or not all(isinstance(g, str) for g in gold):
            raise TypeError(f"ground_truth must be a str or a non-empty list of str, got {ground_truth!r}")
        child = self._acquire()
        try:
            return child.grade(answer, gold)
        finally:
            self._release(child)

    def close(self) -> None:
        """Stop the children. Further grades raise RuntimeError."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for child in idle:
            child.stop()


_shared_graders: dict[float, MathGrader] = {}
_shared_lock = threading.Lock()


def shared_grader(timeout_s: float = 5.0) -> MathGrader:
    """The process-wide :class:`MathGrader` for ``timeout_s`` (created on first use).

    Environments built without a ``grader`` use it, so a rollout worker running hundreds of
    episodes at once keeps a handful of grading processes (``min(4, cpu_count)``), not one per
    episode. It lives until the program exits; environments do not close it.
    """
    with _shared_lock:
        grader = _shared_graders.get(float(timeout_s))
        if grader is None or grader._closed:
            grader = MathGrader(timeout_s=timeout_s, processes=max(1, min(4, os.cpu_count() or 1)))
            _shared_graders[float(timeout_s)] = grader
        return grader


def _stop_process(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except OSError:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


DEFAULT_RETRY_MESSAGE = "Please give your final answer within \\boxed{}."


def grade_failure_kind(action: str, extraction: str, grade: Grade | None) -> str | None:
    """Why a graded (or ungradable) final answer earns nothing, as a short ``failure_kind``; None when correct.

    ``extraction`` is how the answer was found (:func:`extract_answer`), ``grade`` its grade (None
    when nothing was extracted; ``action`` is then searched for a plain number, to tell an answer
    written without a box from no answer at all).
    """
    if grade is None:
        return "unboxed_answer" if extraction == "none" and extract_last_number(action) is not None else "no_answer"
    if grade.correct:
        return None
    if grade.timed_out:
        return "grade_timeout"
    return "grade_error" if grade.error is not None else "wrong_answer"


@register_environment("math")
class MathEnv(TaskEnvironment):
    r"""Math problems graded on the last ``\boxed{}`` answer (see the module docstring).

    Args:
        tasks: optional list of :class:`Task` (prompt and ``ground_truth``); ``reset(seed=i)``
            plays ``tasks[i % len]``. Without it, give tasks by ``set_task`` or a
            ``DatasetEnvironment`` (which is what ``make_environment("math", ...)`` builds).
        max_turns: turns per episode (default ``MAX_AGENT_TURNS`` if set, else 1). With more, a turn WITHOUT a boxed answer is
            answered with ``retry_message`` and the episode goes on; a boxed answer always ends
            it (right or wrong, no feedback on correctness).
        timeout_s: time limit on grading one answer, in seconds.
        grader: the :class:`MathGrader` to use. Default: ``shared_grader(timeout_s)``, shared by
            every environment of the process. The environment never closes its grader.
        apply_chat_template: renders chat-message prompts (see ``render_prompt``).
        retry_message: the observation text of a turn without a box (multi-turn only).
        observation_template: wraps observations; ``{observation}`` is replaced by the text.
        answer_fallback: ``None`` (default: only a box is graded, as in the published settings) or
            ``"last_number"``: a response without a box is graded on its last plain number.
    """

    default_max_turns = 1  # the published math settings answer in one turn

    def __init__(self, tasks: Sequence[Task] | None = None, *, max_turns: int | None = None, timeout_s: float = 5.0,
                 grader: MathGrader | None = None, apply_chat_template: ChatTemplate | None = None,
                 retry_message: str = DEFAULT_RETRY_MESSAGE,
                 observation_template: str = "\n\n{observation}\n\n", answer_fallback: str | None = None) -> None:
        super().__init__(tasks, apply_chat_template=apply_chat_template)
        require_math_verify("MathEnv")
        if answer_fallback not in (None, "last_number"):
            raise ValueError(f"answer_fallback must be None or 'last_number', got {answer_fallback!r}")
        self.answer_fallback = answer_fallback
        max_turns = resolve_max_turns(self.default_max_turns, max_turns)
        if "{observation}" not in observation_template:
            raise ValueError("observation_template must contain '{observation}'")
        self.max_turns = max_turns
        self.grader = grader if grader is not None else shared_grader(timeout_s)
        self.retry_message = retry_message
        self.observation_template = observation_template
        self._turn = 0

    def start(self, task: Task) -> str:
        if task.ground_truth is None:
            raise ValueError(f"MathEnv task {task.index} has no ground_truth (check data.label_key)")
        self._turn = 0
        return super().start(task)

    def step(self, action: str) -> StepResult:
        self._begin_step(action)
        self._turn += 1
        answer, extraction = extract_answer(action, fallback=self.answer_fallback)
        # A retry is asked for only when there is no box (a fallback number does not end the episode early).
        if extraction != "boxed" and self._turn < self.max_turns:
            return StepResult(observation=self.observation_template.replace("{observation}", self.retry_message),
                              reward=0.0, done=False)
        info = {"has_boxed": extraction == "boxed", "correct": False, "grade_timeout": False,
                "grade_error": False, "turns": self._turn, "answer_extraction": extraction}
        grade = None
        if answer is not None:
            grade = self.grader.grade(answer, self.task.ground_truth)
            info.update(correct=grade.correct, grade_timeout=grade.timed_out,
                        grade_error=grade.error is not None and not grade.timed_out)
        kind = grade_failure_kind(action, extraction, grade)
        if kind is not None:
            info["failure_kind"] = kind
        return StepResult(reward=1.0 if info["correct"] else 0.0, done=True, failed=not info["correct"], info=info)
