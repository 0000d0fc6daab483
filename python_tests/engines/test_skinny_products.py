"""The compiled core's skinny products (``csrc/flashreinforce/skinny_gemm.h``) behind the hf engine's decode
step: against a float64 product, independent of the thread count, checked arguments, and the engine's
choice of kernel."""

from __future__ import annotations

import copy

import pytest
import torch

from flashreinforce.engines import GenerationRequest, HFEngine, SamplingParams
from flashreinforce.engines.hf import packed_linear
from flashreinforce.engines.hf.packed_linear import (PackedWeight, compiled_products_available, pack_weight,
                                                     packed_linear_available, packed_matmul)
from python_tests.engines.test_fast_decode import model_of, requests

DTYPES = [torch.float32, torch.bfloat16]


def needs(dtype):
    if not compiled_products_available(dtype):
        pytest.skip(f"this build or CPU has no compiled skinny product for {dtype} (AVX-512F; bf16: AVX-512 BF16)")


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


def check_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype) -> None:
    """float32: a few float32 roundings of the sum of |x w|; bfloat16 adds one rounding of the result."""
    scale = x.double().abs() @ w.double().abs().T
    tol = 4e-7 * scale * x.shape[-1] ** 0.5 + (want.abs() / 256 if dtype == torch.bfloat16 else 0) + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"worst error {(err / tol).max().item():.3g} of the tolerance"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n_in,n_out,bias", [(1, 64, 48, False), (8, 576, 960, True), (13, 33, 50, True),
                                                  (32, 7, 97, False), (40, 130, 200, True)])
def test_the_product_matches_float64_for_row_groups_odd_depths_and_partial_panels(dtype, rows, n_in, n_out, bias):
    needs(dtype)
    g = torch.Generator().manual_seed(rows * 1000 + n_in)
    w = torch.randn(n_out, n_in, generator=g).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    wide = torch.randn(rows, n_in + 3, generator=g).to(dtype)
    x = wide[:, :n_in]  # rows with a stride wider than the row
    packed = pack_weight(w, rows, "compiled")
    assert isinstance(packed, PackedWeight) and packed.kernel == "compiled"
    assert (packed.out_features, packed.in_features) == (n_out, n_in)
    with torch.inference_mode():
        got = packed_matmul(x, packed, b)
    assert got.dtype == dtype and got.shape == (rows, n_out)
    check_close(got, reference(x, w, b), x, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_leading_dimensions_are_kept_and_the_thread_count_does_not_change_a_bit(dtype):
    needs(dtype)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 96, generator=g).to(dtype)
    x = torch.randn(3, 11, 96, generator=g).to(dtype)
    packed = pack_weight(w, 32, "compiled")
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(packed_matmul(x, pack_weight(w, 32, "compiled"), None))
        torch.set_num_threads(threads)
        one = packed_matmul(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (3, 11, 300)
    # a 1-D row, and rows broadcast from one (stride 0) or transposed (last dimension strided)
    torch.testing.assert_close(packed_matmul(x[0, 0], packed, None), one[0, 0], rtol=0, atol=0)
    torch.testing.assert_close(packed_matmul(x[0, :1].expand(4, 96), packed, None), one[0, :1].expand(4, 300),
                               rtol=0, atol=0)
    xt = x[0].T.contiguous().T  # [11, 96] with stride (1, 11)
    torch.testing.assert_close(packed_matmul(xt, packed, None), one[0], rtol=0, atol=0)
    for r in results:
        assert torch.equal(r, one)
    check_close(one.reshape(33, 300), reference(x.reshape(33, 96), w, None), x.reshape(33, 96), w, dtype)


def test_auto_picks_the_compiled_product_where_it_runs_and_onednn_stays_the_default():
    w = torch.randn(20, 12)
    assert pack_weight(w, 4).kernel == "onednn" or not packed_linear_available(torch.float32)
    want = "compiled" if compiled_products_available(torch.float32) else "onednn"
    assert pack_weight(w, 4, "auto").kernel == want
    with pytest.raises(ValueError, match="kernel must be one of"):
        pack_weight(w, 4, "fast")


def test_compiled_is_refused_by_name_where_the_cpu_lacks_it(monkeypatch):
    monkeypatch.setattr(packed_linear, "compiled_products_available", lambda dtype: False)
    with pytest.raises(ValueError, match="kernel 'compiled' needs flashreinforce._C's skinny product"):
        pack_weight(torch.randn(4, 4), 4, "compiled")
    if packed_linear_available(torch.float32):
        assert pack_weight(torch.randn(4, 4), 4, "auto").kernel == "onednn"


def test_bad_arguments_are_refused_by_name():
    needs(torch.float32)
    packed = pack_weight(torch.randn(10, 8), 4, "compiled")
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"x must be a CPU torch.float32 tensor \[\.\.\., 8\]"):
            packed_matmul(torch.randn(3, 9), packed, None)
        with pytest.raises(ValueError, match=r"x must be"):
            packed_matmul(torch.randn(3, 8, dtype=torch.float64), packed, None)
        with pytest.raises(ValueError, match=r"bias must be torch.float32 \[10\]"):
            packed_matmul(torch.randn(3, 8), packed, torch.randn(9))
    from flashreinforce import _C

    x, y = torch.randn(2, 8), torch.empty(2, 10)
    with pytest.raises(ValueError, match="skinny_gemm: strides"):
        _C.skinny_gemm("float32", 2, 8, 10, x.data_ptr(), 4, packed.data.data_ptr(), 0, y.data_ptr(), 10, 1)
    with pytest.raises(ValueError, match="skinny_pack: dtype"):
        _C.skinny_pack("float64", 2, 2, x.data_ptr(), 2, y.data_ptr(), 1)


