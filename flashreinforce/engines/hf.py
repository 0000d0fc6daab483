"""A local rollout engine on a Hugging Face causal LM (CPU or GPU), with a KV cache.

Requests of one :meth:`HFEngine.generate` call are sampled together (left padding, one forward
per new token). Each request has its own random generator seeded by ``request.seed``, so a
continuation does not depend on which other requests share its batch. The recorded log-probability
of a sampled token is taken from the processed distribution it was drawn from (see
:func:`sampling_log_probs`), never recomputed.
"""

from __future__ import annotations

import inspect
from typing import Mapping, Sequence

import torch
from torch import Tensor

from flashreinforce.engines.base import Generation, GenerationRequest, RolloutEngine, SamplingParams

__all__ = ["HFEngine", "sampling_log_probs"]


def sampling_log_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Log-probabilities ``[b, V]`` (float32) of the distribution sampled from, given raw ``logits [b, V]``.

    Order as in Hugging Face's warpers: temperature, then top-k (keep the k largest logits), then
    top-p (sort by probability, descending; keep a token while the mass of the tokens before it is
    below ``top_p``, so the first is always kept), renormalized; removed tokens get ``-inf``.
    ``temperature == 0`` is greedy: log-probability 0 on the argmax (first on ties), ``-inf`` elsewhere.
    """
    logits = logits.float()
    if params.temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 0.0)
        return out
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(scores, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before >= params.top_p
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def _make_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


class HFEngine(RolloutEngine):
    """Rollout engine around ``model`` (a ``transformers`` causal LM), used in inference mode.

    Args:
        model: the engine's own copy of the policy (weights are replaced by :meth:`load_weights`).
        pad_token_id: id used for left padding (never attended to).
        version: the version of the weights ``model`` holds now.
    """

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int = 0, version: int = -1) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.pad_token_id = int(pad_token_id)
        self.version = int(version)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.device = next(model.parameters()).device

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(dict(state_dict), strict=False)
        # Tied output embeddings may be absent from a state dict; anything else is an error.
        missing = [k for k in missing if k not in self._tied_keys()]
        if missing or unexpected:
            raise ValueError(f"load_weights: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
        self.version = int(version)

    def _tied_keys(self) -> set[str]:
        if getattr(self.model.config, "tie_word_embeddings", False):
            return {n for n, _ in self.model.named_parameters(remove_duplicate=False) if n.startswith("lm_head")}
        return set()

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache) -> Tensor:
        kwargs = {self._cache_kw: cache, "use_cache": True, "attention_mask": mask, "position_ids": pos}
        if self._keep_kw:
            kwargs[self._keep_kw] = 1
        return self.model(input_ids=ids, **kwargs).logits[:, -1, :]

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        if not requests:
            return []
        for i, r in enumerate(requests):
            if len(r.token_ids) == 0:
                raise ValueError(f"generate: requests[{i}].token_ids is empty")
            if r.max_new_tokens <= 0:
                raise ValueError(f"generate: requests[{i}].max_new_tokens must be positive, got {r.max_new_tokens}")
        b = len(requests)
        lengths = [len(r.token_ids) for r in requests]
        width = max(lengths)
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - lengths[i]:] = torch.as_tensor(list(r.token_ids), dtype=torch.long)
            mask[i, width - lengths[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(int(r.seed) & 0xFFFF_FFFF_FFFF_FFFF) for r in requests]
        limits = [r.max_new_tokens for r in requests]
        stop = set(int(s) for s in params.stop_token_ids)
        out_ids: list[list[int]] = [[] for _ in requests]
        out_lp: list[list[float]] = [[] for _ in requests]
        reasons: list[str | None] = [None] * b

        cache = _make_cache(self.model)
        logits = self._forward(ids, mask, pos, cache)
        for step in range(max(limits)):
            logp = sampling_log_probs(logits, params).cpu()
            probs = logp.exp()
            next_tokens = torch.full((b,), self.pad_token_id, dtype=torch.long)
            for i in range(b):
                if reasons[i] is not None:
                    continue
                tok = int(torch.multinomial(probs[i], 1, generator=gens[i]))
                out_ids[i].append(tok)
                out_lp[i].append(float(logp[i, tok]))
                next_tokens[i] = tok
                if tok in stop:
                    reasons[i] = "stop"
                elif len(out_ids[i]) >= limits[i]:
                    reasons[i] = "length"
            if all(r is not None for r in reasons):
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long, device=self.device)], dim=1)
            pos = pos[:, -1:] + 1
            logits = self._forward(next_tokens.view(b, 1).to(self.device), mask, pos, cache)
        return [Generation(out_ids[i], out_lp[i], reasons[i] or "length", self.version) for i in range(b)]
