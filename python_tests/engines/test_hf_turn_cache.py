"""The HF engine's turn cache: the next turn of a conversation goes on from the kept keys and values and
samples what an engine without the cache samples."""

from __future__ import annotations

import pytest
import torch

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.engines.hf.turn_cache import TurnCache
from python_tests.builders import tiny_causal_lm

VOCAB = 40


def _model(seed):
    model = tiny_causal_lm(VOCAB, seed=seed, tied=False).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
        for name, p in model.named_parameters():  # peaked attention: every kept key matters
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(5.0)
    return model


def _first_turns(generator, n, prefix_len=10):
    prefix = torch.randint(3, VOCAB, (prefix_len,), generator=generator).tolist()
    out = []
    for i in range(n):
        suffix = torch.randint(3, VOCAB, (2 + i,), generator=generator).tolist()
        suffix[0] = 3 + i
        out.append(GenerationRequest(prefix + suffix, 5 + i, 100 + i))
    return out


def _next_turns(generator, first, generations, seed0=200):
    """Each conversation again: its prompt, the sampled turn, an answer of a few random tokens."""
    out = []
    for i, (r, g) in enumerate(zip(first, generations)):
        answer = torch.randint(3, VOCAB, (3 + i % 2,), generator=generator).tolist()
        out.append(GenerationRequest(list(r.token_ids) + list(g.token_ids) + answer, 6, seed0 + i))
    return out


def _same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        torch.testing.assert_close(torch.tensor(x.log_probs), torch.tensor(y.log_probs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(0.0, stop_token_ids=(1,)),
                                    SamplingParams(1.0, top_p=0.9, stop_token_ids=(1,))])
def test_the_next_turn_goes_on_from_the_kept_states_and_samples_as_without_them(generator, params):
    model = _model(1)
    engine = HFEngine(model, pad_token_id=0, min_shared_prefix=4)
    first = _first_turns(generator, 4)
    generations = engine.generate(first, params)
    assert len(engine._turns) == 4  # one context per finished request
    second = _next_turns(generator, first, generations)
    got = engine.generate(second, params)
    fed = sum(len(r.token_ids) + len(g.token_ids) - 1 for r, g in zip(first, generations))
    assert engine._turns.tokens_reused == fed
    plain = HFEngine(model, pad_token_id=0, min_shared_prefix=4, turn_cache_mb=0)
    assert plain._turns is None
    _same(plain.generate(second, params), got)


def test_a_call_that_mixes_continued_and_new_conversations(generator):
    # The new ones start from the last shared prefix (their first prompt tokens) or from nothing.
    model = _model(2)
    params = SamplingParams(1.0, stop_token_ids=(1,))
    engine = HFEngine(model, pad_token_id=0, min_shared_prefix=4)
    first = _first_turns(generator, 3)
    generations = engine.generate(first, params)
    mixed = _next_turns(generator, first[:2], generations[:2]) + _first_turns(generator, 2)[1:] + [
        GenerationRequest(torch.randint(3, VOCAB, (7,), generator=generator).tolist(), 4, 77)]
    got = engine.generate(mixed, params)
    assert engine._turns.tokens_reused == sum(len(r.token_ids) + len(g.token_ids) - 1
                                              for r, g in zip(first[:2], generations[:2]))
    _same(HFEngine(model, pad_token_id=0, min_shared_prefix=4, turn_cache_mb=0).generate(mixed, params), got)


def test_nothing_is_reused_after_a_weight_change(generator):
    model = _model(3)
    params = SamplingParams(1.0, stop_token_ids=(1,))
    engine = HFEngine(model, pad_token_id=0, min_shared_prefix=4, version=0)
    first = _first_turns(generator, 3)
    generations = engine.generate(first, params)
    new = {k: v * 1.1 for k, v in model.state_dict().items()}
    engine.load_weights(new, version=1)
    second = _next_turns(generator, first, generations)
    got = engine.generate(second, params)
    assert engine._turns.tokens_reused == 0
    other = _model(3)
    other.load_state_dict(new)
    _same(HFEngine(other, pad_token_id=0, min_shared_prefix=4, turn_cache_mb=0).generate(second, params), got)


def test_turn_cache_takes_the_longest_kept_context_once_and_keeps_to_its_budget():
    def states(n, heads=2, dim=4):
        return [(torch.full((heads, n, dim), float(n)), torch.full((heads, n, dim), float(n)))]

    position = 2 * 4 * 2 * 4  # bytes of one position: keys and values, 2 heads x 4 floats each
    cache = TurnCache(max_bytes=10 * position)
    cache.check_weights(("w", 1))
    cache.put([5, 6, 7], states(3))
    cache.put([5, 6, 7, 8, 9], states(5))
    assert cache.bytes == 8 * position
    assert cache.take([5, 6, 7, 8, 9])[0] == 3  # the 5-token context would leave nothing to compute
    cache.put([5, 6, 7], states(3))
    n, got = cache.take([5, 6, 7, 8, 9, 10])  # the longest that leaves a token to compute
    assert n == 5 and got[0][0].shape[1] == 5 and float(got[0][0][0, 0, 0]) == 5.0
    assert cache.take([5, 6, 7, 8, 9, 10])[0] == 3 and len(cache) == 0  # each one is taken once
    assert cache.take([5, 6, 7, 8, 9, 10]) == (0, None)
    assert cache.tokens_reused == 3 + 5 + 3 and cache.bytes == 0
    cache.put([1, 2, 3, 4], states(4))
    cache.put([2, 3, 4, 5], states(4))
    cache.put([3, 4, 5, 6], states(4))  # 12 positions: the oldest goes
    assert cache.bytes == 8 * position and cache.take([1, 2, 3, 4, 9]) == (0, None)
    assert cache.take([3, 4, 5, 6, 9])[0] == 4
    cache.put([9] * 11, states(11))  # alone over the budget: not kept
    assert cache.take([9] * 12) == (0, None)
    cache.check_weights(("w", 2))  # other weights: everything goes
    assert len(cache) == 0 and cache.bytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        TurnCache(0)


def test_turn_cache_mb_is_validated():
    with pytest.raises(ValueError, match="turn_cache_mb"):
        HFEngine(_model(4), turn_cache_mb=-1)
    assert HFEngine(_model(4), kv_cache="dynamic")._turns is None  # needs the preallocated cache


def test_an_engine_whose_transformers_has_no_preallocated_layers_decodes_with_the_dynamic_cache(generator, monkeypatch):
    # (transformers before 4.56: no per-layer caches) The fast step needs the preallocated cache; without it
    # the model's forward decodes, and the result is that of kv_cache="dynamic".
    import flashreinforce.engines.hf.engine as engine_module

    model = _model(5)
    params = SamplingParams(1.0, stop_token_ids=(1,))
    first = _first_turns(generator, 3)
    expected = HFEngine(model, pad_token_id=0, kv_cache="dynamic").generate(first, params)
    monkeypatch.setattr(engine_module, "preallocated_cache", lambda model, capacity: None)
    engine = HFEngine(model, pad_token_id=0)
    assert engine._turns is None
    got = engine.generate(first, params)
    assert engine.kv_cache_in_use == "dynamic"
    _same(expected, got)
