"""``python -m flashreinforce.envs.sandbox [--python PATH] [--allow-network]``: the isolation report.

Starts one sandbox in probe mode (every layer set up, no code run) and prints the level it
reaches, the layers in force, the kernel's answer for each missing one, and the kernel facts
behind them. Exit status 0 when the level meets ``--min`` (default ``filesystem``), else 1.
"""

from __future__ import annotations

import argparse
import sys

from flashreinforce.envs.sandbox.levels import LEVELS
from flashreinforce.envs.sandbox.probe import kernel_facts, probe_isolation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashreinforce.envs.sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=None, help="interpreter the sandbox runs (default: this one)")
    parser.add_argument("--allow-network", action="store_true", help="probe with network access allowed")
    parser.add_argument("--min", default="filesystem", choices=LEVELS, help="level to compare with")
    args = parser.parse_args(argv)
    report = probe_isolation(python=args.python, allow_network=args.allow_network)
    print(report.describe())
    for name, value in kernel_facts().items():
        print(f"{name}: {value}")
    ok = report.at_least(args.min)
    print(f"meets --min {args.min}: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
