"""The agent endpoint against callers other than the episode's agent, and against agents that
misbehave: each episode's calls need its token; an ended episode is 409; connections, header and
body times, body sizes and message sizes are bounded before anything large is read or tokenized;
JSON is strict and not nested without end; a wildcard host is warned about and never handed out;
an async agent that raises SystemExit, or any agent returning a reward no float holds, costs its
episode only. Real sockets, the real ``openai`` client and the tiny GGUF model."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import threading
import time
from fractions import Fraction

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("gguf")

from flashreinforce.agents.server import AgentServer, connection_limit  # noqa: E402
from flashreinforce.agents.environment import AgentEnvironment  # noqa: E402
from flashreinforce.trainer.rollout.buffer import Ticket  # noqa: E402
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode  # noqa: E402
from flashreinforce.trainer.rollout.trajectory import Trajectory  # noqa: E402
from python_tests.agents.test_agent_worker import _http, _run, _worker, tiny  # noqa: E402,F401

SEEN: dict = {}
Q = {"model": "m", "messages": [{"role": "user", "content": "q"}]}


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds (the bound only ends a hung test; nothing is timed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def _raw(port: int, data: bytes, read: bool = True) -> bytes:
    """Send ``data`` on a new connection; the answer (until the server closes or 10 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        if not read:
            return b""
        out = b""
        sock.settimeout(10)
        try:
            while b"\r\n\r\n" not in out or len(out) < out.index(b"\r\n\r\n") + 10:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except socket.timeout:
            pass
        return out


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


# ------------------------------------------------------------------ who may call an episode
def intruded(client, row, base_url):
    """Calls the model, lets another caller try its episode, calls again."""
    client.chat.completions.create(**Q)
    statuses = []
    for token in (None, "wrong", SEEN.get("other_token")):
        statuses.append(_http("POST", base_url + "/chat/completions", json.dumps(Q).encode(), token)[0])
    SEEN[row["seed"]] = statuses
    client.chat.completions.create(**Q)
    return 1.0


def test_an_episode_s_calls_need_its_token_and_nobody_else_s_are_trained(tiny):
    worker = _worker(tiny, intruded)
    try:
        server = worker._ensure_server()
        SEEN["other_token"] = server.open_episode("another-episode")
        (group,) = worker.run_tickets([Ticket(0, 3, 1)])
    finally:
        worker.close()
    assert SEEN[3] == [401, 401, 401]  # no token, a wrong one, another episode's
    assert group and all(isinstance(t, Trajectory) for t in group)
    assert group[0].info["agent_calls"] == 2 and group[0].info["refused_calls"] == 0  # the agent's two calls only


def own_client(client, row, base_url, api_key):
    """A framework that builds its own client from the URL and the key it is given."""
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as mine:
        mine.chat.completions.create(**Q)
    SEEN[row["seed"]] = (base_url, api_key)
    return 1.0


def test_an_ended_episode_answers_409_and_only_to_its_token(tiny):
    worker = _worker(tiny, own_client)
    try:
        (group,) = worker.run_tickets([Ticket(0, 4, 1)])
        assert isinstance(group[0], Trajectory)
        url, key = SEEN[4]
        status, body = _http("POST", url + "/chat/completions", json.dumps(Q).encode(), key)
        assert status == 409 and body["error"]["code"] == "episode_ended"
        assert _http("POST", url + "/chat/completions", json.dumps(Q).encode(), "x" + key)[0] == 401
        unknown = url.replace("/episodes/", "/episodes/0") + "/chat/completions"
        assert _http("POST", unknown, json.dumps(Q).encode(), key)[1]["error"]["code"] == "episode_not_found"
    finally:
        worker.close()


# ------------------------------------------------------------------ limits of the endpoint itself
@pytest.fixture
def server():
    srv = AgentServer(max_connections=8, header_timeout_s=1.0, max_body_bytes=4096)
    srv.start()
    yield srv
    srv.stop()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_connections_are_bounded_and_idle_ones_closed(server):
    before = _open_fds()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(60)]
    try:
        # The ones past the limit are closed at once: the endpoint holds at most max_connections.
        _wait_for(lambda: _open_fds() - before - len(socks) <= server.max_connections, "the surplus to be closed")
        # Connections that never send a request are closed after header_timeout_s.
        for s in socks:
            s.settimeout(30)
            assert s.recv(1) == b""
        _wait_for(lambda: _open_fds() - before - len(socks) <= 0, "every idle connection to be closed")
    finally:
        for s in socks:
            s.close()
    status, body = _http("GET", server.root_url + "/v1/models")  # the endpoint still serves
    assert status == 200 and body["data"][0]["id"] == "policy"


def test_the_connection_limit_stays_under_the_open_file_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(128, hard), hard))
    try:
        assert connection_limit(256) == 32 and connection_limit(10) == 10
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_body_is_not_read_for_an_unknown_episode_nor_past_the_limit(server):
    token = server.open_episode("live")
    huge = b"POST /episodes/%s/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
           b"Content-Length: 300000000\r\n%s\r\n"
    # 300 MB announced, none sent: answered from the headers (a server reading the body would wait).
    assert _status(_raw(server.port, huge % (b"made-up", b""))) == 404
    assert _status(_raw(server.port, huge % (b"live", b""))) == 401
    auth = b"Authorization: Bearer " + token.encode() + b"\r\n"
    answer = _raw(server.port, huge % (b"live", auth))
    assert _status(answer) == 413 and b"request_too_large" in answer
    # Without a length (chunked), the reading stops at the limit.
    chunked = (b"POST /episodes/live/v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n" + auth
               + b"\r\n" + b"1000\r\n" + b"x" * 4096 + b"\r\n" + b"1000\r\n" + b"x" * 4096 + b"\r\n0\r\n\r\n")
    assert _status(_raw(server.port, chunked)) == 413
    # A body that trickles in slower than header_timeout_s.
    slow = (b"POST /episodes/live/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n" + auth + b"\r\n{")
    assert _status(_raw(server.port, slow)) == 408


