"""One run directory as data: its update records, evaluations, samples, summary and configuration."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Run", "default_labels", "load_run", "read_jsonl"]


def read_jsonl(path: str | Path, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` file; a line that is not one (cut by a crash or being written,
    or not UTF-8 text: a binary file gives none) is skipped, and counted in ``skipped`` when given (one
    number appended); no file: empty."""
    path = Path(path)
    if not path.is_file():
        return []
    rows, bad = [], 0
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
            bad += bool(line.strip())
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    if skipped is not None:
        skipped.append(bad)
    return rows


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _number(value: Any) -> float:
    """A finite or NaN float for a plotted value (``None``, text and bools are NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


@dataclass
class Run:
    """A run directory's contents.

    path: the directory. label: its name in legends. metrics: ``metrics.jsonl`` records in file
    order. evals: ``eval.jsonl`` records. command_evals: ``eval_command.jsonl`` records (one per
    ``flashreinforce eval`` of the run's model: ``step``, ``accuracy``, ``pass@1``). samples:
    ``samples.jsonl`` records. summary / config: ``summary.json`` / ``config.json`` (None when absent).
    skipped_lines: lines of ``metrics.jsonl`` that could not be read as records.
    """

    path: Path
    label: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    command_evals: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    #: Lines of ``metrics.jsonl`` that are not JSON records (not UTF-8 text, or cut), skipped.
    skipped_lines: int = 0

    def has(self, key: str) -> bool:
        """Whether some update record or evaluation has a number under ``key``."""
        return any(not math.isnan(_number(r.get(key))) for r in self.metrics + self.evals + self.command_evals)

    def wall_of_step(self) -> dict[int, float]:
        """Update number -> training wall-clock seconds (``wall_time_s``); step 0 is 0."""
        out = {0: 0.0}
        for r in self.metrics:
            if isinstance(r.get("step"), int) and not math.isnan(_number(r.get("wall_time_s"))):
                out[r["step"]] = float(r["wall_time_s"])
        return out

    def series(self, key: str, *, x: str = "step", source: str = "metrics") -> tuple[list[float], list[float]]:
        """``(xs, ys)`` of ``key`` over the update records (``source="metrics"``), the evaluations
        (``"evals"``) or the ``flashreinforce eval`` results (``"command_evals"``), against the update
        number (``x="step"``) or the training wall-clock (``x="wall"``, seconds); records without the
        key are left out."""
        if x not in ("step", "wall"):
            raise ValueError(f"x must be 'step' or 'wall', got {x!r}")
        rows = {"metrics": self.metrics, "evals": self.evals, "command_evals": self.command_evals}[source]
        walls = self.wall_of_step() if x == "wall" else {}
        xs, ys = [], []
        for r in rows:
            y = _number(r.get(key))
            step = r.get("step")
            if math.isnan(y) or not isinstance(step, int):
                continue
            if x == "wall":
                if step not in walls:
                    continue
                xs.append(walls[step])
            else:
                xs.append(float(step))
            ys.append(y)
        return xs, ys


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read run directory ``path``. Raises ``FileNotFoundError`` naming the directory when it is
    not a run directory (no ``metrics.jsonl`` or ``eval.jsonl``)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run directory")
    if not (path / "metrics.jsonl").is_file() and not (path / "eval.jsonl").is_file():
        raise FileNotFoundError(f"{path}: not a run directory (no metrics.jsonl or eval.jsonl)")
    skipped: list[int] = []
    return Run(path=path, label=label or path.resolve().name, metrics=read_jsonl(path / "metrics.jsonl", skipped),
               evals=read_jsonl(path / "eval.jsonl"), command_evals=read_jsonl(path / "eval_command.jsonl"),
               samples=read_jsonl(path / "samples.jsonl"),
               summary=_read_json(path / "summary.json"), config=_read_json(path / "config.json"),
               skipped_lines=sum(skipped))


def default_labels(paths: Sequence[str | Path]) -> list[str]:
    """Legend labels for ``paths``: each directory's name, with its parent's name in front when two
    runs share a name (``seed0`` of ``no_trust`` and of ``base`` become ``no_trust/seed0`` ...)."""
    resolved = [Path(p).resolve() for p in paths]
    names = [p.name for p in resolved]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in resolved]
