"""Per-document attention (flashreinforce.models.attention) inside real transformers decoders.

The packed row with document attention, the same row with shared prefixes computed once, and the
padded forward must give the same log-probabilities, entropies and parameter gradients (float32,
1e-5), for every decoder family the trainer loads; no ``[S, S]`` mask may be built, and the
attention cost must be the sum over documents, not the square of the row.
"""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch
import torch.nn.functional as F
import transformers

from flashreinforce.models import attention
from flashreinforce.models.attention import ATTENTION_NAME, DocumentLayout, attend, use_document_attention
from flashreinforce.trainer.learning.forward_row import forward_row
from flashreinforce.trainer.learning.packing import pack
from flashreinforce.trainer.learning.scoring import token_log_probs
from flashreinforce.trainer.rollout.trajectory import Trajectory

VOCAB = 97


def _config(family: str, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256)
    if family == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=4, **extra)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, num_key_value_heads=2, **extra)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=16, **extra)
    if family == "mistral":  # a sliding window shorter than the documents: it must cut inside each one
        return transformers.MistralConfig(**common, num_key_value_heads=2, sliding_window=9, **extra)
    raise AssertionError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(family)).float()


def _agentic_batch(seed: int, *, groups: int = 3, per_group: int = 3, system: int = 14) -> list[Trajectory]:
    """Groups of trajectories: one system prompt for all, one user prompt per group (a GRPO group),
    then per-sample completions and an observation turn; plus an exact duplicate."""
    rng = random.Random(seed)
    sys_tokens = [rng.randrange(3, VOCAB) for _ in range(system)]
    out = []
    for _ in range(groups):
        user = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))]
        for _ in range(per_group):
            turn = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 15))]
            obs = [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 4))]
            last = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
            ids = sys_tokens + user + turn + obs + last
            mask = [False] * (system + len(user)) + [True] * len(turn) + [False] * len(obs) + [True] * len(last)
            logp = [-rng.random() * 4 if m else 0.0 for m in mask]
            r = float(rng.random() < 0.5)
            out.append(Trajectory(ids, mask, logp, reward=r, failed=r == 0.0))
    first = out[0]
    out.append(Trajectory(list(first.token_ids), list(first.action_mask), list(first.behavior_log_probs), 1.0, False))
    return out


def _scores(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    logp, ent = token_log_probs(model, batch, temperature=0.8, with_entropy=True, **kwargs)
    # A loss that weights every token differently, so that a gradient routed to the wrong place shows.
    weights = torch.linspace(0.5, 1.5, logp.numel())
    ((logp * weights).sum() + 0.3 * (ent * weights.flip(0)).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_shared_and_padded_forwards_agree(family):
    model = _model(family)
    batch = pack(_agentic_batch(1))
    want = _scores(model, batch, packed_forward=False)
    use_document_attention(model)
    assert model.config._attn_implementation == ATTENTION_NAME
    for share, min_shared in ((False, 8), (True, 8), (True, 1)):
        row = forward_row(batch, share_prefixes=share, min_shared_tokens=min_shared)
        if share:
            assert row.shared_tokens > 0 and not row.layout.is_plain
        got = _scores(model, batch, packed_forward=True, share_prefixes=share, min_shared_tokens=min_shared)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], atol=1e-5, rtol=1e-5, msg=name)
    # The switched model's padded forward is still SDPA's.
    again = _scores(model, batch, packed_forward=False)
    torch.testing.assert_close(again[0], want[0], atol=0, rtol=0)


def test_gradient_checkpointing_keeps_the_layout():
    model = _model("qwen2", seed=3)
    batch = pack(_agentic_batch(4))
    want = _scores(model, batch, packed_forward=False)
    model.gradient_checkpointing_enable() if not hasattr(model, "activation_checkpointing_enable") else \
        model.activation_checkpointing_enable()
    model.train()
    got = _scores(model, batch, packed_forward=True)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-5, rtol=1e-5, msg=name)


def _plan_pairs(layout: DocumentLayout) -> int:
    """Query-key pairs the sdpa backend's buckets compute (padding included)."""
    plan = layout.sdpa_plan(torch.device("cpu"))
    return sum(b.q_index.numel() * b.k_index.shape[1] for b in plan.buckets)


def test_no_row_sized_mask_and_cost_is_the_sum_over_documents(monkeypatch):
    model = _model("qwen2")
    trajs = _agentic_batch(2)
    batch = pack(trajs)
    lengths = [t.num_tokens for t in trajs]
    use_document_attention(model)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape, k.shape, None if attn_mask is None else tuple(attn_mask.shape)))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    def no_mask(**kwargs):
        raise AssertionError(f"transformers built a mask for the packed row: {kwargs.get('q_length')} queries")

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(transformers.masking_utils, "sdpa_mask", no_mask)
    n = batch.num_tokens
    layers = model.config.num_hidden_layers
    for share in (False, True):
        calls.clear()
        with torch.no_grad():
            token_log_probs(model, batch, packed_forward=True, share_prefixes=share)
        layout = forward_row(batch, share_prefixes=share).layout
        pairs = sum(q[0] * q[2] * k[2] for q, k, _ in calls)
        assert pairs == layers * _plan_pairs(layout)
        # Each bucket join adds less padding than a call costs: the total stays near the exact cost.
        exact = layout.query_key_pairs()
        assert exact <= _plan_pairs(layout) <= exact + attention.CALL_COST_PAIRS * layout.num_segments
        assert _plan_pairs(layout) < n * n / 4
        assert all(m is None or m[-1] < n for _, _, m in calls)
        if not share:
            assert exact == sum(L * L for L in lengths)
        else:
            assert exact < sum(L * L for L in lengths)


