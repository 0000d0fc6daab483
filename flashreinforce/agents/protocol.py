"""The OpenAI wire format: request checks, responses and errors, as the ``openai`` package parses them.

:func:`chat_request` and :func:`completion_request` check a request body and return a
:class:`CallRequest` (an :class:`APIError` naming the bad field otherwise); :func:`chat_response`,
:func:`completion_response` and :func:`error_body` build the JSON answers. Sampling fields: the
run's settings apply where a request leaves them out; ``n`` must be 1; ``top_logprobs`` above 0 and
non-zero penalties are refused (400) rather than ignored; ``seed`` and ``user`` are ignored (the
run's seeds decide the sampling noise). ``stream`` is served on chat completions: the whole answer,
once sampled, as OpenAI's ``chat.completion.chunk`` events (:func:`chat_stream_events`); completions
refuse it. ``return_token_ids`` (vLLM's field) adds the prompt's and the answer's token ids to the
response (``prompt_token_ids``, ``choices[0].token_ids``).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from flashreinforce.agents.chat import message_text

__all__ = ["APIError", "CallRequest", "chat_request", "chat_response", "chat_stream_events", "completion_request",
           "completion_response", "error_body", "models_body", "with_token_ids"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An answer in OpenAI's error format: HTTP ``status``, ``message``, ``type``, ``param``, ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(err: APIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


@dataclass
class CallRequest:
    """A checked request: ``kind`` (``chat`` / ``completion``), the model name, the messages and tools
    (chat) or the prompt text or ids (completion), and the sampling fields (``None``: the run's)."""

    kind: str
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value > hi or value < lo or (lo_open and value <= lo):
        interval = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise _bad(f"{name} must be a number in {interval}, got {value!r}", name)
    return float(value)


def _common(body: Any, kind: str) -> CallRequest:
    if not isinstance(body, Mapping):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required (any name: the endpoint serves the run's policy)", "model")
    stream = body.get("stream")
    if stream not in (None, False) and not (stream is True and kind == "chat"):
        raise _bad("stream is served on chat completions only (the whole answer as chunks); leave it false", "stream")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise _bad(f"n must be 1 (one completion per call; call again for more), got {n!r}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _bad(f"{name} is not supported (the policy's own distribution is trained); leave it 0", name)
    req = CallRequest(kind, model)
    req.stream = stream is True
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, Mapping) and req.stream):
        raise _bad("stream_options is an object, and only with stream true", "stream_options")
    req.include_usage = bool((options or {}).get("include_usage"))
    token_ids = body.get("return_token_ids")
    if token_ids is not None and not isinstance(token_ids, bool):
        raise _bad("return_token_ids must be a boolean", "return_token_ids")
    req.return_token_ids = bool(token_ids)
    req.temperature = _number(body, "temperature", 0.0, 2.0)
    req.top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(f"{name} must be a positive integer, got {value!r}", name)
        req.max_tokens = value if req.max_tokens is None else min(req.max_tokens, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= 4 and
                                 all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop must be a non-empty string or a list of at most 4 of them", "stop")
    req.stop = list(stop or [])
    return req


def chat_request(body: Any) -> CallRequest:
    """A checked ``/v1/chat/completions`` body."""
    req = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise _bad(f"messages[{k}] must be an object with a role among {', '.join(ROLES)}", f"messages[{k}]")
        try:
            message_text(m.get("content"))
        except ValueError as err:
            raise _bad(f"messages[{k}].content: {err}", f"messages[{k}].content") from None
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise _bad(f"messages[{k}].tool_calls must be a list of {{'function': {{'name', 'arguments'}}}}",
                       f"messages[{k}].tool_calls")
    req.messages = [dict(m) for m in messages]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, Mapping) and t.get("type", "function") == "function" and isinstance(t.get("function"), Mapping)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise _bad("tools must be a list of {'type': 'function', 'function': {'name', 'description', "
                       "'parameters'}}", "tools")
        req.tools = [dict(t) for t in tools] or None
    choice = body.get("tool_choice")
    req.parse_tools = bool(req.tools) and choice != "none"
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs must be a boolean", "logprobs")
    req.logprobs = bool(logprobs)
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise _bad("top_logprobs is not supported (only the sampled token's log-probability); leave it 0",
                   "top_logprobs")
    return req


def completion_request(body: Any) -> CallRequest:
    """A checked ``/v1/completions`` body: ``prompt`` as text, a one-element list of text, or token ids."""
    req = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in prompt):
        req.prompt_ids = list(prompt)
    else:
        raise _bad("prompt must be a non-empty string or a non-empty list of token ids (one prompt per call)",
                   "prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise _bad("logprobs must be 0 or 1 (the sampled token's log-probability only)", "logprobs")
    req.logprobs = bool(logprobs)
    if body.get("echo"):
        raise _bad("echo is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of must be 1", "best_of")
    return req


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(model: str, content: str | None, tool_calls: Sequence[Mapping[str, Any]], finish_reason: str,
                  prompt_tokens: int, completion_tokens: int,
                  logprobs: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [dict(c) for c in tool_calls]
    return {"id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": list(logprobs), "refusal": None}}],
            "usage": _usage(prompt_tokens, completion_tokens)}


def completion_response(model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                        logprobs: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    lp = None
    if logprobs is not None:
        offsets, at = [], 0
        for item in logprobs:
            offsets.append(at)
            at += len(item["token"])
        lp = {"tokens": [i["token"] for i in logprobs], "token_logprobs": [i["logprob"] for i in logprobs],
              "top_logprobs": None, "text_offset": offsets}
    return {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": lp}],
            "usage": _usage(prompt_tokens, completion_tokens)}


def with_token_ids(body: dict[str, Any], prompt_ids: Sequence[int], token_ids: Sequence[int]) -> dict[str, Any]:
    """``body`` (a chat or completion response) with the prompt's and the answer's token ids, where vLLM puts
    them: ``prompt_token_ids`` at the top of a chat completion and in the choice of a completion,
    ``token_ids`` in the choice."""
    choice = body["choices"][0]
    choice["token_ids"] = [int(t) for t in token_ids]
    (body if body["object"] == "chat.completion" else choice)["prompt_token_ids"] = [int(t) for t in prompt_ids]
    return body


def chat_stream_events(body: Mapping[str, Any], include_usage: bool) -> list[str]:
    """A chat completion ``body`` as the server-sent events of a streamed one: a chunk with the whole
    message (role, content, tool calls, log-probabilities, token ids), one with the finish reason,
    the usage when asked (``stream_options.include_usage``), then ``[DONE]``."""
    choice = body["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    head = {k: body[k] for k in ("id", "created", "model")}
    first: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
    if "token_ids" in choice:
        first["token_ids"] = choice["token_ids"]
    chunks = [{**head, "object": "chat.completion.chunk", "choices": [first]},
              {**head, "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}]
    if "prompt_token_ids" in body:
        chunks[0]["prompt_token_ids"] = body["prompt_token_ids"]
    if include_usage:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": body["usage"]})
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def models_body(name: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "flashreinforce"}]}
