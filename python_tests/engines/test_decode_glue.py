"""The compiled core's small operations of the hf engine's decode step (residual update and RMS norm,
rotary embedding into the cache slots, SwiGLU), against PyTorch's, and the step that uses them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.engines.hf.fast_decode import _norm, _rotary, _silu_mul, compiled_glue_available
from flashreinforce.engines.hf.packed_linear import packed_linear_available
from python_tests.engines.test_fast_decode import model_of, requests

pytestmark = pytest.mark.skipif(not (compiled_glue_available() and packed_linear_available(torch.float32)),
                                reason="needs the compiled module's decode step operations and oneDNN linear ops")

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """float32: to float rounding; bfloat16: within about one rounding of the data type (the core
    rounds once where PyTorch rounds after each operation)."""
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [True, False])
def test_norm_updates_the_residual_and_normalizes_as_transformers(dtype, with_delta):
    g = torch.Generator().manual_seed(0)
    rows, hidden, eps = 7, 96, 1e-5
    base = torch.randn(rows, hidden + 5, generator=g).to(dtype)[:, :hidden]  # strided rows
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.empty(hidden).uniform_(0.5, 1.5, generator=g).to(dtype)
    x = base.clone()
    out = torch.empty(rows, hidden, dtype=dtype)
    _norm(x, delta if with_delta else None, weight, out, eps)
    ref_x = base + delta if with_delta else base
    assert torch.equal(x, ref_x)  # the residual stream, rounded like PyTorch's add
    xf = ref_x.float()
    ref = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)  # transformers' LlamaRMSNorm
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_writes_the_rotated_queries_and_keys_and_the_values_to_their_slots(dtype):
    g = torch.Generator().manual_seed(1)
    b, heads, kv, d, cap = 5, 6, 2, 16, 9
    qkv = torch.randn(b, (heads + 2 * kv) * d, generator=g).to(dtype)
    angle = torch.rand(b, d // 2, generator=g) * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype)
    keys = torch.zeros(b, kv, cap, d, dtype=dtype)
    values = torch.zeros(b, kv, cap, d, dtype=dtype)
    q = torch.empty(b, heads, d, dtype=dtype)
    _rotary(qkv, cos, sin, q, keys[:, :, 4:5], values[:, :, 4:5], heads, kv, d)

    def rope(t):  # transformers' apply_rotary_pos_emb, in float32
        t = t.float()
        rotated = torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)
        return t * cos.float()[:, None] + rotated * sin.float()[:, None]

    heads_of = qkv.view(b, heads + 2 * kv, d)
    close(q, rope(heads_of[:, :heads]), dtype)
    close(keys[:, :, 4], rope(heads_of[:, heads:heads + kv]), dtype)
    assert torch.equal(values[:, :, 4], heads_of[:, heads + kv:])
    assert not keys[:, :, :4].any() and not keys[:, :, 5:].any()  # only the slot is written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_is_swiglu(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(6, 2 * 40, generator=g)).to(dtype)
    out = torch.empty(6, 40, dtype=dtype)
    _silu_mul(gate_up, out)
    close(out, F.silu(gate_up[:, :40].float()) * gate_up[:, 40:].float(), dtype)


def test_bad_arguments_are_refused_naming_them():
    from flashreinforce import _C

    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="decode_norm: strides: smaller than hidden"):
        _C.decode_norm("float32", 4, 8, x.data_ptr(), 4, 0, 0, x.data_ptr(), x.data_ptr(), 8, 1e-6, 1)
    with pytest.raises(ValueError, match="decode_silu_mul: dtype"):
        _C.decode_silu_mul("float16", 4, 4, x.data_ptr(), 8, x.data_ptr(), 4, 1)
    with pytest.raises(ValueError, match="decode_rotary: sizes: .*head_dim even"):
        _C.decode_rotary("float32", 1, 1, 1, 3, x.data_ptr(), 9, x.data_ptr(), x.data_ptr(), 3, x.data_ptr(),
                         x.data_ptr(), 3, 3, x.data_ptr(), 3, 3, 1)


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}),
                                        ("qwen2", {})], ids=["llama", "llama-bias", "qwen2"])
def test_the_step_with_compiled_operations_samples_what_pytorchs_operations_sample(kind, extra):
    model = model_of(kind, **extra)
    glued = HFEngine(copy.deepcopy(model), dtype="float32")
    plain = HFEngine(copy.deepcopy(model), dtype="float32", decode_glue=False)
    assert glued.decode_glue_in_use and not plain.decode_glue_in_use
    params = SamplingParams(temperature=0.9, top_p=0.95, stop_token_ids=(17, 29))
    for g, w in zip(glued.generate(requests(), params), plain.generate(requests(), params)):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.log_probs == pytest.approx(w.log_probs, abs=2e-5)


def test_a_bfloat16_step_with_compiled_operations_stays_within_bfloat16_rounding():
    if not packed_linear_available(torch.bfloat16):
        pytest.skip("no packed bfloat16 linear on this CPU")
    model = model_of("llama")
    glued = HFEngine(copy.deepcopy(model), dtype="bfloat16")
    plain = HFEngine(copy.deepcopy(model), dtype="bfloat16", decode_glue=False)
    assert glued.decode_glue_in_use
    logits = {}
    for name, engine in (("glued", glued), ("plain", plain)):
        step = engine._fast.step
        captured = logits[name] = []
        engine._fast.step = lambda *a, step=step, captured=captured: captured.append(step(*a)) or captured[-1]
        engine.generate([GenerationRequest([3, 4, 5, 6, 7], 6, seed=1)], SamplingParams(temperature=0.0))
    for a, b in zip(logits["glued"], logits["plain"]):
        # the logits of a bfloat16 model differ by a few roundings of its dtype between the two
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.1)
