"""The fused LoRA projection (flashreinforce/ops/lora_linear.py) against float64, and PEFT's LoRA layers
routed through it (flashreinforce/models/fused_layers.py) against PEFT's own forward: outputs, every
gradient, biases, the cases that keep PEFT's forward (dropout, merged, disabled, bf16 base, extra
adapters) and the errors."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers

from flashreinforce.models.fused_layers import compiled_layer_counts, use_compiled_layers
from flashreinforce.ops.layers import compiled_layers_available
from flashreinforce.ops.lora_linear import lora_linear

peft = pytest.importorskip("peft")


def _lora64(x, w, b, a, lb, s):
    out = x @ w.t() + s * (x @ a.t()) @ lb.t()
    return out if b is None else out + b


def _run(fn, inputs, grad_out, wants):
    leaves = [None if t is None else t.detach().clone().requires_grad_(want) for t, want in zip(inputs, wants)]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("shape, rank, with_bias, base_trains",
                         [((70, 96), 16, False, False), ((1, 33, 64), 4, True, False), ((2, 5, 48), 8, True, True)])
def test_lora_linear_matches_float64_forward_and_every_gradient(shape, rank, with_bias, base_trains):
    torch.manual_seed(0)
    n_in, n_out, s = shape[-1], 80, 2.5
    inputs = [torch.randn(shape), torch.randn(n_out, n_in) / n_in ** 0.5, torch.randn(n_out) if with_bias else None,
              torch.randn(rank, n_in) / n_in ** 0.5, torch.randn(n_out, rank) / rank ** 0.5]
    wants = [True, base_trains, base_trains, True, True]
    g = torch.randn(*shape[:-1], n_out)
    out, grads = _run(lambda *t: lora_linear(*t, s), inputs, g, wants)
    want, want_grads = _run(lambda *t: _lora64(*t, s), [None if t is None else t.double() for t in inputs],
                            g.double(), wants)
    assert out.shape == (*shape[:-1], n_out) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for name, got, ref, wanted in zip(("x", "weight", "bias", "lora_a", "lora_b"), grads, want_grads, wants):
        if not wanted or ref is None:
            assert got is None, name
            continue
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4, msg=name)


def test_lora_linear_errors_name_the_argument():
    x, w, a, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(2, 8), torch.randn(5, 2)
    with pytest.raises(ValueError, match=r"lora_linear: weight \(5, 7\)"):
        lora_linear(x, torch.randn(5, 7), None, a, b, 1.0)
    with pytest.raises(ValueError, match=r"lora_linear: lora_a \(2, 7\)"):
        lora_linear(x, w, None, torch.randn(2, 7), b, 1.0)
    with pytest.raises(ValueError, match=r"lora_linear: lora_b \(5, 3\) must be \[5, 2\]"):
        lora_linear(x, w, None, a, torch.randn(5, 3), 1.0)
    with pytest.raises(ValueError, match=r"lora_linear: bias \(4,\)"):
        lora_linear(x, w, torch.randn(4), a, b, 1.0)
    with pytest.raises(ValueError, match="lora_linear: lora_b .*bfloat16"):
        lora_linear(x, w, None, a, b.bfloat16(), 1.0)


def _lora_model(family: str, rank: int = 4, dropout: float = 0.0):
    from flashreinforce.models.lora import LoraSettings, apply_lora

    common = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    cfg = (transformers.LlamaConfig(**common, num_key_value_heads=4) if family == "llama"
           else transformers.Qwen2Config(**common, num_key_value_heads=2))  # Qwen2: biases on q, k, v
    torch.manual_seed(5)
    model = apply_lora(transformers.AutoModelForCausalLM.from_config(cfg).float(),
                       LoraSettings(rank=rank, alpha=2.0 * rank, dropout=dropout))
    for p in model.parameters():  # adapters that are not zero, so every gradient depends on both paths
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not compiled_layers_available(), reason="compiled module without the layer operations")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_routed_peft_layers_give_peft_logits_and_adapter_gradients(family):
    eager = _lora_model(family)
    routed = copy.deepcopy(eager)
    assert use_compiled_layers(routed) == {"norms": 5, "mlps": 2, "lora": 14}
    assert compiled_layer_counts(copy.deepcopy(routed))["lora"] == 14  # a copy carries the routing
    ids = torch.randint(0, 61, (1, 40))
    want_logits, want = _loss_and_grads(eager, ids)
    got_logits, got = _loss_and_grads(routed, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert want and got.keys() == want.keys() and all("lora_" in name for name in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def _layers(model):
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]


def _same_as_peft(layer, x, seed=1):
    """Whether the layer's output is PEFT's forward's, bit for bit (the same dropout mask too)."""
    torch.manual_seed(seed)
    got = layer(x)
    torch.manual_seed(seed)
    return torch.equal(got, type(layer).forward(layer, x))


@pytest.mark.skipif(not compiled_layers_available(), reason="compiled module without the layer operations")
def test_peft_forward_runs_where_the_call_is_not_plain_lora(monkeypatch):
    import flashreinforce.models.fused_layers as fused_layers

    fused_calls = []
    fused = fused_layers._lora_linear
    monkeypatch.setattr(fused_layers, "_lora_linear", lambda *a: fused_calls.append(1) or fused(*a))
    x = torch.randn(1, 9, 64)
    # plain LoRA: fused, PEFT's values
    model = _lora_model("llama")
    use_compiled_layers(model)
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        torch.testing.assert_close(q(x), type(q).forward(q, x), rtol=1e-5, atol=1e-6)
    assert len(fused_calls) == 1
    # dropout while training: PEFT's forward; in eval (dropout off) fused again
    model = _lora_model("llama", dropout=0.3)
    use_compiled_layers(model)
    q = model.model.layers[0].self_attn.q_proj
    model.train()
    assert _same_as_peft(q, x) and len(fused_calls) == 1
    model.eval()
    with torch.no_grad():
        q(x)
    assert len(fused_calls) == 2
    # adapters disabled, merged into the base weights, two adapters active, extra arguments: PEFT's forward
    for state in ("disabled", "merged", "two adapters", "arguments", "packed base"):
        model = _lora_model("llama")
        use_compiled_layers(model)
        q = model.model.layers[0].self_attn.q_proj
        if state == "disabled":
            q.enable_adapters(False)
        elif state == "merged":
            q.merge()
        elif state == "packed base":  # a base layer with a forward of its own (the hf engine packs its products)
            own = lambda self, t: torch.nn.functional.linear(t, self.weight)  # noqa: E731
            q.base_layer.forward = types.MethodType(own, q.base_layer)
        elif state == "two adapters":
            peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["q_proj"]), model, adapter_name="second")
            q.set_adapter(["default", "second"])
            assert len(q.active_adapters) == 2
        with torch.no_grad():
            if state == "arguments":
                torch.manual_seed(1)
                got = q(x, adapter_names=["default"])
                assert torch.equal(got, type(q).forward(q, x, adapter_names=["default"])), state
            else:
                assert _same_as_peft(q, x), state
        assert len(fused_calls) == 2, state
    # a bf16 base under float32 adapters: PEFT's forward (its casts)
    from flashreinforce.models.lora import LoraSettings, apply_lora

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(6)
    model = apply_lora(transformers.AutoModelForCausalLM.from_config(cfg).float(),
                       LoraSettings(rank=4, base_dtype="bfloat16"))
    use_compiled_layers(model)
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        assert _same_as_peft(q, x.bfloat16())
    assert len(fused_calls) == 2
