"""Rollout workers: multi-turn layout (observations masked), versions, limits, failures, engine errors
(episode faults: test_fault_tolerance.py)."""

import time

import pytest

from flashreinforce.trainer.rollout.buffer import RolloutBuffer, Ticket
from flashreinforce.engines import HFEngine, LocalWeightStore, SamplingParams
from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.toy import ToyCopyChainEnv
from flashreinforce.trainer.errors import RolloutFailed
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.worker import MAX_ENGINE_FAILURES_IN_A_ROW, RolloutWorker
from flashreinforce.trainer.rollout.thread_pool import ThreadRolloutPool
from flashreinforce.models.tokenizers import CharTokenizer
from python_tests.builders import tiny_causal_lm

TOK = CharTokenizer()


def engine(seed=0, version=0):
    model = tiny_causal_lm(TOK.vocab_size, seed=seed, layers=1, tied=False, max_positions=256)
    return HFEngine(model, pad_token_id=TOK.pad_token_id, version=version)


def settings(**kw):
    base = dict(max_new_tokens=3, max_len=200, max_turns=8, sampling=SamplingParams(stop_token_ids=TOK.eos_token_ids),
                episodes_per_call=4, seed=1)
    base.update(kw)
    return RolloutSettings(**base)


def make_worker(env_factory, store=None, eng=None, **kw):
    store = store or LocalWeightStore()
    eng = eng or engine()
    if store.latest_version() < 0:
        store.publish(eng.model.state_dict(), max(0, eng.version))
    buf = RolloutBuffer(batch_groups=4, async_queue_size=1, vocab_size=TOK.vocab_size)
    return RolloutWorker(0, eng, env_factory, TOK, buf, store, settings(**kw)), buf


def test_multi_turn_layout_masks_observation_tokens():
    worker, _ = make_worker(lambda: ToyCopyChainEnv(alphabet="abc", turns=3))
    groups = worker.run_tickets([Ticket(i, 100 + i, 2) for i in range(3)])
    for g in groups:
        assert len(g) == 2
        for t in g:
            assert t.problem(TOK.vocab_size) is None
            env = ToyCopyChainEnv(alphabet="abc", turns=3)
            prompt = env.reset(seed=t.seed)
            # rebuild the episode independently from the token ids and the environment
            ids, mask, lps = t.token_ids, t.action_mask, t.behavior_log_probs
            expect_prompt = TOK.encode_prompt(prompt)
            assert ids[:len(expect_prompt)] == expect_prompt and not any(mask[:len(expect_prompt)])
            pos, reward, turns = len(expect_prompt), 0.0, 0
            while pos < len(ids):
                end = pos
                while end < len(ids) and mask[end]:
                    end += 1
                assert end > pos, "a turn without action tokens"
                assert all(lp < 0 or lp == 0 for lp in lps[pos:end])
                result = env.step(TOK.decode(ids[pos:end]))
                reward += result.reward
                turns += 1
                obs = TOK.encode_observation(result.observation) if not result.done else []
                assert ids[end:end + len(obs)] == obs  # observation text, appended verbatim
                assert not any(mask[end:end + len(obs)]) and all(x == 0.0 for x in lps[end:end + len(obs)])
                pos = end + len(obs)
            assert turns == t.num_turns == 3 and t.reward == pytest.approx(reward)
            assert t.failed == (t.info["correct_turns"] < 3) and not t.truncated


class PublishingEnv(Environment):
    """Publishes new weights in the middle of its episode (as a concurrent learner would)."""

    def __init__(self, store, new_state):
        self.store, self.new_state, self.turn = store, new_state, 0

    def reset(self, *, seed):
        self.turn = 0
        return "go:"

    def step(self, action):
        self.turn += 1
        if self.turn == 1 and self.store.latest_version() < 1:
            self.store.publish(self.new_state, 1)
        return StepResult(observation=" more:", reward=0.0, done=self.turn >= 2)


