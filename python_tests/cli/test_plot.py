"""`flashreinforce plot`: a PNG of the stated size from run directories; clear errors."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.analysis import default_labels, load_run
from flashreinforce.analysis.plotting import moving_average
from flashreinforce.cli.plot import plot

ROOT = Path(__file__).resolve().parents[2]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk (raises on anything else)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, "the first chunk is not IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data[-12:-4] == b"\x00\x00\x00\x00IEND", "the file does not end with an IEND chunk"
    return width, height


def fake_run(directory: Path, *, steps: int = 30, gate: bool = True, rate: float = 0.05) -> Path:
    """A run directory with records shaped like the trainer's (reward rising at ``rate`` per update)."""
    directory.mkdir(parents=True)
    rows = []
    for s in range(1, steps + 1):
        reward = min(1.0, rate * s)
        row = {"step": s, "policy_version": s, "reward_mean": reward, "reward_std": math.sqrt(reward * (1 - reward)),
               "success_rate": reward, "failure_kinds": {"wrong_answer": int(32 * (1 - reward))},
               "no_answer_fraction": 0.5 * (1 - reward), "acceptance_rate": 1.0 - 0.1 * (s % 3 == 0),
               "policy_lag_mean": 1.5, "policy_lag_min": 1, "policy_lag_max": 2, "tokens_per_s": 1000.0 + s,
               "retained_token_fraction": 0.9, "wall_time_s": 0.5 * s}
        if gate:
            row["sequence_kl_mean"] = 1e-4 * s
        rows.append(row)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "eval_reward_mean": min(1.0, rate * s), "eval_success_rate": min(1.0, rate * s)}
             for s in range(0, steps + 1, 10)]
    (directory / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return directory


def test_plot_renders_a_png_of_the_stated_size_with_runs_overlaid(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'flashreinforce[plot]')")
    base = fake_run(tmp_path / "base")
    ablation = fake_run(tmp_path / "no_trust", gate=False, rate=0.03)  # a panel without data for one run
    out = tmp_path / "figs" / "curves.png"
    assert plot([str(base), str(ablation), "--output", str(out), "--size", "8", "6", "--dpi", "50",
                 "--smooth", "3"]) == 0
    assert png_size(out) == (400, 300)
    assert "400x300 px; 2 runs: base, no_trust" in capsys.readouterr().out
    wall = tmp_path / "wall.png"
    assert plot([str(base), "--output", str(wall), "--x", "wall", "--labels", "baseline"]) == 0
    assert png_size(wall) == (1500, 1000)  # the default 15 x 10 inches at 100 dpi


def test_plot_errors_name_the_problem(tmp_path, capsys):
    base = fake_run(tmp_path / "base")
    assert plot([str(tmp_path / "missing"), "--output", str(tmp_path / "x.png")]) == 2
    assert "missing: no such run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert plot([str(tmp_path / "empty"), "--output", str(tmp_path / "x.png")]) == 2
    assert "not a run directory (no metrics.jsonl" in capsys.readouterr().err
    assert plot([str(base), "--labels", "a", "b", "--output", str(tmp_path / "x.png")]) == 2
    assert "--labels has 2 labels for 1 runs" in capsys.readouterr().err
    assert plot([str(base), "--output", str(tmp_path / "x.pdf")]) == 2
    assert "only PNG" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_binary_or_unreadable_metrics_file_is_a_warning_or_one_line_not_a_traceback(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'flashreinforce[plot]')")
    base = fake_run(tmp_path / "base", steps=5)
    good = (base / "metrics.jsonl").read_bytes()
    (base / "metrics.jsonl").write_bytes(bytes(range(256)) * 40 + b"\n" + good + b"\xff\xfe{\n")
    assert plot([str(base), "--output", str(tmp_path / "a.png")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "UnicodeDecodeError" not in err
    assert "line(s) are not JSON records (not UTF-8 text, or cut) and were skipped" in err
    assert len(load_run(base).metrics) == 5
    (base / "metrics.jsonl").write_bytes(bytes(range(256)) * 40)  # nothing but binary
    assert plot([str(base), "--output", str(tmp_path / "b.png")]) == 0
    assert "metrics.jsonl has no update yet" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_install_line(tmp_path):
    base = fake_run(tmp_path / "base")
    # A fresh interpreter in which importing matplotlib fails, as on a default install.
    code = ("import sys, importlib.util\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'matplotlib' else real(name, *a)\n"
            "sys.modules['matplotlib'] = None\n"
            "from flashreinforce.cli import main\n"
            f"sys.exit(main(['plot', {str(base)!r}, '--output', {str(tmp_path / 'x.png')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'flashreinforce[plot]'" in proc.stderr and "Traceback" not in proc.stderr


def test_load_run_series_and_labels(tmp_path):
    run = load_run(fake_run(tmp_path / "a" / "seed0", steps=5))
    assert run.label == "seed0" and len(run.metrics) == 5 and run.evals[0]["step"] == 0
    xs, ys = run.series("reward_mean")
    assert xs == [1.0, 2.0, 3.0, 4.0, 5.0] and ys == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25])
    xs, ys = run.series("eval_reward_mean", x="wall", source="evals")
    assert xs == [0.0] and ys == [0.0]  # the evaluation at update 0; later ones have no update in 5 steps
    assert run.has("sequence_kl_mean") and not run.has("clip_fraction")
    fake_run(tmp_path / "b" / "seed0", steps=2)
    assert default_labels([tmp_path / "a" / "seed0", tmp_path / "b" / "seed0"]) == ["a/seed0", "b/seed0"]
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_plot_reads_a_real_toy_run(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'flashreinforce[plot]')")
    out = tmp_path / "toy"
    proc = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--output", str(out),
                           "--rollout.batch_size", "16", "--train.batch_size", "16", "--train.max_steps", "6",
                           "--eval.steps", "3", "--eval.eval_at_start", "false", "--ckpt.save_steps", "0",
                           "--no_progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = tmp_path / "toy.png"
    assert plot([str(out), "--output", str(png), "--dpi", "40"]) == 0
    assert png_size(png) == (600, 400)
    run = load_run(out)
    assert len(run.metrics) == 6 and [e["step"] for e in run.evals] == [3, 6] and run.samples == []
    assert run.summary["status"] == "completed"


def test_plot_writes_next_to_the_run_by_default(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'flashreinforce[plot]')")
    run = fake_run(tmp_path / "runs" / "a")
    assert plot([str(run), "--dpi", "20"]) == 0
    assert png_size(run / "curves.png") == (300, 200)
    assert f"wrote {run / 'curves.png'}" in capsys.readouterr().out
    other = fake_run(tmp_path / "runs" / "b")
    assert plot([str(run), str(other), "--dpi", "20"]) == 0
    assert (tmp_path / "runs" / "curves.png").is_file()  # several runs: their common parent


def test_panel_titles_name_only_the_lines_drawn_and_flashreinforce_eval_results_are_read():
    from flashreinforce.analysis.plotting import PANELS, panel_title

    from flashreinforce.analysis.runs import Run

    success, held_out = PANELS[1], PANELS[2]
    bare = Run(path=Path("."), label="x", metrics=[{"step": 1, "success_rate": 0.5}], evals=[])
    assert panel_title(success, [bare]) == "success rate"  # no dotted line is drawn, none is named
    full = Run(path=Path("."), label="y", metrics=[{"step": 1, "success_rate": 0.5, "no_answer_fraction": 0.1}],
               evals=[{"step": 1, "eval_reward_mean": 0.4, "eval_success_rate": 0.4}],
               command_evals=[{"step": 1, "accuracy": 0.5}])
    assert panel_title(success, [bare, full]) == "success rate (dotted: no gradable answer)"
    assert panel_title(held_out, [full]) == ("held-out eval (solid: reward, dashed: success, stars: flashreinforce "
                                             "eval accuracy)")
    assert full.series("accuracy", source="command_evals") == ([1.0], [0.5])


def test_the_log_axis_of_the_sequence_kl_ignores_an_on_policy_rounding_point():
    from flashreinforce.analysis.plotting import log_axis_bottom

    kl = [1e-15] + [1e-4 * s for s in range(1, 30)]
    assert 1e-6 < log_axis_bottom(kl) < 1e-4  # not down at 1e-15: the first update's rounding runs off the axis
    assert log_axis_bottom([2e-3, 3e-3, 4e-3]) == pytest.approx(2e-3 / 1.5)
    assert log_axis_bottom([]) is None
