"""The learner's compiled RMS norm and SwiGLU (flashreinforce/ops/layers.py) against float64, and a
decoder routed through them (flashreinforce/models/fused_layers.py) against the same model in eager
PyTorch: outputs, gradients, LoRA, copies, the fallbacks and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from flashreinforce.models.fused_layers import compiled_layer_counts, use_compiled_layers
from flashreinforce.ops.layers import (compiled_layers_apply, compiled_layers_available, norm_applies, rms_norm,
                                      rms_norm_to_bf16, silu_mul, silu_mul_applies)

pytestmark = pytest.mark.skipif(not compiled_layers_available(), reason="compiled module without the layer operations")


def _norm64(x, w, eps):
    x, w = x.double(), w.double()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _grads(fn, *inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("shape", [(70, 576), (3, 5, 33), (1, 8)])
def test_rms_norm_matches_float64_forward_and_both_gradients(shape):
    torch.manual_seed(0)
    x, w = 3 * torch.randn(shape), torch.randn(shape[-1])
    g = torch.randn(shape)
    out, (gx, gw) = _grads(lambda a, b: rms_norm(a, b, 1e-5), x, w, grad_out=g)
    want, (wx, ww) = _grads(lambda a, b: _norm64(a, b, 1e-5), x.double(), w.double(), grad_out=g.double())
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(gx.double(), wx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), ww, rtol=1e-5, atol=1e-4)


def test_silu_mul_matches_float64_with_extreme_gates():
    torch.manual_seed(1)
    gate, up, g = 4 * torch.randn(3, 20001), torch.randn(3, 20001), torch.randn(3, 20001)
    gate[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -30.0])
    out, (dg, du) = _grads(silu_mul, gate, up, grad_out=g)
    want, (wg, wu) = _grads(lambda a, b: torch.nn.functional.silu(a) * b, gate.double(), up.double(),
                            grad_out=g.double())
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(dg.double(), wg, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(du.double(), wu, rtol=2e-6, atol=1e-7)
    assert torch.isfinite(dg).all() and torch.isfinite(out).all()


def test_only_the_wanted_gradients_are_computed_and_threads_do_not_change_the_bits():
    torch.manual_seed(2)
    x, w = torch.randn(65, 96, requires_grad=True), torch.randn(96)  # a frozen weight (LoRA's norms)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is None
    gate, up = torch.randn(40, 700), torch.randn(40, 700, requires_grad=True)
    silu_mul(gate, up).square().sum().backward()
    assert up.grad is not None and gate.grad is None
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, grads = _grads(lambda a, b: rms_norm(a, b, 1e-6), x, w, grad_out=torch.ones(65, 96))
            results.append([out, *grads])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(8,\)"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="rms_norm: x .*bfloat16.* must be float32 CPU tensors"):
        rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match=r"silu_mul: gate \(2, 3\) and up \(2, 4\)"):
        silu_mul(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="silu_mul: gate .*float64"):
        silu_mul(torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="silu_mul: gate .*bfloat16.*float32.*both float32 or both bfloat16"):
        silu_mul(torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"rms_norm_to_bf16: weight must have shape \(8,\)"):
        rms_norm_to_bf16(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="rms_norm_to_bf16: has no backward"):
        rms_norm_to_bf16(torch.randn(2, 8, requires_grad=True), torch.randn(8), 1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not compiled_layers_apply(torch.randn(2))  # LoRA's rule: float32 without autocast
        assert norm_applies(torch.randn(2, 8), torch.randn(8)) and silu_mul_applies(*torch.randn(2, 3).bfloat16())


def test_bf16_swiglu_and_norm_against_float64():
    """bfloat16 SwiGLU: the float64 value of the bf16 inputs rounded once (within half a bf16 ulp and
    float32's error), and so are both gradients; the bf16-out norm is the float32 norm rounded once."""
    torch.manual_seed(5)
    gate, up, dy = (4 * torch.randn(3, 20001)).bfloat16(), torch.randn(3, 20001).bfloat16(), torch.randn(3, 20001)
    out, (dg, du) = _grads(silu_mul, gate, up, grad_out=dy.bfloat16())
    assert out.dtype == dg.dtype == du.dtype == torch.bfloat16
    g64, u64, d64 = gate.double(), up.double(), dy.bfloat16().double()
    s = torch.sigmoid(g64)
    for got, want in ((out, g64 * s * u64), (du, d64 * g64 * s), (dg, d64 * u64 * s * (1 + g64 * (1 - s)))):
        err = (got.double() - want).abs()
        assert (err <= 2.0 ** -8 * want.abs() + 1e-6 * want.abs().max()).all()
    eager = torch.nn.functional.silu(gate) * up  # eager rounds twice: at most one ulp further
    assert ((out.double() - g64 * s * u64).abs() <= (eager.double() - g64 * s * u64).abs() + 1e-30).float().mean() > 0.9
    x, w = 3 * torch.randn(70, 576), torch.randn(576)
    assert torch.equal(rms_norm_to_bf16(x, w, 1e-5), rms_norm(x, w, 1e-5).bfloat16())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (silu_mul(gate, up), rms_norm_to_bf16(x, w, 1e-5))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], out) and torch.equal(one[1], rms_norm_to_bf16(x, w, 1e-5))


def _config(family: str):
    common = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    if family == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=4)
    if family == "qwen3":  # its attention has norms of its own (q_norm, k_norm over each head)
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=16)
    return transformers.Qwen2Config(**common, num_key_value_heads=2)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, norms_per_layer", [("llama", 2), ("qwen2", 2), ("qwen3", 4)])
