"""The learner: current log-probs from packed/padded forwards, gradients against a float64
per-sequence computation of the objective (docs/semantics.md), micro-batch invariance, schedule, state round trip."""

import copy
import math
import random

import pytest
import torch

from flashreinforce.objective import LossOptions
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.learning.schedule import lr_factor
from flashreinforce.trainer.learning.scoring import token_log_probs
from flashreinforce.trainer.learning.packing import pack
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.builders import tiny_causal_lm

VOCAB = 50


def tiny_model(seed=0):
    return tiny_causal_lm(VOCAB, seed=seed, tied=False)


def f64_log_probs(model64, tokens, temperature=1.0):
    """Per-sequence full-logits float64 log-probs and entropies of tokens[1:] (index t holds token t)."""
    logits = model64(input_ids=torch.tensor([tokens])).logits[0].double() / temperature
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)[:-1]
    zero = torch.zeros(1, dtype=torch.float64)
    return torch.cat([zero, lp]), torch.cat([zero, ent])


def random_batch(seed, model, n=7, temperature=1.0):
    rng = random.Random(seed)
    out = []
    model64 = copy.deepcopy(model).double()
    for i in range(n):
        length = rng.randint(4, 14)
        tokens = [rng.randrange(3, VOCAB) for _ in range(length)]
        mask = [False] + [rng.random() < 0.7 for _ in range(length - 1)]
        mask[rng.randrange(1, length)] = True
        with torch.no_grad():
            lp, _ = f64_log_probs(model64, tokens, temperature)
        # behavior a little off the current policy (stale), per trajectory
        blp = [min(0.0, float(x) - rng.random() * 0.05 * (i % 3)) if m else 0.0 for x, m in zip(lp, mask)]
        reward = float(rng.randint(0, 1)) if i % 2 else rng.random()
        out.append(Trajectory(tokens, mask, blp, reward=reward, failed=reward < 0.5))
    return out


def reference_loss64(model64, trajs, *, delta, q=1.0, temperature=1.0, loss_agg="seq-mean-token-mean"):
    """The objective (docs/semantics.md) written out per trajectory in float64 (independent of the fused op and packing)."""
    b = len(trajs)
    baseline = sum(t.reward for t in trajs) / b
    total_tokens = sum(t.num_action_tokens for t in trajs)
    loss = torch.zeros((), dtype=torch.float64)
    for t in trajs:
        lp, ent = f64_log_probs(model64, t.token_ids, temperature)
        lpd = lp.detach()
        pos = [k for k, m in enumerate(t.action_mask) if m]
        T = len(pos)
        d = 0.0
        for k in pos:
            p = min(max(math.exp(t.behavior_log_probs[k]), 1e-6), 1 - 1e-6)
            qq = min(max(math.exp(float(lpd[k])), 1e-6), 1 - 1e-6)
            d += p * (math.log(p) - math.log(qq)) + (1 - p) * (math.log(1 - p) - math.log(1 - qq))
        if max(0.0, d / T) > delta:
            continue
        kept = pos
        if q < 1.0 and t.failed:
            order = sorted(pos, key=lambda k: (-float(ent.detach()[k]), k))
            kept = sorted(order[: math.ceil(q * T)])
        adv = t.reward - baseline
        scale = 1.0 / (T * b) if loss_agg == "seq-mean-token-mean" else 1.0 / total_tokens
        for k in kept:
            w = math.exp(float(lpd[k]) - t.behavior_log_probs[k]) * adv
            loss = loss - scale * w * lp[k]
    return loss


