"""Scoring the policy: current log-probabilities (and entropies) of a packed batch's action tokens.

The learner's forward pass: one pass of the model body gives the last hidden states; the
log-probability of each action token comes from the hidden state before it and the output
projection (:func:`flashreinforce.ops.logprobs.sampled_token_logprobs`), without materialising
``[tokens, vocab]`` logits. The forward is *packed* (one row, ``position_ids`` restarting per
trajectory) or *padded* (rows padded to the longest trajectory, gathered back to packed order);
both give the same numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashreinforce.ops.logprobs import sampled_token_logprobs
from flashreinforce.trainer.packing import PackedBatch, to_padded

__all__ = ["PolicyLogProbs", "token_log_probs"]


def _body(model: torch.nn.Module) -> torch.nn.Module:
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if body is None or body is model:
        raise ValueError(f"{type(model).__name__}: cannot find the model body (base_model_prefix)")
    return body


def token_log_probs(model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0,
                    with_entropy: bool = False, packed_forward: bool = True, pad_token_id: int = 0,
                    autocast_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """Current log-probabilities (and entropies) ``[N]`` float32 of ``batch``'s action tokens.

    Non-action slots hold 0 (the loss ignores them). Token t is scored from the hidden state at t-1
    of the same trajectory, at ``temperature``. Gradients flow to the model's parameters.
    """
    device = next(model.parameters()).device
    body = _body(model)
    head = model.get_output_embeddings()
    with torch.autocast(device_type=device.type, dtype=autocast_dtype or torch.float32,
                        enabled=autocast_dtype is not None):
        if packed_forward:
            out = body(input_ids=batch.input_ids.to(device)[None], position_ids=batch.position_ids.to(device)[None],
                       use_cache=False)
            hidden = out.last_hidden_state[0]
        else:
            ids, mask, index = to_padded(batch, pad_token_id)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            out = body(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                       use_cache=False)
            hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[index.to(device)]
    positions = torch.nonzero(batch.action_mask, as_tuple=True)[0].to(device)
    weight = head.weight
    rows = hidden[positions - 1].to(weight.dtype)
    logp, ent = sampled_token_logprobs(rows, weight, batch.input_ids.to(device)[positions],
                                       bias=getattr(head, "bias", None), temperature=temperature,
                                       with_entropy=with_entropy)
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

    def forward(self, batch: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
                packed_forward: bool = True, pad_token_id: int = 0,
                autocast_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
        return token_log_probs(self.model, batch, temperature=temperature, with_entropy=with_entropy,
                               packed_forward=packed_forward, pad_token_id=pad_token_id,
                               autocast_dtype=autocast_dtype)
