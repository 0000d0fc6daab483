r"""The ``arith_tool`` task as an agent written against the OpenAI chat API (``--preset arith_tool_agent``).

The same problems as :class:`flashreinforce.envs.arith_python_tool.ArithToolEnv` (two-digit products,
three-digit sums and differences, remainders; the row ``{"seed": SEED}`` names the problem, the
trainer's evaluation seeds play the held-out split), but the program is an ordinary agent: it
declares a ``calculator`` tool in ``tools=``, sends the conversation with
``client.chat.completions.create``, runs each ``tool_calls`` entry itself and sends the result back
as a ``tool`` message, and grades the final ``\boxed{}`` answer. At most :data:`MAX_CALLS` model
calls. Three worked episodes (a tool call, its result, the boxed answer; operands outside the task's
ranges) come before the problem as earlier messages: SmolLM2's template has no tool syntax, and with
the one example the Environment version shows, the model never wrote a tool call.

Reward 1 for the right integer in the last ``\boxed{}`` of the final answer, else 0; ``info``:
``calculator_calls``, ``calculator_errors``, ``answer_from_tool`` (the boxed number is a result the
calculator printed), ``heldout``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

from flashreinforce.envs.arith import problem_for_seed
from flashreinforce.envs.arith_python_tool import QUESTIONS, ToolArithSpec

__all__ = ["MAX_CALLS", "SYSTEM_PROMPT", "TOOLS", "agent", "calculate", "problem"]

MAX_CALLS = 3
SPEC = ToolArithSpec.build(heldout_size=256)
SYSTEM_PROMPT = ("Use the calculator tool for every calculation. After its result, give the final answer in "
                 "\\boxed{}.")
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (+, -, *, /, //, %, ** and parentheses) and return the value.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "e.g. 12 * (3 + 4)"}},
                   "required": ["expression"]}}}]


def _worked_episode(question: str, expression: str, value: str, call_id: str) -> list[dict[str, Any]]:
    """One worked episode as earlier messages: the question, a calculator call, its result, the boxed answer."""
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": value},
            {"role": "assistant", "content": f"\\boxed{{{value}}}"}]


#: Three worked episodes shown before the problem. Their operands lie outside the task's ranges (a
#: one-digit factor, four-digit operands), so no held-out or training problem appears among them. With
#: one example (the first) SmolLM2-135M-Instruct wrote a parseable call in 0 of 32 sampled replies
#: (temperature 0.7); with three, in about half (docs/results.md).
DEMONSTRATION = [
    *_worked_episode("How many seconds are in 3 hours?", "3 * 60 * 60", "10800", "call_demo1"),
    *_worked_episode("What is 7 * 125?", "7 * 125", "875", "call_demo2"),
    *_worked_episode("What is 1204 - 389?", "1204 - 389", "815", "call_demo3"),
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (integers without ``.0``), or ``error: ...``."""
    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    if not isinstance(expression, str) or len(expression) > 200:
        return "error: the expression must be a string of at most 200 characters"
    try:
        value = ev(ast.parse(expression.replace("×", "*").replace("^", "**"), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as err:
        return f"error: {err}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def problem(seed: int) -> tuple[str, int, bool]:
    """``(question, answer, held out)`` of the problem an episode seed plays."""
    p, split = problem_for_seed(SPEC, seed)
    return QUESTIONS[p.op].format(a=p.a, b=p.b), p.answer, split == "heldout"


_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


def agent(client, row: dict[str, Any]) -> dict[str, Any]:
    """One episode: ask, run the calculator calls, grade the boxed answer."""
    question, answer, heldout = problem(int(row["seed"]))
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, *DEMONSTRATION,
                                      {"role": "user", "content": question}]
    calls = errors = 0
    results: list[str] = []
    content = ""
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        content = reply.content or ""
        if not reply.tool_calls:
            break
        messages.append({"role": "assistant", "content": reply.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in reply.tool_calls]})
        for c in reply.tool_calls:
            calls += 1
            try:
                expression = json.loads(c.function.arguments).get("expression")
            except (json.JSONDecodeError, AttributeError):
                expression = None
            out = calculate(expression) if c.function.name == "calculator" else f"error: no tool {c.function.name}"
            errors += out.startswith("error")
            results.append(out)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": out})
        content = ""
    boxed = _BOXED.findall(content)
    given = int(boxed[-1]) if boxed else None
    right = given == answer
    return {"reward": float(right), "failed": not right,
            "info": {"calculator_calls": calls, "calculator_errors": errors, "heldout": heldout,
                     "answer_from_tool": given is not None and str(given) in results}}
