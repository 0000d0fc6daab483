"""``flashreinforce plot``: the curves of one or more runs in one PNG.

``flashreinforce plot RUN_DIR [RUN_DIR ...] [--output FILE.png] [--labels L ...] [--x step|wall]
[--smooth N] [--size W H] [--dpi D] [--title T]``. Without ``--output`` the PNG goes next to the run:
``RUN_DIR/curves.png`` for one run, ``curves.png`` in the runs' common parent directory for several.
Exit status 0 when the file was written, 2 for a bad argument, a directory that is not a run, or
matplotlib missing (the message names the install line). The panels are listed in
docs/observability.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["default_output", "plot"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashreinforce plot", description="Draw the training curves of runs (one "
                                "colour each) into one PNG: reward, success, eval, trust gate, lag, throughput.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (flashreinforce train --output)")
    p.add_argument("--output", "-o", help="PNG file to write (default: RUN_DIR/curves.png for one run; curves.png in "
                   "the runs' common parent directory for several)")
    p.add_argument("--labels", nargs="+", help="legend labels, one per run (default: the directory names)")
    p.add_argument("--x", choices=("step", "wall"), default="step",
                   help="x axis: update number, or training wall-clock seconds (default step)")
    p.add_argument("--smooth", type=int, default=1, help="moving average over N updates (default 1: none)")
    p.add_argument("--size", type=float, nargs=2, default=(15.0, 10.0), metavar=("W", "H"),
                   help="figure size in inches (default 15 10)")
    p.add_argument("--dpi", type=int, default=100, help="pixels per inch (default 100: 1500x1000 pixels)")
    p.add_argument("--title", help="figure title")
    return p


def default_output(runs: Sequence[str]) -> Path:
    """Where the PNG goes without ``--output``: inside the run directory for one run, in the common
    parent directory of several."""
    paths = [Path(r).resolve() for r in runs]
    if len(paths) == 1:
        return paths[0] / "curves.png"
    return Path(os.path.commonpath([p.parent for p in paths])) / "curves.png"


def plot(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    if args.output is None:
        args.output = str(default_output(args.runs))

    def fail(message: str) -> int:
        print(f"flashreinforce plot: error: {message}", file=sys.stderr)
        return 2

    from flashreinforce.analysis import default_labels, load_run, plot_runs, require_matplotlib

    if args.labels is not None and len(args.labels) != len(args.runs):
        return fail(f"--labels has {len(args.labels)} labels for {len(args.runs)} runs")
    if args.smooth < 1:
        return fail(f"--smooth must be >= 1, got {args.smooth}")
    if not (args.size[0] > 0 and args.size[1] > 0) or args.dpi <= 0:
        return fail(f"--size and --dpi must be positive, got {list(args.size)} and {args.dpi}")
    if not args.output.lower().endswith(".png"):
        return fail(f"--output {args.output!r}: only PNG files are written (name it FILE.png)")
    labels = args.labels or default_labels(args.runs)
    try:
        runs = [load_run(path, label) for path, label in zip(args.runs, labels)]
    except FileNotFoundError as err:
        return fail(str(err))
    except OSError as err:  # a file of the run that cannot be read (permissions, a folder of that name)
        return fail(f"{err.filename or 'a run file'}: cannot be read ({err.strerror or err})")
    try:  # last: every mistake in the arguments is reported even where matplotlib is missing
        require_matplotlib()
    except ImportError as err:
        return fail(str(err))
    for run in runs:
        if run.skipped_lines:
            print(f"flashreinforce plot: warning: {run.path / 'metrics.jsonl'}: {run.skipped_lines} line(s) are not JSON "
                  "records (not UTF-8 text, or cut) and were skipped", file=sys.stderr)
        if not run.metrics:
            print(f"flashreinforce plot: warning: {run.path}: metrics.jsonl has no update yet", file=sys.stderr)
    path = plot_runs(runs, args.output, x=args.x, smooth=args.smooth, size=tuple(args.size), dpi=args.dpi,
                     title=args.title)
    width, height = round(args.size[0] * args.dpi), round(args.size[1] * args.dpi)
    print(f"wrote {path} ({width}x{height} px; {len(runs)} run{'s' if len(runs) != 1 else ''}: "
          f"{', '.join(r.label for r in runs)})")
    return 0
