"""Latency of the environment machinery: sandbox runs and math grading. Prints a table.

    python benchmarks/bench_envs.py [--repeats 20]

Numbers depend on the machine (and on its load); docs/environments.md quotes one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from flashreinforce.envs.math_env import MathGrader
from flashreinforce.envs.sandbox import Sandbox


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    sandbox = Sandbox(timeout_s=30)
    rows = []
    result = sandbox.run("pass")
    rows.append(("sandbox: print(1)", _timed(lambda: sandbox.run("print(1)"), args.repeats)))
    rows.append(("sandbox: import numpy, sympy", _timed(lambda: sandbox.run("import numpy, sympy"),
                                                        max(3, args.repeats // 4))))
    grader = MathGrader()
    try:
        rows.append(("grader: first grade (starts the child)", _timed(lambda: grader.grade("1", "1"), 1)))

        def grade_fraction():
            a = rng.randrange(1, 10_000)
            grader.grade(rf"\frac{{{2 * a}}}{{14}}", f"{a}/7")

        rows.append(("grader: warm grade, fresh fraction", _timed(grade_fraction, args.repeats * 5)))
        rows.append(("grader: adversarial 9^{9^{9^{9}}} (timeout 5 s + 2 s grace)",
                     _timed(lambda: grader.grade("9^{9^{9^{9}}}", "5"), 1)))
    finally:
        grader.close()
    print(f"sandbox guards on this machine: {', '.join(result.guards)}")
    print(f"| {'operation':<58} | {'n':>4} | {'median ms':>10} | {'max ms':>9} |")
    print(f"|{'-' * 60}|{'-' * 6}|{'-' * 12}|{'-' * 11}|")
    for name, times in rows:
        print(f"| {name:<58} | {len(times):>4} | {1000 * statistics.median(times):>10.1f} | {1000 * max(times):>9.1f} |")


if __name__ == "__main__":
    main()
