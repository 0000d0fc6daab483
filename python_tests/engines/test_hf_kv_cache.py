"""The hf engine's preallocated KV cache: the same continuations as transformers' DynamicCache,
buffers allocated once per call, compaction when requests leave, clear errors."""

import pytest
import torch

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.engines.hf.kv_cache import (PreallocatedLayer, dynamic_cache, preallocated_cache, reusable_layers,
                                               weights_key)
from python_tests.builders import tiny_causal_lm


def model(seed=0, vocab=48):
    m = tiny_causal_lm(vocab, seed=seed, tied=False)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m.eval()


def mixed_requests():
    shared = [1, 7, 7, 3, 9, 4, 4, 2, 5, 6]  # 10 shared tokens: the shared-prefix path too
    return [GenerationRequest(shared + [11, 12, 13][:k + 1], max_new_tokens=3 + 2 * k, seed=50 + k)
            for k in range(3)] + [GenerationRequest([8, 30, 31], max_new_tokens=9, seed=60)]


@pytest.mark.parametrize("min_shared_prefix", [0, 8])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(0.9, 0.95, 0)])
def test_preallocated_cache_samples_what_the_dynamic_cache_samples(min_shared_prefix, params):
    reqs = mixed_requests()
    if min_shared_prefix:  # every prompt shares the prefix
        reqs = reqs[:3]
    got = {}
    for kind in ("preallocated", "dynamic"):
        engine = HFEngine(model(), pad_token_id=0, kv_cache=kind, min_shared_prefix=min_shared_prefix)
        got[kind] = engine.generate(reqs, params)
        assert engine.kv_cache_in_use == kind
    for a, b in zip(got["preallocated"], got["dynamic"]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)
    # requests of different limits finished at different steps: the batch was compacted on the way
    assert sorted({len(g.token_ids) for g in got["preallocated"]}) == [3, 5, 7, 9][:len(reqs)]


@pytest.mark.parametrize("fast_decode", [False, True])
def test_buffers_are_allocated_once_and_compacted_only_when_requests_leave(fast_decode):
    m = model(seed=1)
    seen = []  # per forward or fast decode step: (batch, key buffer address, cached length before it)

    def note(batch, cache):
        layer = cache.layers[0]
        assert isinstance(layer, PreallocatedLayer)
        ptr = layer._key_buffer.data_ptr() if layer.is_initialized else None
        seen.append((batch, ptr, layer.get_seq_length()))

    # on the decoder stack, which every forward runs (the fast decoder's prefill skips the model's head)
    m.model.register_forward_pre_hook(lambda module, args, kwargs: note(
        kwargs["input_ids"].shape[0], kwargs.get("cache", kwargs.get("past_key_values"))), with_kwargs=True)
    engine = HFEngine(m, pad_token_id=0, min_shared_prefix=0, fast_decode=fast_decode)
    assert engine.fast_decode_in_use == fast_decode
    if fast_decode:
        step = engine._fast.step
        engine._fast.step = lambda tokens, mask, pos, cache: (note(tokens.shape[0], cache),
                                                              step(tokens, mask, pos, cache))[1]
    reqs = [GenerationRequest([3, 4, 5], 6, seed=1), GenerationRequest([6, 7], 3, seed=2)]
    gens = engine.generate(reqs, SamplingParams(1.0))
    assert [len(g.token_ids) for g in gens] == [6, 3]
    batches = [b for b, _, _ in seen]
    assert batches == [2, 2, 2, 1, 1, 1]  # prefill, steps 1-2 with both, then the first alone
    pointers = [p for _, p, _ in seen[1:]]
    assert len(set(pointers[:2])) == 1  # no reallocation while the batch stays
    assert pointers[2] != pointers[1] and len(set(pointers[2:])) == 1  # one compaction when a request left
    assert [n for _, _, n in seen] == [0, 3, 4, 5, 6, 7]  # prompt width 3, then one position per step


def test_layer_views_capacity_and_compaction():
    layer = PreallocatedLayer(capacity=5)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    keys, values = layer.update(k, -k)
    assert keys.shape == (2, 1, 3, 2) and torch.equal(keys, k) and torch.equal(values, -k)
    step = torch.full((2, 1, 1, 2), 100.0)
    keys, _ = layer.update(step, step)
    assert layer.get_seq_length() == 4 and layer.get_max_length() == 5
    assert torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 3:], step)
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape == (1, 1, 4, 2) and torch.equal(layer.keys[0, :, :3], k[1])
    assert layer._key_buffer.shape[2] == 5  # the capacity survives compaction
    layer.update(step[:1], step[:1])
    with pytest.raises(ValueError, match="capacity of 5"):
        layer.update(step[:1], step[:1])
    one_row = PreallocatedLayer(capacity=9)
    one_row.update(k[:1], k[:1])
    with pytest.raises(ValueError, match="batch 2 for a cache of batch 1"):
        one_row.update(step, step)
    repeated = PreallocatedLayer(capacity=4)
    repeated.update(k[:1], k[:1])
    repeated.batch_repeat_interleave(3)
    assert repeated.keys.shape == (3, 1, 3, 2) and all(torch.equal(repeated.keys[i], k[0]) for i in range(3))


def test_preallocated_cache_replaces_only_plain_layers_and_engine_validates_its_option():
    cache = preallocated_cache(model(), 16)
    assert cache is not None and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        HFEngine(model(), kv_cache="static")
    with pytest.raises(ValueError, match="capacity must be positive"):
        PreallocatedLayer(0)


def test_reusable_layers_takes_plain_and_preallocated_layers_only():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    m = model()
    cache = preallocated_cache(m, 16)
    assert reusable_layers(cache) and reusable_layers(dynamic_cache(m))
    cache.layers[1] = DynamicSlidingWindowLayer(sliding_window=4)  # positions dropped: recomputed instead
    assert not reusable_layers(cache)
    assert not reusable_layers(object())


def test_weights_key_changes_with_an_in_place_write_or_a_new_parameter():
    m = model()
    key = weights_key(m)
    assert weights_key(m) == key
    with torch.no_grad():
        m.lm_head.weight.add_(0.0)  # an in-place write, even of the same values
    assert weights_key(m) != key
    key = weights_key(m)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
    assert weights_key(m) != key


def test_importing_the_engines_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, flashreinforce.engines; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
