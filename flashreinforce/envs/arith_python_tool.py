r"""Arithmetic a small model cannot do in its head, with a Python tool: the ``arith_tool`` preset's task.

Each episode is one generated problem (two-digit multiplication, three-digit sums and differences,
remainders; ``mix`` sets the share of each) played with :class:`~flashreinforce.envs.python_tool.
PythonToolEnv`'s protocol: the policy may write a ```` ```python ```` block (the turn ends there), the
sandbox's output comes back as the next user turn, and a ``\boxed{}`` answer ends the episode,
graded with math-verify once it is an integer written out (a boxed expression such as
``\boxed{65 * 39}``, which math-verify would evaluate, is ``not_a_number``). At most ``max_turns`` policy turns (3: code, then the answer, with one turn
to spare). The system prompt states the protocol, and one worked episode on a task that is not
arithmetic (:data:`DEMONSTRATION`) comes before the problem as earlier turns of the conversation.

Splits: as :mod:`flashreinforce.envs.arith` (``problem_for_seed``): a held-out split of
``heldout_size`` distinct problems drawn first from ``problem_seed``, the train split every other
problem, so ``reset(seed=i)`` plays train problem ``i`` and the trainer's evaluation seeds play the
held-out problems. With ``data.prompt_dataset`` the rows (prompt + ground truth) are played instead,
with the same protocol (the environment then takes tasks like any :class:`TaskEnvironment`).

``info``: the tool environment's (``tool_calls``, ``tool_errors``, ``answer_from_tool``, ``turns``,
...) plus ``operation`` and ``split``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from flashreinforce.envs.arith import ArithProblem, problem_for_seed
from flashreinforce.envs.base import StepResult
from flashreinforce.envs.python_tool import PythonToolEnv
from flashreinforce.envs.tasks import Task

__all__ = ["DEFAULT_MIX", "TOOL_SYSTEM_PROMPT", "ArithToolEnv", "ToolArithSpec"]

#: Operation -> (first operand digits, second operand digits) as (min, max) pairs.
OPERAND_DIGITS = {"*": ((2, 2), (2, 2)), "+": ((3, 3), (3, 3)), "-": ((3, 3), (3, 3)), "%": ((3, 4), (1, 2))}
#: The default share of each operation.
DEFAULT_MIX = {"*": 0.4, "+": 0.2, "-": 0.2, "%": 0.2}

QUESTIONS = {"*": "What is {a} * {b}?", "+": "What is {a} + {b}?", "-": "What is {a} - {b}?",
             "%": "What is the remainder when {a} is divided by {b}?"}

TOOL_SYSTEM_PROMPT = ("Use Python for every calculation: write one ```python code block that prints the result "
                      "and stop. After the output, give the final answer in \\boxed{}.")

#: One worked episode, shown as earlier turns of the conversation: the protocol on a task that is not
#: arithmetic, so the model learns the format (code, output, boxed answer) and not the answers. With
#: it, SmolLM2-135M-Instruct answers none of 48 problems greedily and 3 of 48 at temperature 0.7,
#: all with the tool (a worked multiplication instead: 37 greedily; no example: 0 either way;
#: docs/results.md).
DEMONSTRATION = (
    {"role": "user", "content": "How many letters does the word 'banana' have?"},
    {"role": "assistant", "content": "```python\nprint(len('banana'))\n```"},
    {"role": "user", "content": "<output>\n6\n</output>"},
    {"role": "assistant", "content": "\\boxed{6}"},
)


def _digits(pair: Any, name: str) -> tuple[int, int]:
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, int) for x in pair)
            and 1 <= pair[0] <= pair[1] <= 9):
        raise ValueError(f"{name} must be a [min, max] pair of digit counts in 1..9, got {pair!r}")
    return int(pair[0]), int(pair[1])


@dataclass(frozen=True)
class ToolArithSpec:
    """The problem distribution: ``mix`` (operation, share) pairs, operand ``digits`` per operation
    (``(op, (a_min, a_max), (b_min, b_max))`` digit counts), ``seed`` and ``heldout_size`` (the
    interface :func:`flashreinforce.envs.arith.problem_for_seed` splits by)."""

    mix: tuple[tuple[str, float], ...]
    digits: tuple[tuple[str, tuple[int, int], tuple[int, int]], ...]
    seed: int = 0
    heldout_size: int = 256

    @classmethod
    def build(cls, mix: Mapping[str, float] | None = None, digits: Mapping[str, Any] | None = None, *,
              seed: int = 0, heldout_size: int = 256) -> "ToolArithSpec":
        mix = dict(DEFAULT_MIX if mix is None else mix)
        if not mix or any(op not in OPERAND_DIGITS for op in mix):
            raise ValueError(f"mix must map operations among {sorted(OPERAND_DIGITS)} to shares, got {mix!r}")
        if any(not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 for w in mix.values()) or \
                sum(mix.values()) <= 0:
            raise ValueError(f"mix shares must be numbers >= 0 with a positive sum, got {mix!r}")
        table = {op: OPERAND_DIGITS[op] for op in mix}
        for op, pair in (digits or {}).items():
            if op not in table:
                raise ValueError(f"digits names {op!r}, which the mix does not use ({sorted(table)})")
            table[op] = (_digits(pair[0], f"digits[{op!r}][0]"), _digits(pair[1], f"digits[{op!r}][1]"))
        if not isinstance(heldout_size, int) or heldout_size < 1:
            raise ValueError(f"heldout_size must be a positive integer, got {heldout_size!r}")
        return cls(tuple(sorted((op, float(w)) for op, w in mix.items() if w > 0)),
                   tuple(sorted((op, a, b) for op, (a, b) in table.items())), seed, heldout_size)

    def draw(self, rng: random.Random) -> ArithProblem:
        ops, weights = zip(*self.mix)
        op = rng.choices(ops, weights)[0]
        (alo, ahi), (blo, bhi) = next((a, b) for o, a, b in self.digits if o == op)
        a = rng.randint(10 ** (alo - 1), 10 ** ahi - 1)
        b = rng.randint(max(2, 10 ** (blo - 1)) if op == "%" else 10 ** (blo - 1), 10 ** bhi - 1)
        if op == "-" and b > a:
            a, b = b, a
        return ArithProblem(a, op, b)


class ArithToolEnv(PythonToolEnv):
    """Generated arithmetic with the Python tool (see the module docstring).

    Args:
        mix: operation -> share (``*``, ``+``, ``-``, ``%``); default :data:`DEFAULT_MIX`.
        digits: operation -> ``[[a_min, a_max], [b_min, b_max]]`` operand digit counts (default
            :data:`OPERAND_DIGITS`). problem_seed, heldout_size: the splits.
        max_turns: policy turns per episode (default 3). Everything else is
        :class:`~flashreinforce.envs.python_tool.PythonToolEnv`'s (``sandbox_options``,
        ``tool_latency``, ``system_prompt``, ...).
    """

    default_max_turns = 3

    def __init__(self, tasks=None, *, mix: Mapping[str, float] | None = None, digits: Mapping[str, Any] | None = None,
                 problem_seed: int = 0, heldout_size: int = 256, system_prompt: str | None = TOOL_SYSTEM_PROMPT,
                 demonstration: Sequence[Mapping[str, str]] | None = DEMONSTRATION, max_turns: int | None = None,
                 apply_chat_template=None, **kwargs: Any) -> None:
        # max_turns and apply_chat_template are named so that the trainer sees this environment takes
        # them (the turn limit it sets, and the chat template: prompts are rendered here, with the system turn).
        kwargs.setdefault("integer_answers", True)  # every answer is an integer; a boxed expression is not one
        kwargs.setdefault("observation_template", "<output>\n{observation}\n</output>")  # as the demonstration
        super().__init__(tasks, system_prompt=system_prompt, max_turns=max_turns,
                         apply_chat_template=apply_chat_template, **kwargs)
        self.spec = ToolArithSpec.build(mix, digits, seed=problem_seed, heldout_size=heldout_size)
        self.demonstration = tuple(dict(m) for m in (demonstration or ()))
        if any(set(m) != {"role", "content"} or m["role"] not in ("user", "assistant") for m in self.demonstration):
            raise ValueError("demonstration must be a list of {'role': 'user' | 'assistant', 'content': str} messages")
        self._split = "dataset"
        self._operation = ""

    def start(self, task: Task) -> str:
        """The conversation: the system prompt (added by the tool environment), the demonstration, the problem."""
        question = ({"role": "user", "content": task.prompt},) if isinstance(task.prompt, str) else tuple(task.prompt)
        if question and question[0]["role"] == "system":  # a dataset row with its own system message keeps it first
            question, system = question[1:], question[:1]
        else:
            system = ()
        prompt = system + self.demonstration + question
        return super().start(Task(prompt, task.ground_truth, task.datasource, task.index, task.extra))

    def reset(self, *, seed: int) -> str:
        if self._next_task is None and self.tasks is None:  # generated: the problem of this seed
            problem, self._split = problem_for_seed(self.spec, seed)
            self._operation = problem.op
            question = QUESTIONS[problem.op].format(a=problem.a, b=problem.b)
            self.set_task(Task(prompt=question, ground_truth=str(problem.answer), index=seed))
        else:
            self._split, self._operation = "dataset", ""
        return super().reset(seed=seed)

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        if result.done:
            result.info.update(split=self._split, operation=self._operation)
        return result
