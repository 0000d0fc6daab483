"""The direct weight load into vLLM's CPU kernels (:mod:`flashreinforce.engines.vllm.weights`), on a model
built like vLLM's (fused projections, layers that pack their weight for a kernel and drop it, a tied
output projection), so that it runs without vLLM. The same path inside vLLM is tested in
``test_vllm_engine.py`` (the same generations as vLLM's own reload, the float64 probe)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashreinforce.engines.vllm.weights import changed_blocks, load_direct, plan_of, weight_layout


class UnquantizedLinearMethod:
    """As vLLM's CPU build: the weight is packed into the kernel (here: a private copy) and dropped."""

    def __init__(self, keep_weight: bool = False) -> None:
        self.keep_weight = keep_weight
        self.builds = 0

    def process_weights_after_loading(self, layer):
        self.builds += 1
        if self.keep_weight:  # a kernel that multiplies by the layer's own weight (vLLM's fallback)
            layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)
            return
        packed = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias, packed=packed: F.linear(x, packed, bias)
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=packed.dtype), requires_grad=False)


class UnquantizedEmbeddingMethod:
    def process_weights_after_loading(self, layer):
        packed = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias, packed=packed: F.linear(x, packed, bias)


class Linear(torch.nn.Module):
    def __init__(self, in_features: int, sizes: list[int], bias: bool = False, keep_weight: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(sum(sizes), in_features), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(sum(sizes)), requires_grad=False) if bias else None
        self.output_partition_sizes = list(sizes)
        self.quant_method = UnquantizedLinearMethod(keep_weight)
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x):
        return self.cpu_linear(x, self.weight, self.bias)


class Embedding(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(vocab, hidden),
                                                                            requires_grad=False)
        self.quant_method = UnquantizedEmbeddingMethod()
        self.quant_method.process_weights_after_loading(self)


class Norm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden), requires_grad=False)


H, V = 8, 12


class Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, keep_weight: bool = False) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = Embedding(V, H)
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = Linear(H, [8, 4, 4], bias=True)
        layer.self_attn.o_proj = Linear(H, [H], keep_weight=keep_weight)
        layer.mlp = torch.nn.Module()
        layer.mlp.gate_up_proj = Linear(H, [16, 16])
        layer.mlp.down_proj = Linear(16, [H])
        layer.input_layernorm = Norm(H)
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = Norm(H)
        self.lm_head = Embedding(V, H, weight=self.model.embed_tokens.weight)  # tied


def hf_state(seed: int) -> dict[str, torch.Tensor]:
    """A version in Hugging Face names, each tensor on its own (not adjacent)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    p = "model.layers.0."
    emb = r(V, H)
    return {"model.embed_tokens.weight": emb,  # a block's weights before its biases, as weight_layout orders them
            p + "self_attn.q_proj.weight": r(8, H), p + "self_attn.k_proj.weight": r(4, H),
            p + "self_attn.v_proj.weight": r(4, H), p + "self_attn.o_proj.weight": r(H, H),
            p + "self_attn.q_proj.bias": r(8), p + "self_attn.k_proj.bias": r(4), p + "self_attn.v_proj.bias": r(4),
            p + "mlp.gate_proj.weight": r(16, H), p + "mlp.up_proj.weight": r(16, H), p + "mlp.down_proj.weight": r(H, 16),
            p + "input_layernorm.weight": r(H), "model.norm.weight": r(H), "lm_head.weight": emb}


def in_one_buffer(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors as views of one flat buffer, in order (as the shared weight buffer lays them out)."""
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    out, off = {}, 0
    for k, t in state.items():
        out[k] = flat[off:off + t.numel()].view(t.shape)
        off += t.numel()
    return out


