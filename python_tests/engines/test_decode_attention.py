"""The engine's grouped decode attention: the same attention as repeating the key/value heads,
the same continuations as transformers' SDPA attention, and delegation where it does not apply."""

import pytest
import torch
import torch.nn.functional as F

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.engines.decode_attention import ATTENTION_NAME, decode_attention
from python_tests.builders import tiny_causal_lm


class Heads(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def repeated_reference(query, key, value, mask, scale):
    """float64 attention with every key/value head repeated for its query heads."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (9, 3), (4, 4)])
def test_one_query_step_matches_repeated_heads_in_float64(mask_kind, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, L, d = 5, 11, 16
    q = torch.randn(b, heads, 1, d, generator=g)
    k, v = torch.randn(b, kv_heads, L, d, generator=g), torch.randn(b, kv_heads, L, d, generator=g)
    keep = torch.rand(b, 1, 1, L, generator=g) > 0.3
    keep[..., -1] = True  # every row sees its own token
    mask = {"bool": keep, "additive": torch.where(keep, 0.0, -1e9), "none": None}[mask_kind]
    out, weights = decode_attention(Heads(heads // kv_heads), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (b, 1, heads, d) and out.is_contiguous()
    ref = repeated_reference(q, k, v, keep if mask_kind != "none" else None, 0.3)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_prefill_and_per_head_masks_go_to_transformers_sdpa():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g)  # six queries: a prefill
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    out, _ = decode_attention(Heads(2), q, k, v, causal, scaling=None)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=causal).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)
    per_head = torch.ones(2, 4, 1, 6, dtype=torch.bool)
    out, _ = decode_attention(Heads(2), q[:, :, :1], k, v, per_head, scaling=None)
    ref = F.scaled_dot_product_attention(q[:, :, :1], k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=per_head).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(1.1, 0.9, 0)])
def test_engine_continuations_are_those_of_sdpa_attention(params):
    def model():
        m = tiny_causal_lm(48, seed=4, tied=False)  # 4 heads on 2 key/value heads
        with torch.no_grad():
            m.lm_head.weight.mul_(8.0)
        return m.eval()

    reqs = [GenerationRequest([1, 2, 3, 4][:k + 1], max_new_tokens=4 + k, seed=k) for k in range(4)]
    grouped, plain = HFEngine(model(), pad_token_id=0), HFEngine(model(), pad_token_id=0, decode_attention=False)
    assert grouped.decode_attention_in_use and grouped.model.config._attn_implementation == ATTENTION_NAME
    assert not plain.decode_attention_in_use and plain.model.config._attn_implementation == "sdpa"
    for a, b in zip(grouped.generate(reqs, params), plain.generate(reqs, params)):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


def test_a_model_on_another_attention_is_left_alone():
    m = tiny_causal_lm(48, seed=5)
    m.set_attn_implementation("eager")
    engine = HFEngine(m, pad_token_id=0)
    assert not engine.decode_attention_in_use and engine.model.config._attn_implementation == "eager"
