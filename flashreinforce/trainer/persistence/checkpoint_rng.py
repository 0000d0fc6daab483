"""The random states of a checkpoint (``rng.pt``): Python, NumPy and torch (and CUDA) states stored
as tensors and plain numbers, so that ``torch.load(weights_only=True)`` reads them back; the format
of earlier versions (Python and NumPy tuples, a NumPy array inside) is still read, allowing only
NumPy's plain-array reconstruction."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["check_rng_state", "legacy_rng_state", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (and CUDA) random states as tensors and plain numbers, so that
    ``torch.load(weights_only=True)`` reads them back."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def check_rng_state(state: Any) -> None:
    """Raise ValueError unless ``state`` is what :func:`rng_state` writes."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise ValueError("expected a dict with python, numpy and torch random states")
    py, npy = state["python"], state["numpy"]
    if not (isinstance(py, dict) and isinstance(py.get("state"), torch.Tensor) and py["state"].numel() == 625):
        raise ValueError("the Python random state is not 625 integers")
    if not (isinstance(npy, dict) and isinstance(npy.get("keys"), torch.Tensor) and npy["keys"].numel() == 624):
        raise ValueError("the NumPy random state is not 624 integers")
    if not (isinstance(state["torch"], torch.Tensor) and state["torch"].dtype == torch.uint8):
        raise ValueError("the torch random state is not a uint8 tensor")


def legacy_rng_state(path: Path) -> dict[str, Any] | None:
    """``rng.pt`` in the format of earlier versions (``random.getstate()`` and ``np.random.get_state()``
    tuples, a NumPy uint32 array inside), converted to the current one; ``None`` when the file needs
    anything but NumPy's plain-array reconstruction (so nothing else is ever unpickled)."""
    try:
        needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:
        return None
    try:
        from numpy._core.multiarray import _reconstruct  # NumPy 2
    except ImportError:  # NumPy 1
        from numpy.core.multiarray import _reconstruct
    allowed = {f"{_reconstruct.__module__}._reconstruct", "numpy.ndarray", "numpy.dtype"}
    if not needed or not needed <= allowed:
        return None
    try:
        # the key array's dtype class (numpy.dtypes.UInt32DType) is met while unpickling, not listed before
        with torch.serialization.safe_globals([_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]):
            old = torch.load(path, map_location="cpu", weights_only=True)
        (version, internal, gauss_next), (kind, keys, pos, has_gauss, cached) = old["python"], old["numpy"]
        state = {"python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                            "gauss_next": gauss_next},
                 "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                           "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                 "torch": old["torch"]}
        if "cuda" in old:
            state["cuda"] = list(old["cuda"])
        return state
    except Exception:
        return None


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), int(npy["pos"]), int(npy["has_gauss"]),
                         float(npy["cached_gaussian"])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