def assert_serves(model: Model, state: dict[str, torch.Tensor]) -> None:
    layer = model.model.layers[0]
    x = torch.randn(3, H)
    p = "model.layers.0."
    qkv_w = torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    qkv_b = torch.cat([state[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj(x), F.linear(x, qkv_w, qkv_b))
    assert torch.equal(layer.self_attn.o_proj(x), F.linear(x, state[p + "self_attn.o_proj.weight"]))
    gate_up = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
    assert torch.equal(layer.mlp.gate_up_proj(x), F.linear(x, gate_up))
    y = torch.randn(3, 16)
    assert torch.equal(layer.mlp.down_proj(y), F.linear(y, state[p + "mlp.down_proj.weight"]))
    assert torch.equal(layer.input_layernorm.weight, state[p + "input_layernorm.weight"])
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    # The tied output projection's kernel is repacked from the embedding it shares.
    assert torch.equal(model.lm_head.cpu_linear(x, None, None), F.linear(x, state["lm_head.weight"]))


@pytest.mark.parametrize("adjacent", [True, False])
def test_a_version_reaches_every_kernel_and_the_parameters_keep_their_objects(adjacent):
    model = Model()
    kept = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    for seed in (1, 2):  # two versions: the second replaces kernels built by the first
        state = hf_state(seed)
        sent = in_one_buffer(state) if adjacent else state
        assert load_direct(model, list(sent.items()))
        assert_serves(model, state)
    # The layers keep their parameter objects (what a compiled graph holds), the packed ones empty.
    assert {n: p for n, p in model.named_parameters(remove_duplicate=False)} == kept
    assert model.model.layers[0].self_attn.qkv_proj.weight.numel() == 0
    # Adjacent parts are multiplied straight from the buffer; separate ones go through one scratch per shape.
    assert (plan_of(model).scratch == {}) == adjacent


def test_a_kernel_that_keeps_the_plain_weight_gets_a_copy_not_the_shared_buffer():
    model = Model(keep_weight=True)
    state = in_one_buffer(hf_state(3))
    assert load_direct(model, list(state.items()))
    name = "model.layers.0.self_attn.o_proj.weight"
    o_proj = model.model.layers[0].self_attn.o_proj
    assert torch.equal(o_proj.weight, state[name])
    state[name].add_(1.0)  # the trainer writes the next version into the buffer
    assert not torch.equal(o_proj.weight, state[name])


def test_what_it_cannot_place_changes_nothing():
    model = Model()
    good = hf_state(4)
    assert load_direct(model, list(good.items()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    builds = model.model.layers[0].mlp.gate_up_proj.quant_method.builds
    for bad in ({k: v for k, v in hf_state(5).items() if not k.endswith("up_proj.weight")},  # a part missing
                dict(hf_state(5), **{"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}),  # an unknown name
                dict(hf_state(5), **{"model.norm.weight": torch.zeros(H + 1)})):  # a wrong shape
        assert not load_direct(model, list(bad.items()))
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert model.model.layers[0].mlp.gate_up_proj.quant_method.builds == builds
    assert_serves(model, good)


def test_a_model_with_a_layer_it_does_not_know_is_left_to_vllms_reload():
    model = Model()

    class Fp8LinearMethod:  # a quantized layer: its processing is not a plain repack
        def process_weights_after_loading(self, layer):
            pass

    model.model.layers[0].mlp.down_proj.quant_method = Fp8LinearMethod()
    assert plan_of(model) is None
    assert not load_direct(model, list(hf_state(6).items()))


def test_changed_blocks_send_whole_blocks_and_the_layout_follows_the_state_dict():
    import weakref

    import transformers

    state = hf_state(7)
    sent = {k: weakref.ref(v) for k, v in state.items()}
    assert changed_blocks(state, sent) == []
    state = dict(state, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(4, H)})
    names = [n for n, _ in changed_blocks(state, sent)]
    assert names == [k for k in state if k.startswith("model.layers.0.self_attn.")]
    config = transformers.Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    layout = weight_layout(config, torch.bfloat16)
    model = transformers.Qwen2ForCausalLM(config)
    assert sorted((n, s) for n, s, _ in layout) == sorted((n, tuple(t.shape)) for n, t in model.state_dict().items())
    assert {d for _, _, d in layout} == {torch.bfloat16}
    names = [n for n, _, _ in layout]
    # A fused projection's parts one after the other (Qwen2's biases would sit between them otherwise).
    q = names.index("model.layers.0.self_attn.q_proj.weight")
    assert names[q:q + 3] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    g = names.index("model.layers.0.mlp.gate_proj.weight")
    assert names[g:g + 2] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
