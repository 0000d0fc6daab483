"""A trained agent outside the project: an agent LoRA run on a tiny GGUF model, then its export with plain
``transformers`` and ``peft`` (the chat template renders ``tools=`` and tool turns to the ids the endpoint
trained on; the adapter loads by itself, offline) and ``flashreinforce serve`` over the run; the run's
summary has the evaluations before and after, and the warning that the tools were never called."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("gguf")
pytest.importorskip("peft")

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate an expression",
                                            "parameters": {"type": "object",
                                                           "properties": {"expression": {"type": "string"}}}}}]
WORKED = [{"role": "user", "content": "What is 7 * 125?"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function",
               "function": {"name": "calculator", "arguments": json.dumps({"expression": "7 * 125"})}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "875"},
          {"role": "assistant", "content": "875"}]
SEEN: list[list[dict]] = []  # the messages of every call the agent made


def calculator_agent(client, row):
    """A worked episode, the question, then the answer and a tool result sent back: two calls, one conversation."""
    messages = [{"role": "system", "content": "Use the calculator."}, *WORKED, {"role": "user", "content": row["prompt"]}]
    SEEN.append([dict(m) for m in messages])
    reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
    message = reply.choices[0].message
    messages += [{"role": "assistant", "content": message.content},
                 {"role": "tool", "tool_call_id": "call_x", "content": "12"}]
    SEEN.append([dict(m) for m in messages])
    client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
    return float("1" in (message.content or ""))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import flashreinforce as fr
    from python_tests.models.gguf_tiny import write_tiny_gguf

    root = Path(tmp_path_factory.mktemp("agent_export"))
    gguf = root / "tiny.gguf"
    write_tiny_gguf(gguf, seed=6)
    cfg = fr.load_config(None)
    cfg.train.max_steps = 2
    cfg.rollout.batch_size = 4
    cfg.rollout.max_new_tokens = 4
    cfg.rollout.temperature = 0.9
    cfg.data.max_len = 2048
    cfg.lora.rank = 4
    cfg.eval.eval_at_start = True
    cfg.eval.num_prompts = 2
    cfg.ckpt.save_steps = 0
    cfg.logger.warn_no_tool_calls_steps = 2
    rows = [{"prompt": f"What is {a} + {a}?"} for a in range(10, 20)]
    summary = fr.train(cfg, model=str(gguf), agent=calculator_agent, dataset=rows, output=str(root / "run"),
                       device="cpu", progress=False)
    assert summary["status"] == "completed"
    return root / "run", gguf


def test_the_summary_has_before_and_after_and_the_tool_warning(run):
    out, _ = run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start_eval"]["step"] == 0 and summary["final_eval"]["step"] == 2
    assert summary["eval_change"]["steps"] == [0, 2] and summary["final_eval"]["eval_env/calls_with_tools"] == 2.0
    # the random model never writes a tool call: the run says so, naming the remedies
    assert [w["kind"] for w in summary["warnings"]] == ["no_tool_calls"]
    assert "worked episodes" in summary["warnings"][0]["message"]
    assert summary["train_time_s"] <= summary["training_wall_s"]


def test_the_export_renders_tools_and_tool_turns_as_the_endpoint_trained_on_them(run):
    import transformers

    from flashreinforce.agents.chat import ChatRenderer
    from flashreinforce.models.tokenizers import load_tokenizer

    # A call that starts a conversation is trained on the endpoint's rendering of its messages; one that continues
    # it, on that rendering too unless the sampled text re-tokenizes otherwise (env/mismatched_renderings).
    out, gguf = run
    trained = load_tokenizer(str(gguf))
    endpoint = ChatRenderer(trained.tok, trained.eos_token_ids)
    assert SEEN
    for folder in (out / "hf", out / "hf" / "adapter", out / "hf" / "base"):
        exported = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        for messages in SEEN[:4]:
            ids = exported.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
            assert list(ids) == endpoint.encode(endpoint.render(messages, TOOLS, True))
    # the model's own template drops the tools without a word
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    assert "<tools>" not in trained.tok.apply_chat_template(question, tools=TOOLS, tokenize=False)
    assert "<tools>" in exported.apply_chat_template(question, tools=TOOLS, tokenize=False)


def test_the_adapter_loads_by_itself_offline_and_equals_the_merged_export(run, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    import transformers

    out, gguf = run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = json.loads((out / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "hf" / "base").resolve())
    record = json.loads((out / "hf" / "adapter" / "base_model.json").read_text())
    assert record["run_model"] == str(gguf) and record["written_by_the_run"] is True
    adapter = AutoPeftModelForCausalLM.from_pretrained(str(out / "hf" / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf"), local_files_only=True).eval()
    ids = torch.tensor([[5, 40, 77, 12, 3, 9]])
    with torch.no_grad():
        assert torch.allclose(adapter(ids).logits, merged(ids).logits, atol=1e-5)


def test_serve_over_the_run_and_over_the_adapter_answers_the_openai_client(run):
    from flashreinforce.cli.serve import start_endpoint

    out, _ = run
    for model in (out, out / "hf" / "adapter"):
        endpoint = start_endpoint({"model": str(model), "port": 0, "device": "cpu"})
        try:
            s = endpoint.settings
            if model == out:  # the run's own sampling and lengths are the defaults
                assert (s.temperature, s.max_tokens, s.max_len, s.tool_parser, s.model_name) == (0.9, 4, 2048, "hermes",
                                                                                                  "policy")
            client = openai.OpenAI(base_url=endpoint.url, api_key=endpoint.api_key, max_retries=0)
            reply = client.chat.completions.create(model="policy", messages=SEEN[0], tools=TOOLS, max_tokens=3)
            assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
            assert reply.usage.prompt_tokens == len(endpoint.prompt_ids(_chat(SEEN[0])))
            assert [m.id for m in client.models.list().data] == ["policy"]
        finally:
            endpoint.stop()


def _chat(messages):
    from flashreinforce.agents.protocol import chat_request

    return chat_request({"model": "policy", "messages": messages, "tools": TOOLS})
