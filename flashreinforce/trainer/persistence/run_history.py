"""The run's history on resume: ``metrics.jsonl`` and ``eval.jsonl`` as they were at the checkpoint
resumed from (:class:`HistoryRecord`, :func:`trim_history`).

Each checkpoint records the length and SHA-256 of both files as they were when it was written
(:meth:`HistoryRecord.snapshot`, kept up to date incrementally: each save reads only what was
appended since the last). On resume the files must still begin with exactly those bytes; what
follows (the records of updates after the checkpoint, a half-written last line) is cut off. A file
that was edited, or cut shorter, is refused with one line naming it, before any file is cut (a
refused resume changes nothing on disk); a file that is gone is
accepted with a warning (its history then restarts after the checkpoint). A checkpoint of an
earlier version, without that record, gets :func:`trim_history`'s check instead: the records cut
back to the checkpoint's step, and ``metrics.jsonl``'s steps exactly 1 to that step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from flashreinforce.config import ConfigError

__all__ = ["HISTORY_FILES", "HistoryRecord", "trim_history"]

#: The records of a run that a checkpoint vouches for.
HISTORY_FILES = ("metrics.jsonl", "eval.jsonl")
_KEEP_OR_MOVE = "restore it, or move it aside to continue without the earlier history"

log = logging.getLogger(__name__)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


class HistoryRecord:
    """Length and SHA-256 of the run's history files, for its checkpoints."""

    def __init__(self, out: str | Path, names: tuple[str, ...] = HISTORY_FILES) -> None:
        self.out = Path(out)
        self._seen: dict[str, tuple[int, Any]] = {name: (0, hashlib.sha256()) for name in names}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{name: {"bytes", "sha256"}}`` of each file now (hashing only what was appended since the
        last snapshot; a file that shrank meanwhile is hashed again from its start)."""
        out = {}
        for name, (offset, digest) in self._seen.items():
            path = self.out / name
            size = path.stat().st_size if path.is_file() else 0
            if size < offset:
                offset, digest = 0, hashlib.sha256()
            if size > offset:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    digest.update(fh.read(size - offset))
            self._seen[name] = (size, digest)
            out[name] = {"bytes": size, "sha256": digest.hexdigest()}
        return out

    def resume(self, step: int, recorded: Any, before_writing: Any = None) -> None:
        """Bring the files back to the checkpoint at ``step`` whose :meth:`snapshot` is ``recorded``
        (``None`` for a checkpoint without one: :func:`trim_history`'s check); :class:`ConfigError` for
        a file that no longer begins as recorded. Every file is checked before any is cut, so a refused
        resume changes nothing on disk; ``before_writing`` (a callable) runs between the two."""
        cuts: list[tuple[Path, int]] = []
        trims: list[tuple[Path, list[str] | None]] = []
        for name in self._seen:
            entry = recorded.get(name) if isinstance(recorded, dict) else None
            if isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str):
                length = self._check(name, step, entry["bytes"], entry["sha256"])
                if length is not None:
                    cuts.append((self.out / name, length))
            else:
                trims.append((self.out / name, _trim_plan(self.out / name, step)))
        if before_writing is not None:
            before_writing()
        for stale in (s for name in self._seen for s in self.out.glob(f".{name}.tmp-*")):
            stale.unlink(missing_ok=True)
        for path, length in cuts:
            _cut(path, step, length)
        for path, kept in trims:
            if kept is not None:
                _replace_lines(path, kept, step)
        for name in self._seen:
            path = self.out / name
            data = path.read_bytes() if path.is_file() else b""
            self._seen[name] = (len(data), hashlib.sha256(data))

    def _check(self, name: str, step: int, length: int, sha256: str) -> int | None:
        """The length ``name`` is to be cut back to (``None``: nothing to cut); ``ConfigError`` when it
        does not begin with the bytes the checkpoint vouches for."""
        path = self.out / name
        if not path.is_file():
            if length:
                log.warning("%s is missing: the records of the updates up to step %d (%d bytes, which the checkpoint "
                            "vouches for) are not in this run's history; it restarts after step %d", path, step, length,
                            step)
            return None
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(length)
        if len(head) < length:
            raise ConfigError(f"--resume: {path} holds {size} bytes, but the checkpoint at step {step} was written when "
                              f"it held {length}: records it vouches for were cut off; {_KEEP_OR_MOVE}")
        if hashlib.sha256(head).hexdigest() != sha256:
            raise ConfigError(f"--resume: {path} was changed after the checkpoint at step {step} was written (its first "
                              f"{length} bytes differ from the checkpoint's record of them); {_KEEP_OR_MOVE}")
        return length if size > length else None


def _cut(path: Path, step: int, length: int) -> None:
    """Cut ``path`` back to ``length`` bytes (the records of updates after the checkpoint at ``step``)."""
    try:
        os.truncate(path, length)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise ConfigError(f"--resume: cannot cut {path} back to step {step} ({err.strerror or _short(err)})") from None


def trim_history(out: str | Path, step: int, names: tuple[str, ...] = HISTORY_FILES) -> None:
    """Drop the records of updates after ``step`` (their effect is not in the checkpoint resumed from),
    so the run's history continues without a gap or a repeat.

    A half-written last line (the run was killed while appending it) is dropped with a warning. A
    broken line elsewhere (not JSON, no integer 'step') is a
    :class:`~flashreinforce.config.ConfigError` naming the file and line, and so are records of
    ``metrics.jsonl`` (one per update) that are not the steps 1 to ``step``, in order, each once: a
    history that was edited or cut. Every file is checked before any is written, so a refusal changes
    nothing; a file is replaced atomically, and only when something is dropped; a temporary copy left
    by a killed resume is removed; a write that fails (a full disk) is a ``ConfigError`` and leaves
    the file as it was.
    """
    plans = [(Path(out) / name, _trim_plan(Path(out) / name, step)) for name in names]
    for name in names:
        for stale in Path(out).glob(f".{name}.tmp-*"):
            try:
                stale.unlink()
            except OSError:
                pass
    for p, kept in plans:
        if kept is not None:
            _replace_lines(p, kept, step)


def _trim_plan(p: Path, step: int) -> list[str] | None:
    """The lines of ``p`` to keep at ``step`` (``None``: nothing to drop); ``ConfigError`` as
    :func:`trim_history` says. Reads only."""
    name = p.name
    if not p.is_file():
        if name == "metrics.jsonl" and step:
            log.warning("%s is missing: the records of the updates up to step %d are not in this run's history; "
                        "it restarts after step %d", p, step, step)
        return None
    lines = p.read_text(errors="replace").splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    kept, kept_steps = [], []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            record = json.loads(ln)
            record_step = record["step"]
            if isinstance(record_step, bool) or not isinstance(record_step, int):
                raise TypeError(f"'step' is {record_step!r}, not an integer")
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            if i == last:
                log.warning("%s: dropped a half-written last line (%d characters: %r...)", p, len(ln), ln[:60])
                continue
            raise ConfigError(f"{p} line {i + 1}: not a JSON record with a 'step' ({_short(err)}); fix or "
                              "delete that line, then resume again") from None
        if record_step <= step:
            kept.append(ln)
            kept_steps.append(record_step)
    if name == "metrics.jsonl" and kept_steps != list(range(1, step + 1)):
        raise ConfigError(f"--resume: {p} does not hold one record for each update up to the checkpoint's step "
                          f"{step} ({_steps_problem(kept_steps, step)}); {_KEEP_OR_MOVE}")
    return None if kept == lines else kept


def _replace_lines(p: Path, kept: list[str], step: int) -> None:
    tmp = p.with_name(f".{p.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "w") as fh:
            fh.write("".join(ln + "\n" for ln in kept))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except OSError as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise ConfigError(f"--resume: cannot cut {p} back to step {step} ({err.strerror or _short(err)}); the file "
                          "is unchanged: free some disk space, then resume again") from None


def _steps_problem(steps: list[int], step: int) -> str:
    """What is wrong with ``steps`` as the records of updates 1 to ``step``, in a few words."""
    seen: set[int] = set()
    for i, s in enumerate(steps):
        if s in seen:
            return f"step {s} appears twice"
        if i and s < steps[i - 1]:
            return f"step {s} comes after step {steps[i - 1]}"
        seen.add(s)
    missing = [s for s in range(1, step + 1) if s not in seen]
    extra = sorted(seen - set(range(1, step + 1)))
    if extra:
        return f"step {extra[0]} is no update of this run"
    return (f"{len(missing)} missing, the first {missing[0]}" if missing else "out of order")
