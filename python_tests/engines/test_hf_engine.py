"""The hf engine (a Hugging Face model in the worker's process): recorded log-probs equal the distribution it sampled from, seeds, weights."""

import copy
import math

import pytest
import torch

from flashreinforce.engines import GenerationRequest, HFEngine, LocalWeightStore, SamplingParams
from python_tests.builders import tiny_causal_lm


def tiny_model(seed=0, vocab=40):
    model = tiny_causal_lm(vocab, seed=seed, tied=False)
    with torch.no_grad():  # a peaked distribution, so top-p really removes tokens
        model.lm_head.weight.mul_(40.0)
    return model.eval()


def processed_log_probs_f64(logits, temperature, top_p, top_k):
    """Independent float64 version of temperature -> top-k -> top-p, in plain Python."""
    z = [x / temperature for x in logits]
    keep = set(range(len(z)))
    if top_k:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {i for i in keep if z[i] >= kth}
    m = max(z[i] for i in keep)
    norm = sum(math.exp(z[i] - m) for i in keep)
    probs = {i: math.exp(z[i] - m) / norm for i in keep}
    if top_p < 1.0:
        mass, kept = 0.0, set()
        for i in sorted(probs, key=lambda j: -probs[j]):
            if mass >= top_p and kept:
                break
            kept.add(i)
            mass += probs[i]
        keep = kept
    m = max(z[i] for i in keep)
    lse = m + math.log(sum(math.exp(z[i] - m) for i in keep))
    return {i: z[i] - lse for i in keep}


@pytest.mark.parametrize("params", [SamplingParams(1.0, 1.0, 0), SamplingParams(0.7, 1.0, 0),
                                    SamplingParams(1.3, 0.8, 0), SamplingParams(0.9, 0.6, 5)])
def test_recorded_log_probs_are_those_of_the_processed_distribution(params):
    model = tiny_model()
    engine = HFEngine(copy.deepcopy(model), pad_token_id=0, version=3)
    reference = copy.deepcopy(model).double()
    reqs = [GenerationRequest([1, 5, 9, 2, 7][: 2 + k], max_new_tokens=6, seed=100 + k) for k in range(4)]
    gens = engine.generate(reqs, params)
    for req, gen in zip(reqs, gens):
        assert gen.policy_version == 3 and len(gen.token_ids) == len(gen.log_probs) == 6
        context = list(req.token_ids)
        for tok, lp in zip(gen.token_ids, gen.log_probs):
            with torch.no_grad():  # full forward, no KV cache, float64
                logits = reference(input_ids=torch.tensor([context])).logits[0, -1].tolist()
            dist = processed_log_probs_f64(logits, params.temperature, params.top_p, params.top_k)
            assert tok in dist, "sampled a token outside the processed distribution"
            assert lp == pytest.approx(dist[tok], abs=2e-4)
            context.append(tok)


def test_sample_frequencies_follow_the_recorded_probabilities():
    model = tiny_model(seed=1)
    engine = HFEngine(model, pad_token_id=0)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    n = 4000
    gens = engine.generate([GenerationRequest([3, 4], 1, seed=s) for s in range(n)], params)
    counts: dict[int, int] = {}
    logp: dict[int, float] = {}
    for g in gens:
        counts[g.token_ids[0]] = counts.get(g.token_ids[0], 0) + 1
        logp.setdefault(g.token_ids[0], g.log_probs[0])
        assert g.log_probs[0] == pytest.approx(logp[g.token_ids[0]], abs=1e-6)  # same context, same value
    probs = {t: math.exp(v) for t, v in logp.items()}
    assert sum(probs.values()) <= 1.0 + 1e-5
    assert sum(probs.values()) > 0.97  # nothing else was sampled with noticeable mass
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in probs.items())
    dof = max(1, len(probs) - 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)


def test_a_request_samples_the_same_alone_or_in_a_left_padded_batch():
    engine = HFEngine(tiny_model(seed=2), pad_token_id=0)
    params = SamplingParams(1.0, 0.95)
    target = GenerationRequest([1, 2, 3], 5, seed=42)
    alone = engine.generate([target], params)[0]
    others = [GenerationRequest(list(range(1, 12)), 3, seed=7), GenerationRequest([5], 8, seed=8)]
    batched = engine.generate([others[0], target, others[1]], params)[1]
    assert batched.token_ids == alone.token_ids
    assert batched.log_probs == pytest.approx(alone.log_probs, abs=1e-5)


