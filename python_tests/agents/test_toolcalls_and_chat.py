"""Tool-call parsing, request checks and the token-exact conversation splicing, without a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashreinforce.agents.chat import ChatRenderer, Conversations
from flashreinforce.agents.protocol import APIError, chat_request, completion_request
from flashreinforce.agents.toolcalls import get_parser, parse_hermes, register_parser

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def test_hermes_parses_calls_and_keeps_the_content_around_them():
    p = parse_hermes('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
                     '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>')
    assert not p.malformed and p.content == "Let me compute."
    assert [c["function"]["name"] for c in p.tool_calls] == ["calc", "calc"]
    assert [json.loads(c["function"]["arguments"]) for c in p.tool_calls] == [{"expression": "2*3"}, {"expression": "4"}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in p.tool_calls)
    only = parse_hermes('<tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    assert only.content is None and len(only.tool_calls) == 1
    assert parse_hermes("no call here").tool_calls == [] and parse_hermes("no call here").content == "no call here"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "calc", "arguments": {</tool_call>',          # JSON that does not parse
    '<tool_call>{"arguments": {}}</tool_call>',                        # no name
    '<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>',    # arguments not an object
    'ok <tool_call>{"name": "calc", "arguments": {}}',                 # not closed
    '<tool_call>' + "[" * 100000 + '</tool_call>',                     # deeply nested: no RecursionError escapes
    '<tool_call>{"name": "calc", "arguments": {"x": NaN}}</tool_call>',              # NaN: not JSON
    '<tool_call>{"name": "calc", "arguments": "{\\"x\\": -Infinity}"}</tool_call>',  # in the arguments' text
    '<tool_call>{"name": "calc", "arguments": {"x": [Infinity]}}</tool_call>',       # nested
    '<tool_call>{"name": "calc", "arguments": {"x": 1e999}}</tool_call>',            # a number no float holds
])
def test_malformed_calls_come_back_whole_as_content(text):
    p = parse_hermes(text)
    assert p.malformed and p.tool_calls == [] and p.content == text and p.problem


def test_parser_registry_by_name():
    assert get_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: .*hermes"):
        get_parser("nope")
    register_parser("test_upper", lambda text: parse_hermes(text.upper()))
    assert get_parser("test_upper")("x").content == "X"


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "n": 2}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": "yes"}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "stream_options": {}}, "stream_options"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "return_token_ids": 1}, "return_token_ids"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "q"}]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 3}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "top_p": 0}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "stop": ["a"] * 5}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "q"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
])
def test_chat_requests_are_checked_field_by_field(body, param):
    with pytest.raises(APIError) as info:
        chat_request(body)
    assert info.value.status == 400 and info.value.param == param


def test_chat_and_completion_requests_read_the_sampling_fields():
    req = chat_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}],
                        "tools": TOOLS, "temperature": 0.5, "top_p": 0.9, "max_tokens": 7,
                        "max_completion_tokens": 5, "stop": "END", "logprobs": True})
    assert (req.temperature, req.top_p, req.max_tokens, req.stop, req.logprobs, req.parse_tools) == \
        (0.5, 0.9, 5, ["END"], True, True)
    assert not chat_request({"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": TOOLS,
                             "tool_choice": "none"}).parse_tools
    assert completion_request({"model": "m", "prompt": [5, 6, 7]}).prompt_ids == [5, 6, 7]
    assert completion_request({"model": "m", "prompt": ["text"]}).prompt_text == "text"
    streamed = chat_request({"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True,
                             "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert (streamed.stream, streamed.include_usage, streamed.return_token_ids) == (True, True, True)
    with pytest.raises(APIError, match="chat completions only"):
        completion_request({"model": "m", "prompt": "q", "stream": True})


def test_a_streamed_chat_answer_is_the_whole_message_in_openai_chunks():
    from flashreinforce.agents.protocol import chat_response, chat_stream_events, with_token_ids

    calls = [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]
    body = with_token_ids(chat_response("m", "hi", calls, "tool_calls", 4, 2, None), [1, 2, 3, 4], [7, 8])
    events = chat_stream_events(body, include_usage=True)
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n" and all(e.endswith("\n\n") for e in events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hi",
                                                "tool_calls": [{"index": 0, **calls[0]}]}
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3, 4] and chunks[0]["choices"][0]["token_ids"] == [7, 8]
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 2
    assert len(chat_stream_events(body, include_usage=False)) == 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny GGUF's byte-level BPE tokenizer with its ChatML template (no tool syntax)."""
    pytest.importorskip("gguf")
    from flashreinforce.models.tokenizers import load_tokenizer
    from python_tests.models.gguf_tiny import write_tiny_gguf

    path = Path(tmp_path_factory.mktemp("gguf")) / "tiny.gguf"
    write_tiny_gguf(path)
    return load_tokenizer(str(path))


