"""Training-state checkpoints: everything needed to continue a run exactly where it stopped.

Layout of ``CKPT_DIR/step_00000010/`` (``CKPT_DIR/latest`` names the newest):

* ``model.safetensors``: the policy weights (shared tensors such as tied embeddings stored once); a
  policy training LoRA adapters stores its adapters only (the frozen base is rebuilt from ``--model``);
* ``config.json`` and the tokenizer files: enough to reload the model on its own;
* ``optimizer.pt``, ``scheduler.pt``: optimizer moments and schedule position;
* ``rng.pt``: Python, NumPy and torch random states, as tensors and plain numbers;
* ``state.json``: step, policy version, buffer counters and prompt stream (prompts in flight at
  save time are handed out again first on resume), and the trainer's cumulative counters.

Loading never runs code from a checkpoint: the ``.pt`` files are read with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples and dicts only), so a
planted pickle is refused (:class:`CheckpointError` names the file).

Saving survives a crash (power loss, ``kill -9``) at any point: the files are written into a
hidden temporary directory and fsynced; an existing directory of the same step is renamed aside,
the new one renamed in, ``latest`` replaced atomically, and only then is the old one deleted. At
every instant ``latest`` names a complete checkpoint: while a directory it names is being renamed,
it names the other, complete copy. Leftovers of an interrupted save are cleaned up (or, when the
step's directory went missing, restored) by the next save.

A save that cannot complete (non-finite weights or optimizer moments, state that a load would
refuse, a full disk) raises :class:`CheckpointSaveError` (one line, a
:class:`~flashreinforce.trainer.errors.RunFailure`) after removing what it wrote: ``latest`` stays
where it was. :func:`clean_interrupted_saves` removes the leftovers of interrupted or failed saves
on resume.

Loading validates every file and names the one that is missing, truncated or not what it should
be, and checks what the files mean (:mod:`.checkpoint_validation`): finite weights and moments, the
model's tensor names and shapes, ``state.json``'s fields in range and in agreement with each other,
with the optimizer's step counts and with the step directory's name. ``latest`` must name a step
directory of this checkpoints directory (``step_*``, or the hidden copy of an interrupted save);
``step_*`` entries that are symbolic links are ignored. ``--resume`` (the newest checkpoint) falls
back to the newest valid checkpoint with one warning line per refused one; ``--resume DIR`` does
not guess.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file, save_model

from flashreinforce.config import ConfigError
from flashreinforce.trainer.persistence.checkpoint_rng import (check_rng_state, legacy_rng_state, rng_state,
                                                              set_rng_state)
from flashreinforce.models.lora import has_lora
from flashreinforce.trainer.persistence.checkpoint_validation import (CheckpointError, check_optimizer, check_scheduler,
                                                                      check_state, checkpoint_tensors, first_non_finite,
                                                                      read_weights)
from flashreinforce.trainer.errors import RunFailure
from flashreinforce.trainer.persistence.run_history import trim_history

__all__ = ["CheckpointError", "CheckpointSaveError", "ResumePoint", "RUN_FILES", "clean_interrupted_saves", "clear_run",
           "existing_run_files", "find_checkpoint", "latest_checkpoint", "learner_state_to_restore", "load_checkpoint",
           "save_checkpoint", "trim_history"]

log = logging.getLogger(__name__)

LATEST = "latest"
#: Files of a checkpoint directory that loading needs (the model's config.json and tokenizer are extras).
REQUIRED_FILES = ("state.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt")
#: The records a run writes into its output directory (cleared by ``--overwrite``).
RUN_FILES = ("config.json", "metrics.jsonl", "eval.jsonl", "samples.jsonl", "summary.json", "heldout.json",
             "eval_command.jsonl")
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Hidden leftovers of a save: ".step_00000010.tmp-<id>" (being written), ".step_00000010.old-<id>" (set aside).
_LEFTOVER = re.compile(r"^\.(step_\d+)\.(tmp|old|trash)-[0-9a-f]+$")
# What `latest` may name: a step directory, or the complete hidden copy a save names while it swaps.
_POINTABLE = re.compile(r"^(?:step_(\d+)|\.step_(\d+)\.(?:tmp|old)-[0-9a-f]+)$")


class CheckpointSaveError(RunFailure):
    """A checkpoint that could not be written: what was written of it is removed, ``latest`` is left
    as it was, and the message (one line) says why and what ``latest`` names."""


def _dir_step(name: str) -> int | None:
    """The step a checkpoint directory's name gives (``step_*`` or a save's hidden copy), else ``None``."""
    m = _POINTABLE.match(name)
    return int(m.group(1) or m.group(2)) if m else None


def step_name(step: int) -> str:
    return f"step_{step:08d}"


# ---------------------------------------------------------------- durable filesystem steps


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            _fsync(p)
    for p in sorted((d for d in directory.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        _fsync(p)
    _fsync(directory)


def _write_latest(ckpt_dir: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (a temporary file replaces it), durably."""
    tmp = ckpt_dir / f".{LATEST}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "w") as fh:
            fh.write(name)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, ckpt_dir / LATEST)
    except Exception:  # a full disk: the old pointer stands, its replacement is removed
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync(ckpt_dir)


