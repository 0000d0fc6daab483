"""The hf engine's fast decode step: the same tokens and log-probabilities as the model's forward."""

import copy

import pytest
import torch
import transformers

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.engines.hf.decode_attention import compiled_attention_available
from flashreinforce.engines.hf.fast_decode import FastDecoder, unsupported_reason
from flashreinforce.engines.hf.packed_linear import compiled_products_available, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(torch.float32),
                                reason="this PyTorch build has no oneDNN linear ops")


def model_of(kind, seed=0, **extra):
    config = transformers.AutoConfig.for_model(kind, vocab_size=300, hidden_size=64, intermediate_size=96,
                                               num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                               max_position_embeddings=512, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # random biases, so a bias left out would show
                p.normal_()
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def requests(n=6):
    g = torch.Generator().manual_seed(3)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]  # a shared prefix, then suffixes of different lengths (padding)
    return [GenerationRequest(shared + torch.randint(1, 300, (1 + 2 * i,), generator=g).tolist(), 14 + 3 * i,
                              seed=i) for i in range(n)]


CASES = [("llama", {}), ("llama", {"tie_word_embeddings": False}),
         ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {}),
         ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})]


@pytest.mark.parametrize("attention", ["compiled", "sdpa"])
@pytest.mark.parametrize("kind,extra", CASES, ids=[f"{k}-{'-'.join(e) or 'plain'}" for k, e in CASES])
def test_fast_decode_samples_what_the_models_forward_samples(kind, extra, attention):
    model = model_of(kind, **extra)
    fast = HFEngine(copy.deepcopy(model), dtype="float32", attention_kernel=attention)
    slow = HFEngine(copy.deepcopy(model), dtype="float32", fast_decode=False)
    assert fast.fast_decode_in_use and not slow.fast_decode_in_use
    assert fast.attention_kernel_in_use == attention and slow.attention_kernel_in_use is None
    params = SamplingParams(temperature=0.9, top_p=0.95, stop_token_ids=(17, 29))
    got, want = fast.generate(requests(), params), slow.generate(requests(), params)
    assert {g.finish_reason for g in got} >= {"length"}
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.log_probs == pytest.approx(w.log_probs, abs=2e-5)


def test_decode_step_logits_equal_the_forward_in_float64_rounding():
    model = model_of("llama")
    engine = HFEngine(copy.deepcopy(model), dtype="float32")
    captured = []
    step = engine._fast.step
    engine._fast.step = lambda *a: captured.append(step(*a)) or captured[-1]
    req = GenerationRequest([3, 4, 5, 6, 7], 4, seed=1)
    gen = engine.generate([req], SamplingParams(temperature=1.0))[0]
    ids = torch.tensor([req.token_ids + gen.token_ids])
    with torch.no_grad():
        logits = model.double()(input_ids=ids).logits[0]
    for i, step_logits in enumerate(captured):  # step i feeds sampled token i, predicts token i + 1
        torch.testing.assert_close(step_logits[0].double(), logits[len(req.token_ids) + i], rtol=1e-4, atol=1e-4)


def test_new_weights_reach_the_fast_decoder_with_the_load():
    engine = HFEngine(model_of("llama", seed=0), dtype="float32")
    other = model_of("llama", seed=1)
    engine.load_weights(other.state_dict(), 1)
    assert engine._fast.refresh() is False  # the load packed them already
    reference = HFEngine(other, dtype="float32", fast_decode=False)
    params = SamplingParams(temperature=1.0)
    got, want = engine.generate(requests(3), params), reference.generate(requests(3), params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.log_probs == pytest.approx(w.log_probs, abs=2e-5)


def test_weights_changed_in_place_are_packed_again_at_the_next_generation():
    engine = HFEngine(model_of("llama", seed=0), dtype="float32")
    params = SamplingParams(temperature=1.0)
    engine.generate(requests(2), params)
    with torch.no_grad():  # outside load_weights: only the version counters move
        engine.model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        engine.model.lm_head.weight.mul_(0.5)
    reference = HFEngine(copy.deepcopy(engine.model), dtype="float32", fast_decode=False)
    got, want = engine.generate(requests(3), params), reference.generate(requests(3), params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.log_probs == pytest.approx(w.log_probs, abs=2e-5)


def test_models_it_does_not_know_decode_with_their_own_forward():
    assert "is not one of" in unsupported_reason(model_of("gpt2"))
    sliding = model_of("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding-window" in unsupported_reason(sliding)
    assert FastDecoder.build(sliding) is None
    adapted = model_of("llama")

    class LinearWithAdapter(torch.nn.Linear):  # stands for a LoRA or quantized layer
        pass

    old = adapted.model.layers[1].mlp.down_proj
    adapted.model.layers[1].mlp.down_proj = LinearWithAdapter(old.in_features, old.out_features, bias=False)
    assert "LinearWithAdapter" in unsupported_reason(adapted)
    assert not HFEngine(adapted).fast_decode_in_use
    assert not HFEngine(model_of("llama"), kv_cache="dynamic").fast_decode_in_use
    assert not HFEngine(model_of("llama"), fast_decode=False).fast_decode_in_use


def test_the_attention_kernel_is_compiled_by_default_and_checked():
    model = model_of("llama")
    assert HFEngine(copy.deepcopy(model), dtype="float32").attention_kernel_in_use == "compiled"
    # bf16: the compiled kernel takes it, so it runs wherever the fast decoder does (oneDNN's bf16 linear)
    assert compiled_attention_available(torch.bfloat16)
    bf16 = HFEngine(copy.deepcopy(model), dtype="bfloat16")
    products = packed_linear_available(torch.bfloat16) or compiled_products_available(torch.bfloat16)
    assert bf16.attention_kernel_in_use == ("compiled" if products else None)
    assert bf16.fast_decode_in_use == products
    # float16: not a dtype the compiled kernel takes; auto falls back to PyTorch's, compiled is refused
    assert not compiled_attention_available(torch.float16)
    half = model_of("llama").half()
    assert FastDecoder(half, attention="auto").attention == "sdpa"
    with pytest.raises(ValueError, match="attention 'compiled' needs .* torch.float16"):
        FastDecoder(half, attention="compiled")
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        HFEngine(copy.deepcopy(model), dtype="float32", attention_kernel="flash")