def test_template_without_tools_gets_the_hermes_forms(tokenizer):
    r = ChatRenderer(tokenizer.tok, tokenizer.eos_token_ids)
    assert not r.native_tools
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2*3"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "6"}, {"role": "tool", "tool_call_id": "c2", "content": "7"}]
    text = r.render(msgs, TOOLS, True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "calc"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>' \
        '<|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_continuation_keeps_the_sampled_ids_and_counts_a_mismatched_rendering(tokenizer):
    tok = tokenizer.tok
    r = ChatRenderer(tok, tokenizer.eos_token_ids)
    eos = tokenizer.eos_token_ids[0]
    convs = Conversations(r)
    first = [{"role": "user", "content": "say hello"}]
    p1 = convs.prompt_for_chat(first, None)
    assert p1.conversation is None and not p1.rewrite and p1.ids == r.encode(r.render(first, None, True))
    # "hello" sampled one byte at a time: not the tokenizer's own ("he" + "ll" merge to "hell").
    sampled = [tok.convert_tokens_to_ids(c) for c in "hello"] + [eos]
    assert r.encode("hello") != sampled[:-1]
    convs.answered(p1, sampled, {"role": "assistant", "content": "hello"}, "hello", True)
    second = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    p2 = convs.prompt_for_chat(second, None)
    assert p2.conversation is not None and p2.ids[:len(p1.ids) + len(sampled)] == p1.ids + sampled
    assert tok.decode(p2.ids) == r.render(second, None, True)  # the same text, other token ids
    assert p2.mismatch and not p2.rewrite
    assert p2.ids == p1.ids + sampled + p2.context
    # A turn cut at the length limit (no stop token) is closed with one before the next turn.
    convs2 = Conversations(r)
    q1 = convs2.prompt_for_chat(first, None)
    convs2.answered(q1, r.encode("hello"), {"role": "assistant", "content": "hello"}, "hello", False)
    q2 = convs2.prompt_for_chat(second, None)
    assert q2.context[0] == eos and not q2.mismatch and q2.ids == r.encode(r.render(second, None, True))


def test_edited_history_starts_a_new_conversation(tokenizer):
    r = ChatRenderer(tokenizer.tok, tokenizer.eos_token_ids)
    convs = Conversations(r)
    first = [{"role": "user", "content": "q"}]
    p1 = convs.prompt_for_chat(first, None)
    convs.answered(p1, r.encode("a") + [tokenizer.eos_token_ids[0]], {"role": "assistant", "content": "a"}, "a", True)
    edited = first + [{"role": "assistant", "content": "a (edited)"}, {"role": "user", "content": "more"}]
    p2 = convs.prompt_for_chat(edited, None)
    assert p2.conversation is None and p2.rewrite
    other_tools = first + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    assert convs.prompt_for_chat(other_tools, TOOLS).rewrite  # other tools: another rendering, a new conversation
    assert not convs.prompt_for_chat(other_tools, None).rewrite