def test_buckets_pad_short_documents_together_and_keep_long_ones_exact():
    equal = DocumentLayout.from_lengths([64] * 8)
    plan = equal.sdpa_plan(torch.device("cpu"))
    assert len(plan.buckets) == 1 and plan.buckets[0].mask is None and plan.buckets[0].valid is None
    assert plan.q_gather is None and plan.k_gather is None and plan.out_gather is None  # the row itself
    short = DocumentLayout.from_lengths([30, 34, 28, 32, 33, 31])
    assert len(short.sdpa_plan(torch.device("cpu")).buckets) == 1
    long = DocumentLayout.from_lengths([400, 150, 260, 90])
    plan = long.sdpa_plan(torch.device("cpu"))
    assert len(plan.buckets) == 4 and _plan_pairs(long) == long.query_key_pairs()
    # computed in length order (one gather of every bucket's queries), returned in row order (one gather)
    order = [3, 1, 2, 0]  # by length: 90, 150, 260, 400
    starts = [0, 400, 550, 810]
    lengths = [400, 150, 260, 90]
    want = [p for j in order for p in range(starts[j], starts[j] + lengths[j])]
    assert plan.q_gather.tolist() == want and plan.k_gather.tolist() == want
    assert plan.q_sizes == [lengths[j] for j in order]
    assert plan.out_gather[plan.q_gather].tolist() == list(range(900))


def test_sliding_window_without_a_layout_is_sdpa():
    """Generation and other calls without a layout: the switched model is SDPA, window included."""
    model = _model("mistral", seed=5)
    ids = torch.randint(3, VOCAB, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second row
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        unpadded = model(input_ids=ids[:1]).logits
        use_document_attention(model)
        got = model(input_ids=ids, attention_mask=mask).logits
        got_unpadded = model(input_ids=ids[:1]).logits
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, 4:], want[1, 4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_unpadded, unpadded, atol=1e-5, rtol=0)


