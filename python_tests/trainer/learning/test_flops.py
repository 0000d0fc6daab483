"""Model FLOPs and MFU: the coefficients against PyTorch's own FLOP counter, the causal pair count of
packed and shared-prefix rows, the peak table, and the learner's per-update metrics."""

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flashreinforce.models.attention import DocumentLayout
from flashreinforce.trainer.learning import flops as flops_module
from flashreinforce.trainer.learning.flops import ModelFlops, causal_pairs, peak_flops_per_device, utilization
from flashreinforce.trainer.learning.forward_row import forward_row
from flashreinforce.trainer.learning.learner import Learner, LearnerSettings
from flashreinforce.trainer.learning.packing import pack
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.builders import random_trajectory, tiny_causal_lm

VOCAB = 50


def _aten_flops(fn) -> dict[str, int]:
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("tied", [True, False])
def test_coefficients_match_torch_flop_counter(tied):
    model = tiny_causal_lm(VOCAB, tied=tied, layers=3)
    model.set_attn_implementation("eager")  # attention as two batched matmuls over the full square
    f = ModelFlops.of(model)
    ids = torch.randint(3, VOCAB, (1, 11))
    counts = _aten_flops(lambda: model.model(input_ids=ids))
    assert counts.get("aten.mm", 0) + counts.get("aten.addmm", 0) == f.body_per_token * 11
    assert counts["aten.bmm"] == f.attention_per_pair * 11 * 11  # eager computes every pair, masked or not
    hidden = torch.randn(7, model.config.hidden_size)
    head = model.get_output_embeddings()
    assert sum(_aten_flops(lambda: head(hidden)).values()) == f.head_per_scored_token * 7


def test_expert_parameters_count_with_the_share_a_token_uses():
    model = tiny_causal_lm(VOCAB)
    dense = ModelFlops.of(model)
    layer = model.model.layers[0]
    layer.mlp.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in range(4))
    model.config.num_experts, model.config.num_experts_per_tok = 4, 1
    moe = ModelFlops.of(model)
    assert moe.body_per_token == dense.body_per_token + 2 * 32 * 32  # one of the four experts per token
    assert moe.attention_per_pair == dense.attention_per_pair


def test_causal_pairs_of_plain_and_shared_rows():
    plain = DocumentLayout.from_lengths([3, 5, 1])
    assert causal_pairs(plain) == 6 + 15 + 1
    # a 4-token prefix shared by continuations of 2 and 3 tokens, and a separate document of 2
    shared = DocumentLayout([0, 4, 6, 9], [4, 6, 9, 11], [-1, 0, 0, -1])
    assert causal_pairs(shared) == 10 + (2 * 4 + 3) + (3 * 4 + 6) + 3


def test_a_shared_prefix_is_counted_once():
    rng = random.Random(0)
    prefix = [rng.randrange(3, VOCAB) for _ in range(20)]
    trajs = []
    for i in range(4):
        tail = [rng.randrange(3, VOCAB) for _ in range(5 + i)]
        logp = [0.0] * 20 + [-1.0] * len(tail)
        trajs.append(Trajectory(prefix + tail, [False] * 20 + [True] * len(tail), logp, reward=float(i % 2),
                                failed=False))
    batch = pack(trajs)
    unshared = forward_row(batch, share_prefixes=False)
    row = forward_row(batch)
    assert row.num_tokens == batch.num_tokens - 3 * 20
    lengths = [t.num_tokens for t in trajs]
    assert causal_pairs(unshared.layout) == sum(n * (n + 1) // 2 for n in lengths)
    assert causal_pairs(row.layout) == 20 * 21 // 2 + sum((n - 20) * 20 + (n - 20) * (n - 19) // 2 for n in lengths)


def _learner(**kw):
    return Learner(tiny_causal_lm(VOCAB, tied=False), LearnerSettings(lr=1e-3, **kw))


def _batch(seed=0, n=6):
    rng = random.Random(seed)
    return [random_trajectory(rng, VOCAB) for _ in range(n)]


def test_learner_reports_flops_and_tflops_and_no_mfu_on_a_cpu():
    trajs = _batch()
    learner = _learner(micro_batch_trajectories=2)
    m = learner.step(trajs)
    f = ModelFlops.of(learner.model)
    tokens = sum(t.num_tokens for t in trajs)
    pairs = sum(t.num_tokens * (t.num_tokens + 1) // 2 for t in trajs)  # random tokens: no shared prefix
    scored = sum(t.num_action_tokens for t in trajs)
    assert m["model_flops"] == pytest.approx(f.training(tokens, pairs, scored))
    assert m["learner_tflops"] == pytest.approx(m["model_flops"] / m["learner_compute_s"] / 1e12)
    assert "mfu" not in m


def test_padding_is_not_model_flops():
    trajs = _batch(1)
    packed = _learner(packed_forward=True).step(trajs)["model_flops"]
    padded = _learner(packed_forward=False).step(trajs)["model_flops"]
    assert packed == pytest.approx(padded)


def test_peak_flag_gives_mfu():
    m = _learner(peak_tflops=2.0).step(_batch(2))
    assert m["mfu"] == pytest.approx(m["learner_tflops"] / 2.0)


def test_peak_flag_must_be_finite_and_not_negative():
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="train.peak_tflops"):
            LearnerSettings(peak_tflops=bad)


def test_peak_table(monkeypatch):
    cuda = torch.device("cuda", 0)
    for name, tflops in (("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                         ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
                         ("NVIDIA A10", 125.0)):
        monkeypatch.setattr(flops_module.torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_flops_per_device(cuda, torch.bfloat16) == tflops * 1e12, name
        assert peak_flops_per_device(cuda, torch.float16) == tflops * 1e12, name
    assert peak_flops_per_device(cuda, None) is None  # float32: TF32 or not is the run's setting
    monkeypatch.setattr(flops_module.torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops_per_device(cuda, torch.bfloat16) is None
    assert peak_flops_per_device(torch.device("cpu"), torch.bfloat16) is None
    assert peak_flops_per_device(torch.device("cpu"), None, 3.5) == 3.5e12


def test_utilization_over_devices():
    out = utilization(8e12, 2.0, 1e12, devices=4)
    assert out == {"learner_tflops": pytest.approx(4.0), "mfu": pytest.approx(1.0)}
    assert "mfu" not in utilization(8e12, 2.0, None)
    assert utilization(1.0, 0.0, 1e12) == {}


def test_frozen_weights_count_two_forwards_not_three():
    """Under LoRA the base weights get no weight gradient: their matrices cost forward + input gradient."""
    pytest.importorskip("peft")
    from flashreinforce.models.lora import LoraSettings, apply_lora
    from python_tests.builders import tiny_causal_lm

    full = ModelFlops.of(tiny_causal_lm(64, tied=False))
    model = tiny_causal_lm(64, tied=False)
    apply_lora(model, LoraSettings(rank=2, alpha=4.0))
    lora = ModelFlops.of(model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert lora.body_per_token == pytest.approx(full.body_per_token + 2 * adapters)
    assert lora.frozen_body_per_token == pytest.approx(full.body_per_token) and lora.head_frozen
    tokens, pairs, scored = 50, 400, 30
    forward = lora.body_per_token * tokens + lora.attention_per_pair * pairs + lora.head_per_scored_token * scored
    frozen = full.body_per_token * tokens + lora.head_per_scored_token * scored
    assert lora.training(tokens, pairs, scored) == pytest.approx(3 * forward - frozen)
    assert full.training(tokens, pairs, scored) == pytest.approx(
        3 * (full.body_per_token * tokens + full.attention_per_pair * pairs + full.head_per_scored_token * scored))
