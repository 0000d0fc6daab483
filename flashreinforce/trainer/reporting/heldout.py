"""The held-out split of a finite prompt set: evaluation prompts the run never trains on.

Without ``eval.dataset``, a run that evaluates and whose environment has a finite prompt set (a
dataset) holds part of that set out: :func:`heldout_rows` draws the rows from the run's seed and the
size of the set (at most ``eval.num_prompts``, at most a fifth of the set), the buffer hands out only
the other rows, and the evaluation plays exactly these. The split is written to
``OUTPUT/heldout.json`` (:data:`HELDOUT_FILE`) when the run starts; ``--resume`` and
``flashreinforce eval`` of the run read it back, so both see the rows the run held out even when
``eval.num_prompts`` or ``--seed`` is given differently later.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HELDOUT_FILE", "MAX_HELDOUT_SHARE", "HeldOutSplit", "SplitError", "heldout_rows", "read_split",
           "run_split", "split_for_run"]

HELDOUT_FILE = "heldout.json"
#: At most this share of a finite prompt set is held out (the rest is trained on).
MAX_HELDOUT_SHARE = 5  # one row in five


def heldout_rows(num_prompts: int, requested: int, seed: int) -> list[int]:
    """The held-out rows of a prompt set of ``num_prompts`` rows: ``min(requested, num_prompts // 5)``
    distinct rows drawn from ``seed`` and ``num_prompts`` alone (the same run gives the same rows),
    in increasing order. Empty when the set has fewer than 5 rows."""
    if num_prompts <= 0 or requested <= 0:
        return []
    k = min(int(requested), num_prompts // MAX_HELDOUT_SHARE)
    return sorted(random.Random(f"heldout:{int(seed)}:{int(num_prompts)}").sample(range(num_prompts), k))


@dataclass(frozen=True)
class HeldOutSplit:
    """``rows`` of a prompt set of ``num_prompts`` rows are held out; ``seed`` drew them."""

    rows: tuple[int, ...]
    num_prompts: int
    seed: int

    @property
    def train_rows(self) -> list[int]:
        held = set(self.rows)
        return [r for r in range(self.num_prompts) if r not in held]

    def to_json(self) -> dict[str, Any]:
        return {"num_prompts": self.num_prompts, "heldout": len(self.rows), "train": self.num_prompts - len(self.rows),
                "seed": self.seed, "rows": list(self.rows),
                "note": "rows of the prompt set held out for evaluation and never trained on"}

    def write(self, out: str | Path) -> Path:
        path = Path(out) / HELDOUT_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path


class SplitError(ValueError):
    """``heldout.json`` cannot be used (unreadable, or made for another prompt set); the message names it."""


def read_split(out: str | Path) -> HeldOutSplit | None:
    """The split recorded in run directory ``out``; None when the run has none. Raises
    :class:`SplitError` naming the file when it is unreadable."""
    path = Path(out) / HELDOUT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = tuple(int(r) for r in data["rows"])
        num, seed = int(data["num_prompts"]), int(data["seed"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SplitError(f"{path}: not a held-out split ({type(err).__name__}: {err}); delete it to draw the split "
                         "again") from None
    if any(not 0 <= r < num for r in rows) or len(set(rows)) != len(rows) or len(rows) >= num:
        raise SplitError(f"{path}: its rows must be distinct, in [0, {num}) and fewer than {num}")
    return HeldOutSplit(rows, num, seed)


def split_for_run(out: str | Path | None, num_prompts: int, requested: int, seed: int) -> HeldOutSplit:
    """The run's split: the one recorded in ``out`` (checked against ``num_prompts``), else a new one
    from ``seed`` (not written: :meth:`HeldOutSplit.write` does that)."""
    recorded = read_split(out) if out is not None else None
    if recorded is not None:
        if recorded.num_prompts != num_prompts:
            raise SplitError(f"{Path(out) / HELDOUT_FILE}: the run held out rows of a prompt set of "
                             f"{recorded.num_prompts} rows, but the prompt set now has {num_prompts}; train on the "
                             "same data, or start a new run (another --output, or --overwrite)")
        return recorded
    return HeldOutSplit(tuple(heldout_rows(num_prompts, requested, seed)), num_prompts, seed)


def run_split(cfg, num_prompts: int | None, out: str | Path | None,
              env_rows: tuple[int, ...] | None = None) -> HeldOutSplit | None:
    """The held-out split of a run that evaluates (``cfg``: the resolved configuration): None with
    ``eval.dataset`` (its rows are the evaluation) or an endless environment (evaluation seeds are
    disjoint from training seeds already); ``out``: the run directory to read a recorded split from
    (``--resume``, ``flashreinforce eval`` of a run), or None; ``env_rows``: the rows of an evaluation
    split the environment defines itself (a verifiers ``eval_taskset``), held out whole instead of
    drawn. A prompt set too small to hold out a row is a :class:`~flashreinforce.config.ConfigError`
    that names the ways out."""
    from flashreinforce.config import ConfigError

    if cfg.eval.dataset or num_prompts is None:
        return None
    if env_rows:
        recorded = read_split(out) if out is not None else None
        return recorded or HeldOutSplit(tuple(env_rows), num_prompts, cfg.seed)
    try:
        split = split_for_run(out, num_prompts, cfg.eval.num_prompts, cfg.seed)
    except SplitError as err:
        raise ConfigError(str(err)) from None
    if not split.rows:
        raise ConfigError(f"evaluation (eval.steps / eval.every_min / eval.eval_at_start) holds out prompts the run "
                          f"never trains on, at most one in {MAX_HELDOUT_SHARE}, but the prompt set has only "
                          f"{num_prompts}: give --eval.dataset, or turn evaluation off (--eval.steps 0, "
                          "--eval.every_min 0, --eval.eval_at_start false)")
    return split