def grads(model):
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_token_log_probs_packed_padded_and_per_sequence_agree():
    model = tiny_model(1)
    trajs = random_batch(0, model, n=5, temperature=0.7)
    batch = pack(trajs)
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        packed, ent_p = token_log_probs(model, batch, temperature=0.7, with_entropy=True, packed_forward=True)
        padded, ent_q = token_log_probs(model, batch, temperature=0.7, with_entropy=True, packed_forward=False)
        want, want_ent = [], []
        for t in trajs:
            lp, ent = f64_log_probs(model64, t.token_ids, 0.7)
            m = torch.tensor(t.action_mask)
            want.append(torch.where(m, lp, 0.0))
            want_ent.append(torch.where(m, ent, 0.0))
    want, want_ent = torch.cat(want), torch.cat(want_ent)
    for got, ref in ((packed, want), (padded, want), (ent_p, want_ent), (ent_q, want_ent)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("micro,packed,q,agg", [
    (0, False, 1.0, "seq-mean-token-mean"),
    (2, True, 1.0, "seq-mean-token-mean"),
    (3, False, 0.5, "seq-mean-token-mean"),
    (1, False, 1.0, "token-mean"),
])
def test_learner_gradient_matches_float64_reference(micro, packed, q, agg):
    model = tiny_model(2)
    trajs = random_batch(3, model, n=8, temperature=0.9)
    model64 = copy.deepcopy(model).double()
    # pick delta between two trajectories' KL so the gate admits some and rejects others
    with torch.no_grad():
        kls = []
        for t in trajs:
            lp, _ = f64_log_probs(model64, t.token_ids, 0.9)
            pos = [k for k, m in enumerate(t.action_mask) if m]
            d = 0.0
            for k in pos:
                p = min(max(math.exp(t.behavior_log_probs[k]), 1e-6), 1 - 1e-6)
                qq = min(max(math.exp(float(lp[k])), 1e-6), 1 - 1e-6)
                d += p * (math.log(p) - math.log(qq)) + (1 - p) * (math.log(1 - p) - math.log(1 - qq))
            kls.append(max(0.0, d / len(pos)))
    ks = sorted(kls)
    delta = (ks[4] + ks[5]) / 2
    learner = Learner(model, LearnerSettings(loss=LossOptions(delta=delta, negative_token_fraction=q, loss_agg=agg), temperature=0.9,
                                             micro_batch_trajectories=micro, packed_forward=packed))
    learner.optimizer.zero_grad()
    stats = learner.accumulate_gradients(trajs)
    assert 0.0 < stats["acceptance_rate"] < 1.0
    ref = reference_loss64(model64, trajs, delta=delta, q=q, temperature=0.9, loss_agg=agg)
    ref.backward()
    assert stats["loss"] == pytest.approx(float(ref.detach()), rel=1e-4, abs=1e-7)
    got, want = grads(model), grads(model64)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)


def test_ppo_mode_gradient_is_micro_batch_invariant():
    base = tiny_model(4)
    trajs = random_batch(5, base, n=8)
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    out = []
    for micro in (0, 3):
        model = copy.deepcopy(base)
        learner = Learner(model, LearnerSettings(loss_mode="ppo", loss=LossOptions(eps_clip=(0.2, 0.2)), micro_batch_trajectories=micro))
        learner.optimizer.zero_grad()
        learner.accumulate_gradients(trajs, groups)
        out.append(grads(model))
    for name in out[0]:
        torch.testing.assert_close(out[0][name], out[1][name], atol=1e-7, rtol=1e-5)


def test_lr_schedule():
    s = LearnerSettings(scheduler="cosine_with_min_lr", warmup_ratio=0.1, min_lr_ratio=0.2, total_steps=100)
    assert lr_factor(0, s) == pytest.approx(0.1) and lr_factor(9, s) == pytest.approx(1.0)
    assert lr_factor(10, s) == pytest.approx(1.0)
    assert lr_factor(55, s) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, s) == pytest.approx(0.2)
    assert lr_factor(50, LearnerSettings(scheduler="constant", warmup_ratio=0.5, total_steps=100)) == 1.0
    assert lr_factor(4, LearnerSettings(scheduler="constant_with_warmup", warmup_ratio=0.1, total_steps=100)) == 0.5


def test_state_round_trip_gives_the_same_next_update():
    base = tiny_model(6)
    settings = LearnerSettings(lr=1e-2, loss=LossOptions(delta=float("inf")), scheduler="cosine_with_min_lr", warmup_ratio=0.2,
                               total_steps=10)
    a = Learner(copy.deepcopy(base), settings)
    for k in range(3):
        a.step(random_batch(10 + k, a.model))
    saved_model = copy.deepcopy(a.model.state_dict())
    saved = copy.deepcopy(a.state_dict())
    nxt = random_batch(99, a.model)
    a.step(nxt)
    b = Learner(copy.deepcopy(base), settings)
    b.model.load_state_dict(saved_model)
    b.load_state_dict(saved)
    assert b.version == 3
    b.step(nxt)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


def test_non_finite_gradient_skips_the_step():
    model = tiny_model(7)
    learner = Learner(model, LearnerSettings(lr=1e-2, loss=LossOptions(delta=float("inf"))))
    before = copy.deepcopy(model.state_dict())
    trajs = random_batch(1, model, n=3)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises((FloatingPointError, ValueError)):
        learner.step(trajs)
    assert learner.version == 0
    for k, v in model.state_dict().items():
        if k != "lm_head.weight":
            assert torch.equal(v, before[k])


