"""Agent functions against the real endpoint (FastAPI under uvicorn on 127.0.0.1) with the real
``openai`` client, a Hugging Face engine on a tiny GGUF model, and the rollout worker that batches
their calls: token-exact trajectories, history rewrites, OpenAI-style errors, misbehaving agents."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("gguf")

from flashreinforce.engines import LocalWeightStore, SamplingParams, create_engine  # noqa: E402
from flashreinforce.envs.registry import EnvSpec  # noqa: E402
from flashreinforce.agents.worker import AgentRolloutWorker  # noqa: E402
from flashreinforce.trainer.rollout.worker_kinds import worker_class  # noqa: E402
from flashreinforce.trainer.rollout.buffer import Ticket  # noqa: E402
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode  # noqa: E402
from flashreinforce.trainer.rollout.settings import RolloutSettings  # noqa: E402
from flashreinforce.trainer.rollout.trajectory import Trajectory  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALLS: dict[int, list] = {}  # seed -> what the agent saw (responses), for the assertions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from flashreinforce.models.loading import build_model
    from flashreinforce.models.tokenizers import load_tokenizer
    from python_tests.models.gguf_tiny import write_tiny_gguf

    path = Path(tmp_path_factory.mktemp("gguf")) / "tiny.gguf"
    write_tiny_gguf(path, seed=3)
    model, _ = build_model(str(path), device=torch.device("cpu"))
    return model.eval(), load_tokenizer(str(path))


def _worker(tiny, agent, *, rows=None, timeout=5.0, parallel=8, temperature=1.0, max_len=1024, **env_kwargs):
    model, tok = tiny
    config = {"data.prompt_dataset": rows} if rows is not None else {}
    factory = EnvSpec("agent", config, {"agent": agent, **env_kwargs}).factory(tok)
    assert worker_class(factory) is AgentRolloutWorker
    engine = create_engine("hf", model, pad_token_id=tok.pad_token_id, version=0)
    settings = RolloutSettings(max_new_tokens=6, max_len=max_len, sampling=SamplingParams(temperature, 1.0, 0,
                                                                                          tok.eos_token_ids),
                               env_timeout_s=timeout, env_parallel_calls=parallel, seed=11)
    return AgentRolloutWorker(0, engine, factory, tok, None, LocalWeightStore(), settings)


def _run(worker, seeds, group_size=1):
    try:
        return worker.run_tickets([Ticket(i, s, group_size) for i, s in enumerate(seeds)])
    finally:
        worker.close()


# ---------------------------------------------------------------------------------------- agents
def chatty_agent(client, row):
    """Three calls continuing one conversation, with a tool turn; the responses are kept for the test."""
    seen = []
    messages = [{"role": "user", "content": f"question {row['seed']}"}]
    for turn in range(3):
        r = client.chat.completions.create(model="anything", messages=messages, tools=TOOLS, logprobs=True)
        seen.append(r)
        m = r.choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"go on {turn}"} if turn % 2 else
                        {"role": "tool", "tool_call_id": "c", "content": "42"})
    CALLS[row["seed"]] = seen
    return {"reward": 1.0, "info": {"turns_taken": 3}}


def test_calls_of_one_conversation_make_one_token_exact_trajectory(tiny):
    model, tok = tiny
    worker = _worker(tiny, chatty_agent)
    groups = _run(worker, [101, 102, 103, 104])
    for group, seed in zip(groups, [101, 102, 103, 104]):
        (t,) = group
        assert isinstance(t, Trajectory) and t.problem(tok.vocab_size) is None
        assert t.reward == 1.0 and t.num_turns == 3 and t.info["agent_calls"] == 3 and t.info["turns_taken"] == 3
        assert t.info["history_rewrites"] == 0 and t.info["trajectories_of_episode"] == 1
        responses = CALLS[seed]
        # The actions are exactly the sampled tokens, with the log-probabilities the responses reported.
        reported = [lp.logprob for r in responses for lp in r.choices[0].logprobs.content]
        behavior = [lp for lp, m in zip(t.behavior_log_probs, t.action_mask) if m]
        assert behavior == pytest.approx(reported, abs=1e-6)
        assert [r.usage.completion_tokens for r in responses] == [len(r.choices[0].logprobs.content) for r in responses]
        assert sum(r.usage.completion_tokens for r in responses) == t.num_action_tokens
        # Each call's prompt was the trajectory up to that call: prompt_tokens are its prefix lengths.
        starts = [k for k in range(1, len(t.action_mask)) if t.action_mask[k] and not t.action_mask[k - 1]]
        assert [r.usage.prompt_tokens for r in responses] == starts
        # The learner's scoring of the trajectory reproduces the behavior log-probs (nothing re-tokenized).
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        scored = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(t.action_mask[1:])
        assert torch.allclose(scored[mask], torch.tensor(behavior), atol=1e-4)
    assert worker.stats()["agent_largest_batch"] > 1  # calls of several episodes shared engine calls


def two_conversations(client, row):
    a = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "first"}])
    b = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "second, unrelated"}])
    # A rewrite of the first conversation: its answer edited before going on.
    client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "first"}, {"role": "assistant", "content": (a.choices[0].message.content or "") + "!"},
        {"role": "user", "content": "more"}])
    return 0.5 if b.choices[0].finish_reason in ("stop", "length") else -1.0


def test_rewritten_history_gives_several_trajectories_with_the_episode_reward(tiny):
    (group,) = _run(_worker(tiny, two_conversations), [5])
    assert len(group) == 3 and all(isinstance(t, Trajectory) and t.reward == 0.5 for t in group)
    assert {t.info["history_rewrites"] for t in group} == {2} and group[0].info["trajectories_of_episode"] == 3
    assert all(not t.failed for t in group)


def picky_agent(client, row):
    """Checks the endpoint's errors and its non-chat routes, from the agent's side."""
    out = {}
    for name, kwargs in (("n", {"n": 2}), ("temperature", {"temperature": 9})):
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], **kwargs)
        except openai.BadRequestError as err:
            out[name] = (err.status_code, err.body.get("param") if isinstance(err.body, dict) else None)
    try:
        client.completions.create(model="m", prompt="q", stream=True)
    except openai.BadRequestError as err:
        out["stream"] = (err.status_code, err.body.get("param") if isinstance(err.body, dict) else None)
    out["models"] = [m.id for m in client.models.list().data]
    try:
        client.completions.create(model="m", prompt="x" * 1100)
    except openai.BadRequestError as err:
        out["long"] = err.code
    text = client.completions.create(model="m", prompt="hello", max_tokens=3, logprobs=1)
    out["completion"] = (text.choices[0].text, text.usage.completion_tokens, len(text.choices[0].logprobs.tokens))
    CALLS[row["seed"]] = out
    return 1.0


def test_bad_requests_get_openai_errors_and_the_agent_goes_on(tiny):
    worker = _worker(tiny, picky_agent)
    worker._first_finished = True  # its too-long prompt would stop a run whose first episode it is
    (group,) = _run(worker, [9])
    (t,) = group
    out = CALLS[9]
    assert out["n"] == (400, "n") and out["stream"] == (400, "stream") and out["temperature"] == (400, "temperature")
    assert out["models"] == ["policy"] and out["long"] == "context_length_exceeded"
    text, used, n = out["completion"]
    assert isinstance(text, str) and 1 <= used <= 3 and n == used
    assert t.info["refused_calls"] == 1 and t.num_action_tokens == used


def _http(method, url, body=None, token=None):
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_unknown_routes_and_bad_json_are_openai_style_json(tiny):
    worker = _worker(tiny, chatty_agent)
    try:
        server = worker._ensure_server()
        assert server.host == "127.0.0.1"
        status, body = _http("POST", server.root_url + "/v1/chat/completions", b"{}")
        assert status == 404 and body["error"]["code"] == "not_found"
        token = server.open_episode("x")
        status, body = _http("POST", server.root_url + "/episodes/x/v1/chat/completions", b"{not json", token)
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = _http("GET", server.root_url + "/no/such/route")
        assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
        status, body = _http("POST", server.root_url + "/episodes/unknown/v1/chat/completions",
                             json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}]}).encode())
        assert status == 404 and body["error"]["code"] == "episode_not_found"  # before its body is read
        assert _http("GET", server.root_url + "/v1/models")[1]["data"][0]["id"] == "policy"
    finally:
        worker.close()


#: Set when the test that abandons a hung agent is over: that agent's thread then ends.
RELEASE_HUNG_AGENT = threading.Event()


def misbehaving(client, row):
    seed = row["seed"]
    if seed == 0:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        raise RuntimeError("the agent's own bug")
    if seed == 1:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        # Hung, however fast the machine: neither calls the model nor returns until released (a
        # minute at most, so that a worker that never times it out fails the test instead of hanging it)
        RELEASE_HUNG_AGENT.wait(60)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}])
        return 1.0
    if seed == 2:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        return "a string, not a reward"
    if seed == 3:
        return 1.0  # never calls the model
    if seed == 4:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        return {"reward": float("nan")}
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    return {"reward": 1.0, "failed": False}


def test_misbehaving_agents_are_quarantined_one_by_one(tiny):
    # A timeout no prompt answer comes near on a loaded machine: only the agents' own faults quarantine them
    groups = _run(_worker(tiny, misbehaving, timeout=120.0), [0, 2, 3, 4, 5])
    kinds = [g[0].kind if isinstance(g[0], QuarantinedEpisode) else "ok" for g in groups]
    assert kinds == ["agent raised RuntimeError", "agent returned a wrong type", "agent made no model call",
                     "agent returned a wrong type", "ok"]
    assert "the agent's own bug" in groups[0][0].reason and groups[4][0].reward == 1.0


def test_a_hung_agent_is_abandoned_after_env_timeout_s(tiny):
    worker = _worker(tiny, misbehaving, timeout=0.5)
    RELEASE_HUNG_AGENT.clear()
    try:
        (group,) = _run(worker, [1])
    finally:
        RELEASE_HUNG_AGENT.set()
    assert isinstance(group[0], QuarantinedEpisode) and group[0].kind == "agent timed out", group
    assert "within 0.5 s (--rollout.env_timeout_s)" in group[0].reason and worker.stats()["agent_timeouts"] == 1


async def async_agent(client, row):
    assert isinstance(client, openai.AsyncOpenAI)
    a, b = await asyncio.gather(*(client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])
                                  for q in ("one", "two")))
    return float(bool(a.id) and bool(b.id))


def test_async_agents_run_on_the_event_loop_with_calls_at_once(tiny):
    (group,) = _run(_worker(tiny, async_agent), [1])
    assert len(group) == 2 and all(isinstance(t, Trajectory) and t.reward == 1.0 for t in group)


def own_settings(client, row, base_url):
    assert base_url == str(client.base_url).rstrip("/") and "/episodes/" in base_url
    greedy = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], temperature=0,
                                            logprobs=True)
    sampled = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q2"}], top_p=0.5)
    CALLS[row["seed"]] = (greedy.usage.completion_tokens, sampled.usage.completion_tokens,
                          [c.logprob for c in greedy.choices[0].logprobs.content])
    return 1.0


def test_by_default_every_call_is_sampled_and_trained_at_the_run_settings(tiny, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="flashreinforce.agents.worker"):
        groups = _run(_worker(tiny, own_settings), [77, 78])
    greedy, sampled, logps = CALLS[77]
    assert greedy > 0 and sampled > 0  # usage counts what was generated
    assert all(lp < 0 for lp in logps)  # sampled at the run's temperature 1.0, not greedily
    for group in groups:  # two conversations: two trajectories, every sampled token an action
        assert len(group) == 2 and all(isinstance(t, Trajectory) for t in group)
        assert group[0].info["off_policy_calls"] == 2
    assert sum(t.num_action_tokens for t in groups[0]) == greedy + sampled
    warnings = [r.getMessage() for r in caplog.records if "asked for" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, not per call or episode
    assert "temperature 0" in warnings[0] and "--rollout.temperature 1" in warnings[0] and \
        "--rollout.agent_sampling agent" in warnings[0]


def test_agent_sampling_agent_uses_the_client_settings_and_trains_their_tokens(tiny):
    worker = _worker(tiny, own_settings)
    worker.settings = dataclasses.replace(worker.settings, agent_sampling="agent")
    (group,) = _run(worker, [79])
    greedy, sampled, logps = CALLS[79]
    assert greedy > 0 and logps == [0.0] * greedy  # greedy: log-probability 0 on the argmax
    assert len(group) == 2 and sum(t.num_action_tokens for t in group) == greedy + sampled
    first = next(t for t in group if t.num_action_tokens == greedy)
    assert [lp for lp, m in zip(first.behavior_log_probs, first.action_mask) if m] == [0.0] * greedy


def long_tool_agent(client, row):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q " * 200}], tools=TOOLS)
    return 1.0


def looping_agent(client, row):
    for k in range(5):
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{k}"}])
        except openai.BadRequestError:
            break
    return 1.0


def test_a_first_episode_cut_short_by_the_limits_is_fatal_and_names_the_flag(tiny):
    (group,) = _run(_worker(tiny, long_tool_agent, max_len=64), [5])
    assert isinstance(group[0], QuarantinedEpisode) and group[0].fatal
    assert "--data.max_len" in group[0].reason and "leaves no room" in group[0].reason
    worker = _worker(tiny, looping_agent, max_turns=2)
    groups = _run(worker, [6, 7])
    fatal = [g[0] for g in groups if isinstance(g[0], QuarantinedEpisode) and g[0].fatal]
    assert len(fatal) == 1 and "--rollout.max_turns 2" in fatal[0].reason
    # the worker's later episodes are truncated as before, not fatal
    assert any(isinstance(g[0], Trajectory) and g[0].truncated for g in groups)


def refused_only(client, row):
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q " * 200}])
    except openai.BadRequestError:
        pass
    return 1.0


def test_an_episode_with_nothing_to_train_on_says_why(tiny):
    worker = _worker(tiny, refused_only, max_len=64)
    worker._first_finished = True  # not the first episode: counted, not fatal
    (group,) = _run(worker, [9])
    assert not group[0].fatal and "every model call" in group[0].reason and "--data.max_len 64" in group[0].reason


def always_malformed(text):
    from flashreinforce.agents.toolcalls import ToolParse

    return ToolParse(text, malformed=True, problem="test")


def tool_user(client, row):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS)
    CALLS[row["seed"]] = r.choices[0].message
    return 1.0


def test_malformed_tool_calls_come_back_as_content_and_are_counted(tiny):
    from flashreinforce.agents.toolcalls import register_parser

    register_parser("test_always_malformed", always_malformed)
    (group,) = _run(_worker(tiny, tool_user, tool_parser="test_always_malformed"), [8])
    message = CALLS[8]
    assert message.tool_calls is None and isinstance(message.content, str)
    assert group[0].info["malformed_tool_calls"] == 1


def test_rows_of_a_dataset_reach_the_agent(tiny):
    seen = []

    def agent(client, row):
        seen.append(row)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        return float(row["answer"])

    rows = [{"prompt": "p0", "answer": 0}, {"prompt": "p1", "answer": 1}]
    groups = _run(_worker(tiny, agent, rows=rows), [1, 2])
    assert sorted(r["prompt"] for r in seen) == ["p0", "p1"]
    assert [g[0].reward for g in groups] == [1.0, 0.0] and groups[1][0].failed


# ---------------------------------------------------------------------------------------- token ids and streams
def token_agent(client, row):
    """Token in, token out: each call's prompt is the previous prompt ids, the answer's ids and new ids."""
    prompt, seen = [5, 6, 7], []
    for turn in range(3):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=4, extra_body={"return_token_ids": True})
        choice = r.choices[0].model_dump()
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == r.usage.completion_tokens
        seen.append(choice)
        prompt = prompt + choice["token_ids"] + [8, 9 + turn]
    CALLS[row["seed"]] = seen
    return 1.0


def test_an_agent_concatenating_token_ids_across_turns_gets_one_exact_trajectory(tiny):
    (group,) = _run(_worker(tiny, token_agent), [31])
    (t,) = group
    seen = CALLS[31]
    assert t.info["history_rewrites"] == 0 and t.info["agent_calls"] == 3
    assert t.token_ids == seen[-1]["prompt_token_ids"] + seen[-1]["token_ids"]
    actions = [tok for tok, m in zip(t.token_ids, t.action_mask) if m]
    assert actions == [tok for c in seen for tok in c["token_ids"]]


def streaming_agent(client, row):
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS,
                                           extra_body={"return_token_ids": True})
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS,
                                                 stream=True, stream_options={"include_usage": True}))
    CALLS[row["seed"]] = (plain.model_dump(), [c.model_dump() for c in chunks])
    return 1.0


def test_chat_streams_the_sampled_answer_and_returns_token_ids(tiny):
    (group,) = _run(_worker(tiny, streaming_agent), [41])
    plain, chunks = CALLS[41]
    assert plain["prompt_token_ids"] == group[0].token_ids[:len(plain["prompt_token_ids"])]
    assert len(plain["choices"][0]["token_ids"]) == plain["usage"]["completion_tokens"] > 0
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish and chunks[-1]["usage"]["completion_tokens"] > 0 and isinstance(text, str)
    # the streamed call continues no conversation of its own: same prompt, a second trajectory
    assert len(group) == 2 and group[0].info["agent_calls"] == 2
