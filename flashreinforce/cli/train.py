"""``flashreinforce train``: train with the native asynchronous trainer.

``flashreinforce train [--preset NAME] [--env MODULE:CLASS] [--model M] --output DIR [--resume] [--FLAG VALUE ...]``;
``flashreinforce train --help`` lists every flag. Exit status: 0 when training completed, 130 after
Ctrl-C (a checkpoint was saved; or Ctrl-C during start-up, or a second one that aborts: one line,
no traceback), 2 for a bad command line or configuration (a one-line message
naming the flag, nothing started), 1 when the run cannot go on (every rollout worker stopped, or the
watchdog found nothing to train on; a checkpoint was saved and the message says why). Under
``torchrun`` every rank runs this command; rank 0 prints the summary (see docs/distributed.md).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Sequence

__all__ = ["train"]

def train(argv: Sequence[str]) -> int:
    from flashreinforce.config import ConfigError, parse_train_args
    from flashreinforce.config.presets import PRESETS

    try:
        cfg = parse_train_args(argv, PRESETS)
    except ConfigError as err:
        print(f"flashreinforce train: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    trainer = None
    try:
        from flashreinforce.distributed.scale_out import DistributedScaleOut
        from flashreinforce.trainer import Trainer
        from flashreinforce.trainer.errors import RunFailure

        trainer = Trainer(cfg, scale_out=DistributedScaleOut())
        summary = trainer.run()
    except KeyboardInterrupt:  # first: a Ctrl-C may come before the names below exist
        if trainer is None or not trainer.training_started:
            print("flashreinforce train: interrupted during start-up (Ctrl-C): nothing was trained or written",
                  file=sys.stderr)
        else:
            print(f"flashreinforce train: aborted by a second Ctrl-C without finishing the last checkpoint; "
                  f"--resume continues from the newest complete one in {trainer.ckpt_dir}", file=sys.stderr)
        return 130
    except ConfigError as err:
        print(f"flashreinforce train: error: {err}", file=sys.stderr)
        return 2
    except RunFailure as err:
        print(f"flashreinforce train: error: {err}", file=sys.stderr)
        return 1
    if summary["status"] != "follower":  # under torchrun, rank 0 reports for the job
        print(json.dumps(summary, default=str))
    code = 130 if summary["status"] == "interrupted" else 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank whose run is complete: every output file is written and closed and the
        # process group destroyed. Skip the interpreter's teardown, where gloo's C++ objects were
        # seen (rarely) to abort the process after a completed run, turning success into SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code
