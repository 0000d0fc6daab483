"""Latency of the environment machinery: sandbox runs and math grading. Prints a table.

    python benchmarks/bench_envs.py [--repeats 20] [--sandbox-only]

The sandbox rows run ``print(1)`` with every isolation layer, then with layers turned off one
group at a time (interleaved, so machine load hits them alike), which gives the per-call cost
of each layer. Numbers depend on the machine (and on its load); docs/sandbox.md and
docs/environments.md quote one run.
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


# name -> Sandbox options: all layers, then without each group of layers.
SANDBOX_VARIANTS = {
    "all layers (default)": {},
    "no namespaces (no mount tree)": {"namespaces": False},
    "no Landlock": {"landlock": False},
    "no pids cgroup": {"cgroup": False},
    "seccomp only": {"namespaces": False, "landlock": False, "cgroup": False},
    "no kernel layer (rlimits only)": {"namespaces": False, "landlock": False, "cgroup": False, "seccomp": False},
}


def _sandbox_rows(repeats: int) -> tuple[list, list[str]]:
    sandboxes = {name: Sandbox(timeout_s=30, allow_weak_isolation=True, min_isolation="none", **options)
                 for name, options in SANDBOX_VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in sandboxes}
    for _ in range(repeats):  # interleaved: each round runs every variant once
        for name, sandbox in sandboxes.items():
            times[name] += _timed(lambda: sandbox.run("print(1)"), 1)
    rows = [(f"sandbox print(1): {name} [{sandboxes[name].isolation.level}]", times[name]) for name in sandboxes]
    default = sandboxes["all layers (default)"]
    rows.append(("sandbox: import numpy, sympy (all layers)",
                 _timed(lambda: default.run("import numpy, sympy"), max(3, repeats // 4))))
    notes = [f"sandbox layers on this machine: {', '.join(default.isolation.guards)}"]
    return rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sandbox-only", action="store_true", help="skip the grader rows")
    args = parser.parse_args()
    rng = random.Random(0)
    rows, notes = _sandbox_rows(args.repeats)
    if args.sandbox_only:
        _print(rows, notes)
        return
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
    _print(rows, notes)


def _print(rows: list, notes: list[str]) -> None:
    for note in notes:
        print(note)
    print(f"| {'operation':<66} | {'n':>4} | {'median ms':>10} | {'max ms':>9} |")
    print(f"|{'-' * 68}|{'-' * 6}|{'-' * 12}|{'-' * 11}|")
    for name, times in rows:
        print(f"| {name:<66} | {len(times):>4} | {1000 * statistics.median(times):>10.1f} | {1000 * max(times):>9.1f} |")


if __name__ == "__main__":
    main()