def _latest_name(ckpt_dir: Path) -> str | None:
    pointer = ckpt_dir / LATEST
    try:
        return pointer.read_text(errors="replace").strip() or None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _remove_dir(ckpt_dir: Path, path: Path) -> None:
    """Delete ``path``: renamed to a hidden name first, so a crash halfway never leaves a partly deleted
    ``step_*`` directory that looks like a checkpoint."""
    trash = path
    match = _STEP_DIR.match(path.name)
    if match:
        trash = ckpt_dir / f".{path.name}.trash-{uuid.uuid4().hex[:12]}"
        os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the ``step_*`` directories, newest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return sorted(found, reverse=True)


def _clean_leftovers(ckpt_dir: Path) -> None:
    """After ``latest`` names a new checkpoint: a directory set aside whose step directory is missing
    (a save interrupted between the two renames) goes back in place; every other leftover is deleted."""
    keep = _latest_name(ckpt_dir)
    for p in sorted(ckpt_dir.iterdir()):
        m = _LEFTOVER.match(p.name)
        if not m or p.name == keep or not p.is_dir():
            continue
        final = ckpt_dir / m.group(1)
        if m.group(2) == "old" and not final.exists():
            os.rename(p, final)
            _fsync(ckpt_dir)
        else:
            shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_dir.glob(f".{LATEST}.tmp-*"):
        p.unlink(missing_ok=True)


def _latest_note(ckpt_dir: Path, before: str | None) -> str:
    """What ``latest`` names after a failed save (``before``: what it named when the save began)."""
    now = _latest_name(ckpt_dir) if ckpt_dir.is_dir() else None
    if now is None:
        return "there is no earlier checkpoint"
    return f"latest {'still ' if now == before else ''}names {now} (--resume continues from it)"


def _free_space(ckpt_dir: Path) -> str:
    try:
        free = shutil.disk_usage(ckpt_dir).free
    except OSError:
        return "free space unknown"
    return f"{free // 2**10} KiB free there" if free < 10 * 2**20 else f"{free // 2**20} MiB free there"


def _refuse_to_save(ckpt_dir: Path, step: int, model: torch.nn.Module, learner_state: dict,
                    record: dict[str, Any]) -> None:
    """Raise :class:`CheckpointSaveError` when what would be written is not finite or would be refused
    by :func:`load_checkpoint`; nothing is written."""
    label = ckpt_dir / (step_name(step) if isinstance(step, int) and step >= 0 else f"step {step!r}")
    try:
        check_state(record, "state.json")
        problem = first_non_finite(checkpoint_tensors(model).items())
        if problem:
            raise CheckpointError(f"model.safetensors: tensor {problem}")
        optimizer = learner_state["optimizer"]
        check_optimizer(optimizer, "optimizer.pt", model, version=record["version"],
                        steps_skipped=record.get("optimizer_steps_skipped", 0),
                        by_name=record.get("optimizer_format") == "fsdp_full")
        check_scheduler(learner_state["scheduler"], "scheduler.pt", version=record["version"],
                        num_groups=len(optimizer["param_groups"]))
    except CheckpointError as err:
        raise CheckpointSaveError(f"checkpoint {label} not saved: {err}; "
                                  f"{_latest_note(ckpt_dir, _latest_name(ckpt_dir))}") from None


