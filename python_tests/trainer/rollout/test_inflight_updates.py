"""In-flight weight updates: a turn paused for newer weights continues under them, and every token
keeps the version (and log-probability) it was sampled with."""

from __future__ import annotations

import torch

from flashreinforce.engines import GenerationRequest, HFEngine, LocalWeightStore, SamplingParams
from flashreinforce.engines.base import Generation, RolloutEngine
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.models.tokenizers import CharTokenizer
from flashreinforce.trainer.rollout.buffer import RolloutBuffer, Ticket
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.worker import RolloutWorker
from python_tests.builders import tiny_causal_lm

TOK = CharTokenizer()


class OneTurnEnv(Environment):
    """One turn; reward 1 for any answer."""

    def reset(self, *, seed):
        return f"q{seed}"

    def step(self, action):
        return StepResult("", 1.0, True)


class PausingEngine(RolloutEngine):
    """Samples token ``10 + version`` with log-prob ``-0.1 * (version + 1)``; asks ``should_pause`` after
    every ``chunk`` tokens and pauses when it says so. Records the requests it was given."""

    can_pause = True

    def __init__(self, chunk: int) -> None:
        self.version = 0
        self.chunk = chunk
        self.calls: list[list[GenerationRequest]] = []

    def load_weights(self, state_dict, version):
        self.version = int(version)

    def generate(self, requests, params, *, should_pause=None):
        self.calls.append([GenerationRequest(list(r.token_ids), r.max_new_tokens, r.seed) for r in requests])
        out = []
        for r in requests:
            n = r.max_new_tokens
            reason = "length"
            if should_pause is not None and n > self.chunk and should_pause():
                n, reason = self.chunk, "paused"
            out.append(Generation([10 + self.version] * n, [-0.1 * (self.version + 1)] * n, reason, self.version))
        return out


def _worker(engine, store, inflight: bool, max_new_tokens: int = 10) -> RolloutWorker:
    settings = RolloutSettings(max_new_tokens=max_new_tokens, max_len=100, sampling=SamplingParams(),
                               episodes_per_call=2, seed=3, inflight_weight_updates=inflight)
    buf = RolloutBuffer(batch_groups=2, async_queue_size=1, vocab_size=TOK.vocab_size)
    return RolloutWorker(0, engine, OneTurnEnv, TOK, buf, store, settings)


def test_a_turn_paused_for_new_weights_continues_under_them_with_per_token_versions():
    store = LocalWeightStore()
    store.publish({"w": torch.zeros(1)}, 0)
    engine = PausingEngine(chunk=4)
    worker = _worker(engine, store, inflight=True)
    store.publish({"w": torch.ones(1)}, 1)  # newer weights wait before the turn starts sampling
    engine.version = 0  # ... but the engine holds version 0 when the call begins
    worker.weights = _NoSyncBeforeTheCall(store)
    [[t1], [t2]] = worker.run_tickets([Ticket(0, 5, 1), Ticket(1, 6, 1)])
    for t in (t1, t2):
        actions = [tok for tok, m in zip(t.token_ids, t.action_mask) if m]
        assert actions == [10] * 4 + [11] * 6  # 4 tokens under version 0, the rest under version 1
        assert t.action_versions() == [0] * 4 + [1] * 6
        lps = [lp for lp, m in zip(t.behavior_log_probs, t.action_mask) if m]
        assert lps == [-0.1] * 4 + [-0.2] * 6
        assert (t.policy_version_min, t.policy_version_max) == (0, 1)
        assert t.problem(TOK.vocab_size) is None
    # The continuation asked for the rest of the turn, from the context so far.
    first, second = engine.calls
    assert [r.max_new_tokens for r in second] == [6, 6]
    assert [list(r.token_ids) for r in second] == [list(r.token_ids) + [10] * 4 for r in first]
    assert worker.inflight_pauses == 1 and worker.stats()["inflight_pauses"] == 1


def test_without_inflight_updates_the_engine_is_never_asked_to_pause():
    store = LocalWeightStore()
    store.publish({"w": torch.zeros(1)}, 0)
    engine = PausingEngine(chunk=4)
    worker = _worker(engine, store, inflight=False)
    worker.weights = _NoSyncBeforeTheCall(store)
    store.publish({"w": torch.ones(1)}, 1)
    [[t]] = worker.run_tickets([Ticket(0, 5, 1)])
    assert t.action_versions() == [0] * 10 and len(engine.calls) == 1


class _NoSyncBeforeTheCall:
    """The store, except that the sync before a call finds nothing (so the newer version is still
    waiting when the engine starts sampling, as when it is published during the call)."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def sync(self, engine):
        self.calls += 1
        if self.calls == 1:
            return False
        return self.store.sync(engine)

    def latest_version(self):
        return self.store.latest_version()


def test_the_hf_engine_pauses_at_a_check_and_its_tokens_are_those_of_the_whole_turn():
    model = tiny_causal_lm(TOK.vocab_size, seed=2, layers=1, tied=False, max_positions=256)
    engine = HFEngine(model, pad_token_id=TOK.pad_token_id, version=0)
    params = SamplingParams(temperature=1.0)
    reqs = [GenerationRequest(TOK.encode_prompt(f"prompt {i}"), 30, seed=40 + i) for i in range(3)]
    whole = engine.generate(reqs, params)
    asked = []
    paused = engine.generate(reqs, params, should_pause=lambda: asked.append(1) or len(asked) == 2)
    steps = 2 * engine.pause_check_steps
    for w, p in zip(whole, paused):
        if len(w.token_ids) <= steps:  # finished before the pause
            assert p.token_ids == w.token_ids and p.finish_reason == w.finish_reason
        else:
            assert p.finish_reason == "paused" and p.token_ids == w.token_ids[:steps]
            assert p.log_probs == w.log_probs[:steps]
