"""The Ray rollout backend on a local Ray instance: ticket ownership, weights by version through the
object store, trajectories recording the versions that sampled them (checked against a float64
recomputation with each version's weights), and a rollout worker killed mid-run."""

from __future__ import annotations

import copy
import logging
import os
import signal
import threading
import time

import pytest
import torch

from flashreinforce.trainer.rollout.buffer import PromptStream, RolloutBuffer
from flashreinforce.distributed.ray import (ActorClient, ActorGone, OwnedBuffer, RayRollout, StaleIncarnation,
                                           WorkerRecipe)
from flashreinforce.engines import SamplingParams
from flashreinforce.trainer.rollout.settings import RolloutSettings
from flashreinforce.trainer.rollout.backend import fair_share
from flashreinforce.models.tokenizers import load_tokenizer
from flashreinforce.envs.registry import EnvSpec
from flashreinforce.models.loading import build_model
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.distributed.worker_freeze import frozen_holding

TOY = "flashreinforce.envs.toy:ToyCopyEnv"

SLOW_ENV = '''
import time
from flashreinforce.envs.toy import ToyCopyEnv


class SlowCopyEnv(ToyCopyEnv):
    """ToyCopyEnv whose step takes a while, so a worker holds its tickets most of the time."""

    def step(self, action):
        time.sleep(0.05)
        return super().step(action)
'''


SOMETIMES_SLOW_ENV = '''
import time
from flashreinforce.envs.toy import ToyCopyEnv


class SometimesSlowEnv(ToyCopyEnv):
    """ToyCopyEnv whose step takes 3 s for every seed 1 mod 4 (longer than the test's env_timeout_s)."""

    def reset(self, *, seed):
        self._slow = seed % 4 == 1
        return super().reset(seed=seed)

    def step(self, action):
        if self._slow:
            time.sleep(3.0)
        return super().step(action)
'''


def traj(ticket, reward=1.0):
    return Trajectory([1, 2, 3], [False, True, True], [0.0, -0.5, -0.7], reward=reward, failed=reward <= 0,
                      prompt_id=ticket.prompt_id)


# ---------------------------------------------------------------------------- ownership (no Ray)
def test_released_tickets_are_lost_handed_out_again_and_late_calls_are_refused():
    owned = OwnedBuffer(RolloutBuffer(batch_groups=4, async_queue_size=0, prompts=PromptStream()))
    a = owned.acquire_many(0, 0, 2, timeout=0)
    b = owned.acquire_many(1, 0, 2, timeout=0)
    assert [t.prompt_id for t in a] == [0, 1] and [t.prompt_id for t in b] == [2, 3]
    assert owned.held(0) == 2 and owned.held(1) == 2
    assert owned.release(0, 0, "killed") == 2
    stats = owned.stats()
    assert stats["lost_groups"] == 2 and stats["lost_trajectories"] == 2 and stats.get("cancelled_groups", 0) == 0
    # The dead incarnation's late put and its late acquire are refused; nothing of it is queued.
    assert owned.put_many(0, 0, [(a[0], [traj(a[0])])]) == [-1]
    with pytest.raises(StaleIncarnation):  # its loop ends instead of asking again and again
        owned.acquire_many(0, 0, 4, timeout=0)
    # Its prompts come out first, to the next incarnation, which may put them.
    again = owned.acquire_many(0, 1, 4, timeout=0)
    assert [t.prompt_id for t in again] == [0, 1]
    assert owned.put_many(0, 1, [(t, [traj(t)]) for t in again]) == [1, 1]
    # A re-issued prompt never takes the old holder's samples (same prompt id, different holder).
    assert owned.put_many(1, 0, [(t, [traj(t)]) for t in b]) == [1, 1]
    batch = owned.buffer.take(0, timeout=0)
    assert sorted(t.prompt_id for g in batch.groups for t in g) == [0, 1, 2, 3]
    assert owned.stats()["late_calls"] == 2


def test_a_late_put_after_release_never_lands_on_the_reissued_ticket():
    owned = OwnedBuffer(RolloutBuffer(batch_groups=1, async_queue_size=0, prompts=PromptStream()))
    (t,) = owned.acquire_many(0, 0, 1, timeout=0)
    owned.release(0, 0)
    (t2,) = owned.acquire_many(1, 0, 1, timeout=0)
    assert t2.prompt_id == t.prompt_id  # handed out again
    assert owned.put_many(0, 0, [(t, [traj(t, reward=5.0)])]) == [-1]  # the dead holder's result is dropped
    assert owned.put_many(1, 0, [(t2, [traj(t2, reward=2.0)])]) == [1]
    batch = owned.buffer.take(0, timeout=0)
    assert [g[0].reward for g in batch.groups] == [2.0]