def save_checkpoint(ckpt_dir: str | Path, step: int, *, model: torch.nn.Module, learner_state: dict,
                    state: dict[str, Any], tokenizer=None, max_keep: int = 0) -> Path:
    """Write checkpoint ``step`` under ``ckpt_dir`` and point ``latest`` at it; keep the newest
    ``max_keep`` checkpoints (0: keep all). Returns the checkpoint directory. Crash-safe (see the
    module docstring): at no point does ``latest`` name a missing or partial directory.

    Raises:
        CheckpointSaveError: non-finite or inconsistent state (nothing written), or a write failed
            (a full disk: what was written is removed); ``latest`` names what it named before.
    """
    ckpt_dir = Path(ckpt_dir)
    record = {**state, "step": step, "version": learner_state["version"]}
    if learner_state.get("optimizer_steps_skipped"):
        record["optimizer_steps_skipped"] = int(learner_state["optimizer_steps_skipped"])
    _refuse_to_save(ckpt_dir, step, model, learner_state, record)
    name = step_name(step)
    final = ckpt_dir / name
    token = uuid.uuid4().hex[:12]
    tmp = ckpt_dir / f".{name}.tmp-{token}"
    before = _latest_name(ckpt_dir) if ckpt_dir.is_dir() else None
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        if has_lora(model):  # the adapters only: the frozen base is the run's --model
            save_file({k: v.detach().contiguous() for k, v in checkpoint_tensors(model).items()},
                      str(tmp / "model.safetensors"))
        else:
            save_model(model, str(tmp / "model.safetensors"))
        model.config.save_pretrained(str(tmp))
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        torch.save(learner_state["optimizer"], tmp / "optimizer.pt")
        torch.save(learner_state["scheduler"], tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(record, indent=1))
        _fsync_tree(tmp)
        _fsync(ckpt_dir)
    except Exception as err:  # a full disk, a lost mount: torch, safetensors and the OS each say it their way
        free = _free_space(ckpt_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"checkpoint {final} not saved ({_short(err)}; {free}); "
                                  f"the partial copy was removed, {_latest_note(ckpt_dir, before)}") from None
    moved_in = False
    try:
        if final.exists():
            # Replace a checkpoint of the same step (the end of a run whose last update was also a periodic
            # save, or a resumed run passing a step again). `latest` must never name a directory while it
            # is renamed: it names the complete new copy, then the complete old one, then the new one in place.
            if _latest_name(ckpt_dir) == name:
                _write_latest(ckpt_dir, tmp.name)
            aside = ckpt_dir / f".{name}.old-{token}"
            os.rename(final, aside)
            _fsync(ckpt_dir)
            if _latest_name(ckpt_dir) == tmp.name:
                _write_latest(ckpt_dir, aside.name)
        os.rename(tmp, final)
        moved_in = True
        _fsync(ckpt_dir)
        _write_latest(ckpt_dir, name)
    except Exception as err:  # writing the pointer on a full disk: undo what latest does not name
        try:
            if moved_in and _latest_name(ckpt_dir) != name:
                _remove_dir(ckpt_dir, final)
            _clean_leftovers(ckpt_dir)
        except OSError:
            pass
        raise CheckpointSaveError(f"checkpoint {final} not saved ({_short(err)}; {_free_space(ckpt_dir)}); "
                                  f"{_latest_note(ckpt_dir, before)}") from None
    try:
        _clean_leftovers(ckpt_dir)
        if max_keep > 0:
            for _, old in _step_dirs(ckpt_dir)[max_keep:]:
                if old.name != name:
                    _remove_dir(ckpt_dir, old)
            _fsync(ckpt_dir)
    except OSError as err:  # the checkpoint is saved and named; only the tidying failed
        log.warning("checkpoint %s saved, but removing older copies failed (%s); the next save tries again",
                    final, _short(err))
    return final


