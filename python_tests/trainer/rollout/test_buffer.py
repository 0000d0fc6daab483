"""RolloutBuffer semantics: completion order, exactly-once, staleness bound, lag drops, validation."""

import math
import random
import threading

import pytest

from flashreinforce.trainer.rollout.buffer import PromptStream, RolloutBuffer
from flashreinforce.trainer.rollout.trajectory import Trajectory


def traj(prompt_id=0, version=0, reward=1.0, length=4, **kw):
    mask = [False] + [True] * (length - 1)
    return Trajectory(token_ids=list(range(length)), action_mask=mask,
                      behavior_log_probs=[0.0] + [-0.5] * (length - 1), reward=reward, failed=reward <= 0,
                      policy_version_min=version, policy_version_max=version, prompt_id=prompt_id, **kw)


def test_take_returns_groups_in_completion_order_not_issue_order():
    buf = RolloutBuffer(batch_groups=3, async_queue_size=1)
    tickets = [buf.acquire(timeout=0) for _ in range(3)]
    for t in (tickets[2], tickets[0], tickets[1]):  # completion order differs from issue order
        buf.put(t, [traj(t.prompt_id)])
    batch = buf.take(0, timeout=1)
    assert [g[0].prompt_id for g in batch.groups] == [tickets[2].prompt_id, tickets[0].prompt_id, tickets[1].prompt_id]


def test_exactly_once_under_concurrent_workers():
    rng = random.Random(0)
    buf = RolloutBuffer(batch_groups=5, async_queue_size=2)
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            t = buf.acquire(timeout=0.05)
            if t is None:
                if buf.closed:
                    return
                continue
            buf.put(t, [traj(t.prompt_id, reward=rng.random())])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    seen = []
    for version in range(30):
        batch = buf.take(version, timeout=5)
        assert batch is not None and len(batch.groups) == 5
        seen.extend(g[0].prompt_id for g in batch.groups)
        buf.update_done()
    stop.set()
    buf.close()
    for th in threads:
        th.join()
    assert len(seen) == len(set(seen)) == 150  # never a trajectory twice
    assert buf.counters["taken_trajectories"] == 150


@pytest.mark.parametrize("queue", [0, 1, 3])
def test_staleness_bound_limits_prompts_in_flight(queue):
    batch = 4
    buf = RolloutBuffer(batch_groups=batch, async_queue_size=queue)
    got = []
    while (t := buf.acquire(timeout=0)) is not None:
        got.append(t)
    assert len(got) == batch * (1 + queue)  # the current batch plus `queue` batches ahead
    for t in got:
        buf.put(t, [traj(t.prompt_id)])
    assert buf.take(0, timeout=1) is not None
    assert buf.acquire(timeout=0) is None  # taking does not free slots; the update does
    buf.update_done()
    more = [buf.acquire(timeout=0) for _ in range(batch)]
    assert all(t is not None for t in more) and buf.acquire(timeout=0) is None


def test_synchronous_mode_blocks_workers_until_the_update():
    buf = RolloutBuffer(batch_groups=2, async_queue_size=0)
    a, b = buf.acquire(timeout=0), buf.acquire(timeout=0)
    assert buf.acquire(timeout=0.05) is None
    released = []
    th = threading.Thread(target=lambda: released.append(buf.acquire(timeout=5)))
    th.start()
    buf.put(a, [traj(a.prompt_id)])
    buf.put(b, [traj(b.prompt_id)])
    buf.take(0, timeout=1)
    assert th.is_alive()  # still waiting while the learner "trains"
    buf.update_done()
    th.join(5)
    assert released and released[0] is not None


def test_max_policy_lag_drops_counts_and_hands_the_prompt_out_again():
    buf = RolloutBuffer(batch_groups=2, async_queue_size=2, max_policy_lag=1)
    t0, t1, t2 = (buf.acquire(timeout=0) for _ in range(3))
    buf.put(t0, [traj(t0.prompt_id, version=0)])  # lag 3 at learner version 3: dropped
    buf.put(t1, [traj(t1.prompt_id, version=2)])  # lag 1: kept
    buf.put(t2, [traj(t2.prompt_id, version=3)])  # lag 0: kept
    batch = buf.take(3, timeout=1)
    assert [g[0].prompt_id for g in batch.groups] == [t1.prompt_id, t2.prompt_id]
    assert batch.dropped_trajectories == 1 and buf.counters["dropped_stale_trajectories"] == 1
    again = buf.acquire(timeout=0)
    assert (again.prompt_id, again.seed) == (t0.prompt_id, t0.seed)  # not lost: handed out first


def test_lag_uses_the_oldest_version_of_a_multi_version_trajectory():
    buf = RolloutBuffer(batch_groups=1, async_queue_size=0, max_policy_lag=2)
    t = buf.acquire(timeout=0)
    buf.put(t, [Trajectory(**{**traj(t.prompt_id).__dict__, "policy_version_min": 1, "policy_version_max": 5})])
    assert buf.take(4, timeout=0.1) is None  # lag 3 > 2 although the newest tokens are recent
    assert buf.counters["dropped_stale_trajectories"] == 1


