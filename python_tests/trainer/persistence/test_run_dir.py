"""One run per output directory (a lock a killed run does not leave stuck), no empty run directory
left by a run that never started, and Ctrl-C: during start-up, and during the last save."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashreinforce.config import ConfigError
from flashreinforce.trainer.persistence.run_dir import LOCK_NAME, RunLock, create_output, remove_created

ROOT = Path(__file__).resolve().parents[3]
QUICK = ["--preset", "toy", "--no_progress", "--eval.steps", "0", "--eval.eval_at_start", "false",
         "--rollout.batch_size", "8", "--train.batch_size", "8"]


def _wait_for(condition, what: str, timeout: float = 900.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``condition`` until it holds (not a timed assertion: the bound only ends a hung test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (status {proc.returncode}) before {what}: "
                                 f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def _holder(tmp_path: Path) -> subprocess.Popen:
    """Another process that takes the lock of ``tmp_path`` and keeps it until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from flashreinforce.trainer.persistence.run_dir import RunLock
        lock = RunLock({str(tmp_path)!r})
        lock.acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(ConfigError) as err:
            RunLock(tmp_path).acquire()
        message = str(err.value)
        assert f"is in use by another run (process {holder.pid} on " in message and "\n" not in message
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own, the kernel drops the lock
        holder.wait()
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.held and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    again = RunLock(tmp_path)  # released: the next run takes it
    again.acquire()
    again.release()


def test_a_symlinked_lock_file_is_refused_never_written_through(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("a file the run must not touch")
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(ConfigError, match=r"lock file \.flashreinforce\.lock is a symbolic link") as err:
        RunLock(out).acquire()
    assert "\n" not in str(err.value)
    assert victim.read_text() == "a file the run must not touch"
    (out / LOCK_NAME).unlink()
    lock = RunLock(out)
    lock.acquire()  # a lock of its own: mode 0600, a regular file
    st = os.lstat(out / LOCK_NAME)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    lock.release()
    (out / LOCK_NAME).unlink()
    os.link(victim, out / LOCK_NAME)  # a hard link to another file
    with pytest.raises(ConfigError, match="is a hard link"):
        RunLock(out).acquire()
    assert victim.read_text() == "a file the run must not touch"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_an_output_folder_or_lock_file_of_another_user_is_refused(tmp_path, capsys):
    from flashreinforce.cli import main as cli_main
    from python_tests.envs.unprivileged import UNPRIVILEGED_UID

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, UNPRIVILEGED_UID, UNPRIVILEGED_UID)  # a real second account's folder
    code = cli_main(["train", *QUICK, "--train.max_steps", "1", "--output", str(theirs)])
    err = capsys.readouterr().err
    assert code == 2 and f"--output {theirs} belongs to another user" in err and "Traceback" not in err
    assert os.listdir(theirs) == []  # nothing written there
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / LOCK_NAME).write_text("")
    os.chown(mine / LOCK_NAME, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    with pytest.raises(ConfigError, match=rf"is owned by another user \(uid {UNPRIVILEGED_UID}\)"):
        RunLock(mine).acquire()
    assert (mine / LOCK_NAME).read_text() == ""


def test_only_the_folders_a_run_made_are_removed_and_only_when_empty(tmp_path):
    made = create_output(tmp_path / "a" / "b" / "run")
    assert made == [tmp_path / "a" / "b" / "run", tmp_path / "a" / "b", tmp_path / "a"]
    RunLock(made[0]).acquire()  # its file goes with the folder
    remove_created(made)
    assert sorted(os.listdir(tmp_path)) == []
    made = create_output(tmp_path / "x" / "run")
    (tmp_path / "x" / "keep.txt").write_text("someone's file")
    remove_created(made)
    assert sorted(os.listdir(tmp_path / "x")) == ["keep.txt"]


def test_a_run_refused_at_start_up_leaves_no_output_directory(tmp_path):
    out = tmp_path / "new" / "run"
    done = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", *QUICK, "--output", str(out),
                           "--env", "flashreinforce.envs.toy:NoSuchEnv"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 2 and "NoSuchEnv" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_second_run_on_the_same_output_is_refused_and_the_first_keeps_its_records(tmp_path):
    # A re-queued job: a second `--resume` while the first still runs. It is refused (exit 2, one
    # line naming the first run's process), and the first run's history stays steps 1..N.
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "flashreinforce.cli", "train", *QUICK, "--output", str(out),
                              "--train.max_steps", "100000", "--ckpt.save_steps", "3"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 4, "four updates",
                  proc=first)
        second = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", *QUICK, "--output", str(out),
                                 "--resume", "--train.max_steps", "100000"], cwd=ROOT, capture_output=True,
                                text=True, timeout=900)
        assert second.returncode == 2, second.stderr[-3000:]
        (line,) = [ln for ln in second.stderr.splitlines() if "error" in ln]
        assert f"is in use by another run (process {first.pid} on" in line and "Traceback" not in second.stderr
        assert first.poll() is None
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=900)
        assert first.returncode == 130, stderr[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))
    # The interrupted first run held the lock until it ended; a resume now runs.
    resumed = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", *QUICK, "--output", str(out),
                              "--resume", "--train.max_steps", str(len(steps) + 2)], cwd=ROOT, capture_output=True,
                             text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))


