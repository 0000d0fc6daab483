"""One bad episode never stops a run: episodes that fail (an environment error, a wrong type, text
the tokenizer cannot encode, a reward that overflows, a call that never returns) are quarantined and
counted, their prompt is retried a few times then skipped, the others of the same engine call go on,
repeated problems are logged once per kind, and a run where nothing can be trained on stops with a
clear error."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest

from flashreinforce.cli import main as cli_main
from flashreinforce.engines import HFEngine, LocalWeightStore, SamplingParams
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.toy import ToyCopyEnv
from flashreinforce.models.tokenizers import CharTokenizer
from flashreinforce.trainer.rollout.buffer import PromptStream, RolloutBuffer, Ticket
from flashreinforce.trainer.errors import RunStalled
from flashreinforce.trainer.reporting.fault_counters import FaultMetrics
from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.worker import RolloutWorker
from flashreinforce.trainer.rollout.thread_pool import ThreadRolloutPool
from flashreinforce.trainer.rollout.trajectory import Trajectory
from flashreinforce.trainer.run.watchdog import Watchdog
from python_tests.builders import tiny_causal_lm

TOK = CharTokenizer()
RELEASE = threading.Event()  # set at the end of the module: lets the deliberately stuck calls return


@pytest.fixture(scope="module", autouse=True)
def _release_stuck_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


def _engine(seed=0):
    model = tiny_causal_lm(TOK.vocab_size, seed=seed, layers=1, tied=False, max_positions=4096)
    return HFEngine(model, pad_token_id=TOK.pad_token_id, version=0)


def _worker(env_factory, *, eng=None, buffer=None, tokenizer=TOK, **kw):
    eng = eng or _engine()
    store = LocalWeightStore()
    store.publish(eng.model.state_dict(), 0)
    buf = buffer or RolloutBuffer(batch_groups=4, async_queue_size=1, vocab_size=TOK.vocab_size)
    base = dict(max_new_tokens=2, max_len=64, max_turns=3, episodes_per_call=8, seed=1,
                sampling=SamplingParams(stop_token_ids=TOK.eos_token_ids), env_timeout_s=30.0)
    base.update(kw)
    return RolloutWorker(0, eng, env_factory, tokenizer, buf, store, RolloutSettings(**base)), buf


class SeedEnv(Environment):
    """One-turn episodes; the episode of seed ``bad`` misbehaves as ``how`` says."""

    def __init__(self, bad=-1, how="raise"):
        self.bad, self.how, self.seed = bad, how, None

    def reset(self, *, seed):
        self.seed = seed
        if seed == self.bad and self.how == "reset_raises":
            raise RuntimeError("reset exploded")
        if seed == self.bad and self.how == "prompt_int":
            return 123
        if seed == self.bad and self.how == "prompt_huge":
            return "p" * 1_000_000
        return "say a:"

    def step(self, action):
        if self.seed != self.bad:
            return StepResult(reward=1.0, done=True)
        if self.how == "raise":
            raise RuntimeError("environment exploded")
        if self.how == "hang":
            RELEASE.wait(600)
            return StepResult(reward=1.0, done=True)
        if self.how == "dict":
            return {"reward": 1.0, "done": True}
        if self.how == "obs_int":
            return StepResult(observation=5, reward=0.0, done=False)
        if self.how == "reward_str":
            return StepResult(reward="1", done=True)
        if self.how == "non_ascii":
            return StepResult(observation=" h\u00e9llo", reward=0.0, done=False)
        return StepResult(reward=1.0, done=True)


def _tickets(n, first_seed=10):
    return [Ticket(i, first_seed + i, 1) for i in range(n)]


# ---------------------------------------------------------------- quarantine, not discard


@pytest.mark.parametrize("how,kind", [
    ("raise", "RuntimeError"), ("reset_raises", "RuntimeError"), ("prompt_int", "str"), ("dict", "StepResult"),
    ("obs_int", "observation"), ("reward_str", "reward"), ("non_ascii", "ValueError"),
])
def test_a_misbehaving_episode_is_quarantined_and_the_others_of_its_call_kept(how, kind):
    worker, _ = _worker(lambda: SeedEnv(bad=12, how=how))
    groups = worker.run_tickets(_tickets(4))
    assert [type(g[0]).__name__ for g in groups] == ["Trajectory", "Trajectory", "QuarantinedEpisode", "Trajectory"]
    q = groups[2][0]
    assert q.prompt_id == 2 and kind in q.reason, q.reason
    for g in (groups[0], groups[1], groups[3]):
        assert g[0].problem(TOK.vocab_size) is None and g[0].reward == 1.0
    assert worker.stats()["quarantined_episodes"] == 1


class PoisonEngine(HFEngine):
    """Fails the whole call when any context holds the token of ``~`` (as a backend error would)."""

    def generate(self, requests, params):
        if any(TOK.encode("~")[0] in r.token_ids for r in requests):
            raise RuntimeError("engine: bad request in this batch")
        return super().generate(requests, params)


class TildeEnv(Environment):
    def reset(self, *, seed):
        self.seed = seed
        return "~" if seed == 11 else "say a:"

    def step(self, action):
        return StepResult(reward=1.0, done=True)


def test_an_engine_error_costs_only_the_request_that_caused_it():
    model = tiny_causal_lm(TOK.vocab_size, seed=0, layers=1, tied=False)
    worker, _ = _worker(TildeEnv, eng=PoisonEngine(model, pad_token_id=TOK.pad_token_id, version=0))
    groups = worker.run_tickets(_tickets(4))
    kinds = [type(g[0]).__name__ for g in groups]
    assert kinds == ["Trajectory", "QuarantinedEpisode", "Trajectory", "Trajectory"]
    assert "engine" in groups[1][0].reason


def test_a_step_that_never_returns_is_abandoned_after_the_timeout():
    built = []

    def factory():
        built.append(SeedEnv(bad=11, how="hang"))
        return built[-1]

    worker, _ = _worker(factory, env_timeout_s=0.5)
    result = {}
    t = threading.Thread(target=lambda: result.update(groups=worker.run_tickets(_tickets(3))), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the worker waited for a stuck env.step"
    groups = result["groups"]
    assert isinstance(groups[1][0], QuarantinedEpisode) and "timed out" in groups[1][0].reason
    assert "env.step" in groups[1][0].reason
    assert isinstance(groups[0][0], Trajectory) and isinstance(groups[2][0], Trajectory)
    assert worker.stats()["env_timeouts"] == 1
    assert worker.stats()["env_timeouts_by_call"] == {"env.step": 1}  # by call kind
    # the stuck environment instance is never used again: a fresh one takes its place
    n = len(built)
    again = worker.run_tickets([Ticket(7, 20, 1), Ticket(8, 21, 1), Ticket(9, 22, 1)])
    assert all(isinstance(g[0], Trajectory) for g in again)
    assert len(built) == n + 1


class SpyTokenizer(CharTokenizer):
    def __init__(self):
        super().__init__()
        self.longest = 0

    def encode(self, text):
        self.longest = max(self.longest, len(text))
        return super().encode(text)


class HugeObservationEnv(Environment):
    def reset(self, *, seed):
        return "go:"

    def step(self, action):
        return StepResult(observation="x" * 1_000_000, reward=0.5, done=False)


def test_a_huge_observation_or_prompt_is_cut_before_tokenizing():
    tok = SpyTokenizer()
    worker, _ = _worker(HugeObservationEnv, tokenizer=tok, max_len=100)
    (traj,), = worker.run_tickets([Ticket(0, 0, 1)])
    assert traj.truncated and traj.num_tokens <= 100 and traj.reward == 0.5
    assert tok.longest <= 100, f"tokenized {tok.longest} characters for a 100-token context"
    worker, _ = _worker(lambda: SeedEnv(bad=10, how="prompt_huge"), tokenizer=tok, max_len=100)
    groups = worker.run_tickets(_tickets(2))
    assert isinstance(groups[0][0], QuarantinedEpisode) and "data.max_len" in groups[0][0].reason
    assert isinstance(groups[1][0], Trajectory) and tok.longest <= 100


def test_an_evaluation_episode_that_fails_is_left_out_and_counted():
    from flashreinforce.trainer.reporting.evaluation import Evaluator

    model = tiny_causal_lm(TOK.vocab_size, seed=0, layers=1, tied=False)
    store = LocalWeightStore()
    store.publish(model.state_dict(), 0)
    settings = RolloutSettings(max_new_tokens=2, max_len=64, sampling=SamplingParams(stop_token_ids=TOK.eos_token_ids))
    evaluator = Evaluator(env_factory=lambda: SeedEnv(bad=2, how="raise"), seeds=[0, 1, 2, 3], model=model,
                          tokenizer=TOK, weights=store, rollout_settings=settings,
                          sampling=SamplingParams(temperature=0.0, stop_token_ids=TOK.eos_token_ids))
    got: list = []
    metrics = evaluator.evaluate(0, trajectories=got)
    evaluator.close()
    assert metrics["eval_quarantined_episodes"] == 1 and metrics["eval_trajectories"] == 3
    assert metrics["eval_reward_mean"] == 1.0 and [t.seed for t in got] == [0, 1, 3]


# ---------------------------------------------------------------- the buffer: retries, skips, overflow


def test_a_prompt_that_always_fails_is_retried_then_skipped_and_the_worker_goes_on():
    buf = RolloutBuffer(batch_groups=4, async_queue_size=1, vocab_size=TOK.vocab_size, prompts=PromptStream())
    worker, _ = _worker(lambda: SeedEnv(bad=2, how="raise"), buffer=buf, episodes_per_call=2)
    pool = ThreadRolloutPool([worker])
    pool.start()
    try:
        seen = set()
        for version in range(4):
            batch = buf.take(version, timeout=60)
            assert batch is not None, "no batch: the failing prompt stopped the rollout"
            seen |= {t.prompt_id for t in batch.trajectories}
            buf.update_done()
        pool.check()
        stats = buf.stats()
    finally:
        pool.stop()
    assert 2 not in seen
    assert stats["skipped_prompts"] == 1 and stats["quarantined_episodes"] == buf.max_prompt_attempts == 3
    assert stats.get("cancelled_groups", 0) == 0


def test_rewards_that_overflow_float32_are_rejected_at_the_buffer():
    def traj(r):
        return Trajectory([1, 5, 6], [False, True, True], [0.0, -0.5, -0.5], reward=r, failed=False)

    assert "float32" in traj(5e299).problem()
    assert "float32" in traj(-3.5e38).problem()
    assert traj(3.4e38).problem() is None
    buf = RolloutBuffer(batch_groups=2, async_queue_size=0)
    t1, t2 = buf.acquire(), buf.acquire()
    assert buf.put(t1, [traj(5e299)]) == 0 and buf.put(t2, [traj(1.0)]) == 1
    assert buf.stats()["rejected_trajectories"] == 1 and buf.stats()["skipped_prompts"] == 0


def test_repeated_problems_are_logged_once_per_kind_with_counts(caplog):
    buf = RolloutBuffer(batch_groups=1000, async_queue_size=0)
    nan = Trajectory([1, 5], [False, True], [0.0, -0.5], reward=float("nan"), failed=True)
    with caplog.at_level(logging.WARNING):
        for _ in range(1000):
            buf.put(buf.acquire(), [nan])
    assert buf.stats()["rejected_trajectories"] == 1000
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= 5, lines[:10]
    assert "reward" in lines[0] and any("1000" in x for x in lines), lines


def test_worker_errors_are_logged_once_per_kind(caplog):
    worker, _ = _worker(lambda: SeedEnv(bad=-1, how="raise"))
    worker.env_factory = lambda: _AlwaysRaises()
    with caplog.at_level(logging.WARNING):
        for i in range(25):
            worker.run_tickets([Ticket(4 * i + j, j, 1) for j in range(4)])
    assert worker.stats()["quarantined_episodes"] == 100
    assert len([r for r in caplog.records if "exploded" in r.getMessage()]) == 1
    assert len(caplog.records) <= 5


class _AlwaysRaises(SeedEnv):
    def step(self, action):
        raise RuntimeError("always exploded")


# ---------------------------------------------------------------- the watchdog


def test_the_watchdog_names_what_is_stuck_and_for_how_long():
    now = [100.0]
    dog = Watchdog(stall_timeout_s=60, max_failed_in_a_row=0, clock=lambda: now[0])
    stats = {"put_trajectories": 5, "failed_in_a_row": 0, "quarantined_episodes": 2, "skipped_prompts": 0}
    workers = [{"current_call": "env.step", "current_call_s": 70.0}, {"current_call": "", "current_call_s": 0.0}]
    dog.check(stats, workers)
    now[0] += 59
    dog.check(stats, workers)
    now[0] += 2
    with pytest.raises(RunStalled, match=r"61 s.*train\.stall_timeout_s.*worker 0.*env\.step.*70 s"):
        dog.check(stats, workers)
    # progress (a new trajectory) resets the clock
    now[0] += 1
    dog.check(dict(stats, put_trajectories=6), workers)
    now[0] += 30
    dog.check(dict(stats, put_trajectories=6), workers)


def test_the_watchdog_stops_a_run_whose_every_episode_fails():
    dog = Watchdog(stall_timeout_s=0, max_failed_in_a_row=50)
    dog.check({"put_trajectories": 0, "failed_in_a_row": 49}, [])
    with pytest.raises(RunStalled, match=r"50 episodes in a row.*rollout\.max_failed_episodes_in_a_row"):
        dog.check({"put_trajectories": 0, "failed_in_a_row": 50, "last_failure": "RuntimeError: boom"}, [])


def test_a_run_whose_first_batch_trains_nothing_stops_within_it_naming_the_cause():
    dog = Watchdog(stall_timeout_s=0, max_failed_in_a_row=256)
    first = {"failed_in_a_row": 31, "batch_episodes": 32, "last_failure": "agent play made no model call"}
    dog.check(first, [])
    with pytest.raises(RunStalled, match=r"none of the first 32 episodes gave a token to train on.*made no model call"):
        dog.check(dict(first, failed_in_a_row=32), [])
    # a limit below the batch is the limit that speaks
    with pytest.raises(RunStalled, match=r"4 episodes in a row could not be trained on"):
        Watchdog(stall_timeout_s=0, max_failed_in_a_row=4).check(dict(first, failed_in_a_row=4), [])
    # once something was trained on, failures count against max_failed_episodes_in_a_row as before
    dog.check(dict(first, failed_in_a_row=200, put_trajectories=5), [])
    # and 0 still means never
    Watchdog(stall_timeout_s=0, max_failed_in_a_row=0).check(dict(first, failed_in_a_row=500), [])


def test_a_fatal_episode_stops_the_run_at_once_with_its_line():
    dog = Watchdog(stall_timeout_s=0, max_failed_in_a_row=256)
    line = "the first episode of agent play was cut short: ...; give a larger --data.max_len (now 96)"
    with pytest.raises(RunStalled, match=r"give a larger --data\.max_len"):
        dog.check({"failed_in_a_row": 1, "batch_episodes": 32, "fatal_failure": line, "put_trajectories": 3}, [])


def test_the_buffer_reports_a_fatal_episode_and_the_batch_size():
    from flashreinforce.trainer.rollout.buffer import RolloutBuffer
    from flashreinforce.trainer.rollout.fault_records import QuarantinedEpisode

    buf = RolloutBuffer(batch_groups=4, group_size=2)
    ticket = buf.acquire()
    assert buf.stats()["batch_episodes"] == 8 and not buf.stats()["fatal_failure"]
    buf.put(ticket, [QuarantinedEpisode(ticket.prompt_id, 0, "k", "the reason", retry=False, fatal=True),
                     QuarantinedEpisode(ticket.prompt_id, 1, "k", "other", retry=False)])
    assert buf.stats()["fatal_failure"] == "the reason"


def test_a_reset_that_never_returns_is_counted_as_a_reset_timeout():
    class HangingResetEnv(SeedEnv):
        def reset(self, *, seed):
            if seed == 11:
                RELEASE.wait(600)
            return super().reset(seed=seed)

    worker, _ = _worker(HangingResetEnv, env_timeout_s=0.5)
    groups = worker.run_tickets(_tickets(3))
    assert [type(g[0]).__name__ for g in groups] == ["Trajectory", "QuarantinedEpisode", "Trajectory"]
    assert "env.reset timed out" in groups[1][0].kind
    assert worker.stats()["env_timeouts_by_call"] == {"env.reset": 1}


def test_fault_metrics_count_timeouts_per_update_by_call_and_warn_once_a_minute(caplog):
    now = [0.0]
    faults = FaultMetrics(logging.getLogger("fr-test-faults"), clock=lambda: now[0])
    buffer = {"quarantined_episodes": 4, "skipped_prompts": 1, "retried_prompts": 2}

    def workers(*by_call):
        return [{"env_timeouts": sum(b.values()), "env_timeouts_by_call": b} for b in by_call]

    with caplog.at_level(logging.WARNING, logger="fr-test-faults"):
        first = faults(buffer, workers({"env.step": 1}, {}))
        assert first == {"quarantined_episodes": 4, "skipped_prompts": 1, "retried_prompts": 2, "env_timeouts": 1,
                         "env_timeouts_by_call": {"env.reset": 0, "env.step": 1}}
        assert caplog.records == []  # the first timeout: the worker has logged it in full
        now[0] += 5
        second = faults(buffer, workers({"env.step": 3}, {"env.reset": 2}))
        assert second["env_timeouts_by_call"] == {"env.reset": 2, "env.step": 2} and second["env_timeouts"] == 5
        assert len(caplog.records) == 1  # they repeat: one line
        assert "5 environment call(s) timed out (env.reset 2, env.step 3; 5 in this run)" in caplog.records[0].message
        now[0] += 30
        third = faults(buffer, workers({"env.step": 4}, {"env.reset": 2}))
        assert third["env_timeouts_by_call"] == {"env.reset": 0, "env.step": 1}
        assert len(caplog.records) == 1  # within the minute: counted, not logged
        now[0] += 31
        fourth = faults(buffer, workers({"env.step": 6}, {"env.reset": 2}))
        assert fourth["env_timeouts_by_call"] == {"env.reset": 0, "env.step": 2}
        assert len(caplog.records) == 2
        assert "3 environment call(s) timed out since the last warning 61 s ago (env.step 3; 8 in this run)" in \
            caplog.records[1].message
        now[0] += 100
        quiet = faults(buffer, workers({"env.step": 6}, {"env.reset": 2}))
        assert quiet["env_timeouts_by_call"] == {"env.reset": 0, "env.step": 0} and len(caplog.records) == 2


# ---------------------------------------------------------------- whole runs


class FlakyToyEnv(ToyCopyEnv):
    """The toy task, except that the prompt of seed 3 always raises (a plain constructor)."""

    def __init__(self):
        super().__init__()

    def reset(self, *, seed):
        self._bad = seed == 3
        return super().reset(seed=seed)

    def step(self, action):
        if self._bad:
            raise RuntimeError("flaky environment")
        return super().step(action)


class StuckToyEnv(ToyCopyEnv):
    def step(self, action):
        RELEASE.wait(600)
        return super().step(action)


class SometimesStuckToyEnv(ToyCopyEnv):
    """The toy task, except that the step of every seed 5 mod 8 hangs (until the module ends)."""

    def reset(self, *, seed):
        self._stuck = seed % 8 == 5
        return super().reset(seed=seed)

    def step(self, action):
        if self._stuck:
            RELEASE.wait(600)
        return super().step(action)


class NanToyEnv(ToyCopyEnv):
    def step(self, action):
        r = super().step(action)
        return StepResult(reward=float("nan"), done=r.done)


SMALL = ["--preset", "toy", "--rollout.batch_size", "8", "--train.batch_size", "8", "--rollout.num_workers", "1",
         "--ckpt.save_steps", "0", "--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false"]


def test_a_run_with_a_failing_prompt_completes_and_counts_it(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli_main(["train", *SMALL, "--env", f"{__name__}:FlakyToyEnv", "--train.max_steps", "3",
                     "--output", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["skipped_prompts"] == 1 and rows[-1]["quarantined_episodes"] == 3


def test_a_run_whose_every_reward_is_nan_stops_with_a_clear_error(tmp_path, capsys):
    code = cli_main(["train", *SMALL, "--env", f"{__name__}:NanToyEnv", "--train.max_steps", "3",
                     "--rollout.max_failed_episodes_in_a_row", "40", "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" not in err
    # nothing of the first batch (8) could be trained on: the run stops within it, not after 40 in a row
    found = re.search(r"none of the first (\d+) episodes gave a token to train on \(a batch is 8", err)
    assert found and int(found.group(1)) >= 8, err
    assert "rollout.max_failed_episodes_in_a_row" in err and "reward nan is not finite" in err


def test_a_failed_run_whose_last_checkpoint_fails_too_reports_the_first_error(tmp_path, capsys, caplog,
                                                                              monkeypatch):
    # What a lost Ray cluster does: the run fails, and saving the checkpoint after it fails as well
    # (the buffer lives on the lost cluster). The user must see why the run stopped, on one line.
    from flashreinforce.trainer.run.loop import Trainer

    def lost(self):
        raise ConnectionError("the buffer is unreachable")

    monkeypatch.setattr(Trainer, "_save", lost)
    code = cli_main(["train", *SMALL, "--env", f"{__name__}:NanToyEnv", "--train.max_steps", "3",
                     "--rollout.max_failed_episodes_in_a_row", "40", "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" not in err
    assert "gave a token to train on" in err  # the first error, not the checkpoint's
    assert "no checkpoint could be written after the failure (ConnectionError: the buffer is unreachable)" in caplog.text


def test_a_stuck_environment_is_reported_by_the_watchdog(tmp_path, capsys):
    t0 = time.monotonic()
    code = cli_main(["train", *SMALL, "--env", f"{__name__}:StuckToyEnv", "--train.max_steps", "3",
                     "--rollout.env_timeout_s", "0", "--train.stall_timeout_s", "2", "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" not in err
    assert "env.step" in err and "train.stall_timeout_s" in err
    assert time.monotonic() - t0 < 120


def test_a_run_writes_its_environment_call_timeouts_per_update(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="flashreinforce.trainer"):
        code = cli_main(["train", *SMALL, "--env", f"{__name__}:SometimesStuckToyEnv", "--train.max_steps", "4",
                         "--rollout.env_timeout_s", "0.5", "--output", str(out)])
    elapsed = time.monotonic() - t0
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    per_update = [r["env_timeouts_by_call"] for r in rows]
    assert all(set(u) == {"env.reset", "env.step"} and u["env.reset"] == 0 for u in per_update), per_update
    assert sum(u["env.step"] for u in per_update) == rows[-1]["env_timeouts"] > 1  # they add up to the total
    warnings = [r for r in caplog.records if "environment call(s) timed out" in r.getMessage()]
    # Repeated, so said; but one line a minute at most (a loaded machine may stretch the run past a minute).
    assert 1 <= len(warnings) <= 1 + int(elapsed // 60), [r.getMessage() for r in warnings]


class FaultInjectingToyEnv(ToyCopyEnv):
    """The toy task with a fault of its own for seven prompts in 40 (by seed), counted in ``INJECTED``
    when it happens: reset raises, reset returns an int, reset returns text the character tokenizer
    cannot encode, step raises, step returns a dict, step hangs (until the module ends), step gives
    a NaN reward."""

    KINDS = {1: "reset raises", 6: "reset returns an int", 11: "unencodable prompt", 16: "step raises",
             21: "step returns a dict", 26: "step hangs", 31: "NaN reward"}
    INJECTED: dict[str, int] = {}
    LOCK = threading.Lock()

    def _inject(self, kind):
        with self.LOCK:
            self.INJECTED[kind] = self.INJECTED.get(kind, 0) + 1

    def reset(self, *, seed):
        self._kind = self.KINDS.get(seed % 40)
        prompt = super().reset(seed=seed)
        if self._kind == "reset raises":
            self._inject(self._kind)
            raise RuntimeError("injected reset fault")
        if self._kind == "reset returns an int":
            self._inject(self._kind)
            return 7
        if self._kind == "unencodable prompt":
            self._inject(self._kind)
            return prompt + " \u00e9\u00e9"
        return prompt

    def step(self, action):
        kind = self._kind
        if kind in ("step raises", "step returns a dict", "step hangs", "NaN reward"):
            self._inject(kind)
        if kind == "step raises":
            raise RuntimeError("injected step fault")
        if kind == "step returns a dict":
            return {"reward": 1.0, "done": True}
        if kind == "step hangs":
            RELEASE.wait(600)
        result = super().step(action)
        if kind == "NaN reward":
            return StepResult(reward=float("nan"), done=True)
        return result


def test_a_run_survives_every_kind_of_fault_injected_together_and_loses_nothing(tmp_path):
    from flashreinforce.config import parse_train_args
    from flashreinforce.config.presets import PRESETS
    from flashreinforce.trainer import Trainer

    FaultInjectingToyEnv.INJECTED.clear()
    steps, batch = 30, 8
    cfg = parse_train_args([*SMALL, "--env", f"{__name__}:FaultInjectingToyEnv", "--train.max_steps", str(steps),
                            "--rollout.env_timeout_s", "1", "--rollout.num_workers", "2",
                            "--output", str(tmp_path / "run")], PRESETS)
    summary = Trainer(cfg).run()
    injected = dict(FaultInjectingToyEnv.INJECTED)
    assert summary["status"] == "completed" and summary["step"] == steps
    assert set(injected) == set(FaultInjectingToyEnv.KINDS.values()), injected  # every kind happened
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["trajectories"] == batch for r in rows)  # every update trained on a full batch
    stats = summary["buffer"]
    assert stats["taken_trajectories"] == steps * batch and stats.get("lost_trajectories", 0) == 0
    # Each injected fault reached the buffer as a quarantined episode or a rejected trajectory, except
    # those of the episodes still running when the run stopped (cancelled, their prompts kept).
    accounted = stats["quarantined_episodes"] + stats["rejected_trajectories"]
    assert accounted <= sum(injected.values()) <= accounted + stats.get("cancelled_groups", 0), (injected, stats)
    assert stats["rejected_trajectories"] <= injected["NaN reward"]
    assert rows[-1]["env_timeouts"] == sum(r["env_timeouts_by_call"]["env.step"] for r in rows) > 0
    print(f"[faults] {sum(injected.values())} injected over {steps} updates: {injected}; buffer: "
          f"{ {k: stats.get(k, 0) for k in ('quarantined_episodes', 'rejected_trajectories', 'retried_prompts', 'skipped_prompts', 'cancelled_groups', 'lost_trajectories', 'taken_trajectories')} }")
