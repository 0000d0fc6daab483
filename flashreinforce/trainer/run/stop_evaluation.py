"""The evaluation of the final policy when a run stops (``eval.eval_at_stop``).

A run that evaluates (``eval.steps``, ``eval.every_min`` or ``eval.eval_at_start``) evaluates once more
when it stops, whatever stopped it (its last update, ``train.max_minutes``, a callback, Ctrl-C or
SIGTERM), unless ``eval.jsonl`` already ends with an evaluation of that update, so that
``summary.json`` has the policy's numbers at its last update. It runs after the checkpoint and the
export: a Ctrl-C or SIGTERM during it ends the evaluation only.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

from flashreinforce.analysis.runs import read_jsonl
from flashreinforce.trainer.run.interrupts import SIGNALS

__all__ = ["evaluate_at_stop", "evaluates_at_stop"]


def evaluates_at_stop(cfg) -> bool:
    """Whether a run of ``cfg`` (a resolved configuration) evaluates when it stops."""
    e = cfg.eval
    return bool(e.eval_at_stop and (e.steps or e.every_min or e.eval_at_start))


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def evaluate_at_stop(trainer: Any, note: Callable[[str], None], train_s: float) -> None:
    """Evaluate ``trainer``'s policy at its current update (see the module docstring); ``note`` writes a
    console line, ``train_s`` is the run's training time for the record. Call it after the signal watch
    of the update loop is uninstalled (from the main thread, Ctrl-C and SIGTERM then skip it)."""
    records = read_jsonl(trainer.out / "eval.jsonl")
    if not evaluates_at_stop(trainer.cfg) or (records and records[-1].get("step") == trainer.step):
        return
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_interrupt) for s in SIGNALS} if main else {}
    try:
        note(trainer._eval_note(f"evaluation at stop (update {trainer.step})"))
        ev = trainer.evaluate()
    except KeyboardInterrupt:
        note("flashreinforce: evaluation at stop skipped (interrupted); the checkpoint is saved")
        return
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    trainer._write_eval(dict(ev, train_time_s=train_s))
    note(f"eval at stop (update {trainer.step}): reward {ev['eval_reward_mean']:.3f}, success "
         f"{ev['eval_success_rate']:.3f}")
    trainer.callbacks.on_eval(trainer.step, dict(ev, train_time_s=train_s))