# ---------------------------------------------------------------- loading and validation


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The directory ``ckpt_dir/latest`` names, or ``None`` when there is none, it is missing, or it
    is not a step directory of ``ckpt_dir`` (a path elsewhere, a symbolic link, another name)."""
    name = _latest_name(Path(ckpt_dir))
    if name is None or not _POINTABLE.match(name):
        return None
    path = Path(ckpt_dir) / name
    return path if path.is_dir() and not path.is_symlink() else None


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def _load_pt(path: Path, what: str) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the {what})")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL [\w.]+", str(err))
        detail = f"it names {found.group(0).split()[1]}" if found else _short(err)
        raise CheckpointError(f"{path}: refused, it holds more than tensors and plain data and loading it could "
                              f"run code (read with torch.load weights_only=True; {detail})") from None
    except Exception as err:  # truncated or corrupt archive: torch raises RuntimeError, EOFError, ...
        raise CheckpointError(f"{path}: unreadable, truncated or corrupt ({_short(err)})") from None


def _read_state(path: Path) -> dict[str, Any]:
    file = path / "state.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (not a checkpoint directory)")
    try:
        state = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON, truncated or corrupt ({_short(err)})") from None
    return check_state(state, file, dir_step=_dir_step(path.name))


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, restore_rng: bool = True) -> dict[str, Any]:
    """Load the weights of checkpoint ``path`` into ``model`` and return
    ``{"state": state.json, "learner": {optimizer, scheduler, version}}`` (RNG restored unless told not to).

    Every file is read and checked (:mod:`.checkpoint_validation`) before the model is touched.
    Raises :class:`CheckpointError` naming the file that is missing, truncated, of the wrong
    structure, not plain data, not finite, or not in agreement with the model or the other files.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    state = _read_state(path)
    version = state["version"]
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing (the model weights)")
    tensors = read_weights(weights, model)
    optimizer = _load_pt(path / "optimizer.pt", "optimizer state")
    skipped = state.get("optimizer_steps_skipped", 0)
    check_optimizer(optimizer, path / "optimizer.pt", model, version=version, steps_skipped=skipped,
                    by_name=state.get("optimizer_format") == "fsdp_full")
    scheduler = _load_pt(path / "scheduler.pt", "learning-rate schedule state")
    check_scheduler(scheduler, path / "scheduler.pt", version=version, num_groups=len(optimizer["param_groups"]))
    try:
        rng = _load_pt(path / "rng.pt", "random states")
    except CheckpointError:
        rng = legacy_rng_state(path / "rng.pt") if (path / "rng.pt").is_file() else None
        if rng is None:
            raise
        log.info("%s: random states in the format of earlier versions, converted", path / "rng.pt")
    try:
        check_rng_state(rng)
    except ValueError as err:
        raise CheckpointError(f"{path / 'rng.pt'}: {err}") from None
    model.load_state_dict(tensors, strict=False)  # names and shapes checked; a tied tensor is stored once
    if restore_rng:
        set_rng_state(rng)
    learner = {"optimizer": optimizer, "scheduler": scheduler, "version": version, "optimizer_steps_skipped": skipped}
    return {"state": state, "learner": learner}


def _candidates(ckpt_dir: Path) -> Iterable[Path]:
    """What ``--resume`` may load from ``ckpt_dir``: the checkpoint ``latest`` names, then every
    ``step_*`` directory, newest first (a warning when ``latest`` is missing, names nothing, or names
    something that is not a step directory of ``ckpt_dir``)."""
    name = _latest_name(ckpt_dir)
    first = latest_checkpoint(ckpt_dir)
    if first is not None:
        yield first
    elif name is not None and (not _POINTABLE.match(name) or (ckpt_dir / name).is_symlink()):
        log.warning("--resume: %s names %r, which is not a step directory of this run (step_NNNNNNNN inside %s); "
                    "ignoring it and looking for the newest valid checkpoint there", ckpt_dir / LATEST, name, ckpt_dir)
    elif name is not None:
        log.warning("--resume: %s names %s, which does not exist; looking for the newest valid checkpoint",
                    ckpt_dir / LATEST, name)
    elif _step_dirs(ckpt_dir):
        log.warning("--resume: %s is missing; looking for the newest valid checkpoint", ckpt_dir / LATEST)
    for _, path in _step_dirs(ckpt_dir):
        if first is None or path.resolve() != first.resolve():
            yield path