def test_token_ids_outside_the_vocabulary_are_refused_before_the_forward():
    model = tiny_model()
    bad = Trajectory([1, 2, VOCAB + 3, 4], [False, True, True, True], [0.0, -1.0, -1.0, -1.0], reward=1.0,
                     failed=False)
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {VOCAB}\)"):
        token_log_probs(model, pack([bad]))


def test_head_operand_dtype_resolution_and_validation():
    cpu = torch.device("cpu")
    assert LearnerSettings().head_operands(cpu) is None  # float32 by default
    assert LearnerSettings(head_operand_dtype="bf16").head_operands(cpu) == torch.bfloat16
    assert LearnerSettings(head_operand_dtype="fp16").head_operands(cpu) == torch.float16
    assert LearnerSettings(head_operand_dtype="fp32").head_operands(cpu) is None
    # auto: never on a CPU (rounded operands would be emulated by float32 GEMMs there)
    assert LearnerSettings(head_operand_dtype="auto", param_dtype="bf16").head_operands(cpu) is None
    with pytest.raises(ValueError, match="train.head_operand_dtype"):
        LearnerSettings(head_operand_dtype="int8")


def test_bf16_head_operands_change_the_log_probs_by_rounding_only():
    model = tiny_model(seed=3)
    batch = pack(random_batch(5, model))
    lp32, _ = token_log_probs(model, batch)
    lp16, _ = token_log_probs(model, batch, head_operand_dtype=torch.bfloat16)
    diff = (lp16 - lp32).abs().max().item()
    assert 0 < diff < 0.05  # rounded operands, float32 logits (no 8-bit logits); exactness: test_logprobs.py
    assert torch.equal(lp16 == 0, lp32 == 0)  # the same action slots
    learner = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-3, head_operand_dtype="bf16"))
    reference = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-3))
    trajs = random_batch(6, model)
    m16, m32 = learner.step(trajs), reference.step(trajs)
    assert math.isfinite(m16["loss"]) and math.isfinite(m16["grad_norm"])
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.05)


def test_deferred_loss_errors_give_the_same_update_and_the_same_error():
    """On CUDA the learner reads the fused loss's error records once per step; forced here on the CPU."""
    base = tiny_model(8)
    trajs = random_batch(4, base, n=6)
    settings = LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5), micro_batch_trajectories=2, packed_forward=True)
    results = []
    for defer in (False, True):
        learner = Learner(copy.deepcopy(base), settings)
        learner.defer_loss_errors = defer
        metrics = learner.step(trajs)
        results.append((metrics, learner.model.state_dict()))
    (m0, w0), (m1, w1) = results
    assert m0["loss"] == m1["loss"] and m0["acceptance_rate"] == m1["acceptance_rate"]
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    # a bad behavior log-probability in the second micro-batch
    bad = list(trajs)
    t = bad[3]
    k = next(i for i, m in enumerate(t.action_mask) if m)
    logp = list(t.behavior_log_probs)
    logp[k] = 0.25
    bad[3] = Trajectory(t.token_ids, t.action_mask, logp, reward=t.reward, failed=t.failed)
    messages = []
    for defer in (False, True):
        learner = Learner(copy.deepcopy(base), settings)
        learner.defer_loss_errors = defer
        passes = []
        learner.scorer.register_forward_hook(lambda *args: passes.append(1))
        with pytest.raises(ValueError) as err:
            learner.step(bad)
        messages.append(str(err.value))
        assert learner.version == 0
        for name, value in learner.model.state_dict().items():
            assert torch.equal(value, base.state_dict()[name]), name
        # immediate: stops at the second of three micro-batches; deferred: all three queued, then the check
        assert len(passes) == (3 if defer else 2)
    assert messages[0] == messages[1] and "log probability 0.25" in messages[0]


def test_deferred_loss_errors_with_collective_forwards_are_kept_not_raised():
    """A data-parallel rank must finish its passes: the deferred error lands in ``error``."""
    from flashreinforce.trainer.learning.learner import batch_totals

    base = tiny_model(9)
    trajs = random_batch(5, base, n=4)
    t = trajs[1]
    logp = list(t.behavior_log_probs)
    logp[next(i for i, m in enumerate(t.action_mask) if m)] = 0.5
    trajs[1] = Trajectory(t.token_ids, t.action_mask, logp, reward=t.reward, failed=t.failed)
    settings = LearnerSettings(loss=LossOptions(delta=0.5), micro_batch_trajectories=1)
    learner = Learner(copy.deepcopy(base), settings)
    learner.defer_loss_errors = True
    parts = learner.accumulate_gradient_parts(trajs, batch_totals(trajs, None, settings), collective_forwards=True)
    assert isinstance(parts.error, ValueError) and "log probability 0.5" in str(parts.error)


