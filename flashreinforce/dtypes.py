"""The floating-point dtype names the trainer's options take, and the torch dtypes they stand for.

One table for every option that names a dtype (``fsdp.param_dtype``, ``rollout.engine_dtype``,
the engines' ``dtype``): an alias (``bf16``) and the canonical name (``bfloat16``) mean the same.
The table itself needs no torch, so configuration code can validate names without importing it;
:func:`torch_dtype` imports torch when it is called.
"""

from __future__ import annotations

__all__ = ["DTYPE_NAMES", "canonical_dtype", "torch_dtype"]

#: Accepted names -> canonical name (the attribute of ``torch`` that is that dtype).
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


def canonical_dtype(name: str, *, what: str = "dtype") -> str:
    """The canonical name of ``name``; ``ValueError`` naming ``what`` and the accepted names otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"{what} must be one of {sorted(DTYPE_NAMES)}, got {name!r}")
    return DTYPE_NAMES[name]


def torch_dtype(name: str, *, what: str = "dtype"):
    """The ``torch.dtype`` that ``name`` stands for (``ValueError`` as :func:`canonical_dtype`)."""
    import torch

    return getattr(torch, canonical_dtype(name, what=what))
