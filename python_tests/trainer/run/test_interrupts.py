"""Ctrl-C is answered at once while the main thread is inside a long C call (a learner update's
backward is one), and a third Ctrl-C exits at once; the trainer's SIGINT handling is given back."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent(r"""
    import hashlib, sys, threading, time
    from flashreinforce.trainer.run.interrupts import InterruptWatch

    stop = threading.Event()
    watch = InterruptWatch(stop.set, lambda: "ACK first Ctrl-C")
    watch.install()
    t = time.perf_counter()
    hashlib.pbkdf2_hmac("sha256", b"p", b"s", 20_000)
    per_second = 20_000 / (time.perf_counter() - t)
    rounds = int(sys.argv[1])
    print("READY", flush=True)
    for i in range(rounds):
        # one C call of about 2 s that holds no Python frame (the GIL released, as PyTorch's ops do)
        hashlib.pbkdf2_hmac("sha256", b"p", b"s", int(2.0 * per_second))
        print(f"CALL {i} DONE stop={stop.is_set()}", flush=True)
    watch.uninstall()
    print("UNINSTALLED", flush=True)
""")


def _start(rounds: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(rounds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout.readline().strip() == "READY"
    return proc


def _wait_for(fd: int, text: str, seconds: float) -> tuple[str, float]:
    """What came on ``fd`` (raw, unbuffered) until ``text`` appeared, and when; ``inf`` if it did not
    within ``seconds``."""
    got, end = b"", time.perf_counter() + seconds
    while text.encode() not in got:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.perf_counter()))
        if not ready:
            return got.decode(errors="replace"), float("inf")
        chunk = os.read(fd, 4096)
        if not chunk:
            return got.decode(errors="replace"), float("inf")
        got += chunk
    return got.decode(errors="replace"), time.perf_counter()


def test_the_first_ctrl_c_is_answered_during_a_long_c_call():
    proc = _start(rounds=1)
    try:
        time.sleep(0.5)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        err, when = _wait_for(proc.stderr.fileno(), "ACK first Ctrl-C", 10.0)
        assert when - sent < 1.0, err  # not when the 2 s call returns
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "CALL 0 DONE stop=True" in out and "UNINSTALLED" in out
    finally:
        proc.kill()


def test_a_third_ctrl_c_exits_at_once_with_status_130():
    proc = _start(rounds=5)
    try:
        time.sleep(0.5)
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        sent = time.perf_counter()
        proc.wait(timeout=10)
        assert time.perf_counter() - sent < 1.0
        assert proc.returncode == 130
        err = proc.stderr.read()
        assert "ACK first Ctrl-C" in err and "Ctrl-C again: aborting" in err and "exiting now" in err
        assert "CALL 0 DONE" not in proc.stdout.read()
    finally:
        proc.kill()


def test_the_second_ctrl_c_raises_keyboard_interrupt_once_back_in_python():
    from flashreinforce.trainer.run.interrupts import InterruptWatch

    before = signal.getsignal(signal.SIGINT)
    hits = []
    watch = InterruptWatch(lambda: hits.append(1), lambda: "first")
    watch.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        assert hits == [1]
        raised = False
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            raised = True
        assert raised and hits == [1]
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGINT) is before and signal.set_wakeup_fd(-1) == -1
