#!/usr/bin/env python
"""Inspect or launch a published FlashREINFORCE experiment; see examples/README.md.

    python examples/run_experiment.py --setting qwen_math --variant negative_q02 --print-config
    python examples/run_experiment.py --setting r1 --train-data train.jsonl --eval-data eval.jsonl --dry-run
"""

import sys

from flashreinforce.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main())
