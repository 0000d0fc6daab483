"""Episodes as a stream (``rollout.episodes_in_flight``): environment calls submitted without waiting
(:meth:`EnvCalls.submit` / :meth:`EnvCalls.take`), turns sampled while other episodes' tools run, new
prompts started as others end, the same trajectories as call by call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flashreinforce.engines import SamplingParams
from flashreinforce.engines.base import Generation, RolloutEngine
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.trainer.errors import StopRequested
from flashreinforce.trainer.rollout.buffer import RolloutBuffer
from flashreinforce.trainer.rollout.env_calls import EnvCalls
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.trainer.run.test_fault_tolerance import TOK, _worker


# ------------------------------------------------------------------------------- EnvCalls.submit / take
def test_submitted_calls_are_taken_as_they_end():
    calls = EnvCalls(timeout_s=30, max_parallel=8)
    release = threading.Event()
    calls.submit([("fast", "env.step", lambda: 1, None), ("slow", "env.step", lambda: release.wait(20) and 2, None)])
    assert calls.in_flight == 2
    assert calls.take(wait_s=5.0) == {"fast": ("ok", 1)}  # the fast one, without waiting for the slow one
    assert calls.take(wait_s=0.0) == {}  # nothing else has ended
    release.set()
    assert calls.take(wait_s=5.0) == {"slow": ("ok", 2)} and calls.in_flight == 0
    assert calls.take(wait_s=0.0) == {}
    with pytest.raises(ValueError, match="already in flight"):
        calls.submit([("a", "env.step", lambda: release.wait(20), None), ("a", "env.step", lambda: 0, None)])
    calls.abandon_in_flight()
    calls.close()


def test_take_lingers_so_that_answers_close_together_come_together():
    calls = EnvCalls(timeout_s=30, max_parallel=8)
    calls.submit([(i, "env.step", lambda i=i: time.sleep(0.05 * i) or i, None) for i in range(4)])
    got = calls.take(wait_s=5.0, linger_s=2.0)  # all four end within the linger
    assert got == {i: ("ok", i) for i in range(4)}
    calls.close()


def test_a_submitted_call_times_out_errors_are_returned_and_a_stop_abandons_the_rest():
    calls = EnvCalls(timeout_s=0.2, max_parallel=2)
    stuck, closed = threading.Event(), []
    calls.submit([("stuck", "env.step", lambda: stuck.wait(20), lambda: closed.append(1)),
                  ("bad", "env.step", lambda: 1 / 0, None), ("queued", "env.step", lambda: 3, None)])
    got = {}
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        got.update(calls.take(wait_s=1.0, linger_s=0.5))
    assert got["stuck"] == ("timeout", 0.2) and got["bad"][0] == "error" and got["queued"] == ("ok", 3)
    assert calls.timeouts == 1
    stuck.set()
    stop = threading.Event()
    calls.submit([("late", "env.step", lambda: time.sleep(5), None)])
    stop.set()
    with pytest.raises(StopRequested):
        calls.take(stop=stop, wait_s=5.0)
    assert calls.in_flight == 0
    calls.close()


# ------------------------------------------------------------------------------- through a worker
class Tools:
    """Counts one test's tool calls running at a time (a test's own: calls abandoned at the end of
    another test may still be running)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0


class Recorder(RolloutEngine):
    """Answers every request with one token and records, per generate call, how many tool calls were
    running at that moment (``tools.running``)."""

    can_pause = False

    def __init__(self, tools: Tools) -> None:
        self.version = 0
        self.tools = tools
        self.model = torch.nn.Linear(1, 1)  # something for the weight store to publish
        self.calls: list[tuple[int, int]] = []  # (requests, tools running)

    def load_weights(self, state_dict, version):
        self.version = int(version)

    def generate(self, requests, params, *, should_pause=None):
        with self.tools.lock:
            self.calls.append((len(requests), self.tools.running))
        return [Generation([TOK.encode("a")[0]], [-0.5], "length", self.version) for _ in requests]


