"""The figure of ``flashreinforce plot``: the curves a FlashREINFORCE run is judged by, runs overlaid.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend change), so it
works on a machine without a display and inside a program that uses another backend.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from flashreinforce.analysis.runs import Run

__all__ = ["INSTALL_HINT", "LOG_AXIS_QUANTILE", "PANELS", "Curve", "Panel", "log_axis_bottom", "moving_average",
           "panel_title", "plot_runs", "require_matplotlib"]

INSTALL_HINT = "pip install 'flashreinforce[plot]'  (or: pip install matplotlib)"


@dataclass(frozen=True)
class Curve:
    """One line of a panel: ``key`` of the update records (``source="metrics"``), of the
    evaluations (``"evals"``) or of the ``flashreinforce eval`` results (``"command_evals"``, drawn as
    stars), drawn with ``style`` (``-``, ``--``, ``:``); ``band``: keys of a shaded (low, high) range
    around it; ``legend``: what the panel's title says about this curve, shown only when some run has it."""

    key: str
    label: str = ""
    source: str = "metrics"
    style: str = "-"
    band: tuple[str, str] | None = None
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    curves: tuple[Curve, ...]
    log_y: bool = False
    y_range: tuple[float, float] | None = None


#: The panels, row by row (3 x 3). A title lists the ``legend`` of the curves some run has.
PANELS: tuple[Panel, ...] = (
    Panel("training reward (reward_mean)", (Curve("reward_mean"),)),
    Panel("success rate", (Curve("success_rate", "success"),
                           Curve("no_answer_fraction", "no answer", style=":", legend="dotted: no gradable answer")),
          y_range=(-0.02, 1.02)),
    Panel("held-out eval",
          (Curve("eval_reward_mean", "reward", "evals", legend="solid: reward"),
           Curve("eval_success_rate", "success", "evals", "--", legend="dashed: success"),
           Curve("accuracy", "flashreinforce eval", "command_evals", legend="stars: flashreinforce eval accuracy"))),
    Panel("trust-gate acceptance rate", (Curve("acceptance_rate"),), y_range=(-0.02, 1.02)),
    Panel("sequence KL, batch mean", (Curve("sequence_kl_mean"),), log_y=True),
    Panel("policy lag (mean; band: min to max)", (Curve("policy_lag_mean", band=("policy_lag_min", "policy_lag_max")),)),
    Panel("retained-token fraction (entropy filter)", (Curve("retained_token_fraction"),), y_range=(-0.02, 1.02)),
    Panel("throughput (tokens/s)", (Curve("tokens_per_s"),)),
    Panel("reward std in the batch (0: nothing learned)", (Curve("reward_std"),)),
)


def require_matplotlib():
    """Import matplotlib's Figure and Agg canvas; ``ImportError`` naming the install line when missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return Figure, FigureCanvasAgg


def moving_average(ys: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` points (fewer at the start); ``window`` <= 1: unchanged."""
    if window <= 1:
        return list(ys)
    out, total, queue = [], 0.0, []
    for y in ys:
        queue.append(y)
        total += y
        if len(queue) > window:
            total -= queue.pop(0)
        out.append(total / len(queue))
    return out


def _positive(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if y > 0 and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


#: A log axis starts one decade below this quantile of its values: an exactly on-policy batch has a
#: sequence KL of float rounding (about 1e-15), which would otherwise stretch the axis over ten empty
#: decades; such points run off the bottom of the panel.
LOG_AXIS_QUANTILE = 0.05


def log_axis_bottom(values: Sequence[float]) -> float | None:
    """The lower limit of a log axis over ``values`` (the positive, finite ones): the smallest value,
    but no lower than a tenth of their :data:`LOG_AXIS_QUANTILE` quantile; None without values."""
    ys = sorted(v for v in values if v > 0 and math.isfinite(v))
    if not ys:
        return None
    return max(ys[0], ys[int(LOG_AXIS_QUANTILE * (len(ys) - 1))] / 10.0) / 1.5


def panel_title(panel: Panel, runs: Sequence[Run]) -> str:
    """``panel``'s title with the ``legend`` of each of its curves that some run has a value for."""
    legends = [c.legend for c in panel.curves
               if c.legend and any(run.series(c.key, source=c.source)[0] for run in runs)]
    return f"{panel.title} ({', '.join(legends)})" if legends else panel.title


def plot_runs(runs: Sequence[Run], output: str | Path, *, x: str = "step", smooth: int = 1,
              size: tuple[float, float] = (15.0, 10.0), dpi: int = 100, title: str | None = None) -> Path:
    """Draw ``runs`` on the panels of :data:`PANELS` and write a PNG to ``output``.

    x: ``step`` (update number) or ``wall`` (training wall-clock seconds). smooth: moving-average
    window over updates for the update curves (raw values stay faint behind; evaluations are never
    smoothed). size: figure size in inches; with ``dpi`` the PNG is ``size * dpi`` pixels.
    """
    if not runs:
        raise ValueError("plot_runs: no runs to draw")
    if x not in ("step", "wall"):
        raise ValueError(f"x must be 'step' or 'wall', got {x!r}")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    if not (size[0] > 0 and size[1] > 0 and dpi > 0):
        raise ValueError(f"size and dpi must be positive, got {size} and {dpi}")
    Figure, FigureCanvasAgg = require_matplotlib()
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 3, sharex=True).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, panel in zip(axes, PANELS):
        drawn = False
        plotted: list[float] = []
        for run, color in zip(runs, colors):
            for curve in panel.curves:
                xs, ys = run.series(curve.key, x=x, source=curve.source)
                if curve.band is not None:
                    lo_x, lo = run.series(curve.band[0], x=x)
                    hi_x, hi = run.series(curve.band[1], x=x)
                    if lo and len(lo) == len(hi) and lo_x == hi_x:
                        ax.fill_between(lo_x, lo, hi, color=color, alpha=0.15, linewidth=0)
                if panel.log_y:
                    xs, ys = _positive(xs, ys)
                if not xs:
                    continue
                drawn = True
                plotted.extend(ys)
                if curve.source == "command_evals":
                    ax.plot(xs, ys, color=color, linestyle="none", marker="*", markersize=10)
                    continue
                if curve.source == "metrics" and smooth > 1:
                    ax.plot(xs, ys, color=color, alpha=0.2, linewidth=0.8, linestyle=curve.style)
                    ys = moving_average(ys, smooth)
                marker = "o" if curve.source == "evals" else None
                ax.plot(xs, ys, color=color, linestyle=curve.style, linewidth=1.4, marker=marker, markersize=3)
        ax.set_title(panel_title(panel, runs), fontsize=10)
        ax.grid(True, alpha=0.3)
        if panel.log_y and drawn:
            ax.set_yscale("log")
            bottom = log_axis_bottom(plotted)
            if bottom is not None:
                ax.set_ylim(bottom=bottom)
        if panel.y_range is not None:
            ax.set_ylim(*panel.y_range)
        if not drawn:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.5")
    for ax in axes[-3:]:
        ax.set_xlabel("update" if x == "step" else "training wall-clock (s)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=2) for c in colors]
    fig.legend(handles, [r.label for r in runs], loc="outside lower center", ncols=min(len(runs), 6), fontsize=9)
    if smooth > 1:
        title = f"{title + ': ' if title else ''}update curves are moving averages over {smooth} updates"
    if title:
        fig.suptitle(title)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi, format="png")
    return output
