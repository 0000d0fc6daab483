"""Model FLOPs of the learner's forward and backward, and the peak FLOP/s that MFU divides by.

Conventions (the usual ones for MFU; recomputation is not counted):

* A matrix product of an ``[m, k]`` by a ``[k, n]`` matrix is ``2 m k n`` FLOPs; a training pass
  (forward and backward) is 3 forwards for a trained weight (the backward computes the gradients of
  the activations and of the weight) and 2 for a frozen one (LoRA's base weights: the activations'
  gradients only).
* Body: ``2 P`` FLOPs per token run, ``P`` the body's matrix parameters (every parameter with two
  or more dimensions outside the embedding tables). For a mixture of experts, the parameters
  under an ``experts`` module count with the share of experts a token uses
  (``num_experts_per_tok / num_experts``).
* Attention: ``4 H d`` FLOPs per layer per query-key pair that causal attention computes (scores
  and the weighted sum of values; ``H`` query heads of ``d`` channels). Within a document of L
  tokens that is ``L (L + 1) / 2`` pairs; a continuation of ``q`` tokens after ``a`` shared tokens
  adds ``q a + q (q + 1) / 2``. Sliding windows are not taken into account.
* Output projection: ``2 h V`` FLOPs per scored token (the learner projects only the hidden states
  that score an action token, not every position).

What counts is the work of the row the learner actually runs: tokens after prefix sharing (a
shared system prompt is counted once, as it is computed once) and no padding (the padded forward's
pad slots are waste, not model FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashreinforce.models.attention import DocumentLayout
from flashreinforce.trainer.learning.scoring import model_body

__all__ = ["PEAK_TFLOPS_BF16", "ModelFlops", "causal_pairs", "peak_flops_per_device", "utilization"]

#: Dense (no sparsity) bfloat16/float16 tensor-core peaks in TFLOP/s, from the vendors' data sheets,
#: matched as substrings of ``torch.cuda.get_device_name()`` in this order (first match wins).
PEAK_TFLOPS_BF16: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
    ("H100", 989.0), ("H800", 989.0), ("H20", 148.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0), ("MI300X", 1307.0), ("MI250X", 383.0),
)


def causal_pairs(layout: DocumentLayout) -> int:
    """Query-key pairs that causal attention over ``layout`` computes (the lower triangle of each
    segment plus every pair with the segment's ancestors)."""
    total = 0
    for q, k in zip(layout.query_lengths, layout.key_lengths):
        total += q * (k - q) + q * (q + 1) // 2
    return total


@dataclass(frozen=True)
class ModelFlops:
    """FLOP coefficients of one decoder (forward only; see the module docstring).

    body_per_token: ``2 P``. attention_per_pair: ``4 H d`` summed over the layers.
    head_per_scored_token: ``2 h V``. frozen_body_per_token: the part of ``body_per_token`` from
    frozen weights; head_frozen: whether the output projection is frozen.
    """

    body_per_token: float
    attention_per_pair: float
    head_per_scored_token: float
    frozen_body_per_token: float = 0.0
    head_frozen: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelFlops":
        """The coefficients of a ``transformers`` causal LM (its config and its body's parameters)."""
        cfg = model.config
        text_cfg = getattr(cfg, "text_config", None) or cfg
        try:
            body = model_body(model)
        except ValueError:  # no separate body: count the whole model's matrices
            body = model
        embedding_params = {id(m.weight) for m in body.modules() if isinstance(m, torch.nn.Embedding)}
        experts = getattr(text_cfg, "num_experts", None) or getattr(text_cfg, "num_local_experts", None)
        per_token = getattr(text_cfg, "num_experts_per_tok", None)
        expert_share = float(per_token) / float(experts) if experts and per_token else 1.0
        params = frozen = 0.0
        seen: set[int] = set()
        for name, p in body.named_parameters():
            if p.dim() < 2 or id(p) in embedding_params or id(p) in seen:
                continue
            seen.add(id(p))
            share = expert_share if ".experts." in f".{name}" else 1.0
            params += p.numel() * share
            if not p.requires_grad:
                frozen += p.numel() * share
        layers = int(text_cfg.num_hidden_layers)
        heads = int(text_cfg.num_attention_heads)
        hidden = int(text_cfg.hidden_size)
        head_dim = int(getattr(text_cfg, "head_dim", None) or hidden // heads)
        head = model.get_output_embeddings()
        vocab, width = head.weight.shape
        return cls(body_per_token=2.0 * params, attention_per_pair=4.0 * layers * heads * head_dim,
                   head_per_scored_token=2.0 * float(vocab) * float(width), frozen_body_per_token=2.0 * frozen,
                   head_frozen=not head.weight.requires_grad)

    def forward(self, tokens: int, pairs: int, scored_tokens: int) -> float:
        """FLOPs of one forward over a row of ``tokens`` tokens with ``pairs`` causal query-key pairs,
        ``scored_tokens`` of them projected to the vocabulary."""
        return (self.body_per_token * tokens + self.attention_per_pair * pairs
                + self.head_per_scored_token * scored_tokens)

    def training(self, tokens: int, pairs: int, scored_tokens: int) -> float:
        """FLOPs of one forward and backward over the same row (:meth:`forward`'s arguments)."""
        forward = self.forward(tokens, pairs, scored_tokens)
        frozen = self.frozen_body_per_token * tokens + (self.head_per_scored_token * scored_tokens
                                                        if self.head_frozen else 0.0)
        return 3.0 * forward - frozen  # a frozen weight's forward runs twice, not three times


def peak_flops_per_device(device: torch.device, dtype: torch.dtype | None, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one learner device at the learner's compute ``dtype`` (``None``: float32).

    ``override_tflops > 0`` is taken as given (``--train.peak_tflops``). Otherwise CUDA devices in
    :data:`PEAK_TFLOPS_BF16` at bfloat16/float16; ``None`` (MFU not reported) for float32 learners
    (TF32 or not depends on the run's matmul settings), CPUs and unlisted devices.
    """
    if override_tflops > 0:
        return float(override_tflops) * 1e12
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS_BF16:
        if key in name:
            return tflops * 1e12
    return None


def utilization(flops: float, seconds: float, peak_per_device: float | None, devices: int = 1) -> dict[str, float]:
    """``learner_tflops`` (model TFLOP/s achieved over ``seconds``) and, when the peak is known,
    ``mfu`` (that rate over ``devices`` times ``peak_per_device``, a fraction)."""
    if seconds <= 0:
        return {}
    out = {"learner_tflops": flops / seconds / 1e12}
    if peak_per_device:
        out["mfu"] = flops / seconds / (peak_per_device * devices)
    return out
