"""The rollout-engine contract every :class:`~flashreinforce.engines.RolloutEngine` must meet.

:func:`check_engine_contract`: one generation per request, in order, within its token budget, ending
on a stop token exactly when it says ``stop``; per-token sampling log-probabilities of the *processed*
distribution it sampled from (temperature, top-k), equal to an independent float64 recomputation with
the weights of the version it reports; reproducible from the request seeds; new weights loaded in
place by version. Used by the hf and the vLLM engine tests.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from flashreinforce.engines import GenerationRequest, SamplingParams, sampling_log_probs

# Head size 64 and a vocabulary multiple of 64: shapes every vLLM attention backend supports.
CONTRACT_CONFIG = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=True, rope_theta=10000.0)

def contract_model(seed: int) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONTRACT_CONFIG)).float().eval()
    with torch.no_grad():  # sharper distributions than the default init, so sampling is not uniform
        model.lm_head.weight.mul_(8.0)
    return model


def requests(n: int = 6, seed: int = 0) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + i * 2
        ids = torch.randint(8, CONTRACT_CONFIG["vocab_size"], (length,), generator=g).tolist()
        out.append(GenerationRequest(ids, max_new_tokens=1 + (i * 3) % 7, seed=1000 + i))
    return out


def reference_log_probs(model64, context: list[int], generated: list[int], params: SamplingParams) -> list[float]:
    """float64 log-probability of each generated token under the processed distribution it was drawn from."""
    out = []
    with torch.no_grad():
        for k, tok in enumerate(generated):
            ids = torch.tensor([context + generated[:k]])
            logits = model64(input_ids=ids).logits[0, -1:].double()
            out.append(float(sampling_log_probs(logits, params)[0, tok]))
    return out


def check_engine_contract(make_engine, *, atol: float, batch_invariant: bool = True, close: bool = True) -> None:
    """Run the contract on ``make_engine(model)`` (an engine whose weights may be replaced; closed at the
    end unless ``close`` is False)."""
    models = [contract_model(0), contract_model(1)]
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    models64 = [m.double() for m in (contract_model(0), contract_model(1))]
    engine = make_engine(models[0])
    try:
        stop = (5, 7)
        sampled = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, stop_token_ids=stop)
        for version, state in enumerate(states):
            engine.load_weights(state, version)
            assert engine.version == version
            reqs = requests(seed=version)
            gens = engine.generate(reqs, sampled)
            assert len(gens) == len(reqs)
            for r, g in zip(reqs, gens):
                assert g.policy_version == version
                assert 1 <= len(g.token_ids) <= r.max_new_tokens
                assert len(g.log_probs) == len(g.token_ids)
                assert all(0 <= t < CONTRACT_CONFIG["vocab_size"] for t in g.token_ids)
                assert all(t not in stop for t in g.token_ids[:-1])  # a turn ends at its first stop token
                assert g.finish_reason == ("stop" if g.token_ids[-1] in stop else "length")
                if g.finish_reason == "length":
                    assert len(g.token_ids) == r.max_new_tokens
                assert all(math.isfinite(x) and x <= 0.0 for x in g.log_probs)
                want = reference_log_probs(models64[version], list(r.token_ids), g.token_ids, sampled)
                for got_lp, want_lp in zip(g.log_probs, want):
                    assert got_lp == pytest.approx(want_lp, abs=atol), (version, r.seed)
            again = engine.generate(reqs, sampled)  # the request seeds fix the sampling noise
            assert [g.token_ids for g in again] == [g.token_ids for g in gens]
            if batch_invariant:
                alone = engine.generate([reqs[3]], sampled)[0]
                assert alone.token_ids == gens[3].token_ids
        # top-p: the recorded log-probability is that of the renormalized nucleus (models[1]'s weights).
        nucleus = SamplingParams(temperature=0.9, top_p=0.8, top_k=0, stop_token_ids=stop)
        reqs = requests(seed=5)
        for r, g in zip(reqs, engine.generate(reqs, nucleus)):
            want = reference_log_probs(models64[1], list(r.token_ids), g.token_ids, nucleus)
            for got_lp, want_lp in zip(g.log_probs, want):
                assert got_lp == pytest.approx(want_lp, abs=atol), ("top_p", r.seed)
        # top-k 1: the processed distribution puts all its mass on one token, so a recorded
        # log-probability of the raw distribution (< 0) would be caught here.
        greedy_by_topk = SamplingParams(temperature=1.0, top_p=1.0, top_k=1, stop_token_ids=())
        for g in engine.generate(requests(seed=9), greedy_by_topk):
            assert all(abs(x) <= atol for x in g.log_probs)
        # temperature 0: greedy, recorded as 0
        for g in engine.generate(requests(seed=9), SamplingParams(temperature=0.0, stop_token_ids=())):
            assert all(x == 0.0 for x in g.log_probs)
    finally:
        if close:
            engine.close()
