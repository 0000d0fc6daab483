"""Split the five-seed slow-tools runs' updates into those without and with a backward.

    python docs/data/rollout_targets/2026-12-07_amd_zen4/probes_night/per_update_split.py
"""
import json
from pathlib import Path

RUNS = Path(__file__).resolve().parent.parent / "tool_async_long"
for schedule in ("sync_threads2", "stream2_steady_threads2"):
    without, with_backward, after = [], [], []
    for seed in range(5):
        updates = json.loads((RUNS / f"seed{seed}" / f"{schedule}.json").read_text())["per_update"][1:]
        for i, u in enumerate(updates):
            row = (u["step_time_s"], u["cpu_time_s"], u["cpu_time_s"] / (2 * u["step_time_s"]))
            (without if u["backward_skipped"] else with_backward).append(row)
            if i and not updates[i - 1]["backward_skipped"]:
                after.append(row)

    def mean(rows, k):
        return sum(r[k] for r in rows) / len(rows)

    print(f"{schedule}: without a backward n={len(without)} {mean(without, 0):.2f} s, {mean(without, 1):.2f} CPU s, "
          f"busy {mean(without, 2):.2f} | with a backward n={len(with_backward)} {mean(with_backward, 0):.2f} s, "
          f"{mean(with_backward, 1):.2f} CPU s, busy {mean(with_backward, 2):.2f} | the update after a backward "
          f"{mean(after, 0):.2f} s, {mean(after, 1):.2f} CPU s")
