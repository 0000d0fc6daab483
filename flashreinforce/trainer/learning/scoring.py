"""Scoring the policy: current log-probabilities (and entropies) of a packed batch's action tokens.

The learner's forward pass: one pass of the model body gives the last hidden states; the
log-probability of each action token comes from the hidden state before it and the output
projection (:func:`flashreinforce.ops.logprobs.sampled_token_logprobs`), without materialising
``[tokens, vocab]`` logits. The forward is *packed* or *padded*; both give the same numbers.

* Packed: one row (:mod:`flashreinforce.trainer.learning.forward_row`), ``position_ids`` of each token's own
  trajectory, per-document attention (:mod:`flashreinforce.models.attention`: no ``[S, S]`` mask,
  cost sum of L² over documents), and each prefix that several trajectories share computed once.
  The model is switched to document attention on first use
  (:func:`flashreinforce.models.attention.use_document_attention`; without a layout it is SDPA).
* Padded: rows padded to the longest trajectory, gathered back to packed order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashreinforce.models.attention import ATTENTION_NAME, use_document_attention
from flashreinforce.ops.logprobs import sampled_token_logprobs
from flashreinforce.trainer.learning.forward_row import DEFAULT_MIN_SHARED_TOKENS, ForwardRow, forward_row
from flashreinforce.trainer.learning.packing import PackedBatch, to_padded

__all__ = ["PolicyLogProbs", "model_body", "token_log_probs"]


def model_body(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder body of a ``transformers`` causal LM (its ``base_model_prefix`` attribute: the
    module that returns hidden states); ``ValueError`` naming the model class when there is none."""
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if body is None or body is model:
        raise ValueError(f"{type(model).__name__}: cannot find the model body (base_model_prefix)")
    return body


def _vocabulary_size(model: torch.nn.Module, head: torch.nn.Module | None) -> int | None:
    """Rows of the output projection, else of the input embedding; ``None`` when neither is found
    (a model whose body is not a ``transformers`` one; its forward then reports what is wrong)."""
    modules = [head]
    try:
        modules.append(model.get_input_embeddings())
    except (AttributeError, NotImplementedError):
        pass
    for module in modules:
        weight = getattr(module, "weight", None)
        if weight is not None:
            return int(weight.shape[0])
    return None


def token_log_probs(model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0,
                    with_entropy: bool = False, packed_forward: bool = True, pad_token_id: int = 0,
                    autocast_dtype: torch.dtype | None = None, share_prefixes: bool = True,
                    min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS,
                    attention_backend: str = "auto", row: ForwardRow | None = None,
                    head_operand_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """Current log-probabilities (and entropies) ``[N]`` float32 of ``batch``'s action tokens.

    Non-action slots hold 0 (the loss ignores them). Token t is scored from the hidden state at t-1
    of the same trajectory, at ``temperature``. Gradients flow to the model's parameters.
    ``share_prefixes``, ``min_shared_tokens`` and ``attention_backend`` shape the packed forward
    (:func:`flashreinforce.trainer.learning.forward_row.forward_row`); the padded forward ignores them.
    ``row``: the packed row of ``batch`` already planned (the learner counts its FLOPs first); it
    replaces those three options. ``head_operand_dtype``: bf16 / fp16 operands for the output
    projection's GEMMs when its weight is float32 (float32 accumulation and logits;
    :func:`flashreinforce.ops.logprobs.sampled_token_logprobs`); ignored for a low-precision weight.
    """
    device = next(model.parameters()).device
    body = model_body(model)
    head = model.get_output_embeddings()
    token_index = None
    vocab = _vocabulary_size(model, head)
    if vocab is not None and batch.num_tokens:
        lo, hi = (int(x) for x in torch.aminmax(batch.input_ids))  # the host copy: no device synchronization
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}) (the model's vocabulary), got [{lo}, {hi}]")
    with torch.autocast(device_type=device.type, dtype=autocast_dtype or torch.float32,
                        enabled=autocast_dtype is not None):
        if packed_forward:
            if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
                use_document_attention(model)  # ValueError naming the model class when it cannot
            if row is None:
                row = forward_row(batch, share_prefixes=share_prefixes, min_shared_tokens=min_shared_tokens,
                                  backend=attention_backend)
            # A 2-D all-ones mask: transformers then neither derives a packed [S, S] mask from the
            # positions nor builds a causal one (SDPA's mask function skips it); the layout is the mask.
            ones = torch.ones(1, row.num_tokens, dtype=torch.long, device=device)
            out = body(input_ids=row.input_ids.to(device)[None], position_ids=row.position_ids.to(device)[None],
                       attention_mask=ones, use_cache=False, document_layout=row.layout)
            if row.layout.calls == 0:
                raise ValueError(f"{type(model).__name__} does not compute attention through transformers' "
                                 "attention interface, so it cannot run packed rows; use --fsdp.packing_samples false")
            hidden = out.last_hidden_state[0]
            token_index = row.token_index.to(device)
        else:
            ids, mask, index = to_padded(batch, pad_token_id)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            out = body(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                       use_cache=False)
            hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[index.to(device)]
    positions = torch.nonzero(batch.action_mask, as_tuple=True)[0]
    weight = head.weight
    targets = batch.input_ids[positions]  # checked on the host above, not read back from the device
    positions = positions.to(device)
    before = positions - 1 if token_index is None else token_index[positions - 1]
    rows = hidden[before].to(weight.dtype)
    operands = head_operand_dtype if weight.dtype == torch.float32 else None
    logp, ent = sampled_token_logprobs(rows, weight, targets.to(device), bias=getattr(head, "bias", None),
                                       temperature=temperature, with_entropy=with_entropy, check_targets=False,
                                       operand_dtype=operands)
    n = batch.num_tokens
    full_logp = torch.zeros(n, dtype=torch.float32, device=device).index_put((positions,), logp.float())
    full_ent = None
    if ent is not None:
        full_ent = torch.zeros(n, dtype=torch.float32, device=device).index_put((positions,), ent.float())
    return full_logp, full_ent


class PolicyLogProbs(torch.nn.Module):
    """The learner's forward as one module: the model body and the sampled-token log-probabilities.

    :func:`token_log_probs` reads the output projection's weight directly (no ``[tokens, vocab]``
    logits), outside any ``forward`` of the model. Wrapping the computation in a module whose
    ``forward`` is the whole of it lets FSDP2 (``fully_shard``) treat this module as the root:
    the embedding, final norm and output projection are gathered for its forward and their
    gradients reduced after its backward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: PackedBatch, **kwargs) -> tuple[Tensor, Tensor | None]:
        """:func:`token_log_probs` of the wrapped model; ``kwargs`` are its keyword arguments."""
        return token_log_probs(self.model, batch, **kwargs)