_SLOW_ENV = '''
import sys, time
from flashreinforce.envs import Environment, StepResult


class SlowToBuild(Environment):
    """Says when it is being built, then takes its time: a start-up to interrupt."""

    def __init__(self):
        print("building the environment", file=sys.stderr, flush=True)
        time.sleep(600)

    def reset(self, *, seed):
        return "x"

    def step(self, action):
        return StepResult(reward=0.0, done=True)
'''


def test_sigterm_saves_a_checkpoint_and_exits_143_and_the_run_resumes(tmp_path):
    # What a scheduler sends at the end of a job's time: answered like Ctrl-C (it used to end the
    # process at once, status 143 without a checkpoint).
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flashreinforce.cli", "train", *QUICK, "--output", str(out),
                             "--train.max_steps", "100000", "--ckpt.save_steps", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, "three updates", proc=proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "flashreinforce: interrupted (SIGTERM): the run stops when update" in stderr
    assert json.loads(stdout.strip().splitlines()[-1])["status"] == "interrupted"
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{steps[-1]:08d}"
    resumed = subprocess.run([sys.executable, "-m", "flashreinforce.cli", "train", *QUICK, "--output", str(out),
                              "--resume", "--train.max_steps", str(steps[-1] + 1)], cwd=ROOT, capture_output=True,
                             text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, steps[-1] + 2))


@pytest.mark.parametrize("sig,label,code", [(signal.SIGINT, "Ctrl-C", 130), (signal.SIGTERM, "SIGTERM", 143)])
def test_a_signal_during_start_up_is_one_line_and_leaves_nothing(tmp_path, sig, label, code):
    (tmp_path / "slow_env.py").write_text(_SLOW_ENV)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "runs" / "run"
    # Before the training loop takes over SIGINT, Python's own handler answers it; a process started
    # in the background of a shell without job control inherits SIGINT ignored and would sleep on, so
    # the child gets the default disposition back (Python then installs its handler).
    proc = subprocess.Popen([sys.executable, "-m", "flashreinforce.cli", "train", *QUICK, "--output", str(out),
                             "--env", "slow_env:SlowToBuild", "--train.max_steps", "5"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        # The environment's own line, exactly: the trainer's log line "... building the environments ..."
        # comes first, and a signal sent on it could arrive after the trainer took over SIGINT.
        _wait_for(lambda: lines.append(proc.stderr.readline()) or lines[-1].strip() == "building the environment",
                  "the environment's construction", proc=proc)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [ln for ln in stderr.splitlines() if ln.startswith("flashreinforce train:")] == [
        f"flashreinforce train: interrupted during start-up ({label}): nothing was trained or written"]
    assert not (tmp_path / "runs").exists()


_INTERRUPTED_SAVE = '''
import os, signal, sys
from flashreinforce.trainer.run import loop

presses = int(sys.argv[1])
real_save = loop.save_checkpoint

def save_with_ctrl_c(ckpt_dir, step, **kwargs):
    if step == 3:  # the last save of a 3-update run: Ctrl-C arrives while it is written
        for _ in range(presses):
            os.kill(os.getpid(), signal.SIGINT)
    return real_save(ckpt_dir, step, **kwargs)

loop.save_checkpoint = save_with_ctrl_c
from flashreinforce.cli import main
sys.exit(main(["train", *sys.argv[2:]]))
'''


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_the_last_save(tmp_path, presses):
    # One Ctrl-C while the last checkpoint is written: the save finishes (the handler stays the
    # run's until then). Two: the second aborts at once, one line, exit status 130.
    script = tmp_path / "run.py"
    script.write_text(_INTERRUPTED_SAVE)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(script), str(presses), *QUICK, "--output", str(out),
                           "--train.max_steps", "3", "--ckpt.save_steps", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    latest = out / "checkpoints" / "latest"
    if presses == 1:
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "completed"
        assert latest.read_text().strip() == "step_00000003"
    else:
        assert done.returncode == 130, done.stderr[-3000:]
        (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("flashreinforce train:")]
        assert line.startswith("flashreinforce train: aborted by a second Ctrl-C without finishing the last "
                               "checkpoint; --resume continues from the newest complete one in")
        assert not latest.exists()  # no periodic saves in this run: nothing complete to point at
