r"""The Python-tool environment: math problems solved with a code interpreter, multi-turn.

Protocol (also stated to the policy by the default ``system_prompt``):

- **Code**: a turn may contain Python code in a fenced block opened by ```` ```python ````
  (or ```` ```py ````, ```` ```python3 ````) and closed by ```` ``` ````, or between
  ``<code>`` and ``</code>``. The LAST complete block of the turn is run by the sandbox (a fresh
  interpreter each time: nothing carries over between turns, so define what you use and
  ``print`` what you need; a final bare expression is printed like in a notebook). Its output
  comes back as the observation, ``<output>\n...\n</output>`` by default (stdout, then stderr;
  a timeout or a kill is said in words; long output is cut, which is said too).
- **Final answer**: a ``\boxed{...}`` written after the turn's last code block (or in a turn
  without code) ends the episode and is graded like ``MathEnv`` (math-verify, last box).
- **End**: the episode also ends on a turn with neither code nor a box (reward 0), and at
  ``max_turns`` (reward 0 unless that turn gives the answer; code in it is not run).
- **Turn end** (``end_turns``, on by default): a turn ends right after its first complete code block
  or its first complete ``\boxed{...}`` (:meth:`PythonToolEnv.turn_end`): the rollout stops sampling
  there, so the policy never writes on past its own code (inventing the output) and the tool's real
  output comes next.
- **Latency** (``tool_latency``): an added delay per tool call drawn from a lognormal distribution
  (``{"median_s": 0.5, "sigma": 1.0}``), on top of the sandbox's own time, to study asynchrony.

Reward 1.0 for a correct final answer, else 0.0; ``failed = not correct``. The final step's
``info`` holds ``tool_calls``, ``tool_timeouts``, ``tool_errors`` (non-zero exits that were not
timeouts), ``tool_run_s`` (the sandbox's own time in all), ``tool_latency_s`` (added delay in all),
``answer_from_tool`` (the final answer is a
number the last tool run printed), ``turns``, ``turn_limit``, and ``has_boxed``, ``correct``, ``grade_timeout``,
``grade_error``, ``answer_extraction`` (``boxed`` or ``none``); earlier steps return an empty
``info``, so summing or updating the per-step dicts both give the episode's totals. A final answer
that is not correct also gets a ``failure_kind``: ``wrong_answer``, ``grade_timeout``,
``grade_error``, ``no_answer`` (a turn with neither code nor a box), or at the turn limit
``tool_timeout`` / ``tool_error`` (the last code run timed out / failed) or else ``turn_limit``.
"""

from __future__ import annotations

import math
import random
import re
import time
from typing import Any, Sequence

from flashreinforce.envs.base import StepResult, resolve_max_turns
from flashreinforce.envs.tasks import ChatTemplate, Task, TaskEnvironment
from flashreinforce.envs.math_env import (MathGrader, extract_boxed, grade_failure_kind, require_math_verify,
                                          shared_grader)
from flashreinforce.envs.math_grader import first_box_end, is_plain_integer
from flashreinforce.envs.sandbox import Sandbox, SandboxResult
from flashreinforce.envs.registry import register_environment

__all__ = ["PythonToolEnv", "extract_code", "format_tool_output",
           "DEFAULT_SYSTEM_PROMPT"]

DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem step by step. You can run Python code: write it in a ```python ... ``` "
    "block and stop; the output will be given back to you in <output> ... </output>. Each block "
    "runs in a new interpreter (nothing is kept between blocks), so define everything it uses and "
    "print the values you need. Put the final answer within \\boxed{}."
)

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_INNER_FENCE = re.compile(r"^\s*```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)\r?\n?```\s*$", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> tuple[str, int] | None:
    """The last complete code block of ``text`` and the index where it ends, or None.

    Recognizes ```` ```python ```` / ```` ```py ```` / ```` ```python3 ```` fences and
    ``<code>...</code>`` (a fence inside the tags is removed). A block never closed is ignored.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    best: tuple[str, int] | None = None
    # Fences: every later opening fence contains the ``` that closes an earlier block, so this
    # scan stays linear in the text.
    for match in _FENCED.finditer(text):
        best = (match.group(1), match.end())
    # Tags: found from the end with rfind (a regex over many unclosed <code> tags is quadratic).
    close = text.rfind("</code>")
    open_ = text.rfind("<code>", 0, close) if close >= 0 else -1
    if open_ >= 0 and (best is None or close + len("</code>") > best[1]):
        code = text[open_ + len("<code>"):close]
        inner = _INNER_FENCE.match(code)
        best = (inner.group(1) if inner is not None else code, close + len("</code>"))
    return best


def first_code_end(text: str) -> int | None:
    """The index where the FIRST complete code block of ``text`` ends (fence or ``</code>``), or None."""
    fenced = _FENCED.search(text)
    ends = [fenced.end()] if fenced is not None else []
    open_ = text.find("<code>")
    if open_ >= 0:
        close = text.find("</code>", open_)
        if close >= 0:
            ends.append(close + len("</code>"))
    return min(ends) if ends else None


_PRINTED_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _latency_options(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"median_s", "sigma"} or "median_s" not in value:
        raise ValueError(f"tool_latency must be a dict {{'median_s': S, 'sigma': X}}, got {value!r}")
    median, sigma = float(value["median_s"]), float(value.get("sigma", 1.0))
    if not (math.isfinite(median) and median > 0 and math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"tool_latency needs median_s > 0 and sigma >= 0, got {value!r}")
    return median, sigma


def format_tool_output(result: SandboxResult, timeout_s: float) -> str:
    """The text the policy sees for one sandbox run."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append(result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"TimeoutError: the code ran longer than the {timeout_s:g} s limit and was stopped.")
    elif result.exit_code < 0:
        parts.append(f"The process was killed by {result.signal_name}.")
    if not parts:
        parts.append("(no output; use print() to see values)")
    return "\n".join(parts)


@register_environment("python_tool")
class PythonToolEnv(TaskEnvironment):
    """Math with a Python interpreter as a tool (see the module docstring for the protocol).

    Args:
        tasks: optional list of :class:`Task`; as in ``MathEnv``.
        max_turns: policy turns per episode; default ``MAX_AGENT_TURNS`` if set, else 10
            (:func:`~flashreinforce.envs.base.resolve_max_turns`).
        sandbox: the :class:`Sandbox` running the code; default ``Sandbox(timeout_s=10,
            memory_mb=1024, output_limit_bytes=4096)`` with ``sandbox_options`` applied.
        sandbox_options: keyword arguments for the default sandbox (JSON-friendly, so settable
            from ``--env.kwargs``), e.g. ``{"timeout_s": 5, "min_isolation": "full"}``.
        end_turns: end each turn after its first complete code block or box (see the protocol).
        tool_latency: an added lognormal delay per tool call, ``{"median_s": S, "sigma": X}``
            (deterministic per task, turn and call).
        integer_answers: the final answer must be an integer written out (not graded otherwise:
            ``failure_kind`` ``not_a_number``), for tasks whose answers are integers; math-verify
            would evaluate a boxed expression such as ``\\boxed{65 * 39}``.
        allow_weak_isolation: run the tool code even where the machine's isolation is below
            the sandbox's ``min_isolation`` (default ``'filesystem'``); without it, building
            the environment raises :class:`~flashreinforce.envs.sandbox.IsolationError` there.
            The level in force is ``env.sandbox.isolation`` (see docs/sandbox.md).
        grader: the :class:`MathGrader` for the final answer; default ``shared_grader(timeout_s)``.
        timeout_s: time limit on grading the final answer, in seconds.
        system_prompt: instructions on the protocol. For a text prompt it is put before the
            problem (separated by a blank line); for chat messages it becomes a system message
            unless the messages already start with one. None: prompts are used as given.
        observation_template: wraps the tool output; ``{observation}`` is replaced by it. For a
            chat model, put the template's turn markers in it (see docs/environments.md).
        apply_chat_template: renders chat-message prompts (see ``render_prompt``).
    """

    default_max_turns = 10  # the published Python-tool setting (Qwen2.5-7B)

    def __init__(self, tasks: Sequence[Task] | None = None, *, max_turns: int | None = None,
                 sandbox: Sandbox | None = None, grader: MathGrader | None = None, timeout_s: float = 5.0,
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                 observation_template: str = "\n<output>\n{observation}\n</output>\n",
                 apply_chat_template: ChatTemplate | None = None, sandbox_options: dict | None = None,
                 allow_weak_isolation: bool = False, end_turns: bool = True,
                 tool_latency: dict | None = None, integer_answers: bool = False) -> None:
        super().__init__(tasks, apply_chat_template=apply_chat_template)
        require_math_verify("PythonToolEnv")
        max_turns = resolve_max_turns(self.default_max_turns, max_turns)
        if sandbox is not None and not isinstance(sandbox, Sandbox):
            raise TypeError(f"sandbox must be a Sandbox, got {type(sandbox).__name__}")
        if sandbox is not None and (sandbox_options or allow_weak_isolation):
            raise ValueError("sandbox_options and allow_weak_isolation configure the default sandbox; "
                             "with sandbox=..., set them on that Sandbox instead")
        if sandbox_options is not None and not isinstance(sandbox_options, dict):
            raise TypeError(f"sandbox_options must be a dict, got {type(sandbox_options).__name__}")
        if "{observation}" not in observation_template:
            raise ValueError("observation_template must contain '{observation}'")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError("system_prompt must be str or None")
        self.max_turns = max_turns
        if sandbox is None:
            options = {"timeout_s": 10.0, **(sandbox_options or {})}
            if allow_weak_isolation:
                options["allow_weak_isolation"] = True
            sandbox = Sandbox(**options)
        self.sandbox = sandbox
        self.grader = grader if grader is not None else shared_grader(timeout_s)
        self.system_prompt = system_prompt
        self.observation_template = observation_template
        self.end_turns = bool(end_turns)
        self.integer_answers = bool(integer_answers)
        self.tool_latency = _latency_options(tool_latency)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._turn = 0
        self._counts = {"tool_calls": 0, "tool_timeouts": 0, "tool_errors": 0, "tool_run_s": 0.0, "tool_latency_s": 0.0}
        self._last_tool = "none"  # outcome of the latest code run: none, ok, timeout, error
        self._last_output = ""  # what the latest code run printed

    def turn_end(self, text: str) -> int | None:
        """The end of the turn's first complete code block or ``\\boxed{}`` (``end_turns``), else None."""
        if not self.end_turns:
            return None
        ends = [e for e in (first_code_end(text), first_box_end(text)) if e is not None]
        return min(ends) if ends else None

    def start(self, task: Task) -> str:
        if task.ground_truth is None:
            raise ValueError(f"PythonToolEnv task {task.index} has no ground_truth (check data.label_key)")
        self._reset_counters()
        prompt = task.prompt
        if self.system_prompt:
            if isinstance(prompt, str):
                prompt = f"{self.system_prompt}\n\n{prompt}"
            elif not prompt or prompt[0]["role"] != "system":
                prompt = ({"role": "system", "content": self.system_prompt}, *prompt)
        return super().start(Task(prompt, task.ground_truth, task.datasource, task.index, task.extra))

    def _finish(self, answer: str | None, turn_limit: bool) -> StepResult:
        used = answer is not None and answer.strip() in _PRINTED_NUMBER.findall(self._last_output)
        if answer is not None and self.integer_answers and not is_plain_integer(answer):
            info = {**self._counts, "turns": self._turn, "turn_limit": turn_limit, "has_boxed": True,
                    "answer_from_tool": False, "correct": False, "grade_timeout": False, "grade_error": False,
                    "answer_extraction": "boxed", "failure_kind": "not_a_number"}
            return StepResult(reward=0.0, done=True, failed=True, info=info)
        info = {**self._counts, "turns": self._turn, "turn_limit": turn_limit, "has_boxed": answer is not None,
                "answer_from_tool": used, "correct": False, "grade_timeout": False, "grade_error": False,
                "answer_extraction": "none" if answer is None else "boxed"}
        grade = None
        if answer is not None:
            grade = self.grader.grade(answer, self.task.ground_truth)
            info.update(correct=grade.correct, grade_timeout=grade.timed_out,
                        grade_error=grade.error is not None and not grade.timed_out)
        if turn_limit:
            # Out of turns while still writing code: how the latest code run ended is the useful reason.
            kind = {"timeout": "tool_timeout", "error": "tool_error"}.get(self._last_tool, "turn_limit")
        else:
            kind = grade_failure_kind("", info["answer_extraction"], grade)
        if not info["correct"]:
            info["failure_kind"] = kind
        return StepResult(reward=1.0 if info["correct"] else 0.0, done=True, failed=not info["correct"], info=info)

    def step(self, action: str) -> StepResult:
        self._begin_step(action)
        self._turn += 1
        code = extract_code(action)
        after_code = action if code is None else action[code[1]:]
        answer = extract_boxed(after_code)
        if answer is not None or code is None:
            return self._finish(answer, turn_limit=False)
        if self._turn >= self.max_turns:
            return self._finish(None, turn_limit=True)
        started = time.perf_counter()
        result = self.sandbox.run(code[0])
        self._counts["tool_run_s"] += time.perf_counter() - started
        if self.tool_latency is not None:  # a slower tool, for the asynchrony measurements
            median, sigma = self.tool_latency
            rng = random.Random(f"tool-latency:{self.task.index}:{self._turn}:{self._counts['tool_calls']}")
            delay = median * math.exp(sigma * rng.gauss(0.0, 1.0))
            time.sleep(delay)
            self._counts["tool_latency_s"] += delay
        self._counts["tool_calls"] += 1
        self._last_tool = "ok"
        self._last_output = result.stdout
        if result.timed_out:
            self._counts["tool_timeouts"] += 1
            self._last_tool = "timeout"
        elif result.exit_code != 0:
            self._counts["tool_errors"] += 1
            self._last_tool = "error"
        text = format_tool_output(result, self.sandbox.timeout_s)
        return StepResult(observation=self.observation_template.replace("{observation}", text),
                          reward=0.0, done=False)