class ToolEnv(Environment):
    """Two policy turns with a tool call between them; the tool takes 0.02 s, or 1 s for odd seeds."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools

    def reset(self, *, seed):
        self.seed, self.turn = seed, 0
        return "q"

    def step(self, action):
        self.turn += 1
        if self.turn == 2:
            return StepResult("", 1.0, True)
        with self.tools.lock:
            self.tools.running += 1
        time.sleep(1.0 if self.seed % 2 else 0.02)
        with self.tools.lock:
            self.tools.running -= 1
        return StepResult("out", 0.0, False)


def _run(worker, buf, groups: int, timeout: float = 60.0):
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < groups and time.monotonic() < deadline:
        batch = buf.take(0, timeout=0.5)
        if batch is not None:
            got.extend(batch.trajectories)
            buf.update_done()
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return got


@pytest.mark.parametrize("stream", [True, False])
def test_turns_are_sampled_while_other_episodes_tools_run_only_as_a_stream(stream):
    tools = Tools()
    engine = Recorder(tools)
    buf = RolloutBuffer(batch_groups=8, async_queue_size=1, vocab_size=TOK.vocab_size)
    worker, _ = _worker(lambda: ToolEnv(tools), eng=engine, buffer=buf, max_turns=2, episodes_per_call=8,
                        episodes_in_flight=16 if stream else 0, max_new_tokens=1)
    trajectories = _run(worker, buf, 8)
    assert len(trajectories) >= 8 and all(isinstance(t, Trajectory) and t.reward == 1.0 for t in trajectories)
    during = [n for n, tools in engine.calls if tools > 0]
    if stream:
        # Second turns of the episodes whose tool answered fast, and new prompts, while slow tools ran.
        assert during, engine.calls
    else:
        assert not during, engine.calls  # call by call: the engine waits for every tool of the turn


class HalfSlowEnv(Environment):
    """Two policy turns with a tool call between them: the tool of every other episode (in the order of
    their resets, counted on ``tools``) takes 1 s, the others' 0.02 s."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools

    def reset(self, *, seed):
        with self.tools.lock:
            self.slow = getattr(self.tools, "resets", 0) % 2 == 1
            self.tools.resets = getattr(self.tools, "resets", 0) + 1
        self.turn = 0
        return "q"

    def step(self, action):
        self.turn += 1
        if self.turn == 2:
            return StepResult("", 1.0, True)
        time.sleep(1.0 if self.slow else 0.02)
        return StepResult("out", 0.0, False)


@pytest.mark.parametrize("min_episodes", [0, 8])
def test_a_small_call_waits_for_more_answers_only_with_a_minimum(min_episodes):
    """Eight episodes start in one call; four tools answer at once, four a second later. Without a
    minimum the four fast episodes' second turns go in a call of their own; with a minimum of eight
    (and time to gather) the call waits for the slow ones, and all eight go together."""
    tools = Tools()
    engine = Recorder(tools)
    buf = RolloutBuffer(batch_groups=8, async_queue_size=0, vocab_size=TOK.vocab_size)
    worker, _ = _worker(lambda: HalfSlowEnv(tools), eng=engine, buffer=buf, max_turns=2, episodes_per_call=8,
                        episodes_in_flight=8, max_new_tokens=1, stream_call_min_episodes=min_episodes,
                        stream_call_gather_s=2.0)
    trajectories = _run(worker, buf, 8)
    assert len(trajectories) >= 8 and all(t.reward == 1.0 for t in trajectories)
    sizes = [n for n, _ in engine.calls]
    assert sizes[0] == 8
    if min_episodes:
        assert sizes[1] == 8, sizes
    else:
        assert sizes[1:3] == [4, 4], sizes