def test_json_that_is_not_strict_or_nested_without_end_is_400(server):
    token = server.open_episode("live")
    url = server.root_url + "/episodes/live/v1/chat/completions"
    status, body = _http("POST", url, b"[" * 2000 + b"]" * 2000, token)  # within the 4 KiB limit: nested
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    status, body = _http("POST", url, b'{"model": "m", "temperature": NaN, "messages": []}', token)
    assert status == 400 and "NaN is not JSON" in body["error"]["message"]


def test_a_deep_body_within_the_default_limit_is_400_not_500():
    srv = AgentServer()
    srv.start()
    try:
        token = srv.open_episode("live")
        status, body = _http("POST", srv.root_url + "/episodes/live/v1/chat/completions",
                             b"[" * 200000 + b"]" * 200000, token)
        assert status == 400 and body["error"]["message"] == "the request body is JSON nested too deeply"
    finally:
        srv.stop()


def huge_message(client, row):
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 2_000_000}])
    except openai.BadRequestError as err:
        SEEN[row["seed"]] = (err.code, err.message)
    client.chat.completions.create(**Q)
    return 1.0


def test_a_message_too_long_for_max_len_is_refused_without_tokenizing(tiny):
    worker = _worker(tiny, huge_message, max_body_mb=16)
    worker._first_finished = True  # as a run's first episode, cut short by data.max_len, it would stop the run
    calls = []
    encode = worker.renderer.tok.__class__.__call__

    def counting(self, *args, **kwargs):
        calls.append(sum(len(a) for a in args if isinstance(a, str)))
        return encode(self, *args, **kwargs)

    worker.renderer.tok.__class__.__call__ = counting
    try:
        (group,) = _run(worker, [6])
    finally:
        worker.renderer.tok.__class__.__call__ = encode
    code, message = SEEN[6]
    assert code == "context_length_exceeded" and "2000000 characters" in message
    assert max(calls, default=0) < 1_000_000  # the long text never reached the tokenizer
    assert isinstance(group[0], Trajectory) and group[0].info["refused_calls"] == 1


# ------------------------------------------------------------------ hosts
def test_an_empty_host_is_refused_and_a_wildcard_one_warned_about_and_not_handed_out(caplog):
    with pytest.raises(ValueError, match="host must be an address to listen on"):
        AgentEnvironment(lambda client, row: 1.0, host="")
    with pytest.raises(ValueError, match="needs an address to listen on"):
        AgentServer(host="")
    srv = AgentServer(host="0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="flashreinforce.agents.server"):
        srv.start()
    try:
        assert any("listens on every interface (host 0.0.0.0" in r.getMessage() for r in caplog.records)
        assert srv.root_url == f"http://127.0.0.1:{srv.port}" and srv.base_url("e").startswith(srv.root_url)
        assert _http("GET", srv.root_url + "/v1/models")[0] == 200
    finally:
        srv.stop()


# ------------------------------------------------------------------ what agents do and return
async def exiting(client, row):
    seed = row["seed"]
    await client.chat.completions.create(**Q)
    if seed == 0:
        raise SystemExit(3)
    if seed == 1:
        raise KeyboardInterrupt
    return 1.0


def test_an_async_agent_raising_system_exit_costs_its_episode_only(tiny):
    worker = _worker(tiny, exiting, parallel=1)  # one at a time: later episodes need the same event loop
    try:
        groups = worker.run_tickets([Ticket(i, s, 1) for i, s in enumerate([0, 1, 2, 3])])
        kinds = [g[0].kind if isinstance(g[0], QuarantinedEpisode) else "ok" for g in groups]
        assert kinds == ["agent raised SystemExit", "agent raised KeyboardInterrupt", "ok", "ok"]
        assert worker.stats()["agent_timeouts"] == 0
        (again,) = worker.run_tickets([Ticket(9, 5, 1)])  # the loop still serves
        assert isinstance(again[0], Trajectory)
    finally:
        worker.close()


def unrepresentable(client, row):
    client.chat.completions.create(**Q)
    return {0: 10**400, 1: {"reward": 10**400}, 2: Fraction(10**400, 3), 3: {"reward": 1.0, "info": {"x": 10**400}},
            4: -(10**5000)}.get(row["seed"], 1.0)


def test_a_reward_no_float_holds_quarantines_its_episode_only(tiny):
    groups = _run(_worker(tiny, unrepresentable), [0, 1, 2, 3, 4, 5])
    kinds = [g[0].kind if isinstance(g[0], QuarantinedEpisode) else "ok" for g in groups]
    assert kinds == ["agent returned a wrong type"] * 5 + ["ok"]
    assert all(len(g[0].reason) < 400 for g in groups[:5])
