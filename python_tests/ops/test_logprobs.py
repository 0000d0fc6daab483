"""Chunked sampled-token log-probs / entropies vs the naive full-logits computation.

The reference materializes the logits, takes ``log_softmax`` and gathers, in float64 (or in the
tested dtype where stated); every test draws fresh random inputs on odd shapes.
"""

import math
import zlib

import pytest
import torch

from flashreinforce.ops.logprobs import (DEFAULT_CHUNK_BYTES, chunk_rows, sampled_token_logprobs,
                                         wide_gemm_available)


def _reference(hidden, weight, targets, bias=None, temperature=1.0):
    """Naive path: full [N, V] logits -> log_softmax -> gather; entropy from the full row."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # as a model's lm_head computes it
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def _inputs(n, h, v, dtype, *, bias=False, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) * scale / math.sqrt(h)).to(dtype)
    b = torch.randn(v, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, b, targets


def _grads(fn, hidden, weight, bias, coeff_logp, coeff_ent):
    """Gradients of sum(c1 * logp + c2 * entropy) w.r.t. hidden, weight (and bias)."""
    leaves = [hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    logp, ent = fn(*leaves)
    obj = 0.0
    if coeff_logp is not None:
        obj = obj + (logp * coeff_logp.to(logp.dtype)).sum()
    if coeff_ent is not None:
        obj = obj + (ent * coeff_ent.to(ent.dtype)).sum()
    return (logp, ent), torch.autograd.grad(obj, leaves)


# (tokens, hidden, vocab, token rows per tile, vocabulary columns per tile): tiles that do not
# divide the shapes, a single tile, one-row and one-column tiles.
SHAPES = [(37, 16, 101, 5, 13), (64, 8, 1000, 64, None), (1, 3, 7, None, 1), (129, 24, 513, 50, 100),
          (20, 5, 64, 3, 64)]


@pytest.mark.parametrize("n,h,v,chunk,vchunk", SHAPES)
@pytest.mark.parametrize("temperature,use_bias", [(1.0, False), (0.6, True), (1.7, False)])
@pytest.mark.parametrize("grad_from", ["logp", "entropy", "both"])
def test_matches_naive_float64(n, h, v, chunk, vchunk, temperature, use_bias, grad_from):
    seed = zlib.crc32(repr((n, h, v, chunk, vchunk, temperature, use_bias, grad_from)).encode())
    hidden, weight, bias, targets = _inputs(n, h, v, torch.float64, bias=use_bias, seed=seed, scale=3.0)
    gen = torch.Generator().manual_seed(seed + 1)
    c1 = torch.randn(n, generator=gen, dtype=torch.float64) if grad_from in ("logp", "both") else None
    c2 = torch.randn(n, generator=gen, dtype=torch.float64) if grad_from in ("entropy", "both") else None

    def chunked(hd, w, *b):
        return sampled_token_logprobs(hd, w, targets, bias=b[0] if b else None, temperature=temperature,
                                      chunk_size=chunk, vocab_chunk_size=vchunk, with_entropy=True)

    def naive(hd, w, *b):
        return _reference(hd, w, targets, b[0] if b else None, temperature)

    (lp, ent), g = _grads(chunked, hidden, weight, bias, c1, c2)
    (lp_ref, ent_ref), g_ref = _grads(naive, hidden, weight, bias, c1, c2)
    assert lp.dtype == torch.float64 and ent.dtype == torch.float64
    torch.testing.assert_close(lp, lp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-12, atol=1e-12)
    assert len(g) == len(g_ref) == (3 if use_bias else 2)
    for got, want in zip(g, g_ref):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_float32_matches_float64_reference(with_entropy):
    # Float32 in, float32 out; compare to the float64 naive computation on the same values.
    n, h, v = 300, 40, 2051
    hidden, weight, bias, targets = _inputs(n, h, v, torch.float32, bias=True, seed=11, scale=4.0)
    gen = torch.Generator().manual_seed(12)
    c1 = torch.randn(n, generator=gen)
    c2 = torch.randn(n, generator=gen) if with_entropy else None

    def chunked(hd, w, b):
        return sampled_token_logprobs(hd, w, targets, bias=b, temperature=0.8, chunk_size=77,
                                      vocab_chunk_size=500, with_entropy=with_entropy)

    def naive64(hd, w, b):
        return _reference(hd.double(), w.double(), targets, b.double(), 0.8)

    (lp, ent), g = _grads(chunked, hidden, weight, bias, c1, c2)
    (lp_ref, ent_ref), g_ref = _grads(naive64, hidden, weight, bias, c1.double(), None if c2 is None else c2.double())
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=2e-5)
    if with_entropy:
        assert ent.dtype == torch.float32
        torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=2e-5)
    else:
        assert ent is None
    for got, want in zip(g, g_ref):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_low_precision_matches_same_dtype_naive(dtype, entropy_grad):
    # The GEMM runs in the input dtype in both paths, everything after it in float32.
    n, h, v = 70, 32, 997
    hidden, weight, bias, targets = _inputs(n, h, v, dtype, bias=True, seed=5, scale=3.0)
    c1 = torch.randn(n, generator=torch.Generator().manual_seed(6))
    c2 = torch.randn(n, generator=torch.Generator().manual_seed(7)) if entropy_grad else None

    def chunked(hd, w, b):
        return sampled_token_logprobs(hd, w, targets, bias=b, temperature=0.9, chunk_size=16,
                                      vocab_chunk_size=300, with_entropy=True)

    def naive(hd, w, b):
        return _reference(hd, w, targets, b, 0.9)

    (lp, ent), g = _grads(chunked, hidden, weight, bias, c1, c2)
    (lp_ref, ent_ref), g_ref = _grads(naive, hidden, weight, bias, c1, c2)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(g, g_ref):
        assert got.dtype == dtype
        # One low-precision rounding of the result (and of per-chunk partial sums for weight).
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_gradcheck_float64():
    hidden, weight, bias, targets = _inputs(7, 5, 11, torch.float64, bias=True, seed=21, scale=2.0)
    args = tuple(t.requires_grad_() for t in (hidden, weight, bias))

    def fn(hd, w, b):
        return sampled_token_logprobs(hd, w, targets, bias=b, temperature=0.7, chunk_size=3,
                                      vocab_chunk_size=4, with_entropy=True)

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_partial_gradients_and_no_grad():
    n, h, v = 33, 6, 50
    hidden, weight, bias, targets = _inputs(n, h, v, torch.float64, bias=True, seed=31)
    # Only weight requires grad (frozen trunk); only bias (frozen projection).
    w = weight.clone().requires_grad_()
    lp, _ = sampled_token_logprobs(hidden, w, targets, bias=bias, chunk_size=4)
    (gw,) = torch.autograd.grad(lp.sum(), [w])
    w_ref = weight.clone().requires_grad_()
    (gw_ref,) = torch.autograd.grad(_reference(hidden, w_ref, targets, bias)[0].sum(), [w_ref])
    torch.testing.assert_close(gw, gw_ref, rtol=1e-10, atol=1e-12)

    b = bias.clone().requires_grad_()
    _, ent = sampled_token_logprobs(hidden, weight, targets, bias=b, chunk_size=7, with_entropy=True)
    (gb,) = torch.autograd.grad(ent.sum(), [b])
    b_ref = bias.clone().requires_grad_()
    (gb_ref,) = torch.autograd.grad(_reference(hidden, weight, targets, b_ref)[1].sum(), [b_ref])
    torch.testing.assert_close(gb, gb_ref, rtol=1e-10, atol=1e-12)

    hg = hidden.clone().requires_grad_()
    with torch.no_grad():
        lp, ent = sampled_token_logprobs(hg, weight, targets, bias=bias, with_entropy=True)
    assert not lp.requires_grad and not ent.requires_grad
    lp_ref, ent_ref = _reference(hidden, weight, targets, bias)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-12, atol=1e-12)


def test_chunking_does_not_change_results():
    # Any chunk size gives the same values; default chunking uses the byte budget.
    hidden, weight, _, targets = _inputs(101, 12, 301, torch.float32, seed=41, scale=3.0)
    outs = [sampled_token_logprobs(hidden, weight, targets, chunk_size=c, vocab_chunk_size=vc,
                                   with_entropy=True)
            for c, vc in [(1, None), (10, 7), (100, 300), (101, 301), (1000, 1000), (None, None), (33, 1)]]
    for lp, ent in outs[1:]:
        torch.testing.assert_close(lp, outs[0][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ent, outs[0][1], rtol=1e-6, atol=1e-6)
    small_budget = sampled_token_logprobs(hidden, weight, targets, chunk_budget_bytes=301 * 4 * 3)
    torch.testing.assert_close(small_budget[0], outs[0][0], rtol=1e-6, atol=1e-6)


def test_online_logsumexp_across_vocab_tiles_with_extreme_logits():
    # Each row's largest logits sit in a late vocabulary tile, 60 nats above the rest, so the
    # running sums of early tiles are rescaled by ~exp(-60); one row puts almost all mass on its
    # target, whose log-probability must stay <= 0 (the loss rejects positive log-probs).
    n, h, v = 6, 4, 50
    hidden, weight, _, targets = _inputs(n, h, v, torch.float64, seed=71)
    bias = torch.zeros(v, dtype=torch.float64)
    bias[41:44] = 60.0
    bias[0] = -30.0
    targets[0] = 42
    targets[1] = 0
    hidden32, weight32, bias32 = hidden.float(), weight.float(), bias.float()
    weight32[42] *= 30.0  # row 0: target logit far above everything else
    for hd, w, b, tol in [(hidden, weight, bias, 1e-12), (hidden32, weight32, bias32, 2e-5)]:
        lp, ent = sampled_token_logprobs(hd, w, targets, bias=b, chunk_size=4, vocab_chunk_size=9,
                                         with_entropy=True)
        lp_ref, ent_ref = _reference(hd.double(), w.double(), targets, b.double())
        torch.testing.assert_close(lp.double(), lp_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(ent.double(), ent_ref, rtol=tol, atol=tol)
        assert bool((lp <= 0).all())


def test_logp_never_positive_when_one_token_dominates():
    gen = torch.Generator().manual_seed(81)
    hidden = torch.randn(64, 8, generator=gen) * 50.0
    weight = torch.randn(300, 8, generator=gen)
    targets = (hidden @ weight.t()).argmax(1)  # the dominant token: p ~ 1, logp ~ -0
    lp, _ = sampled_token_logprobs(hidden, weight, targets, chunk_size=7, vocab_chunk_size=37)
    assert bool((lp <= 0).all())
    torch.testing.assert_close(lp.double(), _reference(hidden.double(), weight.double(), targets)[0],
                               rtol=0, atol=1e-4)


def test_chunk_rows_respects_budget():
    v = 151936
    rows = chunk_rows(v)
    assert rows * v * 4 <= DEFAULT_CHUNK_BYTES < (rows + 1) * v * 4
    rows = chunk_rows(v, with_entropy=True)
    assert rows * v * 8 <= DEFAULT_CHUNK_BYTES < (rows + 1) * v * 8
    assert chunk_rows(v, torch.bfloat16) * v * 6 <= DEFAULT_CHUNK_BYTES
    assert chunk_rows(v, torch.float64, with_entropy=True) * v * 16 <= DEFAULT_CHUNK_BYTES
    assert chunk_rows(v, budget_bytes=1) == 1
    with pytest.raises(ValueError, match="budget_bytes"):
        chunk_rows(v, budget_bytes=0)


def test_empty_input():
    weight = torch.randn(9, 4, requires_grad=True)
    hidden = torch.zeros(0, 4, requires_grad=True)
    lp, ent = sampled_token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.int64), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    gh, gw = torch.autograd.grad(lp.sum(), [hidden, weight])
    assert gh.shape == (0, 4) and torch.count_nonzero(gw) == 0


def test_int32_targets_and_noncontiguous_hidden():
    hidden, weight, _, targets = _inputs(40, 10, 77, torch.float64, seed=51)
    wide = torch.stack([hidden, -hidden], dim=2)[..., 0]  # strided view with the same values
    assert not wide.is_contiguous()
    lp, _ = sampled_token_logprobs(wide, weight, targets.to(torch.int32), chunk_size=9)
    torch.testing.assert_close(lp, _reference(hidden, weight, targets)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden=torch.zeros(3)), "hidden"),
    (dict(hidden=torch.zeros(3, 4, dtype=torch.int64)), "hidden"),
    (dict(weight=torch.zeros(5, 3)), "weight"),
    (dict(weight=torch.zeros(5, 4, dtype=torch.float64)), "weight dtype"),
    (dict(weight=torch.zeros(0, 4)), "weight"),
    (dict(targets=torch.zeros(2, dtype=torch.int64)), "targets"),
    (dict(targets=torch.zeros(3, 1, dtype=torch.int64)), "targets"),
    (dict(targets=torch.zeros(3)), "targets"),
    (dict(targets=torch.tensor([0, 5, 1])), r"targets must lie in \[0, V\)"),
    (dict(targets=torch.tensor([0, -1, 1])), r"targets must lie in \[0, V\)"),
    (dict(bias=torch.zeros(4)), "bias"),
    (dict(bias=torch.zeros(5, dtype=torch.float64)), "bias dtype"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
    (dict(vocab_chunk_size=0), "vocab_chunk_size"),
    (dict(vocab_chunk_size=True), "vocab_chunk_size"),
    (dict(chunk_budget_bytes=0), "chunk_budget_bytes"),
    (dict(operand_dtype=torch.float64), "operand_dtype must be"),
    (dict(operand_dtype=torch.float32), "operand_dtype must be"),
    (dict(hidden=torch.zeros(3, 4, dtype=torch.bfloat16), weight=torch.zeros(5, 4, dtype=torch.bfloat16),
          operand_dtype=torch.bfloat16), "operand_dtype applies to float32"),
])
def test_validation_names_the_argument(kwargs, match):
    args = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), targets=torch.tensor([0, 4, 1]))
    args.update(kwargs)
    hidden, weight, targets = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(ValueError, match=match):
        sampled_token_logprobs(hidden, weight, targets, **args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_float64(dtype):
    n, h, v = 257, 64, 5003
    hidden, weight, bias, targets = _inputs(n, h, v, dtype, bias=True, seed=61, scale=3.0)
    c1 = torch.randn(n, generator=torch.Generator().manual_seed(62))
    c2 = torch.randn(n, generator=torch.Generator().manual_seed(63))

    def chunked(hd, w, b):
        return sampled_token_logprobs(hd, w, targets.cuda(), bias=b, temperature=0.7, chunk_size=100,
                                      with_entropy=True)

    def naive64(hd, w, b):
        return _reference(hd.double(), w.double(), targets, b.double(), 0.7)

    (lp, ent), g = _grads(chunked, hidden.cuda(), weight.cuda(), bias.cuda(), c1.cuda(), c2.cuda())
    # float64 leaves: the reference's gradients are not rounded back to the inputs' dtype.
    (lp_ref, ent_ref), g_ref = _grads(naive64, hidden.double(), weight.double(), bias.double(), c1.double(),
                                      c2.double())
    # TF32 or bf16 GEMMs: tolerances of one low-precision matmul.
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(lp.double().cpu(), lp_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double().cpu(), ent_ref, rtol=tol, atol=tol)
    for got, want in zip(g, g_ref):
        assert got.dtype == dtype and got.is_cuda
        torch.testing.assert_close(got.double().cpu(), want, rtol=5 * tol, atol=5 * tol * want.abs().max().item())


def _rounded_operand_reference(hidden, weight, bias, targets, temperature, operand_dtype, c1, c2):
    """What low-precision GEMM operands with float32 results compute, in float64: logits from the
    rounded hidden states and weight (bias not rounded); gradients from the float64 logit
    gradient rounded to the operand dtype, times the rounded operands."""
    h_r = hidden.to(operand_dtype).double()
    w_r = weight.to(operand_dtype).double()
    logits = (h_r @ w_r.T + bias.double()).requires_grad_()
    logsm = torch.log_softmax(logits / temperature, dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(-1)
    obj = (logp * c1.double()).sum() + (0.0 if c2 is None else (ent * c2.double()).sum())
    (g_logits,) = torch.autograd.grad(obj, [logits])
    g_r = g_logits.to(torch.float32).to(operand_dtype).double()
    return logp.detach(), ent.detach(), (g_r @ w_r, g_r.T @ h_r, g_logits.sum(0))


@pytest.mark.parametrize("operand_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_low_precision_operands_round_the_operands_not_the_logits(operand_dtype, with_entropy):
    n, h, v = 70, 48, 1031
    hidden, weight, bias, targets = _inputs(n, h, v, torch.float32, bias=True, seed=71, scale=4.0)
    gen = torch.Generator().manual_seed(72)
    c1 = torch.randn(n, generator=gen)
    c2 = torch.randn(n, generator=gen) if with_entropy else None

    def chunked(hd, w, b, od=operand_dtype):
        return sampled_token_logprobs(hd, w, targets, bias=b, temperature=0.9, chunk_size=16,
                                      vocab_chunk_size=300, with_entropy=True, operand_dtype=od)

    (lp, ent), g = _grads(chunked, hidden, weight, bias, c1, c2)
    lp_ref, ent_ref, g_ref = _rounded_operand_reference(hidden, weight, bias, targets, 0.9, operand_dtype, c1, c2)
    assert lp.dtype == ent.dtype == torch.float32
    # The logits are float32 sums of exact products: float32 accuracy, not 8-bit.
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(g, g_ref):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4 * want.abs().max().item())
    # And the operands really are rounded: the float32 path gives measurably different numbers.
    (lp32, _), _ = _grads(lambda hd, w, b: chunked(hd, w, b, None), hidden, weight, bias, c1, c2)
    assert (lp32 - lp).abs().max() > 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_entropy", [False, True])
def test_cuda_bf16_operands_with_float32_results(with_entropy):
    # On CUDA the operands go to a bf16 GEMM with float32 accumulation and output where torch has
    # one (wide_gemm_available), else they are emulated; the numbers are the same either way.
    n, h, v = 300, 64, 5003
    hidden, weight, bias, targets = _inputs(n, h, v, torch.float32, bias=True, seed=81, scale=4.0)
    gen = torch.Generator().manual_seed(82)
    c1 = torch.randn(n, generator=gen)
    c2 = torch.randn(n, generator=gen) if with_entropy else None
    print(f"wide GEMM on cuda: {wide_gemm_available('cuda')}")

    def chunked(hd, w, b):
        return sampled_token_logprobs(hd, w, targets.cuda(), bias=b, temperature=0.9, chunk_size=128,
                                      with_entropy=True, operand_dtype=torch.bfloat16)

    (lp, ent), g = _grads(chunked, hidden.cuda(), weight.cuda(), bias.cuda(), c1.cuda(),
                          None if c2 is None else c2.cuda())
    lp_ref, ent_ref, g_ref = _rounded_operand_reference(hidden, weight, bias, targets, 0.9, torch.bfloat16, c1, c2)
    torch.testing.assert_close(lp.double().cpu(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double().cpu(), ent_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(g, g_ref):
        assert got.dtype == torch.float32 and got.is_cuda
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-3, atol=1e-4 * want.abs().max().item())