def test_stop_tokens_end_a_turn_and_greedy_has_log_prob_zero():
    model = tiny_model(seed=3)
    engine = HFEngine(model, pad_token_id=0)
    greedy = engine.generate([GenerationRequest([1, 2], 4, seed=0)], SamplingParams(temperature=0.0))[0]
    assert greedy.log_probs == [0.0] * 4 and greedy.finish_reason == "length"
    first = greedy.token_ids[0]
    stopped = engine.generate([GenerationRequest([1, 2], 4, seed=0)],
                              SamplingParams(temperature=0.0, stop_token_ids=(first,)))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_weights_load_by_version_without_restart():
    a, b = tiny_model(seed=4), tiny_model(seed=5)
    engine = HFEngine(copy.deepcopy(a), pad_token_id=0, version=0)
    store = LocalWeightStore()
    store.publish(b.state_dict(), 7)
    assert store.fetch(7) is None and store.latest_version() == 7
    assert store.sync(engine) and engine.version == 7
    assert not store.sync(engine)
    req = [GenerationRequest([1, 2, 3], 3, seed=1)]
    params = SamplingParams(temperature=0.0)
    assert engine.generate(req, params)[0].token_ids == HFEngine(b, pad_token_id=0).generate(req, params)[0].token_ids
    with pytest.raises(ValueError, match="not newer"):
        store.publish(a.state_dict(), 7)


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_inverse_cdf_sampling_never_draws_a_removed_token():
    from flashreinforce.engines.hf import sample_tokens

    inf = float("inf")
    logp = torch.log_softmax(torch.tensor([[-inf, 0.0, 1.0, -inf], [2.0, -inf, -inf, -inf]]), -1)
    below_one = 1.0 - 2.0 ** -53
    for u, expected in ((0.0, [1, 0]), (below_one, [2, 0]), (0.2, [1, 0]), (0.5, [2, 0])):
        got = sample_tokens(logp, torch.tensor([u, u], dtype=torch.float64)).tolist()
        assert got == expected, (u, got)
    # the boundary between tokens 1 and 2 lies at p1 = 1 / (1 + e) (up to the float32 log-probabilities)
    p1 = 1 / (1 + math.e)
    assert sample_tokens(logp[:1], torch.tensor([p1 - 1e-6], dtype=torch.float64)).item() == 1
    assert sample_tokens(logp[:1], torch.tensor([p1 + 1e-6], dtype=torch.float64)).item() == 2


def test_sampling_workspace_draws_the_same_tokens_as_fresh_buffers():
    from flashreinforce.engines.hf import SamplingWorkspace, sample_tokens

    g = torch.Generator().manual_seed(3)
    workspace = SamplingWorkspace()
    # A batch that shrinks (the buffers' first rows are reused) and then grows (they are replaced).
    for rows in (6, 6, 4, 1, 7):
        logp = torch.log_softmax(4 * torch.randn(rows, 257, generator=g), -1)
        logp[0, :100] = float("-inf")  # removed tokens are never drawn, with or without the workspace
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        fresh = sample_tokens(logp, u)
        assert torch.equal(sample_tokens(logp, u, workspace), fresh)
        assert int(fresh[0]) >= 100
    probs, cdf = workspace.buffers(torch.zeros(7, 257))
    assert probs.shape == cdf.shape == (7, 257) and cdf.dtype == torch.float64


@pytest.mark.parametrize("fast_decode", [False, True])
def test_finished_requests_leave_the_batch(fast_decode):
    model = tiny_model(seed=6)
    sizes = []
    # The decoder stack runs every forward, the prefill included (the fast decoder's prefill skips
    # the model's own head).
    model.model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                          with_kwargs=True)
    engine = HFEngine(model, pad_token_id=0, fast_decode=fast_decode)
    assert engine.fast_decode_in_use == fast_decode
    if fast_decode:  # decode steps are the fast decoder's, not the model's forward
        step = engine._fast.step
        engine._fast.step = lambda tokens, *rest: (sizes.append(tokens.shape[0]), step(tokens, *rest))[1]
    params = SamplingParams(1.0, 1.0)
    reqs = [GenerationRequest([1, 2, 3], 2, seed=1), GenerationRequest([4, 5], 5, seed=2),
            GenerationRequest([6], 3, seed=3)]
    gens = engine.generate(reqs, params)
    assert [len(g.token_ids) for g in gens] == [2, 5, 3]
    # prefill, then one forward per step with the requests still running: 3, 2, 1, 1
    assert sizes == [3, 3, 2, 1, 1]
    alone = [HFEngine(tiny_model(seed=6), pad_token_id=0).generate([r], params)[0] for r in reqs]
    for g, a in zip(gens, alone):
        assert g.token_ids == a.token_ids
        assert g.log_probs == pytest.approx(a.log_probs, abs=1e-5)


def test_engine_dtype_casts_the_weights_and_what_it_loads():
    from flashreinforce.engines import create_engine

    model = tiny_model(seed=7)
    engine = create_engine("hf", copy.deepcopy(model), pad_token_id=0,
                           options={"dtype": "bfloat16", "auto_dtype": "float32"})
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    engine.load_weights(tiny_model(seed=8).state_dict(), 1)  # float32 weights from the learner
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16} and engine.version == 1
    gen = engine.generate([GenerationRequest([1, 2, 3], 4, seed=1)], SamplingParams(1.0))[0]
    assert len(gen.token_ids) == 4 and all(lp <= 0.0 for lp in gen.log_probs)
    # auto follows the learner's dtype on CUDA devices only
    auto = create_engine("hf", copy.deepcopy(model), pad_token_id=0, options={"dtype": "auto", "auto_dtype": "bfloat16"})
    assert {p.dtype for p in auto.model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="dtype must be one of"):
        create_engine("hf", copy.deepcopy(model), pad_token_id=0, options={"dtype": "int8"})
    with pytest.raises(ValueError, match=r"the hf engine takes the options .*got \['seed'\]"):
        create_engine("hf", copy.deepcopy(model), pad_token_id=0, options={"seed": 1})