def _newest_valid(ckpt_dir: Path, model: torch.nn.Module, flag: str) -> tuple[Path, dict[str, Any]]:
    """Fallback: a refused checkpoint is skipped (one warning line: which, why, what happens) and the
    next older one tried; none valid is a :class:`ConfigError` listing every refusal."""
    problems: list[str] = []
    for path in _candidates(ckpt_dir):
        try:
            loaded = load_checkpoint(path, model=model)
        except CheckpointError as err:
            log.warning("%s: refused the checkpoint %s: %s; trying the next older one (move %s out of %s to stop "
                        "this warning; the run replaces it when it saves that step again)", flag, path.name, err,
                        path.name, ckpt_dir)
            problems.append(str(err))
            continue
        if problems:
            log.warning("%s: resuming from %s, the newest valid checkpoint (%d newer one%s refused, named above)",
                        flag, path, len(problems), "s" if len(problems) > 1 else "")
        return path, loaded
    if problems:
        raise ConfigError(f"{flag}: no valid checkpoint in {ckpt_dir}: " + "; ".join(problems)
                          + "; repair or remove these, or start over with --overwrite (deletes the run)")
    raise ConfigError(f"{flag}: no checkpoint in {ckpt_dir}")


def _another_choice(path: Path) -> str:
    """What to do when the checkpoint ``--resume DIR`` names is refused."""
    others = [p for _, p in _step_dirs(path.parent) if p.resolve() != path.resolve()]
    if others:
        return (f"resume another checkpoint: --resume {path.parent} takes the newest valid one there "
                f"({len(others)} other{'s' if len(others) > 1 else ''})")
    return "give another checkpoint, or start over with --overwrite (deletes the run)"


def _is_checkpoints_dir(path: Path) -> bool:
    return (path / LATEST).is_file() or bool(_step_dirs(path))


def find_checkpoint(ckpt_dir: str | Path, resume: str) -> Path:
    """The directory ``--resume`` names, without loading it: ``latest`` (what ``ckpt_dir/latest``
    names), a checkpoint directory, a checkpoints directory or a run directory (their newest)."""
    if resume == "latest":
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}")
        return path
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"--resume {resume}: no such directory")
    if (path / "state.json").exists() or not (_is_checkpoints_dir(path) or _is_checkpoints_dir(path / "checkpoints")):
        return path
    inner = path if _is_checkpoints_dir(path) else path / "checkpoints"
    found = latest_checkpoint(inner) or next((p for _, p in _step_dirs(inner)), None)
    if found is None:  # only a `latest` that names nothing of this directory
        raise ConfigError(f"--resume {resume}: no checkpoint in {inner} ({inner / LATEST} names none of its own)")
    return found