def test_the_gathering_settings_are_checked():
    from flashreinforce.trainer.rollout.settings import RolloutSettings

    with pytest.raises(ValueError, match="stream_call_min_episodes must be >= 0, got -1"):
        RolloutSettings(max_new_tokens=1, max_len=8, stream_call_min_episodes=-1)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stream_call_gather_s must be a finite number >= 0"):
            RolloutSettings(max_new_tokens=1, max_len=8, stream_call_gather_s=bad)


def test_a_stream_samples_the_same_trajectories_as_call_by_call():
    from flashreinforce.envs.toy import ToyCopyChainEnv

    runs = {}
    for stream in (0, 6):
        buf = RolloutBuffer(batch_groups=6, async_queue_size=1, vocab_size=TOK.vocab_size)
        worker, _ = _worker(lambda: ToyCopyChainEnv(alphabet="abcdefgh", turns=3), buffer=buf, max_turns=3,
                            episodes_per_call=6, episodes_in_flight=stream, max_new_tokens=3,
                            sampling=SamplingParams(temperature=1.0, stop_token_ids=TOK.eos_token_ids))
        runs[stream] = {t.prompt_id: t for t in _run(worker, buf, 6)}
    common = sorted(set(runs[0]) & set(runs[6]))
    assert len(common) >= 6
    for pid in common:
        a, b = runs[0][pid], runs[6][pid]
        assert a.token_ids == b.token_ids and a.action_mask == b.action_mask and a.reward == b.reward
        assert a.behavior_log_probs == pytest.approx(b.behavior_log_probs, abs=1e-5)


def test_a_stream_keeps_at_most_its_episodes_in_flight_and_hands_prompts_back_when_stopped():
    tools = Tools()
    engine = Recorder(tools)
    buf = RolloutBuffer(batch_groups=4, async_queue_size=3, vocab_size=TOK.vocab_size)
    worker, _ = _worker(lambda: ToolEnv(tools), eng=engine, buffer=buf, max_turns=2, episodes_per_call=4, episodes_in_flight=5,
                        max_new_tokens=1)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(1.5)
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert max(n for n, _ in engine.calls) <= 5
    stats = buf.stats()
    # Every prompt still being sampled at the stop was handed back: the prompts out are the finished
    # groups waiting for the learner, and those cancelled come again first.
    assert stats["in_flight"] == stats["ready_groups"] and stats["cancelled_groups"] > 0


def test_a_training_run_streams_its_episodes(tmp_path):
    """``--rollout.episodes_in_flight`` reaches the workers of a run: a multi-turn run trains on complete
    episodes sampled as a stream."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy_multiturn",
                           "--output", str(out), "--train.max_steps", "4", "--ckpt.save_steps", "0", "--seed", "0",
                           "--rollout.episodes_in_flight", "48", "--no_progress", "--eval.steps", "0",
                           "--eval.eval_at_start", "false"],
                          cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["num_turns_mean"] == 3 for r in rows)
    assert json.loads((out / "config.json").read_text())["flags"]["rollout.episodes_in_flight"] == 48


def test_the_flag_reaches_the_workers_settings():
    from flashreinforce.config import parse_train_args
    from flashreinforce.config.presets import PRESETS
    from flashreinforce.trainer.run.components import rollout_settings

    for given, expected in ((["--rollout.episodes_in_flight", "48"], 48), ([], 0)):
        cfg = parse_train_args(["--preset", "toy", *given], PRESETS)
        assert rollout_settings(cfg, TOK, 0).episodes_in_flight == expected
    cfg = parse_train_args(["--preset", "toy", "--rollout.stream_call_min_episodes", "16",
                            "--rollout.stream_call_gather_s", "0.5"], PRESETS)
    settings = rollout_settings(cfg, TOK, 0)
    assert (settings.stream_call_min_episodes, settings.stream_call_gather_s) == (16, 0.5)
    defaults = rollout_settings(parse_train_args(["--preset", "toy"], PRESETS), TOK, 0)
    assert (defaults.stream_call_min_episodes, defaults.stream_call_gather_s) == (0, 0.3)
