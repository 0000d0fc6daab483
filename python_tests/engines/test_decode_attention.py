"""The engine's grouped decode attention: the same attention as repeating the key/value heads,
the same continuations as transformers' SDPA attention, and delegation where it does not apply; and
the compiled core's decode attention (``fused_decode_attention``) against a float64 computation."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.engines.hf.decode_attention import (ATTENTION_NAME, compiled_attention_available, decode_attention,
                                                     fused_decode_attention)
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


# --- the compiled decode attention -------------------------------------------------------------

def fused_case(dtype, b, kv_heads, groups, d, length, seed=0, hole=True):
    """Queries laid out as the fast decoder's (a view of a [b, heads + kv_heads, d] tensor), a cache
    buffer longer than ``length`` read through a view, and a mask with holes."""
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(b, kv_heads * groups + kv_heads, d, generator=g).to(dtype)
    q = qk[:, :kv_heads * groups].reshape(b, kv_heads, groups, d)
    cap = length + 5
    keys = torch.randn(b, kv_heads, cap, d, generator=g).to(dtype)[:, :, :length]
    values = torch.randn(b, kv_heads, cap, d, generator=g).to(dtype)[:, :, :length]
    attend = torch.rand(b, length, generator=g) > (0.3 if hole else -1.0)
    attend[:, -1] = True
    return q, keys, values, attend


def float64_attention(q, keys, values, attend, scale):
    scores = (q.double() @ keys.double().transpose(-1, -2)) * scale  # [b, K, G, L]
    scores = scores.masked_fill(~attend[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ values.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,kv_heads,groups,d,length", [
    (32, 3, 3, 64, 100),   # SmolLM2's decode step
    (4, 2, 7, 128, 37),    # Qwen2.5-0.5B's groups, more than four queries per head
    (3, 2, 1, 16, 1),      # one position, no grouping
    (5, 1, 4, 40, 23),     # a head size off the vector width (plain loops)
    (2, 2, 2, 32, 300)])
def test_compiled_attention_matches_float64(dtype, b, kv_heads, groups, d, length):
    assert compiled_attention_available(dtype)
    q, keys, values, attend = fused_case(dtype, b, kv_heads, groups, d, length, seed=length)
    scale = d ** -0.5
    out = fused_decode_attention(q, keys, values, attend, scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    want = float64_attention(q, keys, values, attend, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    sdpa = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend[:, None, None, :], scale=scale)
    torch.testing.assert_close(out.double(), sdpa.double(), atol=3 * tol, rtol=3 * tol)


def test_compiled_attention_gives_zeros_to_a_request_with_no_position_and_leaves_the_others():
    q, keys, values, attend = fused_case(torch.float32, 4, 2, 3, 32, 20, hole=False)
    alone = fused_decode_attention(q, keys, values, attend, 0.2)
    attend[1] = False
    out = fused_decode_attention(q, keys, values, attend, 0.2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[[0, 2, 3]], alone[[0, 2, 3]])


def test_compiled_attention_does_not_depend_on_the_thread_count():
    q, keys, values, attend = fused_case(torch.float32, 16, 3, 3, 64, 150, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_decode_attention(q, keys, values, attend, 0.125)
        torch.set_num_threads(2)
        two = fused_decode_attention(q, keys, values, attend, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


_EACH_PATH = textwrap.dedent("""
    import json, torch
    from flashreinforce import _C
    from python_tests.engines.test_decode_attention import float64_attention, fused_case
    from flashreinforce.engines.hf.decode_attention import fused_decode_attention
    errors = {}
    for b, kv_heads, groups, d, length in ((32, 3, 3, 64, 100), (4, 2, 7, 128, 37), (3, 2, 1, 32, 41),
                                           (5, 1, 4, 48, 23), (2, 2, 2, 256, 70), (2, 1, 5, 96, 33)):
        for hole in (True, False):
            q, keys, values, attend = fused_case(torch.bfloat16, b, kv_heads, groups, d, length, seed=d, hole=hole)
            if not hole:
                attend[:, : length // 3] = False  # left padding: runs of skipped then attended positions
            out = fused_decode_attention(q, keys, values, attend, d ** -0.5)
            want = float64_attention(q, keys, values, attend, d ** -0.5)
            errors[f"{b},{kv_heads},{groups},{d},{length},{hole}"] = ((out.double() - want).abs()
                                                                      / (want.abs() + 1e-2)).max().item()
    print(json.dumps({"isa": _C.cpu_isa(), "avx512_bf16": _C.cpu_avx512_bf16(), "errors": errors}))
""")


@pytest.mark.parametrize("isa", [None, "avx512", "avx2", "generic"])
def test_bfloat16_attention_of_every_instruction_set_matches_float64(isa):
    """Each build of the bfloat16 kernel (AVX-512 with its BF16 extension: scores by vdpbf16ps; AVX-512
    without it, AVX2, generic: the rows read in pair order where the head size allows) against float64,
    on head sizes in and out of pair order, with holes and with left padding. A name above this CPU's
    instruction set runs its best (the run says which)."""
    env = dict(os.environ)
    env.pop("FLASHREINFORCE_CPU_ISA", None)
    if isa is not None:
        env["FLASHREINFORCE_CPU_ISA"] = isa
    done = subprocess.run([sys.executable, "-c", _EACH_PATH], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    print(isa, run["isa"], "AVX-512 BF16" if run["avx512_bf16"] else "")
    if isa is not None:
        assert not run["avx512_bf16"]
    # float32 scores and sums, then the bfloat16 output's rounding (2^-9 relative)
    assert max(run["errors"].values()) < 6e-3, run


def test_compiled_attention_errors_name_the_argument():
    q, keys, values, attend = fused_case(torch.float32, 2, 2, 2, 16, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        fused_decode_attention(q, keys.double(), values, attend, 1.0)
    with pytest.raises(ValueError, match="share one dtype"):
        fused_decode_attention(q.half(), keys.half(), values.half(), attend, 1.0)
    with pytest.raises(ValueError, match="attend must be a bool"):
        fused_decode_attention(q, keys, values, attend.long(), 1.0)
    with pytest.raises(ValueError, match="attend must be a bool"):
        fused_decode_attention(q, keys, values, attend[:, :-1], 1.0)
    with pytest.raises(ValueError, match="keys .* and values"):
        fused_decode_attention(q, keys[:, :1], values, attend, 1.0)
    with pytest.raises(ValueError, match="values must be contiguous in its last dimension"):
        fused_decode_attention(q, keys, values.transpose(2, 3).contiguous().transpose(2, 3), attend, 1.0)
    with pytest.raises(ValueError, match="4-D"):
        fused_decode_attention(q[0], keys, values, attend, 1.0)
    assert not compiled_attention_available(torch.float16) and not compiled_attention_available(torch.float64)
