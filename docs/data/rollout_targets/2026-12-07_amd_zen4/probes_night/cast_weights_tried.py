"""Low-precision copies of the learner's linear weights, kept between forwards that need no gradient.

Under autocast every ``F.linear`` casts its float32 weight (and bias) to the autocast dtype, in every
forward: for SmolLM2-135M that is 135M values read in float32 and written in bf16 per pass, about 5%
of a 2,300-token forward on 2 cores of a Zen 4 EPYC. A forward that needs no gradient (the statistics
of a batch whose every advantage is 0) can take those casts from :class:`CastWeightCache` instead: it
makes each copy once and again only after the weight changes (its version counter moves at every
in-place write, the optimizer's included). The copy is the very cast autocast makes (round to
nearest even), and autocast leaves a weight already in its dtype as it is, so the forward's numbers
are the same bit for bit (``python_tests/trainer/learning/test_cast_weights.py``).

Only the weights of plain ``torch.nn.Linear`` modules are copied (subclasses may use their weight in
other ways), and only those no other module shares (a tied embedding is read by the embedding lookup,
which autocast does not cast). The cost is memory: one copy in the autocast dtype, half the float32
weights for bf16.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = ["CastWeightCache"]


class CastWeightCache:
    """Copies of a module's float32 linear weights and biases in ``dtype`` (bf16 or fp16), by
    parameter name (see the module docstring). ``copies_made``: casts made so far (for tests)."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"CastWeightCache: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        self.dtype = dtype
        self._copies: dict[str, tuple[weakref.ref, int, Tensor]] = {}
        self.copies_made = 0

    def overrides(self, module: torch.nn.Module) -> dict[str, Tensor]:
        """``{parameter name: its copy in dtype}`` for every eligible weight and bias of ``module``, each
        copy made again where the parameter is another tensor or was written since."""
        out: dict[str, Tensor] = {}
        for name, p in self._eligible(module):
            kept = self._copies.get(name)
            if kept is None or kept[0]() is not p or kept[1] != p._version:
                self._copies.pop(name, None)  # the old copy goes before the new one is made
                kept = (weakref.ref(p), p._version, p.detach().to(self.dtype))
                self._copies[name] = kept
                self.copies_made += 1
            out[name] = kept[2]
        return out

    def clear(self) -> None:
        self._copies.clear()

    @staticmethod
    def _eligible(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
        uses: dict[int, int] = {}
        for _, p in module.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        found = []
        for prefix, m in module.named_modules():
            if type(m) is not torch.nn.Linear:
                continue
            for leaf in ("weight", "bias"):
                p = getattr(m, leaf, None)
                if p is not None and p.dtype == torch.float32 and uses.get(id(p), 0) == 1:
                    found.append((f"{prefix}.{leaf}" if prefix else leaf, p))
        return found
