"""An engine's own processes (vLLM's EngineCore and workers): a dead one is noticed within a poll and
stops the run with one line and a checkpoint; none outlives the engine, the command's forced exit, or
a trainer killed outright; the files a killed trainer left in shared memory are removed, and only its
own. Real processes throughout (vLLM's own are in test_vllm_engine.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flashreinforce.engines import HFEngine
from flashreinforce.engines.registry import EngineKind, register_engine
from flashreinforce.engines.vllm.shared_weights import shared_memory_dir
from flashreinforce.engines.vllm.process import EngineProcesses, TRAINER_PID_VAR, proc_stat

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
RELEASE = threading.Event()


@pytest.fixture(scope="module", autouse=True)
def _release_stuck_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


def _wait_for(condition, what: str, timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds (the bound only ends a hung test; nothing is timed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def _running(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def test_a_dead_process_is_named_and_the_others_are_ended():
    outside = subprocess.Popen(SLEEPER)  # started before: not the engine's
    watched = EngineProcesses("test engine", poll_s=0.1)
    try:
        with watched.starting():
            core = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                     f"subprocess.Popen({SLEEPER!r}); time.sleep(600)"])
            _wait_for(lambda: len([p for p in os.listdir("/proc") if p.isdigit() and proc_stat(int(p))
                                   and int(proc_stat(int(p))[1]) == core.pid]) == 1, "the grandchild")
        assert core.pid in watched.procs and outside.pid not in watched.procs and len(watched.procs) == 2
        watched.watch()
        assert watched.failure is None
        core.kill()
        _wait_for(lambda: watched.failure is not None, "the failure")
        assert f"process {core.pid} ended unexpectedly" in watched.failure and "\n" not in watched.failure
        _wait_for(lambda: watched.alive() == [], "the grandchild's end")  # ended by the watcher
        assert _running(outside.pid)
    finally:
        watched.close()
        watched.terminate()
        outside.kill()
        outside.wait()
        core.wait()


def test_a_process_without_a_command_line_is_named_by_its_kernel_name():
    """A process read at the instant of its exec, or a zombie, has an empty command line; its name then
    comes from /proc/PID/comm, so a failure never reads "process process"."""
    from flashreinforce.engines.vllm.process import _command, _label

    child = subprocess.Popen(["sleep", "0"])  # not waited for until the end: a zombie once it exits
    try:
        _wait_for(lambda: (proc_stat(child.pid) or ["X"])[0] == "Z", "the zombie")
        with open(f"/proc/{child.pid}/cmdline", "rb") as fh:
            assert fh.read() == b""  # what the engine's watch read in the race
        assert _command(child.pid, tries=2, wait_s=0.0) == "sleep"
        assert _label(_command(child.pid, tries=1)) == "sleep"
    finally:
        child.wait()
    assert _command(child.pid) == "" and _label("") == ""  # no such process: nothing to name


def test_terminate_ends_what_is_left_and_a_closed_watch_reports_nothing():
    watched = EngineProcesses("test engine", poll_s=0.1)
    with watched.starting():
        proc = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        time.sleep(0.5)  # the child ignores SIGTERM from here on (a stuck process)
    watched.watch()
    watched.close()  # the engine closes: its processes end on purpose
    assert watched.terminate(grace_s=0.5) == [proc.pid]
    assert proc.wait(timeout=60) == -signal.SIGKILL
    time.sleep(0.3)
    assert watched.failure is None


def test_the_command_s_forced_exit_ends_the_engines_processes(tmp_path):
    # A rollout thread still in a call: the command leaves through os._exit, where atexit never runs.
    code = textwrap.dedent(f"""
        import subprocess, sys, threading, time
        from flashreinforce.cli import ROLLOUT_THREAD_PREFIX, exit_past_running_calls
        from flashreinforce.engines.base import at_exit
        from flashreinforce.engines.vllm.process import EngineProcesses
        watched = EngineProcesses("test engine")
        with watched.starting():
            subprocess.Popen({SLEEPER!r})
        at_exit(watched.terminate)
        print(list(watched.procs)[0], flush=True)
        threading.Thread(target=time.sleep, args=(600,), name=ROLLOUT_THREAD_PREFIX + "0", daemon=True).start()
        exit_past_running_calls(3)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    child = int(done.stdout.split()[0])
    _wait_for(lambda: not _running(child), "the engine's process to end")


@pytest.mark.parametrize("code", [0, 1])
def test_the_forced_exit_leaves_a_failing_command_s_last_line_last(code):
    # A failing command has printed why; the notice about the abandoned thread must not follow it.
    prog = textwrap.dedent(f"""
        import sys, threading, time
        from flashreinforce.cli import ROLLOUT_THREAD_PREFIX, exit_past_running_calls
        threading.Thread(target=time.sleep, args=(600,), name=ROLLOUT_THREAD_PREFIX + "0", daemon=True).start()
        print("the command's last line", file=sys.stderr)
        exit_past_running_calls({code})
    """)
    done = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == code, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    if code == 0:
        assert last == "flashreinforce: not waiting for 1 rollout thread(s) still running (rollout-worker-0); " \
                       "exiting with status 0"
    else:
        assert last == "the command's last line"


