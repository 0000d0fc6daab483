"""A batch whose every advantage is 0: the learner runs its forwards for the statistics only, and the update
is that of the full backward, bit for bit (weights, AdamW's state, the statistics)."""

import copy

import pytest
import torch

from flashreinforce.objective import LossOptions
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.trainer.learning.test_trainer_learner import random_batch, tiny_model


def _with_rewards(trajectories, rewards):
    return [Trajectory(t.token_ids, t.action_mask, t.behavior_log_probs, reward=r, failed=r < 0.5)
            for t, r in zip(trajectories, rewards)]


def _pair(settings, seed=5):
    """Two learners on the same model and batch history: one as shipped, one that always runs the backward."""
    model = tiny_model(seed)
    skipping = Learner(copy.deepcopy(model), settings)
    full = Learner(copy.deepcopy(model), settings)
    full.gradient_vanishes = lambda trajectories, totals: False
    return model, skipping, full


def _weights(learner):
    return {k: v.clone() for k, v in learner.scorer.state_dict().items()}


@pytest.mark.parametrize("loss_mode", ["flash_reinforce", "ppo"])
@pytest.mark.parametrize("step_on_zero", [True, False])
def test_a_batch_of_equal_rewards_skips_the_backward_and_gives_the_same_update(loss_mode, step_on_zero):
    settings = LearnerSettings(loss_mode=loss_mode, lr=1e-2, weight_decay=0.1, loss=LossOptions(delta=0.5),
                               step_on_zero_gradient=step_on_zero)
    model, skipping, full = _pair(settings)
    first = random_batch(3, model, n=5)  # an ordinary update first: AdamW has momentum to move the weights with
    equal = _with_rewards(random_batch(4, model, n=5), [1.0] * 5)
    results = []
    for learner in (skipping, full):
        ordinary = learner.step(first)
        assert ordinary["backward_skipped"] == 0.0 and ordinary["grad_norm"] > 0
        before = _weights(learner)
        results.append((learner.step(equal), before))
    (skipped, before), (ran, _) = results
    assert skipped["backward_skipped"] == 1.0 and ran["backward_skipped"] == 0.0
    assert skipped["grad_norm"] == ran["grad_norm"] == 0.0
    assert skipped["optimizer_step_skipped"] == ran["optimizer_step_skipped"] == float(not step_on_zero)
    for key in ("loss", "acceptance_rate", "lr", "policy_tokens"):
        assert skipped[key] == ran[key], key
    if loss_mode == "flash_reinforce":
        assert skipped["per_trajectory"] == ran["per_trajectory"]
        assert skipped["sequence_kl_mean"] == ran["sequence_kl_mean"]
    # The forwards alone: a third of a forward and backward of the same rows (no frozen weight here).
    assert skipped["model_flops"] == pytest.approx(ran["model_flops"] / 3)
    a, b = _weights(skipping), _weights(full)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], before[k]) for k in a) is step_on_zero
    sa, sb = skipping.optimizer.state_dict()["state"], full.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][name], sb[i][name]) for i in sa for name in sa[i])
    assert skipping.version == full.version == 2


def test_the_rule_follows_the_loss_arithmetic_rewards_stored_in_float32():
    # Five rewards of 0.1: their float64 mean is 0.1, but the packed batch stores float32(0.1), so every
    # advantage is about 1.5e-9, not 0; the gradient is tiny and not zero, and the backward runs.
    model = tiny_model(6)
    learner = Learner(model, LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5)))
    out = learner.step(_with_rewards(random_batch(4, model, n=5), [0.1] * 5))
    assert out["backward_skipped"] == 0.0 and out["grad_norm"] > 0.0
    # 0.5 is exact in float32: every advantage is 0.
    out = learner.step(_with_rewards(random_batch(5, model, n=5), [0.5] * 5))
    assert out["backward_skipped"] == 1.0 and out["grad_norm"] == 0.0


def test_the_backward_runs_when_any_reward_differs_or_an_entropy_bonus_is_on():
    model = tiny_model(7)
    batch = random_batch(4, model, n=5)
    learner = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5)))
    out = learner.step(_with_rewards(batch, [1.0, 1.0, 1.0, 1.0, 0.0]))
    assert out["backward_skipped"] == 0.0 and out["grad_norm"] > 0.0
    bonus = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5), entropy_coef=0.01))
    out = bonus.step(_with_rewards(batch, [1.0] * 5))
    assert out["backward_skipped"] == 0.0 and out["grad_norm"] > 0.0  # the bonus has a gradient of its own


