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

from flashreinforce.config import ConfigError

__all__ = ["ResumePoint", "find_checkpoint", "latest_checkpoint", "learner_state_to_restore", "load_checkpoint",
           "save_checkpoint", "trim_history"]

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


def find_checkpoint(ckpt_dir: str | Path, resume: str) -> Path:
    """The checkpoint ``--resume`` names: ``latest`` (the newest under ``ckpt_dir``) or a directory."""
    path = latest_checkpoint(ckpt_dir) if resume == "latest" else Path(resume)
    if path is None:
        raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}")
    return path


class ResumePoint:
    """A checkpoint being resumed from: its ``path``, ``state`` (``state.json``) and ``learner``
    state (optimizer, scheduler, version), after its weights were loaded into the model."""

    def __init__(self, path: Path, loaded: dict[str, Any]) -> None:
        self.path = path
        self.state: dict[str, Any] = loaded["state"]
        self.learner: dict[str, Any] = loaded["learner"]

    @classmethod
    def load(cls, ckpt_dir: str | Path, resume: str, model: torch.nn.Module) -> "ResumePoint":
        """Find the checkpoint, load its weights into ``model`` (not yet sharded) and restore the RNG."""
        path = find_checkpoint(ckpt_dir, resume)
        return cls(path, load_checkpoint(path, model=model))

    @property
    def step(self) -> int:
        return int(self.state["step"])


def learner_state_to_restore(point: ResumePoint, *, sharded: bool) -> dict[str, Any]:
    """The learner state of ``point`` for a learner that is (not) ``sharded``; a fully_shard
    optimizer state only restores into a fully_shard learner."""
    learner_state = dict(point.learner)
    if point.state.get("optimizer_format"):
        learner_state["optimizer_format"] = point.state["optimizer_format"]
        if not sharded:
            raise ConfigError(f"--resume: {point.path} holds the optimizer state of a fully_shard learner; resume it "
                              "under torchrun with --fsdp.strategy fully_shard")
    return learner_state


def trim_history(out: str | Path, step: int, names: tuple[str, ...] = ("metrics.jsonl", "eval.jsonl")) -> None:
    """Drop the records of updates after ``step`` (their effect is not in the checkpoint resumed from),
    so the run's history continues without a gap or a repeat."""
    for name in names:
        p = Path(out) / name
        if p.is_file():
            kept = [ln for ln in p.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
            p.write_text("".join(ln + "\n" for ln in kept))
