"""``flashreinforce serve``: the OpenAI client against the served endpoint; prompts rendered to the ids the
training endpoint gives, tool calls parsed as in training, the usual refusals, and the command itself."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("gguf")

from flashreinforce.agents.chat import ChatRenderer  # noqa: E402
from flashreinforce.agents.serving import Sample, ServeEndpoint, ServeSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 37 * 48?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                          "arguments": json.dumps({"expression": "37 * 48"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "1776"},
    {"role": "user", "content": "And 12 * 12?"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from flashreinforce.models.tokenizers import load_tokenizer
    from python_tests.models.gguf_tiny import write_tiny_gguf

    path = Path(tmp_path_factory.mktemp("gguf")) / "tiny.gguf"
    write_tiny_gguf(path, seed=1)
    return load_tokenizer(str(path)), path


class Scripted:
    """A sampler that answers with given texts (then the end-of-turn token) and records what it was asked."""

    def __init__(self, tokenizer, answers):
        self.tok, self.answers, self.asked = tokenizer, list(answers), []

    def __call__(self, requests, temperature, top_p, top_k):
        out = []
        for r in requests:
            self.asked.append((r, temperature, top_p))
            ids = list(self.tok.tok(self.answers.pop(0), add_special_tokens=False)["input_ids"])
            ids += [self.tok.eos_token_ids[0]]
            out.append(Sample(ids, [-0.5] * len(ids), "stop"))
        return out


def _endpoint(tok, answers, **settings):
    tokenizer, _ = tok
    sampler = Scripted(tokenizer, answers)
    endpoint = ServeEndpoint(tokenizer.tok, tokenizer.eos_token_ids, tokenizer.decode, sampler,
                             ServeSettings(**{"max_len": 4096, "temperature": 0.7, **settings}), port=0)
    endpoint.start()
    return endpoint, sampler, openai.OpenAI(base_url=endpoint.url, api_key=endpoint.api_key, max_retries=0)


def test_a_chat_call_is_rendered_as_in_training_and_its_tool_calls_parsed(tok):
    tokenizer, _ = tok
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 12"}}\n</tool_call>'
    endpoint, sampler, client = _endpoint(tok, ["ok " + call])
    try:
        reply = client.chat.completions.create(model="anything", messages=CONVERSATION, tools=TOOLS)
    finally:
        endpoint.stop()
    (request, temperature, top_p), = sampler.asked
    training = ChatRenderer(tokenizer.tok, tokenizer.eos_token_ids)
    assert request.prompt_ids == training.encode(training.render(CONVERSATION, TOOLS, True))
    assert (temperature, top_p) == (0.7, 1.0)  # the served run's defaults
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "ok"
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "calculator" and json.loads(tool_call.function.arguments) == {
        "expression": "12 * 12"}
    assert reply.usage.prompt_tokens == len(request.prompt_ids)


def test_stop_strings_logprobs_completions_and_refusals(tok):
    tokenizer, _ = tok
    endpoint, sampler, client = _endpoint(tok, ["hello world", "abc"], max_len=300)
    try:
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stop=["wor"],
                                               logprobs=True, temperature=0.2)
        assert reply.choices[0].message.content == "hello " and reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.tool_calls is None  # no tools: the text is not parsed
        assert all(lp.logprob == -0.5 for lp in reply.choices[0].logprobs.content)
        assert sampler.asked[0][1] == 0.2
        ids = tokenizer.tok("hi there", add_special_tokens=False)["input_ids"]
        text = client.completions.create(model="m", prompt=ids, max_tokens=5)
        assert text.choices[0].text == "abc" and sampler.asked[1][0].prompt_ids == list(ids)
        assert sampler.asked[1][0].max_tokens == 5
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
        with pytest.raises(openai.BadRequestError, match="leaves no room for an answer in max_len 300"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 400}])
        # the training endpoint's API-key check and limits hold here too
        stranger = openai.OpenAI(base_url=endpoint.url, api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert len(sampler.asked) == 2  # nothing sampled for it
        assert requests_get(endpoint.root_url + "/health")["status"] == "ok"
    finally:
        endpoint.stop()


def test_token_ids_and_a_streamed_answer_as_the_training_endpoint_gives_them(tok):
    tokenizer, _ = tok
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    endpoint, sampler, client = _endpoint(tok, ["four", "abc", call])
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    try:
        reply = client.chat.completions.create(model="m", messages=messages, extra_body={"return_token_ids": True})
        ids = tokenizer.tok("hi there", add_special_tokens=False)["input_ids"]
        text = client.completions.create(model="m", prompt=ids, extra_body={"return_token_ids": True})
        chunks = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                     stream_options={"include_usage": True}))
    finally:
        endpoint.stop()
    extra = reply.model_extra
    assert extra["prompt_token_ids"] == sampler.asked[0][0].prompt_ids
    answer = reply.choices[0].model_extra["token_ids"]
    assert answer[-1] == tokenizer.eos_token_ids[0] and tokenizer.decode(answer) == "four"
    choice = text.choices[0].model_extra
    assert choice["prompt_token_ids"] == list(ids) and tokenizer.decode(choice["token_ids"]) == "abc"
    # streamed: the whole answer as chunks, its tool call parsed, then the finish reason and the usage
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    (tool_call,) = [t for d in deltas for t in (d.tool_calls or [])]
    assert tool_call.function.name == "calculator" and json.loads(tool_call.function.arguments) == {
        "expression": "2 + 2"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.prompt_tokens == len(sampler.asked[2][0].prompt_ids)


def requests_get(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def test_the_serve_command_answers_the_openai_client_and_stops_on_sigterm(tok):
    _, gguf = tok
    proc = subprocess.Popen([sys.executable, "-m", "flashreinforce.cli", "serve", str(gguf), "--port", "0",
                             "--max_tokens", "3"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        found, seen, deadline = None, "", time.time() + 240
        while found is None and time.time() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
            seen += line
            found = re.search(r" at (http://127\.0\.0\.1:\d+/v1) \(API key (\S+);", line)
        assert found is not None, seen
        client = openai.OpenAI(base_url=found.group(1), api_key=found.group(2), max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hello"}])
        assert reply.usage.completion_tokens <= 3 and reply.choices[0].finish_reason in ("stop", "length")
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, seen + rest
    assert "stopped after 1 answers" in rest
