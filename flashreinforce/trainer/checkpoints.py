"""Training-state checkpoints: everything needed to continue a run exactly where it stopped.

Layout of ``CKPT_DIR/step_00000010/`` (written to a temporary directory, then renamed, so a
crash never leaves a half-written checkpoint behind; ``CKPT_DIR/latest`` names the newest):

* ``model.safetensors``: the policy weights (shared tensors such as tied embeddings stored once);
* ``config.json`` and the tokenizer files: enough to reload the model on its own;
* ``optimizer.pt``, ``scheduler.pt``: optimizer moments and schedule position;
* ``rng.pt``: Python, NumPy and torch random states;
* ``state.json``: step, policy version, buffer counters and prompt stream (prompts in flight at
  save time are handed out again first on resume), and the trainer's cumulative counters.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

LATEST = "latest"


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_dir: str | Path, step: int, *, model: torch.nn.Module, learner_state: dict,
                    state: dict[str, Any], tokenizer=None, max_keep: int = 0) -> Path:
    """Write checkpoint ``step`` under ``ckpt_dir`` and point ``latest`` at it; keep the newest
    ``max_keep`` checkpoints (0: keep all). Returns the checkpoint directory."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = ckpt_dir / name
    tmp = ckpt_dir / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    model.config.save_pretrained(str(tmp))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
    torch.save(learner_state["optimizer"], tmp / "optimizer.pt")
    torch.save(learner_state["scheduler"], tmp / "scheduler.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "version": learner_state["version"]}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    (ckpt_dir / (LATEST + ".tmp")).write_text(name)
    (ckpt_dir / (LATEST + ".tmp")).replace(ckpt_dir / LATEST)
    if max_keep > 0:
        old = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())[:-max_keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The directory ``ckpt_dir/latest`` names, or ``None`` when there is no checkpoint."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(ckpt_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, restore_rng: bool = True) -> dict[str, Any]:
    """Load the weights of checkpoint ``path`` into ``model`` and return
    ``{"state": state.json, "learner": {optimizer, scheduler, version}}`` (RNG restored unless told not to)."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no state.json)")
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    state = json.loads((path / "state.json").read_text())
    learner = {"optimizer": torch.load(path / "optimizer.pt", weights_only=False),
               "scheduler": torch.load(path / "scheduler.pt", weights_only=False), "version": state["version"]}
    if restore_rng:
        _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return {"state": state, "learner": learner}