def _private_file(path: Path, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.close(fd)
    os.chmod(path, mode)
    return path


def test_a_trainer_killed_outright_takes_vllm_s_processes_and_its_shared_files_with_it(tmp_path):
    # trainer -> "EngineCore" -> "worker" (which imports the worker extension, as vLLM's does), then
    # SIGKILL for the trainer: the worker removes the trainer's files, kills EngineCore and leaves.
    shm = Path(shared_memory_dir())
    worker = ("import time, flashreinforce.engines.vllm.worker as w; "
              "assert w._TRAINER_WATCH is not None; print('watching', flush=True); time.sleep(600)")
    core = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(600)"
    trainer = textwrap.dedent(f"""
        import os, subprocess, sys, time
        os.environ[{TRAINER_PID_VAR!r}] = str(os.getpid())
        core = subprocess.Popen([sys.executable, "-c", {core!r}])
        print(os.getpid(), core.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", trainer], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    trainer_pid, core_pid = map(int, proc.stdout.readline().split())
    ours = [_private_file(shm / f"flashreinforce-weights-{trainer_pid}-{os.urandom(6).hex()}"),
            Path(os.path.join(shm, f"flashreinforce-lora-{trainer_pid}-abc"))]
    ours[1].mkdir(mode=0o700)
    (ours[1] / "adapter_config.json").write_text("{}")
    kept = [_private_file(shm / f"flashreinforce-weights-{trainer_pid + 1}-{os.urandom(6).hex()}"),  # another's
            _private_file(shm / f"flashreinforce-weights-{trainer_pid}-{os.urandom(6).hex()}", 0o644)]  # not private
    try:
        children = lambda: [int(p) for p in os.listdir("/proc") if p.isdigit() and proc_stat(int(p))  # noqa: E731
                            and int(proc_stat(int(p))[1]) == core_pid]
        assert proc.stdout.readline().strip() == "watching"  # the worker's line (it inherited the pipe)
        (worker_pid,) = children()
        assert _running(core_pid) and _running(worker_pid)
        proc.kill()
        proc.wait()
        _wait_for(lambda: not _running(core_pid) and not _running(worker_pid), "vLLM's processes to end")
        _wait_for(lambda: not any(p.exists() for p in ours), "the trainer's files to go")
        assert all(p.exists() for p in kept)
    finally:
        for pid in (core_pid,):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in kept:
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------ a run whose engine process dies
CHILDREN: list[subprocess.Popen] = []


class EngineWithAProcess(HFEngine):
    """The hf engine plus a process of its own, watched as vLLM's are; once that process is dead a
    generate call never returns (what a dead vLLM engine did)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.processes = EngineProcesses("test engine", poll_s=0.2)
        with self.processes.starting():
            CHILDREN.append(subprocess.Popen(SLEEPER))
        self.processes.watch()

    def generate(self, requests, params, **kwargs):
        if CHILDREN[-1].poll() is not None:
            RELEASE.wait(600)
        return super().generate(requests, params, **kwargs)

    def failure(self):
        return self.processes.failure

    def close(self):
        self.processes.close()
        self.processes.terminate()
        super().close()


class WithAProcessKind(EngineKind):
    name = "hf_with_a_process"
    takes_policy_copy = True

    def create(self, model, *, pad_token_id, version, options):
        return EngineWithAProcess(model, pad_token_id=pad_token_id, version=version)


def test_a_run_whose_engine_process_dies_stops_with_one_line_and_a_checkpoint(tmp_path, capsys):
    from flashreinforce.cli import main as cli_main

    register_engine(WithAProcessKind())
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"

    def kill_after_two_updates():
        _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, "two updates", 900)
        CHILDREN[-1].kill()

    killer = threading.Thread(target=kill_after_two_updates, daemon=True)
    killer.start()
    code = cli_main(["train", "--preset", "toy", "--rollout.engine", "hf_with_a_process", "--rollout.batch_size", "8",
                     "--train.batch_size", "8", "--rollout.num_workers", "1", "--ckpt.save_steps", "0", "--no_progress",
                     "--eval.steps", "0", "--eval.eval_at_start", "false", "--train.max_steps", "100000",
                     "--train.stall_timeout_s", "900", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("flashreinforce train: error:")]
    assert f"test engine's python process {CHILDREN[-1].pid} ended unexpectedly" in line
    assert "the rollout engine of worker 0 failed" in line and "--resume" in line
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert steps and latest.endswith(str(steps[-1]))  # the checkpoint holds every update recorded