@pytest.mark.parametrize("bad,reason", [
    (dict(behavior_log_probs=[0.0, 0.1, -0.1, -0.1]), "<= 0"),
    (dict(behavior_log_probs=[0.0, float("nan"), -0.1, -0.1]), "finite"),
    (dict(reward=float("inf")), "reward"),
    (dict(action_mask=[False] * 4), "no action token"),
    (dict(action_mask=[False, True, True]), "lengths disagree"),
    (dict(token_ids=[0, 1, 2, 500]), "token id"),
])
def test_invalid_trajectories_are_rejected_counted_and_quarantined(bad, reason):
    buf = RolloutBuffer(batch_groups=1, async_queue_size=0, vocab_size=100)
    t = buf.acquire(timeout=0)
    good = traj(t.prompt_id, reward=0.5)
    broken = Trajectory(**{**traj(t.prompt_id).__dict__, **bad})
    assert buf.put(t, [broken, good]) == 1
    assert buf.counters["rejected_trajectories"] == 1
    problem, kept = buf.quarantine[-1]
    assert reason in problem and kept is broken
    batch = buf.take(0, timeout=1)  # training goes on with the valid sample
    assert batch.trajectories == [good]


def test_an_entirely_invalid_group_frees_its_slot():
    buf = RolloutBuffer(batch_groups=1, async_queue_size=0)
    t = buf.acquire(timeout=0)
    assert buf.acquire(timeout=0) is None
    buf.put(t, [Trajectory(**{**traj(t.prompt_id).__dict__, "reward": math.nan})])
    assert buf.counters["rejected_groups"] == 1
    assert buf.acquire(timeout=0) is not None


def test_cancel_requeues_and_double_put_is_an_error():
    buf = RolloutBuffer(batch_groups=2, async_queue_size=0)
    a = buf.acquire(timeout=0)
    buf.cancel(a, "worker died")
    again = buf.acquire(timeout=0)
    assert again.prompt_id == a.prompt_id
    buf.put(again, [traj(again.prompt_id)])
    with pytest.raises(ValueError, match="not outstanding"):
        buf.put(again, [traj(again.prompt_id)])


def test_close_wakes_waiters():
    buf = RolloutBuffer(batch_groups=1, async_queue_size=0)
    buf.acquire(timeout=0)
    out = []
    th = threading.Thread(target=lambda: out.append((buf.acquire(), buf.take(0))))
    th.start()
    buf.close()
    th.join(5)
    assert out == [(None, None)]


def test_state_dict_hands_out_in_flight_prompts_first_after_resume():
    stream = PromptStream(num_prompts=5, seed=3)
    buf = RolloutBuffer(batch_groups=2, async_queue_size=1, prompts=stream)
    ts = [buf.acquire(timeout=0) for _ in range(4)]
    for t in ts[:2]:
        buf.put(t, [traj(t.prompt_id)])
    buf.take(0, timeout=1)
    buf.update_done()
    state = buf.state_dict()
    fresh = RolloutBuffer(batch_groups=2, async_queue_size=1, prompts=PromptStream(num_prompts=5, seed=3))
    fresh.load_state_dict(state)
    resumed = [fresh.acquire(timeout=0) for _ in range(4)]
    assert [(t.prompt_id, t.seed) for t in resumed[:2]] == [(t.prompt_id, t.seed) for t in ts[2:]]
    continuing = [buf.acquire(timeout=0) for _ in range(2)]
    assert [(t.prompt_id, t.seed) for t in resumed[2:]] == [(t.prompt_id, t.seed) for t in continuing]
    assert fresh.acquire(timeout=0) is None  # the same bound holds after resume


def test_prompt_stream_passes_are_permutations():
    s = PromptStream(num_prompts=7, seed=1)
    seeds = [s.next()[1] for _ in range(21)]
    for k in range(3):
        assert sorted(seeds[7 * k:7 * k + 7]) == list(range(7))
    assert seeds[:7] != seeds[7:14]  # each pass reshuffled


def test_wait_until_full_waits_for_every_allowed_prompt_to_finish():
    """The fixed policy lag's gate: full once every prompt of the batches the bound allows is handed out
    and finished (a cancelled one is handed out again and must finish too); closing releases it."""
    buf = RolloutBuffer(batch_groups=2, async_queue_size=1)  # two batches of two prompts allowed
    assert not buf.wait_until_full(timeout=0)  # nothing handed out yet
    tickets = [buf.acquire(timeout=0) for _ in range(4)]
    assert buf.acquire(timeout=0) is None  # the bound is reached
    for t in tickets[:3]:
        buf.put(t, [traj(t.prompt_id)])
    assert not buf.wait_until_full(timeout=0.05)  # one still being generated
    buf.cancel(tickets[3], "worker error")
    assert not buf.wait_until_full(timeout=0)  # its slot is free again
    again = buf.acquire(timeout=0)
    assert again.prompt_id == tickets[3].prompt_id and buf.acquire(timeout=0) is None
    finisher = threading.Timer(0.1, lambda: buf.put(again, [traj(again.prompt_id)]))
    finisher.start()
    assert buf.wait_until_full(timeout=5)
    finisher.join()
    batch = buf.take(0, timeout=0)  # taking a batch keeps it full: taken groups stay counted
    assert len(batch.groups) == 2 and buf.wait_until_full(timeout=0)
    buf.update_done()  # one more batch allowed: not full until it is sampled
    assert not buf.wait_until_full(timeout=0)
    closer = threading.Timer(0.1, buf.close)
    closer.start()
    assert buf.wait_until_full(timeout=5) is False
    closer.join()