class ResumePoint:
    """A checkpoint being resumed from: its ``path``, ``state`` (``state.json``) and ``learner``
    state (optimizer, scheduler, version), after its weights were loaded into the model."""

    def __init__(self, path: Path, loaded: dict[str, Any]) -> None:
        self.path = path
        self.state: dict[str, Any] = loaded["state"]
        self.learner: dict[str, Any] = loaded["learner"]

    @classmethod
    def load(cls, ckpt_dir: str | Path, resume: str, model: torch.nn.Module) -> "ResumePoint":
        """Find the checkpoint, load its weights into ``model`` (not yet sharded) and restore the RNG.

        ``resume``: ``latest`` (the newest valid checkpoint under ``ckpt_dir``; a broken one is skipped
        with a warning), or a directory: a checkpoint (used as is; an error names its broken file), a
        checkpoints directory or a run directory (their newest valid checkpoint).

        Raises:
            ConfigError: nothing valid to resume from (the message names the files and problems).
        """
        if resume == "latest":
            return cls(*_newest_valid(Path(ckpt_dir), model, "--resume"))
        path = Path(resume)
        flag = f"--resume {resume}"
        if not path.is_dir():
            raise ConfigError(f"{flag}: no such directory")
        if (path / "state.json").exists():
            try:
                return cls(path, load_checkpoint(path, model=model))
            except CheckpointError as err:
                raise ConfigError(f"{flag}: refused: {err}; {_another_choice(path)}") from None
        for inner in (path, path / "checkpoints"):
            if _is_checkpoints_dir(inner):
                return cls(*_newest_valid(inner, model, flag))
        raise ConfigError(f"{flag}: not a checkpoint (no state.json), a checkpoints directory or a run directory")

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def check_within(self, max_steps: int) -> None:
        """Refuse (:class:`ConfigError`) a checkpoint past this run's ``max_steps`` updates (it would
        report "completed" without training); one at exactly ``max_steps`` is a finished run."""
        if self.step > max_steps:
            raise ConfigError(f"--resume: {self.path} is at step {self.step}, past this run's {max_steps} updates; "
                              f"continue with --train.max_steps {self.step} or more (or more train.num_episodes), "
                              "or resume an earlier checkpoint")


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


# ---------------------------------------------------------------- the run's history and files


def clean_interrupted_saves(ckpt_dir: str | Path) -> None:
    """On resume (the run's own checkpoints directory, before anything is written there): remove what
    interrupted or failed saves left behind (hidden copies and pointer files), keeping the copy
    ``latest`` names and putting back a set-aside copy whose step directory is missing. What cannot
    be removed is left, with a warning: ``--resume`` ignores it, the next save tries again."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return
    found = [p.name for p in ckpt_dir.iterdir() if _LEFTOVER.match(p.name) or p.name.startswith(f".{LATEST}.tmp-")]
    if not found:
        return
    try:
        _clean_leftovers(ckpt_dir)
    except OSError as err:
        log.warning("--resume: could not remove the leftovers of interrupted saves in %s (%s)", ckpt_dir, _short(err))
        return
    log.info("--resume: removed the leftovers of interrupted saves in %s: %s", ckpt_dir, ", ".join(sorted(found)))


def existing_run_files(out: str | Path, ckpt_dir: str | Path) -> list[Path]:
    """The records and checkpoints of an earlier run in output directory ``out`` (empty when none)."""
    out, ckpt_dir = Path(out), Path(ckpt_dir)
    found = [out / n for n in RUN_FILES if (out / n).exists()]
    if ckpt_dir.is_dir() and _is_checkpoints_dir(ckpt_dir):
        found.append(ckpt_dir)
    return found


def clear_run(out: str | Path, ckpt_dir: str | Path, hf_dir: str | Path) -> None:
    """Delete an earlier run's files (``--overwrite``): its records (:data:`RUN_FILES`), its
    checkpoints (``latest``, ``step_*`` and leftovers; nothing else in ``ckpt_dir``) and its
    ``hf`` export when that lies inside ``out``. Other files in ``out`` are left alone."""
    out, ckpt_dir, hf_dir = Path(out), Path(ckpt_dir), Path(hf_dir)
    for n in RUN_FILES:
        (out / n).unlink(missing_ok=True)
    if ckpt_dir.is_dir():
        (ckpt_dir / LATEST).unlink(missing_ok=True)
        for p in ckpt_dir.iterdir():
            if p.is_symlink() and _STEP_DIR.match(p.name):
                p.unlink()  # the link only: what it points at is not this run's
            elif p.is_dir() and (_STEP_DIR.match(p.name) or _LEFTOVER.match(p.name)):
                shutil.rmtree(p)
            elif p.name.startswith(f".{LATEST}.tmp-"):
                p.unlink()
    if hf_dir.is_dir() and out.resolve() in hf_dir.resolve().parents:
        shutil.rmtree(hf_dir)
