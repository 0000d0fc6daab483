"""The HF engine's shared-prefix prefill: same continuations and log-probs as without it."""

from __future__ import annotations

import pytest
import torch

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from python_tests.builders import tiny_causal_lm


def requests(generator, prefix_len, suffix_lens, vocab=40, max_new=6):
    """Prompts of one shared prefix and random suffixes whose first tokens differ (so that the shared
    part is exactly the prefix, whatever the random draw)."""
    prefix = torch.randint(3, vocab, (prefix_len,), generator=generator).tolist()
    out = []
    for i, n in enumerate(suffix_lens):
        suffix = torch.randint(3, vocab, (n,), generator=generator).tolist()
        if suffix:
            suffix[0] = 3 + i
        out.append(GenerationRequest(prefix + suffix, max_new, 100 + i))
    return out


def run(model, reqs, params, min_shared_prefix):
    engine = HFEngine(model, pad_token_id=0, min_shared_prefix=min_shared_prefix)
    return engine.generate(reqs, params), engine


def test_shared_prefix_is_found_and_leaves_every_prompt_a_suffix(generator):
    engine = HFEngine(tiny_causal_lm(40, seed=0), pad_token_id=0, min_shared_prefix=4)
    reqs = requests(generator, 10, [0, 3, 5])
    prompts = [list(r.token_ids) for r in reqs]
    assert engine._shared_prefix(prompts) == 9  # the 10-token prompt keeps its last token
    assert engine._shared_prefix(prompts[1:]) == 10
    assert engine._shared_prefix([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]]) == 0  # 3 < 4 shared tokens
    assert engine._shared_prefix(prompts[:1]) == 0
    assert HFEngine(tiny_causal_lm(40, seed=0), min_shared_prefix=0)._shared_prefix(prompts) == 0


def test_generation_with_a_shared_prefix_matches_plain_batching(generator):
    model = tiny_causal_lm(40, seed=1, tied=False).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    reqs = requests(generator, 12, [1, 4, 2, 7, 3])
    for params in (SamplingParams(0.0, stop_token_ids=(1,)), SamplingParams(1.0, top_p=0.9, stop_token_ids=(1,))):
        plain, _ = run(model, reqs, params, 0)
        shared, engine = run(model, reqs, params, 4)
        assert engine._shared_prefix([list(r.token_ids) for r in reqs]) == 12
        for a, b in zip(plain, shared):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), rtol=1e-4, atol=1e-4)


def test_shared_prefix_continuations_match_one_request_at_a_time(generator):
    # Positions must not count the padding between the prefix and a short suffix: each request
    # alone (no padding at all) gives the same greedy continuation and log-probs.
    model = tiny_causal_lm(40, seed=2, tied=False).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    reqs = requests(generator, 9, [1, 6, 3])
    params = SamplingParams(0.0, stop_token_ids=(1,))
    together, _ = run(model, reqs, params, 4)
    for r, g in zip(reqs, together):
        alone, _ = run(model, [r], params, 4)
        assert alone[0].token_ids == g.token_ids
        torch.testing.assert_close(torch.tensor(alone[0].log_probs), torch.tensor(g.log_probs), rtol=1e-4, atol=1e-4)


def _suffixed(prefix, suffix_lens, generator, seed0, vocab=40, max_new=6):
    out = []
    for i, n in enumerate(suffix_lens):
        suffix = torch.randint(3, vocab, (n,), generator=generator).tolist()
        suffix[0] = 3 + i
        out.append(GenerationRequest(prefix + suffix, max_new, seed0 + i))
    return out


def _same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        torch.testing.assert_close(torch.tensor(x.log_probs), torch.tensor(y.log_probs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache", ["preallocated", "dynamic"])
def test_a_later_call_copies_the_shared_prefix_and_samples_as_a_fresh_engine(generator, kv_cache):
    model = tiny_causal_lm(40, seed=3, tied=False).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    params = SamplingParams(1.0, stop_token_ids=(1,))
    prefix = torch.randint(3, 40, (14,), generator=generator).tolist()
    first = _suffixed(prefix, [3, 5, 2], generator, 10)
    later = _suffixed(prefix, [4, 1, 6, 2], generator, 20)
    shorter = _suffixed(prefix[:9], [3, 3], generator, 30)  # a prefix of the saved one: its positions copied
    engine = HFEngine(model, pad_token_id=0, min_shared_prefix=4, kv_cache=kv_cache)
    engine.generate(first, params)
    assert engine.prefix_tokens_reused == 0
    got_later = engine.generate(later, params)
    assert engine.prefix_tokens_reused == 14
    got_shorter = engine.generate(shorter, params)
    assert engine.prefix_tokens_reused == 14 + 9
    again = engine.generate(later, params)  # the same prefix copied whole: the very same numbers
    assert [g.log_probs for g in again] == [g.log_probs for g in got_later]
    assert [g.token_ids for g in again] == [g.token_ids for g in got_later]
    for reqs, got in ((later, got_later), (shorter, got_shorter)):
        fresh = HFEngine(model, pad_token_id=0, min_shared_prefix=4, kv_cache=kv_cache)
        _same(fresh.generate(reqs, params), got)
        assert fresh.prefix_tokens_reused == 0


def test_the_shared_prefix_is_computed_again_after_any_weight_change(generator):
    model = tiny_causal_lm(40, seed=4, tied=False).eval()
    params = SamplingParams(1.0, stop_token_ids=(1,))
    prefix = torch.randint(3, 40, (12,), generator=generator).tolist()
    engine = HFEngine(model, pad_token_id=0, min_shared_prefix=4, version=0)
    engine.generate(_suffixed(prefix, [2, 3], generator, 10), params)
    # A new version through load_weights.
    new = {k: v * 1.25 for k, v in model.state_dict().items()}
    engine.load_weights(new, version=1)
    reqs = _suffixed(prefix, [3, 2, 4], generator, 20)
    got = engine.generate(reqs, params)
    assert engine.prefix_tokens_reused == 0
    other = tiny_causal_lm(40, seed=4, tied=False).eval()
    other.load_state_dict(new)
    _same(HFEngine(other, pad_token_id=0, min_shared_prefix=4).generate(reqs, params), got)
    # A weight changed in place, outside load_weights.
    with torch.no_grad():
        next(engine.model.parameters()).mul_(0.5)
    engine.generate(_suffixed(prefix, [2, 2], generator, 30), params)
    assert engine.prefix_tokens_reused == 0
    engine.generate(_suffixed(prefix, [3, 3], generator, 40), params)  # unchanged since: copied
    assert engine.prefix_tokens_reused == 12
