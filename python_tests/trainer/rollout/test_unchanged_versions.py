"""An update without an optimizer step leaves every weight as it was: its version names the same tensors
(``WeightStore.advance``), so engines copy nothing and keep what they computed with those weights (packed
weights, the shared prefix's and the finished turns' keys and values)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flashreinforce.api import train
from flashreinforce.engines import GenerationRequest, HFEngine, LocalWeightStore, SamplingParams
from flashreinforce.engines.base import WeightStore
from flashreinforce.envs.base import Environment, StepResult
from python_tests.builders import tiny_causal_lm


def test_advance_names_the_newest_tensors_under_a_new_version():
    store = LocalWeightStore()
    with pytest.raises(ValueError, match="nothing was published"):
        store.advance(1)
    state = tiny_causal_lm(40).state_dict()
    store.publish(state, 3)
    _, published = store.fetch(-1)
    store.advance(4)
    version, again = store.fetch(3)
    assert version == 4 and store.latest_version() == 4
    assert again.keys() == published.keys() and all(again[k] is published[k] for k in published)
    with pytest.raises(ValueError, match="not newer"):
        store.advance(4)
    store.publish(state, 5)  # publishing goes on as before
    assert store.fetch(4)[0] == 5


def test_the_default_advance_of_a_store_publishes_the_newest_weights_again():
    class ListStore(WeightStore):  # a store with only the abstract methods
        def __init__(self):
            self.versions = []

        def publish(self, state_dict, version, frozen=()):
            self.versions.append((int(version), {k: v.clone() for k, v in state_dict.items()}))

        def latest_version(self):
            return self.versions[-1][0] if self.versions else -1

        def fetch(self, newer_than):
            return self.versions[-1] if self.versions and self.versions[-1][0] > newer_than else None

    store = ListStore()
    with pytest.raises(ValueError, match="nothing was published before version 2"):
        store.advance(2)
    state = tiny_causal_lm(40).state_dict()
    store.publish(state, 1)
    store.advance(2)
    assert store.latest_version() == 2
    assert all(torch.equal(store.versions[1][1][k], state[k]) for k in state)


def test_an_engine_syncing_an_advanced_version_copies_nothing_and_keeps_its_caches():
    policy = tiny_causal_lm(40, seed=3)
    store = LocalWeightStore()
    store.publish(policy.state_dict(), 0)
    engine = HFEngine(copy.deepcopy(policy), pad_token_id=0, version=-1, min_shared_prefix=2)
    assert store.sync(engine) and engine.last_load[1] > 0
    params = SamplingParams(temperature=0.0)
    prompts = [[5, 6, 7, 8, 9, 10 + i] for i in range(3)]
    first = engine.generate([GenerationRequest(p, 4, seed=i) for i, p in enumerate(prompts)], params)
    assert engine._turns is not None and engine._turns.bytes > 0  # the finished turns' states are kept
    fast_key = engine._fast._key if engine._fast is not None else None
    store.advance(1)
    assert store.sync(engine) and engine.version == 1
    assert engine.last_load[1] == 0  # not a byte copied
    if engine._fast is not None:
        assert engine._fast._key == fast_key  # no repacking
    # The next turns go on from the kept states: a turn cache that had been dropped would reuse nothing.
    reused = engine._turns.tokens_reused
    second = [p + g.token_ids + [11, 12] for p, g in zip(prompts, first)]
    out = engine.generate([GenerationRequest(p, 3, seed=i) for i, p in enumerate(second)], params)
    assert engine._turns.tokens_reused > reused
    # A real change is loaded, and the next call reuses nothing kept before it.
    with torch.no_grad():
        policy.lm_head.weight.add_(0.01)
    store.publish(policy.state_dict(), 2)
    assert store.sync(engine) and engine.last_load[1] > 0
    reused = engine._turns.tokens_reused
    third = [p + g.token_ids + [13] for p, g in zip(second, out)]
    engine.generate([GenerationRequest(p, 3, seed=i) for i, p in enumerate(third)], params)
    assert engine._turns.tokens_reused == reused


class ZeroRewardEnv(Environment):
    """Every answer earns 0: every batch's rewards are equal, so every gradient is exactly zero."""

    def reset(self, *, seed):
        return "say a:"

    def step(self, action):
        return StepResult(reward=0.0, done=True)


@pytest.mark.parametrize("step_on_zero", [False, True])
def test_a_run_publishes_no_weights_for_updates_without_an_optimizer_step(step_on_zero, tmp_path):
    settings = {"preset": "toy", "rollout.batch_size": 4, "train.max_steps": 3, "rollout.num_workers": 1,
                "eval.steps": 0, "eval.eval_at_start": False, "ckpt.save_steps": 0,
                "actor.step_on_zero_gradient": step_on_zero}
    summary = train(settings, env=ZeroRewardEnv, output=str(tmp_path), progress=False, torch_threads=1)
    assert summary["status"] == "completed"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(r["optimizer_step_skipped"] == float(not step_on_zero) for r in rows)
    synced = [r["weight_sync_bytes"] for r in rows[1:]]  # the first update's batch came before any sync
    if step_on_zero:  # AdamW moves the weights on a zero gradient (weight decay): every tensor again
        assert all(b > 0 for b in synced)
    else:
        assert synced == [0.0] * len(synced)
