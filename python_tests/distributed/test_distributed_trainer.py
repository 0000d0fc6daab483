"""`torchrun --nproc-per-node 2 -m flashreinforce.cli train ...` (gloo on CPU) against one process:
the same first update (loss, gradient norm, weights), for the replicate and fully_shard learners."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashreinforce.models.loading import build_model

ROOT = Path(__file__).resolve().parents[2]
LR = 1e-3  # the toy preset's

# Synchronous, one worker: the first batch is prompts 0..127 sampled with the initial weights, in
# order, whatever the learner layout, so both runs train on the very same batch.
FLAGS = ["train", "--preset", "toy", "--train.max_steps", "1", "--train.async_queue_size", "0",
         "--rollout.num_workers", "1", "--eval.eval_at_start", "false", "--eval.steps", "0", "--seed", "3",
         "--no_progress", "--ckpt.save_steps", "0", "--torch_threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    out = dict(os.environ, OMP_NUM_THREADS="1")
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p])
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(key, None)
    return out


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def result(out: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1
    return metrics[0], load_file(str(out / "hf" / "model.safetensors")), json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run([sys.executable, "-m", "flashreinforce.cli", *FLAGS, "--output", str(out)])
    return result(out)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicate", "fully_shard"])
def test_torchrun_two_ranks_make_the_one_process_update(single, strategy, tmp_path):
    out = tmp_path / strategy
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "flashreinforce.cli", *FLAGS, "--output", str(out), "--fsdp.strategy", strategy])
    (m1, w1, _), (m2, w2, cfg) = single, result(out)
    assert cfg["learner_ranks"] == 2 and cfg["learner_strategy"] == strategy
    assert m2["trajectories"] == m1["trajectories"] == 128 and m2["tokens"] == m1["tokens"]
    assert m2["reward_mean"] == m1["reward_mean"]  # the same batch
    # split over the two ranks, balanced by tokens (toy trajectories differ by a few tokens at most)
    assert m2["rank_tokens_max"] + m2["rank_tokens_min"] == m2["tokens"]
    assert m2["rank_tokens_max"] - m2["rank_tokens_min"] <= 24
    for key in ("loss", "grad_norm", "acceptance_rate", "sequence_kl_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-9), key
    assert m1["grad_norm"] > 0 and m1["lr"] == pytest.approx(LR)
    init, _ = build_model("tiny-qwen2", device=torch.device("cpu"), seed=3)  # the runs' initial weights
    init = init.state_dict()
    moved = max(float((w1[k] - init[k]).abs().max()) for k in w1)
    assert 0.5 * LR < moved < 1.5 * LR  # one AdamW step moves weights by about LR
    assert set(w1) == set(w2)
    for name in w1:
        diff = float((w1[name].double() - w2[name].double()).abs().max())
        assert diff <= 1e-2 * LR, (name, diff)  # float32 rounding, amplified by Adam's normalization


# ---------------------------------------------------------------------------- two nodes (simulated)
def torchrun_two_nodes(args: list[str], logs: Path) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 1`` as two launcher processes (one per "node") meeting
    through c10d rendezvous on localhost, as on two machines; both must succeed. Which launcher's
    process becomes rank 0 is decided by the rendezvous."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}",
           "--rdzv-conf", "join_timeout=120", "--max-restarts", "0", "-m", "flashreinforce.cli", *args]
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for node in range(2):  # files, not pipes: one launcher must never block on output while the other waits
        log = open(logs / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [p.wait(timeout=600) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    text = "\n".join(f"--- node {i}\n" + (logs / f"node{i}.log").read_text()[-4000:] for i in range(2))
    assert codes == [0, 0], text


def summary_line(logs: Path) -> dict:
    """Rank 0's summary (the last JSON line of whichever launcher ran rank 0)."""
    for i in range(2):
        lines = [ln for ln in (logs / f"node{i}.log").read_text().splitlines() if ln.startswith('{"status"')]
        if lines:
            return json.loads(lines[-1])
    raise AssertionError("no summary line from rank 0")


@pytest.mark.slow
def test_two_node_torchrun_makes_the_one_process_update(single, tmp_path):
    out = tmp_path / "two_nodes"
    torchrun_two_nodes([*FLAGS, "--output", str(out)], tmp_path / "logs")
    (m1, w1, _), (m2, w2, cfg) = single, result(out)
    assert cfg["learner_ranks"] == 2 and cfg["learner_strategy"] == "replicate"
    assert m2["reward_mean"] == m1["reward_mean"] and m2["tokens"] == m1["tokens"]
    assert m2["rank_tokens_max"] + m2["rank_tokens_min"] == m2["tokens"]
    for key in ("loss", "grad_norm", "acceptance_rate", "sequence_kl_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-9), key
    for name in w1:
        diff = float((w1[name].double() - w2[name].double()).abs().max())
        assert diff <= 1e-2 * LR, (name, diff)


@pytest.fixture(scope="module")
def single_three_steps(tmp_path_factory):
    """One process, three updates: the reference for a two-node run interrupted after two and resumed."""
    out = tmp_path_factory.mktemp("single3")
    run([sys.executable, "-m", "flashreinforce.cli", *FLAGS, "--output", str(out), "--train.max_steps", "3"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, load_file(str(out / "hf" / "model.safetensors"))


@pytest.mark.slow
def test_two_node_fully_shard_run_resumes_where_it_stopped(single_three_steps, tmp_path):
    out = tmp_path / "fsdp"
    flags = [*FLAGS, "--output", str(out), "--fsdp.strategy", "fully_shard", "--ckpt.save_steps", "1"]
    torchrun_two_nodes([*flags, "--train.max_steps", "2"], tmp_path / "logs_a")
    state = json.loads((out / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert state["optimizer_format"] == "fsdp_full"  # the sharded optimizer state, gathered in full
    torchrun_two_nodes([*flags, "--train.max_steps", "3", "--resume"], tmp_path / "logs_b")
    summary = summary_line(tmp_path / "logs_b")
    assert summary["status"] == "completed" and summary["step"] == 3
    ref_metrics, ref_weights = single_three_steps
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in got] == [1, 2, 3]  # two from the first run, one after the resume
    for ref, m in zip(ref_metrics, got):
        assert m["reward_mean"] == ref["reward_mean"] and m["tokens"] == ref["tokens"], m["step"]  # same batches
        for key in ("loss", "grad_norm"):
            assert m[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-9), (m["step"], key)
    # The weights after the resumed third update equal three uninterrupted one-process updates: the
    # checkpoint carried the weights and the AdamW moments across the restart.
    weights = load_file(str(out / "hf" / "model.safetensors"))
    assert set(weights) == set(ref_weights)
    for name in weights:
        diff = float((weights[name].double() - ref_weights[name].double()).abs().max())
        assert diff <= 3e-2 * LR, (name, diff)
