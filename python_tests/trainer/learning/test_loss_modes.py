"""Loss modes by name: the registry, a user-registered mode driving the Learner, the learner interface."""

import random

import pytest
import torch

from flashreinforce.objective import LOSS_MODE_REGISTRY
from flashreinforce.ops.loss_modes import LOSS_MODES, LossMode, get_loss_mode, register_loss_mode
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings, PolicyLearner
from python_tests.builders import random_trajectory, tiny_causal_lm

VOCAB = 40


def test_unknown_mode_names_the_known_ones():
    with pytest.raises(ValueError, match=r"actor.loss_mode must be one of \['flash_reinforce', 'ppo'.*got 'nope'"):
        get_loss_mode("nope")
    with pytest.raises(ValueError, match="actor.loss_mode"):
        LearnerSettings(loss_mode="nope")


def test_a_name_registers_once():
    class Again(LossMode):
        name = "ppo"

        def loss(self, mb, batch, options):
            raise AssertionError

        def summarize(self, per_trajectory, sums, batch):
            raise AssertionError

    with pytest.raises(ValueError, match="already registered"):
        register_loss_mode(Again)
    assert type(LOSS_MODES["ppo"]).__name__ == "PPOClippedLoss"


class _MeanRewardReinforce(LossMode):
    """Plain on-policy REINFORCE, token mean over the batch: -(1/tokens) sum_t (R_i - mean R) log p_t."""

    name = "test_plain_reinforce"
    per_trajectory_stats = ("tokens",)

    def loss(self, mb, batch, options):
        lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).cpu()
        row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        adv = (mb.rewards.double() - batch.reward_baseline).float()[row]
        loss = -(adv * mb.log_probs * mb.action_mask).sum() / batch.policy_tokens
        tokens = torch.zeros(lengths.numel()).index_add_(0, row, mb.action_mask.float())
        return loss, {"tokens": tokens}, {"calls": 1.0}

    def summarize(self, per_trajectory, sums, batch):
        return {"tokens_seen": float(per_trajectory["tokens"].sum()), "micro_batches": sums["calls"]}


@pytest.fixture
def plain_reinforce():
    register_loss_mode(_MeanRewardReinforce)
    yield _MeanRewardReinforce.name
    del LOSS_MODES[_MeanRewardReinforce.name]
    del LOSS_MODE_REGISTRY[_MeanRewardReinforce.name]


def test_a_registered_mode_drives_the_learner(plain_reinforce):
    rng = random.Random(0)
    trajs = [random_trajectory(rng, VOCAB) for _ in range(6)]
    model = tiny_causal_lm(VOCAB, seed=1)
    learner = Learner(model, LearnerSettings(loss_mode=plain_reinforce, lr=1e-2, micro_batch_trajectories=2),
                      pad_token_id=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = learner.step(trajs)
    assert metrics["tokens_seen"] == sum(t.num_action_tokens for t in trajs)
    assert metrics["micro_batches"] == 3.0
    assert learner.version == 1 and learner.loss_impl == plain_reinforce
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_learners_implement_the_loop_interface():
    learner = Learner(tiny_causal_lm(VOCAB), LearnerSettings(), pad_token_id=0)
    assert isinstance(learner, PolicyLearner) and learner.sharded is False
    copy = learner.full_model()
    assert copy is not learner.model and torch.equal(copy.lm_head.weight, learner.model.lm_head.weight)
    from flashreinforce.distributed.data_parallel import DataParallelLearner

    members = [m for m in dir(PolicyLearner) if not m.startswith("_")] + list(PolicyLearner.__annotations__)
    missing = [m for m in members if not hasattr(DataParallelLearner, m) and m not in ("loss_impl",)]
    assert missing == [], missing


def test_ppo_with_one_sample_per_prompt_takes_the_batch_as_the_group():
    """GRPO's group baseline of a one-trajectory group is its own reward (advantage 0, nothing trains):
    with groups of one the ppo mode uses the batch mean, as FlashREINFORCE does; real groups keep theirs."""
    from flashreinforce.objective import LossOptions

    mode = get_loss_mode("ppo")
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    singles = mode.advantages(rewards, torch.tensor([5, 2, 9, 7]), LossOptions())
    assert singles.tolist() == [0.5, -0.5, -0.5, 0.5]
    pairs = mode.advantages(rewards, torch.tensor([0, 0, 1, 1]), LossOptions())
    assert pairs.tolist() == [0.5, -0.5, -0.5, 0.5]
    pairs = mode.advantages(torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1]),
                            LossOptions())
    assert pairs.tolist() == [0.0, 0.0, -0.5, 0.5]


@pytest.mark.parametrize("metric", ["binary_kl", "kpop", "k3", "log_ratio"])
def test_the_method_reports_every_gate_metric_per_trajectory(metric):
    """``drift_<metric>`` of each trajectory is the metric's mean the fused gate would compare with delta:
    the selected metric's equals the gate's own sequence_kl."""
    import math

    from flashreinforce.objective import LossOptions
    from flashreinforce.ops.loss_modes import BatchContext, MicroBatch

    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 12, 20])
    current = -torch.rand(20, generator=gen, dtype=torch.float64) * 3
    behavior = current + 0.3 * torch.randn(20, generator=gen, dtype=torch.float64)
    behavior = behavior.clamp(max=0.0)
    mask = torch.ones(20, dtype=torch.bool)
    mask[cu[:-1]] = False
    mb = MicroBatch(current.clone().requires_grad_(), behavior, torch.tensor([1.0, 0.0, 1.0]), cu, mask,
                    torch.zeros(3, dtype=torch.bool), torch.arange(3))
    mode = get_loss_mode("flash_reinforce")
    _, per_trajectory, _ = mode.loss(mb, BatchContext(3, 2 / 3, int(mask.sum())),
                                     LossOptions(delta=math.inf, gate_metric=metric))
    assert set(per_trajectory) == set(mode.per_trajectory_stats)
    assert torch.allclose(per_trajectory[f"drift_{metric}"], per_trajectory["sequence_kl"].double(), rtol=1e-10)
    others = [m for m in ("binary_kl", "kpop", "k3", "log_ratio") if m != metric]
    assert all(not torch.allclose(per_trajectory[f"drift_{m}"], per_trajectory["sequence_kl"].double())
               for m in others)
