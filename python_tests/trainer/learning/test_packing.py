"""Packing: offsets, reset positions, alignment of log-probs and masks, micro-batches, padding."""

import random

import pytest
import torch

from flashreinforce.trainer.learning.packing import micro_batches, pack, to_padded
from flashreinforce.trainer.rollout.trajectory import Trajectory


def random_traj(rng, turns=3):
    """A multi-turn trajectory built turn by turn, remembering what each token is."""
    tokens, mask, logp, kinds = [], [], [], []
    for k in range(rng.randint(1, 4)):  # prompt
        tokens.append(rng.randrange(100)); mask.append(False); logp.append(0.0); kinds.append("prompt")
    for turn in range(turns):
        for _ in range(rng.randint(1, 5)):
            tokens.append(rng.randrange(100)); mask.append(True); logp.append(-rng.random() * 5); kinds.append("action")
        if turn < turns - 1:
            for _ in range(rng.randint(0, 4)):
                tokens.append(rng.randrange(100)); mask.append(False); logp.append(0.0); kinds.append("obs")
    return Trajectory(tokens, mask, logp, reward=rng.random(), failed=rng.random() < 0.5), kinds


def test_pack_offsets_positions_and_alignment():
    rng = random.Random(0)
    items = [random_traj(rng, turns=rng.randint(1, 4)) for _ in range(9)]
    trajs = [t for t, _ in items]
    p = pack(trajs)
    lengths = [t.num_tokens for t in trajs]
    assert p.cu_seqlens.dtype == torch.int32
    assert p.cu_seqlens.tolist() == [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    for i, (t, kinds) in enumerate(items):
        a, b = int(p.cu_seqlens[i]), int(p.cu_seqlens[i + 1])
        assert p.input_ids[a:b].tolist() == t.token_ids
        assert p.position_ids[a:b].tolist() == list(range(b - a))
        # the log-prob of token t sits at index t, exactly where the token is
        assert p.behavior_log_probs[a:b].tolist() == pytest.approx(t.behavior_log_probs, abs=1e-6)
        # only sampled tokens are policy tokens: prompt and observations are masked out
        assert p.action_mask[a:b].tolist() == [k == "action" for k in kinds]
        assert bool(p.failures[i]) == t.failed and float(p.rewards[i]) == pytest.approx(t.reward)


def test_micro_batches_respect_budgets_and_keep_order():
    rng = random.Random(1)
    trajs = [random_traj(rng)[0] for _ in range(20)]
    mbs = micro_batches(trajs, max_tokens=40, max_trajectories=3)
    assert [r for mb in mbs for r in mb.rows] == list(range(20))
    for mb in mbs:
        assert mb.num_trajectories <= 3
        assert mb.num_tokens <= 40 or mb.num_trajectories == 1  # a long trajectory is never cut
        assert mb.input_ids.tolist() == [x for r in mb.rows for x in trajs[r].token_ids]
    assert len(micro_batches(trajs)) == 1


def test_to_padded_round_trip():
    rng = random.Random(2)
    p = pack([random_traj(rng)[0] for _ in range(5)])
    ids, mask, index = to_padded(p, pad_id=99)
    assert ids.flatten()[index].tolist() == p.input_ids.tolist()
    lengths = (p.cu_seqlens[1:] - p.cu_seqlens[:-1]).tolist()
    assert mask.sum(1).tolist() == lengths
    assert ids.shape == (5, max(lengths))


def test_pack_rejects_inconsistent_lengths():
    bad = Trajectory([1, 2, 3], [False, True], [0.0, -1.0, -1.0], reward=0.0, failed=True)
    with pytest.raises(ValueError, match="trajectory 0"):
        pack([bad])
    with pytest.raises(ValueError, match="empty"):
        pack([])