def test_new_weights_between_turns_give_a_multi_version_trajectory():
    store = LocalWeightStore()
    eng = engine(0, version=0)
    store.publish(eng.model.state_dict(), 0)
    new_state = engine(1).model.state_dict()
    worker, _ = make_worker(lambda: PublishingEnv(store, new_state), store=store, eng=eng)
    (t,), = worker.run_tickets([Ticket(0, 0, 1)])
    assert (t.policy_version_min, t.policy_version_max) == (0, 1)
    assert eng.version == 1 and worker.weight_loads == 1
    assert t.failed  # no failure label from the env: reward 0 <= 0 means failed


class EndlessEnv(Environment):
    def reset(self, *, seed):
        return "x"

    def step(self, action):
        return StepResult(observation=" again:", reward=0.25, done=False)


def test_turn_and_context_limits_truncate():
    worker, _ = make_worker(EndlessEnv, max_turns=2)
    (t,), = worker.run_tickets([Ticket(0, 0, 1)])
    assert t.truncated and t.num_turns == 2 and t.reward == 0.5 and not t.failed
    worker, _ = make_worker(EndlessEnv, max_len=12, max_turns=50)
    (t,), = worker.run_tickets([Ticket(0, 0, 1)])
    assert t.truncated and t.num_tokens <= 12


def test_rollouts_are_reproducible_from_the_seeds():
    a, _ = make_worker(lambda: ToyCopyChainEnv(turns=2))
    b, _ = make_worker(lambda: ToyCopyChainEnv(turns=2))
    ga = a.run_tickets([Ticket(5, 17, 1), Ticket(6, 18, 1)])
    gb = b.run_tickets([Ticket(6, 18, 1)])  # other batch composition, same prompt
    assert ga[1][0].token_ids == gb[0][0].token_ids


class BrokenEngine(HFEngine):
    def generate(self, requests, params, **kwargs):
        raise RuntimeError("engine exploded")


def test_a_worker_whose_engine_always_fails_stops_and_is_reported():
    model = tiny_causal_lm(TOK.vocab_size, seed=0, layers=1, tied=False, max_positions=256)
    worker, buf = make_worker(lambda: ToyCopyChainEnv(turns=2),
                              eng=BrokenEngine(model, pad_token_id=TOK.pad_token_id, version=0), episodes_per_call=1)
    pool = ThreadRolloutPool([worker])
    pool.start()
    deadline = time.time() + 30
    while any(t.is_alive() for t in pool._threads) and time.time() < deadline:
        time.sleep(0.05)
    with pytest.raises(RolloutFailed, match="every rollout worker has stopped"):
        pool.check()
    # each failed call's episode was quarantined; its prompt retried, then skipped
    assert worker.engine_failures_in_a_row == MAX_ENGINE_FAILURES_IN_A_ROW == worker.errors
    assert buf.counters["quarantined_episodes"] == MAX_ENGINE_FAILURES_IN_A_ROW
    assert buf.counters["skipped_prompts"] >= 1
    assert "engine exploded" in worker.last_error
    pool.stop()


def test_pool_runs_workers_concurrently_with_a_learner_loop():
    store = LocalWeightStore()
    buf = RolloutBuffer(batch_groups=4, async_queue_size=1, vocab_size=TOK.vocab_size)
    workers = []
    for i in range(2):
        e = engine(0, version=0)
        workers.append(RolloutWorker(i, e, lambda: ToyCopyChainEnv(turns=2), TOK, buf, store, settings()))
    store.publish(workers[0].engine.model.state_dict(), 0)
    pool = ThreadRolloutPool(workers)
    pool.start()
    seen_workers = set()
    version = 0
    # Which worker gets a batch's prompts depends on thread timing: learn until both have contributed.
    while version < 4 or (seen_workers != {0, 1} and version < 40):
        batch = buf.take(version, timeout=30)
        assert batch is not None
        seen_workers |= {t.worker_id for t in batch.trajectories}
        version += 1
        store.publish(workers[0].engine.model.state_dict(), version)
        buf.update_done()
    pool.stop()
    assert seen_workers == {0, 1}
    assert all(not t.is_alive() for t in pool._threads)
