"""The processes vLLM starts for one engine: recorded, watched, and ended with the engine or the trainer.

``vllm.LLM(...)`` starts vLLM's EngineCore process and, with its multiprocessing executor, worker
processes under it. :class:`EngineProcesses` records the processes that appeared during that call
(this process's descendants; engines start one at a time under a lock, so that two never claim each
other's) and watches them from a thread:

* one of them ends while the engine is open (killed, out of memory, a crash of vLLM's): within
  ``poll_s`` seconds :attr:`EngineProcesses.failure` says which one, the others are ended (a
  ``generate`` call waiting on them would otherwise wait for ever), and the trainer, which asks every
  engine for its failure while it waits for rollouts, stops the run with that line and a checkpoint;
* the engine closes, the interpreter exits, or the command leaves past a rollout thread still in a
  call (:func:`flashreinforce.engines.base.run_exit_hooks`): what is left of them is ended (SIGTERM,
  then SIGKILL).

A trainer killed outright (SIGKILL) runs none of that. For that case vLLM's processes are told the
trainer's process id (``FLASHREINFORCE_TRAINER_PID``, set while they start) and the worker extension
(:mod:`flashreinforce.engines.vllm.worker`) watches it: once the trainer is gone it removes the
trainer's files from shared memory and the temporary directory (:func:`remove_files_of`) and ends
EngineCore and itself.

Processes are read from ``/proc`` (Linux, where vLLM runs), each known by its id and start time, so
that a later process given a dead one's id is never taken for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from typing import Iterator, Mapping

__all__ = ["EngineProcesses", "TRAINER_PID_VAR", "environment", "owned_private_entry", "proc_stat", "remove_files_of"]

log = logging.getLogger(__name__)

#: vLLM's processes read the trainer's process id from this variable (set while ``vllm.LLM`` starts).
TRAINER_PID_VAR = "FLASHREINFORCE_TRAINER_PID"

#: The names of the trainer's files in shared memory and the temporary directory start with this,
#: then the trainer's process id and a dash.
FILE_PREFIX = "flashreinforce-"

_START_LOCK = threading.Lock()
# Processes that are not an engine's even when they appear while one starts (multiprocessing's helpers).
_NOT_ENGINE = ("resource_tracker", "semaphore_tracker", "forkserver")


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block (what vLLM's processes start with), restored after it."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (``[0]`` the state, ``[1]`` the parent's
    id, ``[19]`` the start time), or ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _descendants() -> dict[int, str]:
    """This process's descendants: ``{pid: start time}`` (the start time tells a process from a later
    one given the same id)."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for name in os.listdir("/proc"):
        fields = proc_stat(int(name)) if name.isdigit() else None
        if fields is not None and len(fields) > 19:
            parents.setdefault(int(fields[1]), []).append(int(name))
            starts[int(name)] = fields[19]
    out, todo = {}, [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in out:
                out[child] = starts[child]
                todo.append(child)
    return out


def _command(pid: int, tries: int = 5, wait_s: float = 0.01) -> str:
    """The command line of ``pid``, or ``""`` when there is no such process. A process caught while it
    replaces its program (the instant of its ``exec``), or a zombie, reads as an empty command line: it is
    read again ``tries`` times ``wait_s`` apart, then the kernel's short name (``/proc/PID/comm``) stands in."""
    for attempt in range(tries):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return ""
        if command:
            return command
        if attempt + 1 < tries:
            time.sleep(wait_s)
    try:
        with open(f"/proc/{pid}/comm", "rb") as fh:
            return fh.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int, started: str) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[19] == started and fields[0] not in ("Z", "X")


def _label(command: str) -> str:
    """The name of one of vLLM's processes as its title gives it (``VLLM::EngineCore_DP0`` -> EngineCore_DP0)."""
    head = command.split()[0] if command.split() else ""
    return head.split("::", 1)[1] if "::" in head else os.path.basename(head)[:40]


class EngineProcesses:
    """The processes of one engine (see the module docstring). ``what`` names the engine in messages."""

    def __init__(self, what: str = "vLLM", poll_s: float = 0.5) -> None:
        self.what, self.poll_s = what, float(poll_s)
        self.procs: dict[int, str] = {}  # pid -> start time
        self.labels: dict[int, str] = {}
        #: Why the engine cannot serve any more (one of its processes ended), or ``None``.
        self.failure: str | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Record the processes started inside the block (one engine starts at a time)."""
        with _START_LOCK:
            before = set(_descendants())
            try:
                yield
            finally:
                for pid, started in _descendants().items():
                    if pid in before:  # only new processes are read (a command line may take retries)
                        continue
                    command = _command(pid)
                    if not any(name in command for name in _NOT_ENGINE):
                        self.procs[pid], self.labels[pid] = started, _label(command)

    def watch(self) -> None:
        """Start the watching thread (once)."""
        if self._thread is None and self.procs:
            self._thread = threading.Thread(target=self._watch, name=f"{self.what}-process-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            gone = [pid for pid, started in self.procs.items() if not _alive(pid, started)]
            if gone and not self._closed.is_set():
                pid = gone[0]
                label = f"{self.labels[pid]} " if self.labels[pid] else ""
                self.failure = (f"{self.what}'s {label}process {pid} ended unexpectedly (killed, out of "
                                "memory, or a crash of its own); its other processes were ended too")
                log.error("%s", self.failure)
                self.terminate()
                return

    def close(self) -> None:
        """Stop watching (the engine is closing: its processes end on purpose now)."""
        self._closed.set()

    def alive(self) -> list[int]:
        """The recorded processes still running."""
        return [pid for pid, started in self.procs.items() if _alive(pid, started)]

    def terminate(self, grace_s: float = 5.0) -> list[int]:
        """End the recorded processes still running (SIGTERM, then SIGKILL after ``grace_s``); returns
        their ids."""
        left = self.alive()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in left:
                if _alive(pid, self.procs[pid]):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self.alive():
                break
        return left


def owned_private_entry(path: str) -> bool:
    """Whether ``path`` is a file or directory (not a link) of this user that no other user may read."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
    return kind and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def remove_files_of(trainer_pid: int) -> list[str]:
    """Remove what the trainer with process id ``trainer_pid`` left in shared memory and the temporary
    directory (its weight buffers, adapter folders and model folders: ``flashreinforce-*-PID-*``),
    each only when it is this user's private file or folder; returns what was removed."""
    from flashreinforce.engines.vllm.shared_weights import shared_memory_dir

    removed = []
    for folder in {shared_memory_dir(), tempfile.gettempdir()}:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            parts = name.split("-")  # flashreinforce-KIND-PID-RANDOM
            if not (name.startswith(FILE_PREFIX) and len(parts) >= 4 and parts[2] == str(int(trainer_pid))
                    and owned_private_entry(path)):
                continue
            try:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed
