"""A chat template that renders ``tools=`` and tool turns as the agent endpoint does, for exports.

The endpoint (:class:`flashreinforce.agents.chat.ChatRenderer`) renders tools itself when the model's
chat template has no tool syntax (SmolLM2's): the Hermes ``# Tools ... <tools>`` block in the system
message, an assistant message's ``tool_calls`` as ``<tool_call>`` blocks after its content, ``tool``
messages as one user turn of ``<tool_response>`` blocks. A model trained that way and exported with
its own template would lose all of it outside the project: ``apply_chat_template(messages,
tools=TOOLS)`` would drop the tools silently.

:func:`tool_chat_template` writes a template that does the same rewriting of ``messages`` in Jinja
and then runs the model's own template over the result, so that a trained agent's export renders
exactly the token ids it was trained on. Tool-call ``arguments`` given as a dict (the ``transformers``
convention, and what the endpoint passes) are written as ``json.dumps`` writes them; a JSON string
(the OpenAI wire format) is written as given, which is the same text when it came from the endpoint
(whose answers hold ``json.dumps``'s form).
"""

from __future__ import annotations

import json

from flashreinforce.agents.toolcalls import hermes_tool_response, hermes_tools_system

__all__ = ["has_tool_syntax", "tool_chat_template"]

#: Marks a template this module wrote (so that it is not wrapped twice).
MARKER = "{#- flashreinforce: Hermes tool rendering of the agent endpoint -#}"

# Jinja run before the model's template. Whitespace control (`{%-`, `-%}`) keeps it from writing
# anything; `ns.msgs` is the rewritten conversation, then bound to `messages`.
_TEMPLATE = MARKER + r"""
{%- set ns = namespace(msgs=[], tool_turn=false) -%}
{%- for m in messages -%}
  {%- set role = 'system' if m['role'] == 'developer' else m['role'] -%}
  {%- if m['content'] is none or m['content'] is not defined -%}
    {%- set text = '' -%}
  {%- elif m['content'] is string -%}
    {%- set text = m['content'] -%}
  {%- else -%}
    {%- set text = m['content'] | map(attribute='text') | join('') -%}
  {%- endif -%}
  {%- if role == 'tool' -%}
    {%- set wrapped = @RESPONSE_HEAD@ + text + @RESPONSE_TAIL@ -%}
    {%- if ns.tool_turn -%}
      {%- set ns.msgs = ns.msgs[:-1] + [{'role': 'user', 'content': ns.msgs[-1]['content'] + '\n' + wrapped}] -%}
    {%- else -%}
      {%- set ns.msgs = ns.msgs + [{'role': 'user', 'content': wrapped}] -%}
    {%- endif -%}
    {%- set ns.tool_turn = true -%}
  {%- else -%}
    {%- if m['tool_calls'] is defined and m['tool_calls'] -%}
      {%- set calls = namespace(text='') -%}
      {%- for c in m['tool_calls'] -%}
        {%- set fn = c['function'] if c['function'] is defined else c -%}
        {%- set args = fn['arguments'] if fn['arguments'] is defined else {} -%}
        {%- set args = args if args is string else (args | tojson) -%}
        {%- set block = '<tool_call>\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' + args + '}\n</tool_call>' -%}
        {%- set calls.text = calls.text + ('\n' if calls.text else '') + block -%}
      {%- endfor -%}
      {%- set text = (text + '\n' if text else '') + calls.text -%}
    {%- endif -%}
    {%- set ns.msgs = ns.msgs + [{'role': role, 'content': text}] -%}
    {%- set ns.tool_turn = false -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools is defined and tools -%}
  {%- set lines = namespace(text='') -%}
  {%- for t in tools -%}
    {%- set lines.text = lines.text + ('\n' if lines.text else '') + (t | tojson) -%}
  {%- endfor -%}
  {%- set block = @TOOLS_HEAD@ + lines.text + @TOOLS_TAIL@ -%}
  {%- if ns.msgs and ns.msgs[0]['role'] == 'system' -%}
    {%- set ns.msgs = [{'role': 'system', 'content': ns.msgs[0]['content'] + '\n\n' + block}] + ns.msgs[1:] -%}
  {%- else -%}
    {%- set ns.msgs = [{'role': 'system', 'content': block}] + ns.msgs -%}
  {%- endif -%}
{%- endif -%}
{%- set messages = ns.msgs -%}
"""


def _literal(text: str) -> str:
    """``text`` as a Jinja string literal (JSON's escapes are Jinja's)."""
    return json.dumps(text, ensure_ascii=False)


def _split(text: str, marker: str) -> tuple[str, str]:
    head, tail = text.split(marker)
    return head, tail


# The endpoint's own texts (toolcalls.py), split where the variable part goes.
_MARK = "\x00FLASHREINFORCE\x00"
_TOOLS = _split(hermes_tools_system([_MARK]), json.dumps(_MARK, ensure_ascii=False))
_RESPONSE = _split(hermes_tool_response(_MARK), _MARK)
_PREFIX = (_TEMPLATE.replace("@TOOLS_HEAD@", _literal(_TOOLS[0])).replace("@TOOLS_TAIL@", _literal(_TOOLS[1]))
           .replace("@RESPONSE_HEAD@", _literal(_RESPONSE[0])).replace("@RESPONSE_TAIL@", _literal(_RESPONSE[1])))


def has_tool_syntax(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (the endpoint then passes them to it)."""
    return bool(template) and "tools" in template


def tool_chat_template(template: str) -> str:
    """``template`` (a model's chat template without tool syntax) preceded by the endpoint's Hermes
    rewriting of ``messages`` and ``tools`` (see the module docstring). A template with tool syntax
    of its own is returned as it is: the endpoint passed the tools to it unchanged."""
    if MARKER in template or has_tool_syntax(template):
        return template
    return _PREFIX + template