def _gated_out_batch(model, seed):
    """A batch the trust gate admits nothing of: the behavior policy was nearly sure of every token
    (probability 0.99) that the current one gives about 1/50."""
    return [Trajectory(t.token_ids, t.action_mask, [math.log(0.99) if m else 0.0 for m in t.action_mask],
                       reward=t.reward, failed=t.failed) for t in random_batch(seed, model, n=4)]


@pytest.mark.parametrize("step_on_zero", [True, False])
def test_a_zero_gradient_update_steps_adamw_only_when_asked(step_on_zero):
    # A batch the gate admits nothing of has a gradient of exactly zero. AdamW still moves the weights
    # (momentum of the earlier updates, weight decay) unless step_on_zero_gradient is false.
    model = tiny_model(11)
    learner = Learner(model, LearnerSettings(lr=1e-2, weight_decay=0.1, loss=LossOptions(delta=0.05),
                                             step_on_zero_gradient=step_on_zero))
    first = learner.step(random_batch(3, model, n=4))  # an ordinary update: the optimizer gets momentum
    assert first["grad_norm"] > 0 and first["optimizer_step_skipped"] == 0.0
    weights = copy.deepcopy(model.state_dict())
    moments = copy.deepcopy(learner.optimizer.state_dict()["state"])
    out = learner.step(_gated_out_batch(model, 4))
    assert out["acceptance_rate"] == 0.0 and out["grad_norm"] == 0.0
    assert learner.version == 2  # the update counts either way (schedule and version advance)
    moved = any(not torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert moved is step_on_zero
    assert out["optimizer_step_skipped"] == float(not step_on_zero)
    if not step_on_zero:
        state = learner.optimizer.state_dict()["state"]
        assert all(torch.equal(state[i][name], moments[i][name]) for i in moments for name in moments[i])


def test_a_run_whose_first_update_skips_the_step_warns_nothing(recwarn):
    # The schedule then steps before AdamW ever has; PyTorch warns about that order, which is intended here.
    model = tiny_model(13)
    learner = Learner(model, LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.05), step_on_zero_gradient=False))
    out = learner.step(_gated_out_batch(model, 4))
    assert out["optimizer_step_skipped"] == 1.0
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)], [str(w.message) for w in recwarn]


def _half_gated_batch(model):
    """Four trajectories the gate admits at delta 0.5 and two it drops (see :func:`_gated_out_batch`)."""
    return random_batch(21, model, n=4) + _gated_out_batch(model, 22)[:2]


def test_scale_step_by_acceptance_is_the_step_at_the_admitted_share_of_the_rate():
    # The same update with the rate scaled by hand: the same weights, bit for bit; the schedule's rate
    # is left as it was for the next update, and the metrics give the rate the step ran at.
    model = tiny_model(12)
    batch = _half_gated_batch(model)
    scaled = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5),
                                                           scale_step_by_acceptance=True))
    out = scaled.step(batch)
    assert out["acceptance_rate"] == pytest.approx(4 / 6)
    assert out["lr"] == pytest.approx(1e-2 * 4 / 6)
    assert scaled.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    by_hand = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-2 * (4 / 6), loss=LossOptions(delta=0.5)))
    by_hand.step(batch)
    unscaled = Learner(copy.deepcopy(model), LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5)))
    unscaled.step(batch)
    a, b, c = (m.scorer.model.state_dict() if hasattr(m.scorer, "model") else m.scorer.state_dict()
               for m in (scaled, by_hand, unscaled))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_scale_step_by_acceptance_leaves_the_weights_on_an_update_it_admitted_nothing_of():
    model = tiny_model(13)
    learner = Learner(model, LearnerSettings(lr=1e-2, weight_decay=0.1, loss=LossOptions(delta=0.05),
                                             scale_step_by_acceptance=True))
    learner.step(random_batch(3, model, n=4))  # momentum from an ordinary update
    weights = copy.deepcopy(model.state_dict())
    out = learner.step(_gated_out_batch(model, 4))
    assert out["acceptance_rate"] == 0.0 and out["lr"] == 0.0 and out["optimizer_step_skipped"] == 0.0
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_scale_step_by_acceptance_needs_a_loss_mode_with_a_gate():
    with pytest.raises(ValueError, match="actor.scale_step_by_acceptance needs a loss mode with a trust gate"):
        LearnerSettings(loss_mode="ppo", scale_step_by_acceptance=True)