def test_fair_share_leaves_work_for_every_worker():
    assert fair_share(128, 1, 2) == 128  # 256 prompts may be in flight: half each
    assert fair_share(4, 1, 3) == 3  # rounded up
    assert fair_share(1, 0, 8) == 1  # at least one
    with pytest.raises(ValueError, match="num_workers"):
        fair_share(4, 1, 0)


# ---------------------------------------------------------------------------- on a local Ray instance
@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray", reason="the Ray backend tests need ray (pip install 'flashreinforce[ray]')")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def make_rollout(env_spec, *, num_workers=2, batch_groups=8, async_queue_size=0, per_call=4, max_restarts=2,
                 env_timeout_s=120.0):
    model, _ = build_model("tiny-qwen2", device=torch.device("cpu"), seed=0)
    tok = load_tokenizer("char")
    settings = RolloutSettings(max_new_tokens=1, max_len=24, max_turns=1,
                               sampling=SamplingParams(1.0, 1.0, 0, tok.eos_token_ids), episodes_per_call=per_call,
                               seed=0, env_timeout_s=env_timeout_s)
    rollout = RayRollout.create(address=None, buffer_kwargs=dict(batch_groups=batch_groups, group_size=1,
                                                                 async_queue_size=async_queue_size,
                                                                 vocab_size=tok.vocab_size),
                                prompt_kwargs=dict(num_prompts=None, seed=0))
    recipe = WorkerRecipe(model_config=model.config, engine="hf", tokenizer=tok, env=env_spec, settings=settings,
                          torch_threads=1)
    backend = rollout.backend(recipe, num_workers, num_cpus=1, num_gpus=0, max_restarts=max_restarts)
    return model, tok, rollout, backend


def version_weights(base, version):
    """Distinct weights per version: the base model moved by a seeded random step."""
    g = torch.Generator().manual_seed(1000 + version)
    return {k: v + 0.3 * version * torch.randn(v.shape, generator=g) for k, v in base.state_dict().items()}


@pytest.mark.slow
def test_trajectories_record_the_version_whose_weights_sampled_them(ray_instance):
    base, tok, rollout, backend = make_rollout(EnvSpec(TOY, {}, {"alphabet": "abcdefgh"}), async_queue_size=0)
    states = {v: version_weights(base, v) for v in range(3)}
    try:
        rollout.weights.publish(states[0], 0)
        backend.start()
        got = []
        for version in range(3):
            batch = rollout.buffer.take(version, timeout=60)
            assert batch is not None, "no batch from the Ray workers"
            got.append(batch.trajectories)
            # Synchronous schedule: the next batch starts after this update, with the next weights.
            if version < 2:
                rollout.weights.publish(states[version + 1], version + 1)
            rollout.buffer.update_done()
        stats = rollout.buffer.stats()
    finally:
        backend.stop()
        rollout.close()
    assert stats["taken_trajectories"] == 24 and stats.get("rejected_trajectories", 0) == 0
    model64 = copy.deepcopy(base).double()
    for version, trajs in enumerate(got):
        assert {t.policy_version_min for t in trajs} == {t.policy_version_max for t in trajs} == {version}
        assert {t.worker_id for t in trajs} <= {0, 1}
        for t in trajs:
            k = t.action_mask.index(True)
            for v, state in states.items():
                model64.load_state_dict({n: x.double() for n, x in state.items()})
                with torch.no_grad():
                    logits = model64(input_ids=torch.tensor([t.token_ids[:k]])).logits[0, -1]
                want = float(torch.log_softmax(logits, -1)[t.token_ids[k]])
                if v == version:  # recorded by the engine = recomputed with that version's weights
                    assert t.behavior_log_probs[k] == pytest.approx(want, abs=2e-5), (version, t.prompt_id)
                elif abs(t.behavior_log_probs[k] - want) > 1e-3:
                    break
            else:
                pytest.fail(f"trajectory {t.prompt_id}: its log-prob matches another version's weights too")


