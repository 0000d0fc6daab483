"""The evaluation at a run's stop: when it runs, what it records, and Ctrl-C or SIGTERM during it skipping it
(the checkpoint is saved by then) with the signal handlers given back."""

from __future__ import annotations

import json
import os
import signal
import types

import pytest

from flashreinforce.config import TrainerConfig
from flashreinforce.trainer.run.stop_evaluation import evaluate_at_stop, evaluates_at_stop


class FakeRun:
    """What evaluate_at_stop reads of a Trainer."""

    def __init__(self, out, cfg, step, evaluate):
        self.out, self.cfg, self.step, self.evaluate = out, cfg, step, evaluate
        self.callbacks = types.SimpleNamespace(on_eval=lambda step, ev: self.seen.append(step))
        self.seen: list[int] = []

    def _eval_note(self, what):
        return f"{what}: 4 evaluation prompts ..."

    def _write_eval(self, metrics):
        with open(self.out / "eval.jsonl", "a") as fh:
            fh.write(json.dumps({"step": self.step, **metrics}) + "\n")


def _cfg(**eval_settings):
    cfg = TrainerConfig.from_layers({})
    for key, value in eval_settings.items():
        setattr(cfg.eval, key, value)
    return cfg


def test_which_runs_evaluate_at_their_stop():
    assert evaluates_at_stop(_cfg(steps=10)) and evaluates_at_stop(_cfg(eval_at_start=True))
    assert evaluates_at_stop(_cfg(every_min=5.0))
    assert not evaluates_at_stop(_cfg())  # a run that never evaluates does not start at its stop
    assert not evaluates_at_stop(_cfg(steps=10, eval_at_stop=False))


def test_the_stop_is_evaluated_once_and_recorded(tmp_path):
    lines: list[str] = []
    run = FakeRun(tmp_path, _cfg(steps=10), 7, lambda: {"eval_reward_mean": 0.5, "eval_success_rate": 0.25})
    evaluate_at_stop(run, lines.append, 12.5)
    records = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert records == [{"step": 7, "eval_reward_mean": 0.5, "eval_success_rate": 0.25, "train_time_s": 12.5}]
    assert run.seen == [7] and lines[-1] == "eval at stop (update 7): reward 0.500, success 0.250"
    evaluate_at_stop(run, lines.append, 12.5)  # eval.jsonl already ends with this update's
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 1 and run.seen == [7]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_it_skips_it_and_the_handlers_come_back(tmp_path, signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    reached = []

    def evaluate():
        os.kill(os.getpid(), signum)  # the user, or a scheduler, during the evaluation
        for _ in range(10**7):  # the handler runs at the next bytecode
            reached.append(1)
        raise AssertionError("the signal did not end the evaluation")

    lines: list[str] = []
    run = FakeRun(tmp_path, _cfg(eval_at_start=True), 3, evaluate)
    evaluate_at_stop(run, lines.append, 1.0)
    assert lines[-1] == "flashreinforce: evaluation at stop skipped (interrupted); the checkpoint is saved"
    assert not (tmp_path / "eval.jsonl").exists() and run.seen == []
    assert len(reached) < 10**7
    assert {s: signal.getsignal(s) for s in before} == before