def _reference_attention(q, k, v, allowed):
    """Float64 softmax attention of ``q [H, S, D]`` over ``k, v [Hkv, S, D]`` where ``allowed[i, j]``."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0).double(), v.repeat_interleave(rep, 0).double()
    scores = (q.double() @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _allowed(layout: DocumentLayout, window: int | None = None) -> torch.Tensor:
    """The ``[S, S]`` visibility of a layout, written directly from its definition (test only)."""
    s = layout.num_tokens
    allowed = torch.zeros(s, s, dtype=torch.bool)
    for j in range(layout.num_segments):
        chain = [j]
        while layout.parents[chain[-1]] >= 0:
            chain.append(layout.parents[chain[-1]])
        keys = [p for c in reversed(chain) for p in range(layout.starts[c], layout.ends[c])]
        for qi in range(layout.starts[j], layout.ends[j]):
            visible = [kk for kk in keys if kk < layout.starts[j] or kk <= qi]
            rank = {kk: r for r, kk in enumerate(visible)}
            for kk in visible:
                if window is None or rank[qi] - rank[kk] < window:
                    allowed[qi, kk] = True
    return allowed


@pytest.mark.parametrize("kernel", ["default", "math"])
@pytest.mark.parametrize("window", [None, 4])
def test_attend_matches_its_definition_on_a_tree(window, kernel):
    """Against the definition, with the default SDPA kernel and with the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Segments: 0 root (prefix), 1 child of 0, 2 child of 1, 3 child of 0, 4 a root, 5 a child of 4.
    layout = DocumentLayout([0, 6, 9, 13, 15, 20], [6, 9, 13, 15, 20, 22], [-1, 0, 1, 0, -1, 4])
    assert any(b.valid is not None for b in layout.sdpa_plan(torch.device("cpu"), window).buckets)
    torch.manual_seed(0)
    q = torch.randn(4, 22, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 22, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 22, 8, dtype=torch.float64, requires_grad=True)
    def backends():
        return sdpa_kernel([SDPBackend.MATH]) if kernel == "math" else contextlib.nullcontext()

    with backends():
        got = attend(layout, q, k, v, sliding_window=window)
    want = _reference_attention(q, k, v, _allowed(layout, window))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    g = torch.randn_like(got)
    with backends():
        grads = torch.autograd.grad(got, (q, k, v), g)
    ref_grads = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_buckets_in_row_order_read_the_row_itself(window):
    """Buckets whose segments lie end to end in row order are views of the row (no gather, no
    scatter-add in the backward); documents out of row order after sorting, or a tree, are gathered
    once for all buckets. Both agree with the definition, gradients too."""
    # Two documents of 20 tokens, then four of 48: two buckets (padding 20 to 48 costs more than a call),
    # sorted by length, which is row order; then the same documents with the long ones first.
    in_order = DocumentLayout([0, 20, 40, 88, 136, 184], [20, 40, 88, 136, 184, 232])
    plan = in_order.sdpa_plan(torch.device("cpu"), window)
    assert len(plan.buckets) == 2 and plan.q_sizes == [40, 192]
    assert plan.q_gather is None and plan.k_gather is None and plan.out_gather is None
    reordered = DocumentLayout([0, 48, 96, 144, 192, 212], [48, 96, 144, 192, 212, 232])
    plan = reordered.sdpa_plan(torch.device("cpu"), window)
    assert plan.q_gather.tolist() == list(range(192, 232)) + list(range(192))
    tree = DocumentLayout([0, 6, 9], [6, 9, 12], [-1, 0, 0])
    assert tree.sdpa_plan(torch.device("cpu"), window).k_gather is not None  # the children see the root's keys
    for layout in (in_order, reordered):
        torch.manual_seed(1)
        q = torch.randn(6, 232, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 232, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 232, 8, dtype=torch.float64, requires_grad=True)
        got = attend(layout, q, k, v, sliding_window=window)
        want = _reference_attention(q, k, v, _allowed(layout, window))
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
        g = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_varlen_backend_offsets_and_gathered_keys(monkeypatch):
    """The ``varlen`` backend's device-independent part (offsets, gathered keys, GQA, causal flag),
    checked against a stand-in for PyTorch's varlen kernel that follows its documented contract."""
    seen = {}

    def fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False):
        seen.update(max_q=max_q, max_k=max_k, window=window_size, gqa=enable_gqa)
        outs = []
        for i in range(len(cu_seq_q) - 1):
            qs, qe, ks, ke = int(cu_seq_q[i]), int(cu_seq_q[i + 1]), int(cu_seq_k[i]), int(cu_seq_k[i + 1])
            qq, kk, vv = query[qs:qe].transpose(0, 1), key[ks:ke].transpose(0, 1), value[ks:ke].transpose(0, 1)
            allowed = torch.arange(ke - ks)[None, :] <= torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)
            outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=scale,
                                                       enable_gqa=enable_gqa).transpose(0, 1))
        return torch.cat(outs)

    monkeypatch.setattr(attention, "_varlen", lambda: (fake_varlen, frozenset(
        ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "scale", "window_size", "enable_gqa"])))
    layout = DocumentLayout([0, 5, 8, 12, 14], [5, 8, 12, 14, 19], [-1, 0, 0, -1, 3], backend="varlen")
    torch.manual_seed(1)
    q, k, v = torch.randn(4, 19, 8), torch.randn(2, 19, 8), torch.randn(2, 19, 8)
    got = attend(layout, q, k, v, scale=0.3)
    want = attend(DocumentLayout(layout.starts, layout.ends, layout.parents, backend="sdpa"), q, k, v, scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert seen == {"max_q": 5, "max_k": 9, "window": (-1, 0), "gqa": True}
    cu_q, cu_k, index = layout.device_offsets(torch.device("cpu"))
    assert cu_q.tolist() == [0, 5, 8, 12, 14, 19] and cu_k.tolist() == [0, 5, 13, 22, 24, 31]
    assert index.tolist() == [*range(0, 5), *range(0, 5), 5, 6, 7, *range(0, 5), 8, 9, 10, 11, 12, 13,
                              12, 13, 14, 15, 16, 17, 18]


def test_auto_backend_is_sdpa_off_cuda():
    q = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    assert not attention.varlen_available(q)


def test_layout_errors_name_the_problem():
    with pytest.raises(ValueError, match="tile the row"):
        DocumentLayout([0, 4], [3, 6])
    with pytest.raises(ValueError, match="parent"):
        DocumentLayout([0, 3], [3, 6], [-1, 1])
    with pytest.raises(ValueError, match="backend"):
        DocumentLayout([0], [3], backend="flex")
    layout = DocumentLayout.from_lengths([3, 4])
    with pytest.raises(ValueError, match="covers 7 tokens"):
        attend(layout, torch.randn(2, 6, 4), torch.randn(2, 6, 4), torch.randn(2, 6, 4))


def test_a_model_that_cannot_take_document_attention_is_named():
    gemma = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(gemma)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM.*packing_samples false"):
        use_document_attention(model)


class _NoInterfaceBody(torch.nn.Module):
    """A body that computes no attention through transformers (the scorer must notice)."""

    def __init__(self, inner):
        super().__init__()
        self.embed = inner.model.embed_tokens

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, **kwargs):
        return transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=self.embed(input_ids))


def test_a_body_that_bypasses_the_attention_interface_is_refused():
    model = _model("qwen2")
    model.model = _NoInterfaceBody(copy.deepcopy(model))
    batch = pack(_agentic_batch(0))
    with pytest.raises(ValueError, match="attention interface.*packing_samples false"):
        token_log_probs(model, batch, packed_forward=True)
