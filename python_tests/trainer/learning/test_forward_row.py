"""The learner's forward row (flashreinforce.trainer.learning.forward_row): shared prefixes found from the
token ids, each computed once, with every packed token mapped to the row position that holds it;
and the learner's update unchanged by the sharing."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from flashreinforce.objective import LossOptions
from flashreinforce.trainer.learning.forward_row import forward_row
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.learning.packing import micro_batches, pack
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.builders import tiny_causal_lm


def _traj(ids, prompt_len):
    mask = [False] * prompt_len + [True] * (len(ids) - prompt_len)
    return Trajectory(list(ids), mask, [-0.5 if m else 0.0 for m in mask], reward=float(len(ids) % 2), failed=False)


def _check_row(batch, row):
    """Every packed token is at its row position, with its own position id; the row's segments tile it."""
    assert torch.equal(row.input_ids[row.token_index], batch.input_ids)
    assert torch.equal(row.position_ids[row.token_index], batch.position_ids)
    assert row.layout.num_tokens == row.num_tokens
    # Within a trajectory, the row positions of consecutive tokens follow the layout: token t+1 is either
    # the next row position of the same segment or the first of a child segment.
    seg_of = torch.empty(row.num_tokens, dtype=torch.int64)
    for j, (s, e) in enumerate(zip(row.layout.starts, row.layout.ends)):
        seg_of[s:e] = j
    cu = batch.cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        idx = row.token_index[cu[i]:cu[i + 1]].tolist()
        for a, b in zip(idx, idx[1:]):
            sa, sb = int(seg_of[a]), int(seg_of[b])
            assert (sa == sb and b == a + 1) or (row.layout.parents[sb] == sa and a == row.layout.ends[sa] - 1
                                                 and b == row.layout.starts[sb])


def test_no_sharing_is_the_packed_row():
    batch = pack([_traj(range(3, 13), 4), _traj(range(20, 27), 2)])
    row = forward_row(batch, share_prefixes=False)
    assert torch.equal(row.input_ids, batch.input_ids) and row.shared_tokens == 0 and row.layout.is_plain
    assert row.layout.starts == [0, 10] and row.layout.ends == [10, 17]
    assert torch.equal(row.token_index, torch.arange(17))


def test_a_common_system_prompt_is_computed_once():
    system = list(range(50, 70))  # 20 shared tokens
    trajs = [_traj(system + [3, 4, 5 + i, 6, 7], 22) for i in range(4)]
    batch = pack(trajs)
    row = forward_row(batch)
    _check_row(batch, row)
    # Shared: the 20 system tokens plus [3, 4] = 22, once instead of 4 times.
    assert row.num_tokens == 22 + 4 * 3 and row.shared_tokens == 3 * 22
    assert row.layout.parents == [-1, 0, 0, 0, 0]
    assert row.position_ids[22:25].tolist() == [22, 23, 24]  # positions continue after the prefix


def test_grpo_groups_share_the_system_prompt_and_their_own_prompt():
    rng = random.Random(0)
    system = [rng.randrange(3, 90) for _ in range(12)]
    trajs = []
    for g in range(3):
        user = [90 + g] + [rng.randrange(3, 90) for _ in range(9)]
        for _ in range(4):
            trajs.append(_traj(system + user + [rng.randrange(3, 90) for _ in range(rng.randint(3, 9))], 22))
    batch = pack(trajs)
    row = forward_row(batch)
    _check_row(batch, row)
    parents = row.layout.parents
    assert parents[0] == -1 and sum(p == -1 for p in parents) == 1  # the system prompt, a single root
    prompt_nodes = [j for j, p in enumerate(parents) if p == 0]
    assert len(prompt_nodes) == 3  # one node per group's user prompt
    assert all(sum(p == j for p in parents) == 4 for j in prompt_nodes)  # each with its 4 completions
    assert row.num_tokens == 12 + 3 * 10 + sum(t.num_tokens - 22 for t in trajs)


