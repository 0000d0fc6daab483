"""``OUTPUT/summary.json``: what a run was and where its results are, in one short file.

Written when a run completes and after Ctrl-C (status ``completed`` / ``interrupted``): the status,
the configuration hash (same flags, preset, environment arguments, tokenizer and seed give the same
hash), the versions of the package, PyTorch, transformers and Python and the source's git commit
(when the package runs from a git checkout), steps done and planned, training time and wall-clock,
the training reward at the start and the end, the evaluation before training (``start_eval``, update 0),
the final and the best evaluation (from ``eval.jsonl``) and the change between the first two
(``eval_change``), the warnings of the run (``warnings``: tools offered and never called,
:mod:`.diagnostics`), and where the checkpoints and the exported model are.

``--resume`` continues the file: the earlier sessions stay in ``sessions`` (one entry each: start,
end, status, steps, config hash), the current one is added, and the top-level fields describe the
run as it now stands.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

from flashreinforce.analysis.runs import read_jsonl
from flashreinforce.trainer.reporting.diagnostics import tool_use_warnings, trust_gate_warnings

__all__ = ["SUMMARY_FILE", "config_hash", "software_versions", "write_run_summary"]

SUMMARY_FILE = "summary.json"

#: TrainerConfig.to_json() keys that define what a run computes (not where or how fast it goes).
_HASHED = ("flags", "preset", "env_kwargs", "tokenizer", "seed")
#: Flags that only move outputs or change reporting.
_NOT_HASHED_FLAG_PREFIXES = ("logger.", "ckpt.path", "ckpt.output_dir", "ckpt.save_steps", "ckpt.max_ckpt_num")


def config_hash(config: Mapping[str, Any]) -> str:
    """First 16 hex digits of the SHA-256 of the run-defining part of ``config`` (a
    ``TrainerConfig.to_json()`` dict): flags (not output paths, checkpoint cadence or logging),
    preset, environment arguments, tokenizer, seed."""
    defining = {k: config.get(k) for k in _HASHED}
    flags = defining.get("flags")
    if isinstance(flags, Mapping):
        defining["flags"] = {k: v for k, v in flags.items() if not k.startswith(_NOT_HASHED_FLAG_PREFIXES)}
    text = json.dumps(defining, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _git_commit(source: Path) -> dict[str, Any] | None:
    """The commit (and whether tracked files differ from it) of the git checkout holding ``source``."""
    try:
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):  # no git, or too slow: the summary goes on without it
        return None


def software_versions() -> dict[str, Any]:
    """Versions of flashreinforce, torch, transformers and Python; ``git`` when run from a checkout."""
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in ("flashreinforce", "torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["git"] = _git_commit(Path(__file__).resolve().parent)
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _eval_entry(e: dict[str, Any]) -> dict[str, Any]:
    """One evaluation as the summary shows it: step, reward, success rate, episodes; with the sampling
    (``eval_temperature``, 0 = greedy) and what the environment reported per episode when recorded."""
    keys = ("step", "eval_reward_mean", "eval_success_rate", "eval_trajectories")
    out = {k: e.get(k) for k in keys}
    out.update({k: v for k, v in e.items()
                if k in ("eval_temperature", "eval_samples_per_prompt") or k.startswith("eval_env/")})
    return out


def _eval_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    scored = [e for e in evals if _finite(e.get("eval_reward_mean"))]
    if not scored:
        return {"start_eval": None, "final_eval": None, "best_eval": None, "eval_change": None}
    best = max(scored, key=lambda e: (e["eval_reward_mean"], -e.get("step", 0)))  # the earliest of equal bests
    start = next((e for e in scored if e.get("step") == 0), None)
    final = scored[-1]
    change = None
    if start is not None and final is not start:
        change = {k: final[k] - start[k] for k in ("eval_reward_mean", "eval_success_rate")
                  if _finite(final.get(k)) and _finite(start.get(k))}
        change["steps"] = [0, final.get("step")]
    return {"start_eval": None if start is None else _eval_entry(start), "final_eval": _eval_entry(final),
            "best_eval": _eval_entry(best), "eval_change": change}


def _train_reward(metrics: list[dict[str, Any]], k: int = 10) -> dict[str, Any]:
    rewards = [m["reward_mean"] for m in metrics if _finite(m.get("reward_mean"))]
    if not rewards:
        return {"reward_first": None, "reward_last": None}
    k = max(1, min(k, len(rewards) // 4 or 1))
    return {"reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k, "reward_window": k}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def write_run_summary(out: str | Path, *, config: Mapping[str, Any], status: str, step: int, max_steps: int,
                      policy_version: int, training_wall_s: float, session_started: float, resumed: bool,
                      checkpoints_dir: str | Path, checkpoint: str | Path | None, export_dir: str | Path | None,
                      extra: Mapping[str, Any] | None = None, train_time_s: float | None = None,
                      warn_no_tool_calls_steps: int = 0, warn_gate_drop_steps: int = 0,
                      scale_step_by_acceptance: bool = False) -> Path:
    """Write ``OUT/summary.json`` (see the module docstring); returns its path.

    ``config``: ``TrainerConfig.to_json()``. ``training_wall_s``: wall-clock seconds of the update
    loops over every session (evaluations and checkpoint saves inside them included);
    ``train_time_s``: the same without them (the clock of ``train.max_minutes``). ``session_started``:
    this session's start (``time.time()``). ``resumed``: keep the earlier sessions of an existing
    summary. ``checkpoint``: the newest checkpoint written; ``export_dir``: the exported model (None
    when the run was not exported). ``extra``: more top-level fields. ``warn_no_tool_calls_steps``:
    ``logger.warn_no_tool_calls_steps`` (:func:`~.diagnostics.tool_use_warnings` over ``metrics.jsonl``);
    ``warn_gate_drop_steps`` and ``scale_step_by_acceptance``: ``logger.warn_gate_drop_steps`` and
    ``actor.scale_step_by_acceptance`` (:func:`~.diagnostics.trust_gate_warnings` over ``metrics.jsonl``).
    """
    out = Path(out)
    path = out / SUMMARY_FILE
    sessions: list[dict[str, Any]] = []
    if resumed and path.is_file():
        try:
            previous = json.loads(path.read_text())
            sessions = [s for s in previous.get("sessions", []) if isinstance(s, dict)]
        except (ValueError, AttributeError):
            sessions = []  # an unreadable summary is replaced, not fatal
    now = time.time()
    chash = config_hash(config)
    sessions.append({"started": _iso(session_started), "ended": _iso(now), "status": status, "last_step": step,
                     "session_s": round(now - session_started, 3), "config_hash": chash})
    metrics = read_jsonl(out / "metrics.jsonl")
    evals = read_jsonl(out / "eval.jsonl")
    summary: dict[str, Any] = {
        "status": status,
        "step": step,
        "max_steps": max_steps,
        "policy_version": policy_version,
        "config_hash": chash,
        "config_changed_on_resume": len({s.get("config_hash") for s in sessions}) > 1,
        "versions": software_versions(),
        "training_wall_s": round(float(training_wall_s), 3),
        "train_time_s": None if train_time_s is None else round(float(train_time_s), 3),
        "eval_time_s": round(sum(float(e["eval_time_s"]) for e in evals if _finite(e.get("eval_time_s"))), 3),
        "sessions_wall_s": round(sum(float(s.get("session_s", 0.0)) for s in sessions), 3),
        **_train_reward(metrics),
        **_eval_summary(evals),
        "warnings": tool_use_warnings(metrics, warn_no_tool_calls_steps) + trust_gate_warnings(
            metrics, warn_gate_drop_steps, scaled=scale_step_by_acceptance),
        "checkpoints_dir": str(checkpoints_dir),
        "latest_checkpoint": None if checkpoint is None else str(checkpoint),
        "exported_model": None if export_dir is None else str(export_dir),
        "files": sorted(p.name for p in out.iterdir() if p.is_file() and p.name != SUMMARY_FILE),
        "sessions": sessions,
    }
    summary.update(extra or {})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(path)  # never a half-written summary
    return path
