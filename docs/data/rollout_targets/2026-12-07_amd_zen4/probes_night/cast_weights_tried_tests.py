"""The learner's cache of its linear weights' casts: forwards without a gradient under autocast give the
same numbers bit for bit, reuse the casts while the weights stay, and cast again after a write."""

import copy
import dataclasses

import pytest
import torch

from flashreinforce.objective import LossOptions
from flashreinforce.trainer.learning.cast_weights import CastWeightCache
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.learning.packing import pack
from flashreinforce.trainer.learning.scoring import model_body, token_log_probs
from python_tests.trainer.learning.test_trainer_learner import random_batch, tiny_model
from python_tests.trainer.learning.test_vanishing_gradient import _with_rewards


def _linear_weights(model):
    return [m for m in model_body(model).modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("packed", [True, False])
def test_the_cached_casts_give_the_forward_its_numbers_bit_for_bit(packed):
    model = tiny_model(11)
    batch = pack(random_batch(2, model, n=4))
    cache = CastWeightCache(torch.bfloat16)
    kw = {"autocast_dtype": torch.bfloat16, "packed_forward": packed}
    with torch.no_grad():
        plain, _ = token_log_probs(model, batch, **kw)
        cached, _ = token_log_probs(model, batch, cast_weights=cache, **kw)
        again, _ = token_log_probs(model, batch, cast_weights=cache, **kw)
    linears = _linear_weights(model)
    eligible = sum(1 + (m.bias is not None) for m in linears)
    assert eligible > 0 and cache.copies_made == eligible  # made once, reused by the second forward
    assert torch.equal(plain, cached) and torch.equal(plain, again)
    # A write to one weight (as the optimizer's step makes): that cast alone is made again.
    with torch.no_grad():
        linears[0].weight.add_(0.01)
        changed, _ = token_log_probs(model, batch, **kw)
        cached, _ = token_log_probs(model, batch, cast_weights=cache, **kw)
    assert cache.copies_made == eligible + 1
    assert torch.equal(changed, cached) and not torch.equal(changed, plain)


def test_a_forward_that_records_a_gradient_casts_as_before():
    model = tiny_model(12)
    batch = pack(random_batch(3, model, n=3))
    cache = CastWeightCache(torch.bfloat16)
    logp, _ = token_log_probs(model, batch, autocast_dtype=torch.bfloat16, cast_weights=cache)
    logp.sum().backward()
    assert cache.copies_made == 0
    assert all(m.weight.grad is not None for m in _linear_weights(model))


def test_only_plain_linear_weights_that_nothing_else_shares_are_cached():
    class Scaled(torch.nn.Linear):
        pass

    body = torch.nn.Module()
    body.a = torch.nn.Linear(4, 4)
    body.b = Scaled(4, 4)
    body.emb = torch.nn.Embedding(4, 4)
    body.tied = torch.nn.Linear(4, 4, bias=False)
    body.tied.weight = body.emb.weight
    names = set(CastWeightCache(torch.bfloat16).overrides(body))
    assert names == {"a.weight", "a.bias"}


def test_the_cache_takes_a_low_precision_dtype_only():
    with pytest.raises(ValueError, match="dtype"):
        CastWeightCache(torch.float32)


def test_the_learner_statistics_are_the_same_with_and_without_the_cache():
    # No optimizer step on a zero gradient: the weights stay between the two statistics forwards (AdamW's
    # step would write every weight, its decay included, and the casts would all be made again).
    settings = LearnerSettings(lr=1e-2, loss=LossOptions(delta=0.5), param_dtype="bf16", step_on_zero_gradient=False)
    model = tiny_model(13)
    with_cache = Learner(copy.deepcopy(model), settings)
    without = Learner(copy.deepcopy(model), dataclasses.replace(settings, cast_weight_cache=False))
    assert with_cache.cast_weights is not None and without.cast_weights is None
    equal_a = _with_rewards(random_batch(4, model, n=5), [1.0] * 5)
    ordinary = random_batch(5, model, n=5)
    equal_b = _with_rewards(random_batch(6, model, n=5), [0.0] * 5)
    runs = []
    for learner in (with_cache, without):
        runs.append([learner.step(b) for b in (equal_a, equal_a, ordinary, equal_b)])
    for a, b in zip(*runs):
        assert a["backward_skipped"] == b["backward_skipped"]
        assert a["per_trajectory"] == b["per_trajectory"]
        assert a["sequence_kl_mean"] == b["sequence_kl_mean"] and a["acceptance_rate"] == b["acceptance_rate"]
    eligible = sum(1 + (m.bias is not None) for m in _linear_weights(with_cache.model))
    # Cast for the first statistics forward, reused by the second, cast again after the optimizer's step.
    assert with_cache.cast_weights.copies_made == 2 * eligible
    for p, q in zip(with_cache.model.parameters(), without.model.parameters()):
        assert torch.equal(p, q)