def test_a_routed_decoder_gives_the_eager_models_logits_and_gradients(family, norms_per_layer):
    torch.manual_seed(3)
    eager = transformers.AutoModelForCausalLM.from_config(_config(family)).float()
    routed = copy.deepcopy(eager)
    counts = use_compiled_layers(routed)
    assert counts == {"norms": 2 * norms_per_layer + 1, "mlps": 2, "lora": 0}
    assert use_compiled_layers(routed) == counts and compiled_layer_counts(routed) == counts  # idempotent
    assert compiled_layer_counts(eager) == {"norms": 0, "mlps": 0, "lora": 0}
    ids = torch.randint(0, 61, (1, 40))
    want_logits, want = _loss_and_grads(eager, ids)
    got_logits, got = _loss_and_grads(routed, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    # a copy carries the routing, bound to its own modules
    clone = copy.deepcopy(routed)
    assert compiled_layer_counts(clone) == counts
    assert clone.model.norm.forward.__self__ is clone.model.norm
    torch.testing.assert_close(clone(input_ids=ids).logits, got_logits)
    # in float64 the modules' own forward runs: the eager numbers exactly
    routed64, eager64 = copy.deepcopy(routed).double(), copy.deepcopy(eager).double()
    with torch.no_grad():
        assert torch.equal(routed64(input_ids=ids).logits, eager64(input_ids=ids).logits)
    _check_bf16_autocast(eager, routed, eager64, ids, norms_per_layer)


def _norm_output_dtypes(model, run):
    """The dtype of every norm's output during ``run()``, by module name."""
    seen, hooks = {}, []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm"):
            hooks.append(module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype)))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _check_bf16_autocast(eager, routed, eager64, ids, norms_per_layer):
    """Under bf16 CPU autocast the routed model computes too: the layer norms hand their products bf16 in a
    forward without a backward (the final norm and Qwen3's per-head norms do not), the SwiGLU runs on bf16,
    and the logits and gradients are the eager ones within bf16 rounding, no further from float64."""
    with torch.no_grad():
        exact = eager64(input_ids=ids).logits.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = eager(input_ids=ids).logits.float()
        dtypes = _norm_output_dtypes(routed, lambda: routed(input_ids=ids))
        got = routed(input_ids=ids).logits.float()
    layer_norms = {n for n in dtypes if n.endswith(("input_layernorm", "post_attention_layernorm"))}
    assert len(layer_norms) == 4 and len(dtypes) == 2 * norms_per_layer + 1
    assert all(dtypes[n] == (torch.bfloat16 if n in layer_norms else torch.float32) for n in dtypes), dtypes
    assert not torch.equal(got, want)  # the compiled path ran (its roundings differ from eager's)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.01)
    assert (got - exact).abs().max() <= 1.5 * (want - exact).abs().max() + 1e-3
    # with a backward the norms keep float32 (the products' casts, as eager), the gradients are eager's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtypes = _norm_output_dtypes(routed, lambda: _loss_and_grads(routed, ids))
        _, got_grads = _loss_and_grads(routed, ids)
        _, want_grads = _loss_and_grads(eager, ids)
    assert set(dtypes.values()) == {torch.float32}
    for name in want_grads:
        scale = want_grads[name].abs().max()
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0.05, atol=0.05 * scale, msg=name)


def test_lora_adapters_train_through_the_routed_mlps():
    from flashreinforce.models.lora import LoraSettings, apply_lora

    torch.manual_seed(4)
    base = transformers.AutoModelForCausalLM.from_config(_config("llama")).float()
    eager = apply_lora(copy.deepcopy(base), LoraSettings(rank=4, alpha=8.0))
    for p in eager.parameters():  # adapters that are not zero, so their gradients depend on the activations
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    routed = copy.deepcopy(eager)
    assert use_compiled_layers(routed) == {"norms": 5, "mlps": 2, "lora": 14}
    ids = torch.randint(0, 61, (1, 33))
    _, want = _loss_and_grads(eager, ids)
    _, got = _loss_and_grads(routed, ids)
    assert want and got.keys() == want.keys()  # the adapters only: the norms' weights are frozen
    assert all("lora" in name for name in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_other_module_classes_are_left_alone():
    cfg = transformers.GemmaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert use_compiled_layers(model) == {"norms": 0, "mlps": 0, "lora": 0}  # Gemma: a 1 + weight norm, a GELU MLP


def test_the_learner_routes_its_model_and_steps_as_the_eager_learner():
    import random

    from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
    from python_tests.builders import random_trajectory, tiny_causal_lm

    rng = random.Random(0)
    trajectories = [random_trajectory(rng, 50) for _ in range(6)]
    base = tiny_causal_lm(50)
    learners = {flag: Learner(copy.deepcopy(base), LearnerSettings(lr=1e-3, compiled_layers=flag))
                for flag in (True, False)}
    assert compiled_layer_counts(learners[True].model) == {"norms": 5, "mlps": 2, "lora": 0}
    assert compiled_layer_counts(learners[False].model) == {"norms": 0, "mlps": 0, "lora": 0}
    metrics = {flag: learner.step(trajectories) for flag, learner in learners.items()}
    assert metrics[True]["loss"] == pytest.approx(metrics[False]["loss"], rel=1e-5, abs=1e-7)
    assert metrics[True]["grad_norm"] == pytest.approx(metrics[False]["grad_norm"], rel=1e-4)
    after = {flag: dict(learner.model.named_parameters()) for flag, learner in learners.items()}
    for name, p in after[False].items():
        torch.testing.assert_close(after[True][name], p, rtol=1e-5, atol=1e-6, msg=name)