@pytest.mark.slow
def test_a_killed_worker_loses_only_its_unfinished_prompts_and_is_restarted(ray_instance, tmp_path):
    env_file = tmp_path / "slow_env.py"
    env_file.write_text(SLOW_ENV)
    base, tok, rollout, backend = make_rollout(EnvSpec(f"{env_file}:SlowCopyEnv", {}, {}), async_queue_size=2,
                                               batch_groups=8, per_call=4)
    taken: list[int] = []
    workers_after: set[int] = set()
    version = 0
    try:
        rollout.weights.publish(base.state_dict(), 0)
        backend.start()

        def learn_one():
            nonlocal version
            batch = rollout.buffer.take(version, timeout=60)
            assert batch is not None, "training stalled"
            taken.extend(t.prompt_id for t in batch.trajectories)
            version += 1
            rollout.weights.publish(base.state_dict(), version)
            rollout.buffer.update_done()
            return batch

        for _ in range(2):
            learn_one()
        deadline = time.monotonic() + 120
        while True:  # freeze worker 0 in the middle of episodes: what it holds cannot change any more
            assert time.monotonic() < deadline, "worker 0 never held a prompt"
            pid = backend.worker_pid(0)
            held = frozen_holding(pid, lambda: ray_instance.get(rollout.buffer.handle.held_prompts.remote(0)))
            if held:
                break
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 300  # a restarted process imports torch again: slow on a busy machine
        while backend.restarts[0] == 0 or not workers_after:
            assert time.monotonic() < deadline, "worker 0 was not restarted"
            batch = learn_one()  # the learner keeps going on the other worker's rollouts
            if backend.restarts[0]:
                workers_after |= {t.worker_id for t in batch.trajectories if t.worker_id == 0}
        for _ in range(2):
            learn_one()
        stats = rollout.buffer.stats()
    finally:
        backend.stop()
        rollout.close()
    worker_stats = backend.stats()  # final: every loop returned its statistics at stop
    assert backend.restarts == [1, 0]
    assert stats["lost_groups"] == len(held) and stats["lost_trajectories"] == len(held)
    assert len(taken) == len(set(taken)), "a prompt was trained on twice"
    for pid_ in held:  # every lost prompt was handed out again and trained on exactly once
        assert taken.count(pid_) == 1, pid_
    assert workers_after == {0}  # the restarted worker produces trajectories again
    assert worker_stats[0]["restarts"] == 1 and worker_stats[0]["episodes"] > 0


@pytest.mark.slow
def test_ray_workers_report_their_environment_call_timeouts_by_call_kind(ray_instance, tmp_path):
    from flashreinforce.trainer.reporting.fault_counters import FaultMetrics

    env_file = tmp_path / "sometimes_slow_env.py"
    env_file.write_text(SOMETIMES_SLOW_ENV)
    base, tok, rollout, backend = make_rollout(EnvSpec(f"{env_file}:SometimesSlowEnv", {}, {}), env_timeout_s=0.3)
    faults = FaultMetrics()
    records = []
    try:
        rollout.weights.publish(base.state_dict(), 0)
        backend.start()
        for version in range(3):
            batch = rollout.buffer.take(version, timeout=120)
            assert batch is not None, "no batch from the Ray workers"
            rollout.weights.publish(base.state_dict(), version + 1)
            rollout.buffer.update_done()
            time.sleep(0.6)  # the supervisor refreshes the workers' statistics twice a second
            records.append(faults(rollout.buffer.stats(), backend.stats()))
    finally:
        backend.stop()
        rollout.close()
    total = records[-1]["env_timeouts"]
    assert total > 0 and sum(r["env_timeouts_by_call"]["env.step"] for r in records) == total, records
    assert all(r["env_timeouts_by_call"]["env.reset"] == 0 for r in records)
    assert records[-1]["quarantined_episodes"] >= total  # each timed-out episode was quarantined


