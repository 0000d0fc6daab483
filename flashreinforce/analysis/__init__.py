"""Reading run directories and drawing their curves (``flashreinforce plot``).

:func:`load_run` reads one ``flashreinforce train --output`` directory (``metrics.jsonl``,
``eval.jsonl``, ``samples.jsonl``, ``summary.json``, ``config.json``) with the standard library
only; :func:`plot_runs` draws the figure of ``flashreinforce plot`` with matplotlib (the optional
``plot`` extra), imported only when drawing.
"""

from flashreinforce.analysis.plotting import PANELS, plot_runs, require_matplotlib
from flashreinforce.analysis.runs import Run, default_labels, load_run

__all__ = ["PANELS", "Run", "default_labels", "load_run", "plot_runs", "require_matplotlib"]
