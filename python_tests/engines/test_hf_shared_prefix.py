"""The HF engine's shared-prefix prefill: same continuations and log-probs as without it."""

from __future__ import annotations

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