@pytest.mark.slow
def test_after_the_buffer_actor_is_gone_cleanup_is_quick_quiet_and_keeps_the_first_error(ray_instance, caplog):
    caplog.set_level(logging.DEBUG, logger="flashreinforce")
    base, tok, rollout, backend = make_rollout(EnvSpec(TOY, {}, {"alphabet": "abcdefgh"}))
    try:
        rollout.weights.publish(base.state_dict(), 0)
        backend.start()
        assert rollout.buffer.take(0, timeout=60) is not None
        ray_instance.kill(rollout.buffer_actor, no_restart=True)  # as when its node or the cluster goes away
        deadline = time.monotonic() + 60
        # The first call to find the actor gone names itself: this take, or the supervisor's release of a
        # worker that died with it (a race between two threads, either may come first).
        with pytest.raises(ActorGone, match=r"the rollout buffer actor is gone \((take|release)\)") as first:
            while time.monotonic() < deadline:
                rollout.buffer.take(0, timeout=0.5)
        # The workers' calls fail too; the supervisor stops, and says so in one line (a RunFailure).
        while backend._supervisor_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ActorGone, match="the Ray rollout supervisor stopped"):
            backend.check()
        t0 = time.monotonic()
        with pytest.raises(ActorGone) as again:  # a cleanup call: the first error, at once
            rollout.buffer.state_dict()
        assert str(again.value) == str(first.value) and time.monotonic() - t0 < 2.0
    finally:
        t0 = time.monotonic()
        backend.stop(timeout=5.0)  # neither raises nor waits for what cannot answer
        rollout.close()
        cleanup_s = time.monotonic() - t0
    assert cleanup_s < 20.0, cleanup_s
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert tracebacks == [], [r.getMessage() for r in tracebacks]


class SleeperClient(ActorClient):
    remote_methods = frozenset(("sleep", "pid"))
    actor_name = "test actor"


class Sleeper:
    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s

    def pid(self) -> int:
        return os.getpid()


@pytest.mark.slow
def test_actor_client_turns_a_dead_or_silent_actor_into_a_clear_error(ray_instance):
    handle = ray_instance.remote(Sleeper).options(num_cpus=0, max_restarts=0).remote()
    c = SleeperClient(handle, call_timeout_s=1.0)
    assert c.call("sleep", 0.0, timeout=120.0) == 0.0  # the actor is up (starting it may take a while)
    with pytest.raises(ActorGone, match=r"the test actor did not answer sleep within 1 s") as first:
        c.sleep(30.0)
    # From then on the client fails at once with that first error, without asking Ray again.
    t0 = time.monotonic()
    with pytest.raises(ActorGone) as again:
        c.call("pid", timeout=60.0)
    assert str(again.value) == str(first.value) and c.gone is first.value
    assert time.monotonic() - t0 < 2.0  # not the 60 s the call would have waited behind sleep(30)
    ray_instance.kill(handle, no_restart=True)
    fresh = SleeperClient(handle, call_timeout_s=1.0)
    with pytest.raises(ActorGone, match=r"the test actor is gone \(pid\)") as info:
        fresh.call("pid", timeout=60.0)
    # Ends a run like every RunFailure: one line from the CLI, saying how to go on.
    from flashreinforce.trainer.errors import RunFailure

    assert isinstance(info.value, RunFailure)
    assert "continue with --resume" in str(info.value)


@pytest.mark.slow
def test_calls_on_two_threads_that_meet_a_silent_actor_raise_the_first_error(ray_instance):
    handle = ray_instance.remote(Sleeper).options(num_cpus=0, max_restarts=0).remote()
    c = SleeperClient(handle, call_timeout_s=60.0)
    try:
        assert c.call("pid", timeout=120.0) > 0  # the actor is up
        raised = {}

        def call(name, *args, timeout):
            try:
                c.call(name, *args, timeout=timeout)
            except ActorGone as err:
                raised[name] = err

        # Both calls are in flight before either fails; pid waits behind sleep and gives up 0.5 s later.
        threads = [threading.Thread(target=call, args=("sleep", 30.0), kwargs={"timeout": 1.0}),
                   threading.Thread(target=call, args=("pid",), kwargs={"timeout": 1.5})]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        assert "did not answer sleep within 1 s" in str(raised["sleep"]) and c.gone is raised["sleep"]
        assert str(raised["pid"]) == str(raised["sleep"])  # not its own "did not answer pid"
    finally:
        ray_instance.kill(handle, no_restart=True)


def test_the_ray_store_advances_to_the_newest_object_without_a_new_put(ray_instance):
    from flashreinforce.distributed.ray.weights import RayWeightStore, WeightRegistry

    store = RayWeightStore(ray_instance.remote(WeightRegistry).remote())
    with pytest.raises(ValueError, match="published nothing before version 1"):
        store.advance(1)
    state = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    store.publish(state, 0)
    ref = store._ref
    store.advance(1)
    version, got = store.fetch(0)
    assert version == 1 and store.latest_version() == 1 and store._ref is ref
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="not newer"):
        store.advance(1)