def test_the_engine_decodes_the_same_tokens_with_either_kernel_and_says_which_runs():
    needs(torch.float32)
    if not packed_linear_available(torch.float32):
        pytest.skip("this PyTorch build has no oneDNN linear ops")
    model = model_of("llama", attention_bias=True, mlp_bias=True)
    compiled = HFEngine(copy.deepcopy(model), dtype="float32")
    onednn = HFEngine(copy.deepcopy(model), dtype="float32", product_kernel="onednn")
    assert compiled.product_kernel_in_use == "compiled" and onednn.product_kernel_in_use == "onednn"
    assert HFEngine(copy.deepcopy(model), dtype="float32", fast_decode=False).product_kernel_in_use is None
    params = SamplingParams(temperature=0.9, top_p=0.95, stop_token_ids=(17, 29))
    for g, w in zip(compiled.generate(requests(), params), onednn.generate(requests(), params)):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.log_probs == pytest.approx(w.log_probs, abs=2e-5)
    with pytest.raises(ValueError, match="product_kernel must be one of"):
        HFEngine(copy.deepcopy(model), dtype="float32", product_kernel="mkl")


def test_a_bfloat16_step_with_the_compiled_product_stays_within_bfloat16_rounding_of_onednns():
    needs(torch.bfloat16)
    if not packed_linear_available(torch.bfloat16):
        pytest.skip("no packed bfloat16 oneDNN linear on this CPU")
    model = model_of("qwen2")
    logits = {}
    for kernel in ("compiled", "onednn"):
        engine = HFEngine(copy.deepcopy(model), dtype="bfloat16", product_kernel=kernel)
        assert engine.product_kernel_in_use == kernel
        step = engine._fast.step
        captured = logits[kernel] = []
        engine._fast.step = lambda *a, step=step, captured=captured: captured.append(step(*a)) or captured[-1]
        engine.generate([GenerationRequest([3, 4, 5, 6, 7], 6, seed=1)], SamplingParams(temperature=0.0))
    assert len(logits["compiled"]) == len(logits["onednn"]) == 5
    for a, b in zip(logits["compiled"], logits["onednn"]):
        # greedy tokens, so the steps see the same inputs; the logits differ by a few bfloat16 roundings
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.1)
