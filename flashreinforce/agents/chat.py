"""Chat messages to the exact token ids the policy continues, and an episode's conversations.

:class:`ChatRenderer` renders OpenAI ``messages`` and ``tools`` with the model's chat template
(``tokenizer.apply_chat_template``). A template that takes ``tools`` renders them itself; for one
without tool syntax (SmolLM2's) the Hermes form is used (:mod:`.toolcalls`): the tools are declared
in the system message (appended to the first system message, or as a system message of their own),
an assistant message's ``tool_calls`` are written after its content as ``<tool_call>`` blocks, and
``tool`` messages become a user turn of ``<tool_response>`` blocks (consecutive ones together).

:class:`Conversations` keeps the token history of one episode. A call whose messages are those of an
earlier call, then the assistant message the server answered it with (compared by role, content and
tool calls, not by tool-call ids), then more messages, *continues* that conversation: its prompt is
the earlier context token for token (the earlier prompt and the sampled ids, never re-tokenized),
the end-of-turn token when the sampled turn did not end with one, then the template's rendering of
what follows the assistant turn. Any other call starts a new conversation from the template's
rendering of its messages (a *history rewrite* when the episode already had one). When the template,
rendering the whole conversation again, gives other ids than the exact history (a tool call written
back with other JSON spacing, a stop string cut from the content), the call is counted as a
*mismatched rendering*: the policy is still given, and trained on, the exact history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from flashreinforce.agents.toolcalls import hermes_call_text, hermes_tool_response, hermes_tools_system

__all__ = ["ChatRenderer", "Conversation", "Conversations", "Prompt", "canonical_message", "message_text"]


def message_text(content: Any) -> str:
    """A message's ``content`` as text: a string, ``None`` (""), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return "".join(parts)
    raise ValueError(f"message content must be a string, null or a list of text parts, got {type(content).__name__}")


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def canonical_message(message: Mapping[str, Any]) -> tuple:
    """What identifies a message when conversations are matched: role, text, tool calls (name and
    parsed arguments), ``tool_call_id`` and ``name``."""
    calls = tuple((str((c.get("function") or {}).get("name")),
                   json.dumps(_arguments((c.get("function") or {}).get("arguments")), sort_keys=True))
                  for c in (message.get("tool_calls") or ()))
    return (message.get("role"), message_text(message.get("content")), calls, message.get("tool_call_id"),
            message.get("name"))


