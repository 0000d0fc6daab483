r"""The math environment: a problem in, a ``\boxed{}`` answer out, graded with math-verify.

``MathEnv`` is single-turn by default: the policy answers once, and the LAST ``\boxed{...}``
of the answer (nested braces allowed) is compared with the task's ground truth by
``math_verify.parse`` / ``math_verify.verify``. Reward 1.0 if correct, else 0.0, and
``failed = not correct``. The final step's ``info`` holds ``has_boxed``, ``correct``,
``grade_timeout`` and ``grade_error`` (booleans) and ``turns``.

Grading runs in a :class:`MathGrader` child process with a hard wall-clock limit, so an
adversarial answer (``9^{9^{9^{9}}}``) can neither hang nor crash a rollout worker, and it
works from any thread (math-verify's own timeout needs the main thread). A grade that times
out or fails counts as incorrect and is counted in ``info``.
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

from flashreinforce.envs.base import StepResult
from flashreinforce.envs.dataset import ChatTemplate, Task, TaskEnvironment
from flashreinforce.envs.math_grader import Grade, extract_boxed, grade_answer

__all__ = ["MathEnv", "MathGrader", "Grade", "extract_boxed", "grade_answer"]

# Runs math_grader.py as a script without putting its directory (which holds a ``math.py``
# that would shadow the standard library) or the working directory on sys.path.
_BOOT = "import runpy, sys; sys.path = [p for p in sys.path if p]; runpy.run_path(sys.argv[1], run_name='__main__')"
_GRADER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_grader.py")


def require_math_verify(who: str) -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(f"{who} needs the math-verify package: pip install 'math-verify>=0.7'")


class MathGrader:
    """Grades answers with math-verify in a child process, with a hard time limit. Thread-safe.

    Args:
        timeout_s: limit on one grade in seconds. The child bounds it with an alarm; if the
            answer has not come ``grace_s`` later (native code ignores alarms), the child is
            killed and restarted on the next call, and the grade is ``timed_out``.
        memory_mb: address-space limit of the child (RLIMIT_AS), so a huge number cannot
            exhaust the machine's memory (the grade then fails with an error).
        startup_timeout_s: how long to wait for a (re)started child to import math-verify.
        grace_s: extra seconds allowed past ``timeout_s`` before the kill.

    ``restarts`` counts the children started after the first. Call :meth:`close` when done
    (it is also called when the object is garbage collected or the program exits).
    """

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 2048, startup_timeout_s: float = 120.0,
                 grace_s: float = 2.0) -> None:
        require_math_verify("MathGrader")
        for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(grace_s, (int, float)) or grace_s < 0:
            raise ValueError(f"grace_s must be a number >= 0, got {grace_s!r}")
        if not isinstance(memory_mb, int) or isinstance(memory_mb, bool) or memory_mb < 256:
            raise ValueError(f"memory_mb must be an integer >= 256, got {memory_mb!r}")
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.startup_timeout_s = float(startup_timeout_s)
        self.grace_s = float(grace_s)
        self.restarts = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._next_id = 0
        self._started_once = False
        self._finalizer = None
        self._closed = False

    # -- child process -------------------------------------------------------------------
    def _start(self) -> str | None:
        """Starts the child; returns an error message, or None when it is ready."""
        if self._started_once:
            self.restarts += 1
        self._started_once = True
        config = json.dumps({"memory_bytes": self.memory_mb * 1024 * 1024})
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, _GRADER_SCRIPT, config], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
        self._buffer = b""
        self._finalizer = weakref.finalize(self, _stop_process, self._proc)
        line = self._read_line(time.monotonic() + self.startup_timeout_s)
        try:
            message = json.loads(line) if line is not None else None
        except ValueError:
            message = None
        if not (isinstance(message, dict) and message.get("ready")):
            error = message.get("error") if isinstance(message, dict) else None
            self._stop()
            return f"the grader process did not start: {error or 'no answer'}"
        return None

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the child once
            self._finalizer = None
        self._proc = None
        self._buffer = b""

    def _read_line(self, deadline: float) -> bytes | None:
        """Reads one protocol line from the child; None on timeout or end of file."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(timeout=remaining):
                    return None
                data = os.read(fd, 65536)
                if not data:
                    return None
                self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    # -- public --------------------------------------------------------------------------
    def grade(self, answer: str, ground_truth: str | Sequence[str]) -> Grade:
        r"""Grade an extracted answer (the content of the box) against the ground truth.

        Never raises for the answer's content; failures come back as ``Grade(correct=False,
        timed_out=..., error=...)``. Raises TypeError for arguments of the wrong type.
        """
        if not isinstance(answer, str):
            raise TypeError(f"answer must be str, got {type(answer).__name__}")
        gold = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
        if not gold or not all(isinstance(g, str) for g in gold):
            raise TypeError(f"ground_truth must be a str or a non-empty list of str, got {ground_truth!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError("MathGrader is closed")
            if self._proc is None or self._proc.poll() is not None:
                error = self._start()
                if error is not None:
                    return Grade(False, error=error)
            self._next_id += 1
            request = {"id": self._next_id, "answer": answer, "gold": gold, "timeout_s": self.timeout_s}
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._stop()
                return Grade(False, error=f"the grader process died: {exc}")
            line = self._read_line(time.monotonic() + self.timeout_s + self.grace_s)
            if line is None:
                died = self._proc.poll() is not None
                self._stop()
                if died:
                    return Grade(False, error="the grader process died while grading (memory limit?)")
                return Grade(False, timed_out=True, error=f"grading exceeded {self.timeout_s} s; grader restarted")
            try:
                reply = json.loads(line)
                if reply.get("id") != request["id"]:
                    raise ValueError(f"reply for request {reply.get('id')}, expected {request['id']}")
            except (ValueError, AttributeError) as exc:
                self._stop()
                return Grade(False, error=f"bad reply from the grader process: {exc}")
            return Grade(bool(reply["correct"]), bool(reply["timed_out"]), reply["error"])

    def close(self) -> None:
        """Stop the child process. Further grades raise RuntimeError."""
        with self._lock:
            self._closed = True
            self._stop()


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


class MathEnv(TaskEnvironment):
    r"""Math problems graded on the last ``\boxed{}`` answer (see the module docstring).

    Args:
        tasks: optional list of :class:`Task` (prompt and ``ground_truth``); ``reset(seed=i)``
            plays ``tasks[i % len]``. Without it, give tasks by ``set_task`` or a
            ``DatasetEnvironment`` (which is what ``make_environment("math", ...)`` builds).
        max_turns: turns per episode (default 1). With more, a turn WITHOUT a boxed answer is
            answered with ``retry_message`` and the episode goes on; a boxed answer always ends
            it (right or wrong, no feedback on correctness).
        timeout_s: time limit on grading one answer, in seconds.
        grader: a :class:`MathGrader` to use (it may be shared between environments; it is then
            not closed by :meth:`close`). Default: one per environment, started on first use.
        apply_chat_template: renders chat-message prompts (see ``render_prompt``).
        retry_message: the observation text of a turn without a box (multi-turn only).
        observation_template: wraps observations; ``{observation}`` is replaced by the text.
    """

    def __init__(self, tasks: Sequence[Task] | None = None, *, max_turns: int = 1, timeout_s: float = 5.0,
                 grader: MathGrader | None = None, apply_chat_template: ChatTemplate | None = None,
                 retry_message: str = DEFAULT_RETRY_MESSAGE,
                 observation_template: str = "\n\n{observation}\n\n") -> None:
        super().__init__(tasks, apply_chat_template=apply_chat_template)
        require_math_verify("MathEnv")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        if "{observation}" not in observation_template:
            raise ValueError("observation_template must contain '{observation}'")
        self.max_turns = max_turns
        self._own_grader = grader is None
        self.grader = grader if grader is not None else MathGrader(timeout_s=timeout_s)
        self.retry_message = retry_message
        self.observation_template = observation_template
        self._turn = 0

    def start(self, task: Task) -> str:
        if task.ground_truth is None:
            raise ValueError(f"MathEnv task {task.index} has no ground_truth (check data.label_key)")
        self._turn = 0
        return super().start(task)

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if not isinstance(action, str):
            raise TypeError(f"action must be str, got {type(action).__name__}")
        self._turn += 1
        answer = extract_boxed(action)
        if answer is None and self._turn < self.max_turns:
            return StepResult(observation=self.observation_template.replace("{observation}", self.retry_message),
                              reward=0.0, done=False)
        info = {"has_boxed": answer is not None, "correct": False, "grade_timeout": False,
                "grade_error": False, "turns": self._turn}
        if answer is not None:
            grade = self.grader.grade(answer, self.task.ground_truth)
            info.update(correct=grade.correct, grade_timeout=grade.timed_out,
                        grade_error=grade.error is not None and not grade.timed_out)
        return StepResult(reward=1.0 if info["correct"] else 0.0, done=True, failed=not info["correct"], info=info)

    def close(self) -> None:
        if self._own_grader:
            self.grader.close()
