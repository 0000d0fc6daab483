"""The data-parallel learner: two gloo ranks (launched with torchrun) against one process on the same batch.

``distributed_learner_check.py`` runs every case under ``torchrun --nproc-per-node 2``; rank 0 also
runs the one-process :class:`~flashreinforce.trainer.learning.learner.Learner` (itself tested against a float64
computation of the objective (docs/semantics.md) in ``test_trainer_learner.py``) and records the differences.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flashreinforce.distributed.data_parallel import partition_by_tokens

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).with_name("distributed_learner_check.py")
LR = 1e-2  # the check's learning rate

CASES = ["flash_micro2_padded", "flash_packed_untied", "flash_scaled_step", "token_mean_filter", "ppo_groups_split", "one_trajectory",
         "fsdp_flash_micro2", "fsdp_untied_filter", "fsdp_one_trajectory", "lora_packed", "fsdp_lora"]
LORA_CASES = {"lora_packed", "fsdp_lora"}
SKIP_CASES = ["overflow_skips_everywhere", "fsdp_overflow_skips_everywhere"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("dp") / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(CHECK), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return {r["case"]: r for r in json.loads(out.read_text())}


def test_partition_by_tokens_balances_and_covers_every_index():
    lengths = [30, 5, 17, 17, 2, 40, 9, 11]
    parts = partition_by_tokens(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first bound
    assert all(p == sorted(p) for p in parts)
    assert partition_by_tokens(lengths, 3) == parts  # deterministic
    assert partition_by_tokens([4], 2) == [[0], []]
    with pytest.raises(ValueError, match="parts"):
        partition_by_tokens(lengths, 0)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_the_one_process_update(results, case):
    r = results[case]
    assert r["error"] is None and r["ref_error"] is None
    assert r["version"] == r["ref_version"] == 2
    # The summed gradient equals the one-process gradient to float32 rounding (relative to its size).
    assert not r["grad_name_mismatch"]
    assert r["grad_scale"] > 1e-4, "the case must produce a real gradient"
    # Adapter gradients are products of two float32 GEMM chains (dL/dB = s G A^T), rounded in another
    # order when the model is sharded: a looser bound for them, still float32 rounding.
    rel = 1e-5 if case in LORA_CASES else 2e-6
    assert r["grad_max_diff"] <= rel * r["grad_scale"] + 1e-9, r["grad_max_diff"] / r["grad_scale"]
    # The second update's metrics follow parameters the first Adam step moved (which amplifies float32
    # rounding, see below): with adapters that shows as a few 1e-5 relative.
    metric_rel = 5e-5 if case in LORA_CASES else 1e-5
    for key in ("loss", "grad_norm", "acceptance_rate", "policy_tokens"):
        got, want = r[key]
        assert got == pytest.approx(want, rel=metric_rel, abs=1e-8), key
    # Parameters after the step: Adam divides each gradient entry by its own magnitude, so float32
    # rounding of near-zero entries shows up amplified; still far below the step itself (~LR).
    assert not r["param_name_mismatch"]
    assert r["param_moved"] > 0.5 * LR
    if case in LORA_CASES:  # only the adapters train; every other weight is exactly as it was
        assert r["grad_names"] and all(".lora_" in n for n in r["grad_names"])
        assert r["frozen_moved"] == 0.0
    assert r["param_max_diff"] <= 1e-2 * LR
    assert r["second_step_max_diff"] <= 2e-2 * LR
    if r["strategy"] == "replicate":
        assert r["replica_max_diff"] == 0.0  # every rank holds the same parameters
    if case == "flash_scaled_step":  # the whole batch's acceptance (5 of 7) scales the step on every rank
        assert r["acceptance_rate"][1] == pytest.approx(5 / 7)
        assert r["lr"][0] == r["lr"][1] == pytest.approx(LR * 5 / 7)


@pytest.mark.slow
@pytest.mark.parametrize("case", SKIP_CASES)
def test_an_overflow_on_one_rank_skips_the_update_on_every_rank(results, case):
    r = results[case]
    assert "FloatingPointError" in r["ref_error"]
    assert "update skipped on every rank" in r["error"] and "importance ratio overflows" in r["error"]
    assert r["version"] == r["ref_version"] == 1  # the skipped update did not count; the next one ran
    assert r["param_max_diff"] == 0.0 and r["param_moved"] == 0.0  # weights untouched by the skipped update
    assert r["second_step_max_diff"] <= 2e-2 * LR


@pytest.mark.slow
def test_fully_shard_optimizer_state_round_trip_gives_the_same_next_update(results):
    r = results["fully_shard_resume"]
    assert not r["param_name_mismatch"] and r["version"] == 2
    assert r["param_max_diff"] == 0.0