def test_short_shared_runs_are_recomputed_and_the_threshold_is_exact():
    trajs = [_traj([5, 6, 7, 8, 9, 10, 11, 40 + i, 3], 7) for i in range(3)]  # 7 shared tokens
    batch = pack(trajs)
    assert forward_row(batch, min_shared_tokens=8).layout.is_plain
    row = forward_row(batch, min_shared_tokens=7)
    _check_row(batch, row)
    assert row.shared_tokens == 14
    with pytest.raises(ValueError, match="min_shared_tokens"):
        forward_row(batch, min_shared_tokens=0)


def test_duplicates_and_a_trajectory_that_is_a_prefix_of_another():
    base = list(range(10, 30))
    trajs = [_traj(base, 5), _traj(base, 5), _traj(base + [3, 4, 5], 5), _traj([7] + base, 5)]
    batch = pack(trajs)
    row = forward_row(batch)
    _check_row(batch, row)
    # base once (20), the continuation [3, 4, 5] (3), and the unrelated trajectory (21).
    assert row.num_tokens == 20 + 3 + 21


def test_random_batches_map_every_token():
    rng = random.Random(7)
    for trial in range(30):
        prefixes = [[rng.randrange(3, 8) for _ in range(rng.randint(0, 20))] for _ in range(3)]
        trajs = []
        for _ in range(rng.randint(1, 9)):
            ids = rng.choice(prefixes) + [rng.randrange(3, 8) for _ in range(rng.randint(2, 12))]
            trajs.append(_traj(ids, 1))
        batch = pack(trajs)
        for min_shared in (1, 3, 8):
            _check_row(batch, forward_row(batch, min_shared_tokens=min_shared))


def _learner(model, **kwargs):
    return Learner(model, LearnerSettings(loss=LossOptions(delta=0.05), lr=1e-3, temperature=0.9, **kwargs))


def test_the_update_and_its_statistics_do_not_depend_on_the_forward():
    """Padded, packed and packed with shared prefixes: the same loss, statistics, gradient and step."""
    rng = random.Random(3)
    system = [rng.randrange(3, 60) for _ in range(16)]
    trajs = []
    for i in range(8):
        ids = system + [rng.randrange(3, 60) for _ in range(rng.randint(3, 14))]
        mask = [False] * 17 + [True] * (len(ids) - 17)
        logp = [-rng.random() * 3 if m else 0.0 for m in mask]
        trajs.append(Trajectory(ids, mask, logp, reward=float(i % 3 == 0), failed=i % 3 != 0))
    model = tiny_causal_lm(64, seed=1)
    results = {}
    for name, kwargs in {"padded": dict(packed_forward=False), "packed": dict(share_prefixes=False),
                         "shared": dict(share_prefixes=True), "shared_micro": dict(micro_batch_tokens=90)}.items():
        learner = _learner(copy.deepcopy(model), **kwargs)
        metrics = learner.step(trajs)
        results[name] = (metrics, [p.detach().clone() for p in learner.model.parameters()])
    assert len(micro_batches(trajs, max_tokens=90)) > 1
    want, want_params = results["padded"]
    for name, (got, params) in results.items():
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-8), name
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
        for key in ("acceptance_rate", "policy_tokens"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), (name, key)
        for key, values in want["per_trajectory"].items():
            assert got["per_trajectory"][key] == pytest.approx(values, rel=1e-4, abs=1e-6), (name, key)
        for a, b in zip(params, want_params):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_engine_copies_keep_the_models_own_attention():
    model = tiny_causal_lm(32)
    learner = _learner(model)
    assert model.config._attn_implementation == "per_document"
    assert learner.full_model().config._attn_implementation == "sdpa"
    padded = _learner(tiny_causal_lm(32), packed_forward=False)
    assert padded.model.config._attn_implementation == "sdpa"
