"""The run's history on resume: ``metrics.jsonl`` and ``eval.jsonl`` cut back to the step of the
checkpoint resumed from (:func:`trim_history`)."""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from flashreinforce.config import ConfigError

__all__ = ["trim_history"]

log = logging.getLogger(__name__)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def trim_history(out: str | Path, step: int, names: tuple[str, ...] = ("metrics.jsonl", "eval.jsonl")) -> None:
    """Drop the records of updates after ``step`` (their effect is not in the checkpoint resumed from),
    so the run's history continues without a gap or a repeat.

    A half-written last line (the run was killed while appending it) is dropped with a warning. A
    broken line elsewhere (not JSON, no integer 'step') is a
    :class:`~flashreinforce.config.ConfigError` naming the file and line. The file is replaced
    atomically, and only when something is dropped; a temporary copy left by a killed resume is
    removed; a write that fails (a full disk) is a ``ConfigError`` and leaves the file as it was.
    """
    for name in names:
        p = Path(out) / name
        for stale in Path(out).glob(f".{name}.tmp-*"):
            try:
                stale.unlink()
            except OSError:
                pass
        if not p.is_file():
            continue
        lines = p.read_text(errors="replace").splitlines()
        last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
        kept = []
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
        if kept == lines:
            continue  # nothing to drop: no write (a resume on a full disk still works)
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
