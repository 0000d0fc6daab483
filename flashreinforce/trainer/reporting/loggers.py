"""Experiment trackers beside ``metrics.jsonl``: TensorBoard and Weights & Biases (both optional).

``--logger.tensorboard.dir DIR`` writes TensorBoard event files to DIR; ``--logger.wandb.project P``
(with ``--logger.wandb.run_name``) logs to a W&B run, which works offline with
``WANDB_MODE=offline`` (synced later with ``wandb sync``). Both are off by default and log the same
keys as ``metrics.jsonl`` (evaluation keys included, at their update), with the update number as the
step; a dict value such as ``failure_kinds`` becomes ``failure_kinds/KIND``. Only the leading
process logs (torchrun rank 0; rollout workers never do).

Resuming: TensorBoard drops the events of later steps than the checkpoint (``purge_step``); W&B
continues the same run (its id is kept in ``OUTPUT/wandb_run_id``) and plots against the ``step``
key, so the updates redone after a resume are drawn at their step again.
"""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["MetricSink", "TensorBoardSink", "WandbSink", "close_sinks", "flat_scalars", "open_sinks"]

#: logger -> (module that must import, install line)
_PACKAGES = {"tensorboard": ("tensorboard", "pip install 'flashreinforce[tensorboard]'  (or: pip install tensorboard)"),
             "wandb": ("wandb", "pip install 'flashreinforce[wandb]'  (or: pip install wandb)")}


def flat_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics record as floats (bools as 0/1), dicts flattened to
    ``key/subkey``; strings and ``None`` are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            for sub, v in flat_scalars(value).items():
                out[f"{key}/{sub}"] = v
        elif isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def _require(name: str, flag: str) -> None:
    module, install = _PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"--{flag} needs the {name} package, which is not installed: {install}")


class MetricSink:
    """Where update records go besides ``metrics.jsonl``."""

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Log ``record`` (a metrics record, or evaluation keys) at update ``step``."""
        raise NotImplementedError

    def close(self, status: str = "completed") -> None:
        """Flush and close; ``status`` is the run's outcome (``completed``, ``interrupted``, ...)."""


class TensorBoardSink(MetricSink):
    """Scalars into TensorBoard event files under ``log_dir`` (``torch.utils.tensorboard``).

    ``purge_step``: on resume, events at or after this step left by the earlier session are dropped.
    """

    def __init__(self, log_dir: str | Path, *, purge_step: int | None = None) -> None:
        _require("tensorboard", "logger.tensorboard.dir")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for key, value in flat_scalars(record).items():
            if key != "step":
                self.writer.add_scalar(key, value, global_step=step)

    def close(self, status: str = "completed") -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink(MetricSink):
    """One Weights & Biases run (``wandb.init``); offline with ``WANDB_MODE=offline``.

    Args:
        project: W&B project. run_name: display name (default: the run directory's name).
        out: the run directory: W&B's files go to ``OUTPUT/wandb`` and the run id to
            ``OUTPUT/wandb_run_id`` (a resumed run continues the same W&B run).
        config: the run's configuration, stored with the W&B run.
        resume: whether this is a resumed run (reuse the saved id).
    """

    def __init__(self, project: str, *, out: str | Path, run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, resume: bool = False) -> None:
        _require("wandb", "logger.wandb.project")
        import wandb

        out = Path(out)
        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=project, name=run_name or out.resolve().name, id=run_id, resume="allow",
                              dir=str(out), config=dict(config or {}))
        # Plot every key against the update number, which also orders the points of a resumed run.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in flat_scalars(record).items() if not math.isnan(v)}
        scalars["step"] = float(step)
        self.run.log(scalars)

    def close(self, status: str = "completed") -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)


def open_sinks(logger: Any, out: str | Path, *, config: Mapping[str, Any] | None = None,
               initial_step: int = 0, resume: bool = False, rank: int | None = None) -> list[MetricSink]:
    """The trackers the ``logger`` section (:class:`flashreinforce.config.sections.LoggerConfig`) turns on
    (empty by default, and on every rank but 0).

    ``initial_step``: the step a resumed run continues from. ``rank``: this process's rank
    (default ``$RANK``, 0 without torchrun).
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if rank != 0:
        return []
    sinks: list[MetricSink] = []
    try:
        if logger.tensorboard.dir:
            sinks.append(TensorBoardSink(logger.tensorboard.dir,
                                         purge_step=initial_step + 1 if resume and initial_step else None))
        if logger.wandb.project:
            sinks.append(WandbSink(logger.wandb.project, out=out, run_name=logger.wandb.run_name, config=config,
                                   resume=resume))
    except BaseException:
        close_sinks(sinks, "failed")
        raise
    return sinks


def close_sinks(sinks: Sequence[MetricSink], status: str = "completed") -> None:
    """Close every sink, even when one fails (the first error is raised after)."""
    error: BaseException | None = None
    for sink in sinks:
        try:
            sink.close(status)
        except Exception as err:  # the others still get closed
            error = error or err
    if error is not None:
        raise error
