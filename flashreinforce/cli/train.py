"""``flashreinforce train``: train with the native asynchronous trainer.

``flashreinforce train [--preset NAME] [--env MODULE:CLASS] [--model M] --output DIR [--resume] [--FLAG VALUE ...]``;
``flashreinforce train --help`` lists every flag. Exit status: 0 when training completed, 130 after
Ctrl-C and 143 after SIGTERM, which is answered the same way (a checkpoint was saved; or the signal
came during start-up, or a second one aborts: one line, no traceback), 2 for a bad command line or configuration (a one-line message
naming the flag, nothing started), 1 when the run cannot go on (every rollout worker stopped, or the
watchdog found nothing to train on; a checkpoint was saved and the message says why). Under
``torchrun`` every rank runs this command; rank 0 prints the summary (see docs/distributed.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import Sequence

__all__ = ["train"]

class _Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop (which answers it like Ctrl-C): handled as a Ctrl-C there."""


def _terminated(signum, frame) -> None:
    raise _Terminated()


def train(argv: Sequence[str]) -> int:
    from flashreinforce.config import ConfigError, parse_train_args
    from flashreinforce.config.presets import PRESETS

    try:
        cfg = parse_train_args(argv, PRESETS)
    except ConfigError as err:
        print(f"flashreinforce train: error: {err}", file=sys.stderr)
        return 2
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _train(cfg)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)


def _train(cfg) -> int:
    from flashreinforce.config import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    trainer = None
    try:
        from flashreinforce.distributed.scale_out import DistributedScaleOut
        from flashreinforce.trainer import Trainer
        from flashreinforce.trainer.errors import RunFailure

        trainer = Trainer(cfg, scale_out=DistributedScaleOut())
        summary = trainer.run()
    except KeyboardInterrupt as err:  # first: a Ctrl-C may come before the names below exist
        watch = getattr(trainer, "_watch_signals", None)
        signum = signal.SIGTERM if isinstance(err, _Terminated) else signal.SIGINT
        if watch is not None and watch.first_signal is not None:
            signum = watch.first_signal
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if trainer is None or not trainer.training_started:
            print(f"flashreinforce train: interrupted during start-up ({what}): nothing was trained or written",
                  file=sys.stderr)
        else:
            print(f"flashreinforce train: aborted by a second {what} without finishing the last checkpoint; "
                  f"--resume continues from the newest complete one in {trainer.ckpt_dir}", file=sys.stderr)
        return 128 + int(signum)
    except ConfigError as err:
        print(f"flashreinforce train: error: {err}", file=sys.stderr)
        return 2
    except RunFailure as err:
        print(f"flashreinforce train: error: {err}", file=sys.stderr)
        return 1
    if summary["status"] != "follower":  # under torchrun, rank 0 reports for the job
        print(json.dumps(summary, default=str))
    code = 128 + int(summary.get("signal", signal.SIGINT)) if summary["status"] == "interrupted" else 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank whose run is complete: every output file is written and closed and the
        # process group destroyed. Skip the interpreter's teardown, where gloo's C++ objects were
        # seen (rarely) to abort the process after a completed run, turning success into SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code