class ChatRenderer:
    """Renders messages with a Hugging Face tokenizer's chat template (see the module docstring).

    ``stop_token_ids``: the tokens that end an assistant turn (the run's stop tokens).
    """

    def __init__(self, tokenizer, stop_token_ids: Sequence[int]) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the tokenizer has no chat template: /v1/chat/completions cannot render messages "
                             "(use /v1/completions, or a tokenizer with a chat template)")
        self.tok = tokenizer
        self.native_tools = "tools" in template
        self.native_tool_calls = "tool_calls" in template
        self.stop_texts = {}
        for i in stop_token_ids:
            text = tokenizer.convert_ids_to_tokens(int(i))
            if isinstance(text, str) and text:
                self.stop_texts[text] = int(i)

    # ------------------------------------------------------------------ rendering
    def template_messages(self, messages: Sequence[Mapping[str, Any]],
                          tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
        """``messages`` as the template takes them (text content; Hermes forms where the template has none)."""
        out: list[dict[str, Any]] = []
        for m in messages:
            role = m.get("role")
            text = message_text(m.get("content"))
            if role == "developer":
                role = "system"
            calls = list(m.get("tool_calls") or ())
            if role == "tool" and not self.native_tools:
                wrapped = hermes_tool_response(text)
                if out and out[-1].get("_tool_turn"):
                    out[-1]["content"] += "\n" + wrapped
                else:
                    out.append({"role": "user", "content": wrapped, "_tool_turn": True})
                continue
            msg: dict[str, Any] = {"role": role, "content": text}
            if calls and self.native_tool_calls:
                msg["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                      "function": {"name": (c.get("function") or {}).get("name"),
                                                   "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
                                     for c in calls]
            elif calls:
                msg["content"] = (text + "\n" if text else "") + hermes_call_text(calls)
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None and self.native_tools:
                    msg[key] = m[key]
            out.append(msg)
        for m in out:
            m.pop("_tool_turn", None)
        if tools and not self.native_tools:
            block = hermes_tools_system(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
               generation_prompt: bool) -> str:
        kwargs = {"tools": list(tools)} if tools and self.native_tools else {}
        return self.tok.apply_chat_template(self.template_messages(messages, tools), tokenize=False,
                                            add_generation_prompt=generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def end_of_turn(self, turn_text: str) -> tuple[int, str] | None:
        """``(stop token id, the text after it)`` of a rendered assistant turn: where its last stop
        token's text ends (``None``: the template ends turns without a stop token)."""
        best = None
        for text, token in self.stop_texts.items():
            pos = turn_text.rfind(text)
            if pos >= 0 and (best is None or pos > best[0]):
                best = (pos, token, turn_text[pos + len(text):])
        return None if best is None else (best[1], best[2])


@dataclass
class Conversation:
    """One token history of an episode: the messages (canonical, the last answer included), the tools,
    the rendered text of the last prompt, and ``ids`` (that prompt and the ids sampled for it)."""

    messages: list[tuple]
    tools_key: str
    prompt_text: str
    ids: list[int]
    ended_with_stop: bool
    index: int


@dataclass
class Prompt:
    """A call's prompt: ``ids``; ``conversation`` it continues (``None``: a new one), ``context`` the
    ids added after that conversation's history (all of ``ids`` for a new one); ``rewrite`` (a new
    conversation in an episode that had one), ``mismatch`` (the template's own rendering differs)
    and ``problem`` (why a continuation could not be spliced, when it could not)."""

    ids: list[int]
    conversation: Conversation | None
    context: list[int]
    text: str
    tools_key: str
    messages: list[tuple]
    rewrite: bool = False
    mismatch: bool = False
    problem: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Conversations:
    """The conversations of one episode (see the module docstring)."""

    def __init__(self, renderer: ChatRenderer | None) -> None:
        self.renderer = renderer
        self.items: list[Conversation] = []

    def prompt_for_chat(self, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None) -> Prompt:
        r = self.renderer
        if r is None:
            raise ValueError("the tokenizer has no chat template")
        canon = [canonical_message(m) for m in messages]
        tools_key = json.dumps(list(tools or ()), sort_keys=True)
        full_text = r.render(messages, tools, True)
        full_ids = r.encode(full_text)
        for conv in reversed(self.items):
            k = len(conv.messages)
            if conv.tools_key != tools_key or len(canon) <= k or canon[:k] != conv.messages or conv.prompt_text is None:
                continue
            before = r.render(messages[:k], tools, False)
            problem = ""
            if not before.startswith(conv.prompt_text) or not full_text.startswith(before):
                problem = "the chat template does not render the conversation as a growing prefix"
            else:
                end = r.end_of_turn(before[len(conv.prompt_text):])
                if end is None:
                    problem = "the chat template ends the assistant turn without a stop token"
            if problem:  # the template's rendering from scratch, as a conversation of its own
                return Prompt(full_ids, None, full_ids, full_text, tools_key, canon, rewrite=False, mismatch=True,
                              problem=problem)
            stop_id, after = end
            context = ([] if conv.ended_with_stop else [stop_id]) + r.encode(after + full_text[len(before):])
            ids = conv.ids + context
            return Prompt(ids, conv, context, full_text, tools_key, canon, mismatch=ids != full_ids)
        return Prompt(full_ids, None, full_ids, full_text, tools_key, canon, rewrite=bool(self.items))

    def prompt_for_text(self, text: str | None, ids: Sequence[int] | None, encode) -> Prompt:
        """A ``/v1/completions`` prompt: given as ``ids`` (continuing the conversation whose history it
        starts with) or as ``text`` (continuing the one whose text, answer included, it starts with)."""
        if ids is not None:
            ids = [int(i) for i in ids]
            for conv in reversed(self.items):
                if conv.tools_key == "<ids>" and len(ids) > len(conv.ids) and ids[:len(conv.ids)] == conv.ids:
                    return Prompt(ids, conv, ids[len(conv.ids):], "", "<ids>", [])
            return Prompt(ids, None, ids, "", "<ids>", [], rewrite=bool(self.items))
        full_ids = encode(text)
        for conv in reversed(self.items):
            if conv.tools_key == "<text>" and len(text) > len(conv.prompt_text) and text.startswith(conv.prompt_text):
                context = encode(text[len(conv.prompt_text):])
                return Prompt(conv.ids + context, conv, context, text, "<text>", [],
                              mismatch=conv.ids + context != full_ids)
        return Prompt(full_ids, None, full_ids, text, "<text>", [], rewrite=bool(self.items))

    def answered(self, prompt: Prompt, sampled: Sequence[int], answer_message: Mapping[str, Any] | None,
                 answer_text: str, ended_with_stop: bool) -> Conversation:
        """Record the answer to ``prompt``: its conversation now ends with the sampled ids."""
        ids = list(prompt.ids) + [int(t) for t in sampled]
        if prompt.tools_key in ("<ids>", "<text>"):
            messages, text = [], (prompt.text + answer_text if prompt.tools_key == "<text>" else "")
        else:
            messages, text = prompt.messages + [canonical_message(answer_message or {})], prompt.text
        conv = prompt.conversation
        if conv is None:
            conv = Conversation(messages, prompt.tools_key, text, ids, ended_with_stop, len(self.items))
            self.items.append(conv)
        else:
            conv.messages, conv.prompt_text, conv.ids, conv.ended_with_stop = messages, text, ids, ended_with_stop
        return conv
