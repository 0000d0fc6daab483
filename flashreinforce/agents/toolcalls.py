"""Tool calls in the model's text: parsers registered by name, and the Hermes rendering of tools.

A parser turns a sampled response into ``(content, tool_calls)`` in the OpenAI wire format
(``tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``).
A response whose tool-call markup is there but malformed (JSON that does not parse, ``NaN`` or
``Infinity`` anywhere in it, no ``name``, arguments that are not an object, an unclosed block) comes back whole as plain ``content`` with no
``tool_calls``, and the parse says so (``malformed``), so the server counts it; a parser never
raises on model output.

``hermes`` (the default; Qwen2.5 and Qwen3 use the same markup)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 48"}}
    </tool_call>

For a chat template without tool syntax (SmolLM2's), :func:`hermes_tools_system` is the system
text that declares the tools, :func:`hermes_call_text` the text an assistant message's
``tool_calls`` are written back as, and :func:`hermes_tool_response` the wrapping of a tool result.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ["PARSERS", "ToolParse", "get_parser", "hermes_call_text", "hermes_tool_response", "hermes_tools_system",
           "new_call_id", "parse_hermes", "register_parser"]


@dataclass
class ToolParse:
    """What a parser found: ``content`` (text outside the calls, ``None`` when empty and calls were
    found), ``tool_calls`` (wire format) and ``malformed`` (markup that could not be read: then
    ``content`` is the whole response and ``tool_calls`` empty)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False
    problem: str = ""


def new_call_id() -> str:
    """A tool-call id in OpenAI's form (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str) -> Any:
    """``json.loads`` refusing ``NaN``, ``Infinity`` and ``-Infinity`` (Python's reader takes them; JSON does
    not, and a tool would get them as numbers)."""
    return json.loads(text, parse_constant=_not_json)


def _call_from_json(text: str) -> tuple[dict[str, Any] | None, str]:
    try:
        obj = _strict_json(text)
    except (ValueError, RecursionError) as err:  # json.JSONDecodeError is a ValueError
        return None, f"the tool call is not valid JSON ({err})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, "the tool call is not a JSON object with a string 'name'"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments given as JSON text: it must hold an object
        try:
            args = _strict_json(args)
        except (ValueError, RecursionError):
            return None, "the tool call's 'arguments' string is not JSON"
    if not isinstance(args, dict):
        return None, "the tool call's 'arguments' is not a JSON object"
    try:
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # deeper than the writer goes
        return None, "the tool call's 'arguments' cannot be written back as JSON"
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}, ""


def parse_hermes(text: str) -> ToolParse:
    """``<tool_call>{json}</tool_call>`` blocks anywhere in ``text`` (see the module docstring)."""
    if "<tool_call>" not in text:
        return ToolParse(text)
    calls, rest, last = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        call, problem = _call_from_json(match.group(1).strip())
        if call is None:
            return ToolParse(text, malformed=True, problem=problem)
        calls.append(call)
        rest.append(text[last:match.start()])
        last = match.end()
    tail = text[last:]
    if "<tool_call>" in tail:
        return ToolParse(text, malformed=True, problem="a <tool_call> block is not closed")
    content = ("".join(rest) + tail).strip()
    return ToolParse(content or None, calls)


#: Tool-call parsers by name (``env.kwargs`` ``tool_parser``): ``parse(text) -> ToolParse``.
PARSERS: dict[str, Callable[[str], ToolParse]] = {"hermes": parse_hermes, "qwen": parse_hermes}


def register_parser(name: str, parse: Callable[[str], ToolParse]) -> None:
    """Make ``parse`` available as the tool parser ``name``."""
    if not callable(parse):
        raise TypeError(f"register_parser({name!r}): the parser must be callable")
    PARSERS[name] = parse


def get_parser(name: str) -> Callable[[str], ToolParse]:
    """The parser registered as ``name`` (``ValueError`` listing the known ones)."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


def hermes_tools_system(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text declaring ``tools`` (the OpenAI ``tools`` list) in the Hermes / Qwen2.5 form."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def hermes_call_text(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """The text of an assistant message's ``tool_calls``, one ``<tool_call>`` block each."""
    blocks = []
    for call in tool_calls:
        fn = call.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # written back as given
        blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                      + "\n</tool_call>")
    return "\n".join(blocks)


def hermes_tool_response(content: str) -> str:
    """A tool result as the Hermes form passes it back (inside a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"