def test_a_skipped_backward_still_raises_the_loss_errors():
    # The loss still runs on the forwards' log-probabilities: a behavior log-probability the op refuses
    # is refused whether or not the gradient vanishes.
    model = tiny_model(8)
    batch = _with_rewards(random_batch(4, model, n=3), [1.0] * 3)
    bad = batch[0]
    blp = list(bad.behavior_log_probs)
    blp[bad.action_mask.index(True)] = float("nan")
    batch[0] = Trajectory(bad.token_ids, bad.action_mask, blp, reward=1.0, failed=False)
    learner = Learner(model, LearnerSettings(lr=1e-2))
    with pytest.raises(ValueError, match="behavior_log_probs"):
        learner.step(batch)
    assert learner.version == 0


@pytest.mark.parametrize("step_on_zero", [True, False])
def test_without_statistics_no_pass_runs_and_the_update_is_the_same(step_on_zero):
    settings = dict(lr=1e-2, weight_decay=0.1, loss=LossOptions(delta=0.5), step_on_zero_gradient=step_on_zero)
    model = tiny_model(9)
    scored = Learner(copy.deepcopy(model), LearnerSettings(**settings))
    unscored = Learner(copy.deepcopy(model), LearnerSettings(**settings, statistics_without_gradient=False))
    calls = []
    forward = unscored.scorer.forward
    unscored.scorer.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    first = random_batch(3, model, n=5)
    equal = _with_rewards(random_batch(4, model, n=5), [1.0] * 5)
    for learner in (scored, unscored):
        learner.step(first)
    passes = len(calls)
    assert passes > 0  # an ordinary update runs its passes
    a, b = scored.step(equal), unscored.step(equal)
    assert len(calls) == passes  # none for the batch without a gradient
    assert b["forward_skipped"] == 1.0 and a["forward_skipped"] == 0.0 and b["backward_skipped"] == 1.0
    assert b["loss"] == a["loss"] == 0.0 and b["model_flops"] == 0.0 and b["per_trajectory"] == {}
    assert b["acceptance_rate"] != b["acceptance_rate"] and b["sequence_kl_mean"] != b["sequence_kl_mean"]  # NaN
    assert b["policy_tokens"] == a["policy_tokens"] and b["grad_norm"] == a["grad_norm"] == 0.0
    assert b["optimizer_step_skipped"] == a["optimizer_step_skipped"] == float(not step_on_zero)
    wa, wb = _weights(scored), _weights(unscored)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = scored.optimizer.state_dict()["state"], unscored.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i][name], sb[i][name]) for i in sa for name in sa[i])
    # Any reward that differs: the passes run as always.
    out = unscored.step(_with_rewards(random_batch(5, model, n=5), [1.0, 1.0, 0.0, 1.0, 1.0]))
    assert out["forward_skipped"] == 0.0 and out["grad_norm"] > 0 and len(calls) > passes


def test_a_step_scaled_by_the_acceptance_keeps_its_forwards():
    # A zero gradient that still steps, at the rate times the acceptance: the acceptance is needed.
    model = tiny_model(10)
    learner = Learner(model, LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5), statistics_without_gradient=False,
                                             scale_step_by_acceptance=True, step_on_zero_gradient=True))
    out = learner.step(_with_rewards(random_batch(4, model, n=5), [1.0] * 5))
    assert out["forward_skipped"] == 0.0 and out["backward_skipped"] == 1.0
    assert 0.0 <= out["acceptance_rate"] <= 1.0 and out["lr"] == pytest.approx(1e-2 * out["acceptance_rate"])
    # Without the step on a zero gradient the rate does not matter: no pass.
    skipping = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5),
                                                             statistics_without_gradient=False,
                                                             scale_step_by_acceptance=True,
                                                             step_on_zero_gradient=False))
    out = skipping.step(_with_rewards(random_batch(5, model, n=5), [0.0] * 5))
    assert out["forward_skipped"] == 1.0 and out["optimizer_step_skipped"] == 1.0


def test_the_gate_watch_ignores_updates_without_statistics():
    from flashreinforce.trainer.reporting.diagnostics import TrustGateWatch

    watch = TrustGateWatch(2)
    assert watch.observe({"step": 1, "acceptance_rate": 0.1}) is None
    assert watch.observe({"step": 2, "acceptance_rate": float("nan")}) is None  # neither low nor a reset
    assert watch.observe({"step": 3, "acceptance_rate": 0.1}) is not None
