"""A pids cgroup per sandbox run, where the launcher may create one (root, or a delegated tree).

The cgroup bounds the number of tasks (processes and threads) the code can have at once,
which is the thread bound for root (exempt from RLIMIT_NPROC), and lets the launcher kill
everything the run started, wherever it moved in the process tree (a ``setsid`` child
included). The child joins the cgroup itself, first thing; the launcher creates the directory
before the start and removes it after the end.

Both hierarchies are handled: cgroup v1 with a ``pids`` controller, and cgroup v2 when
``pids`` is enabled in the launcher's own cgroup's ``cgroup.subtree_control``. Where neither
is writable (the usual case for a non-root user without a delegated cgroup), :func:`create`
returns None with the reason, and the sandbox relies on the other layers.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

__all__ = ["PidsCgroup", "pids_hierarchy"]

_counter = itertools.count()
_lock = threading.Lock()
_hierarchy: tuple[str | None, str, str] | None = None  # (directory, version, reason)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        digits = field[i + 1:i + 4]
        if field[i] == "\\" and len(digits) == 3 and digits.isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _discover() -> tuple[str | None, str, str]:
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f.read().splitlines()]
    except OSError as exc:
        return None, "", f"cannot read the cgroup membership: {exc}"
    v1_path = v2_path = None
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            v2_path = path
        elif "pids" in controllers.split(","):
            v1_path = path
    for fields in mounts:
        sep = fields.index("-")
        root, mountpoint, fstype, options = _unescape(fields[3]), _unescape(fields[4]), fields[sep + 1], fields[-1]
        own = v1_path if fstype == "cgroup" and "pids" in options.split(",") else \
            v2_path if fstype == "cgroup2" else None
        if own is None:
            continue
        relative = own[len(root):] if root != "/" and own.startswith(root) else own
        directory = os.path.join(mountpoint, relative.lstrip("/"))
        if fstype == "cgroup":
            if os.access(directory, os.W_OK):
                return directory, "v1", ""
            return None, "", f"cgroup v1 pids directory {directory} is not writable"
        try:
            with open(os.path.join(directory, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError as exc:
            return None, "", f"cgroup v2 directory {directory}: {exc}"
        if "pids" in enabled and os.access(directory, os.W_OK):
            return directory, "v2", ""
        if v1_path is None:
            return None, "", (f"cgroup v2 directory {directory} has no writable pids controller for its children "
                              "(needs a delegated cgroup)")
    return None, "", "no pids cgroup hierarchy is mounted"


def pids_hierarchy() -> tuple[str | None, str, str]:
    """``(directory, version, reason)``: where run cgroups go, or None and why not (cached)."""
    global _hierarchy
    with _lock:
        if _hierarchy is None:
            _hierarchy = _discover()
        return _hierarchy


class PidsCgroup:
    """One run's cgroup: ``path`` (pass it to the child), :meth:`kill_all`, :meth:`remove`."""

    def __init__(self, path: str, version: str) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, max_tasks: int) -> tuple["PidsCgroup | None", str]:
        """A new cgroup limited to ``max_tasks`` tasks, or ``(None, reason)``."""
        base, version, reason = pids_hierarchy()
        if base is None:
            return None, reason
        path = os.path.join(base, f"flashreinforce-sandbox-{os.getpid()}-{next(_counter)}")
        try:
            os.mkdir(path, 0o755)
        except OSError as exc:
            return None, f"cannot create {path}: {exc}"
        group = cls(path, version)
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(max_tasks))
        except OSError as exc:
            group.remove()
            return None, f"cannot set {path}/pids.max: {exc}"
        return group, ""

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def kill_all(self, timeout_s: float = 2.0) -> bool:
        """SIGKILL every process in the cgroup; True once it is empty (within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        kill_file = os.path.join(self.path, "cgroup.kill")
        while True:
            pids = self.pids()
            if not pids:
                return True
            if self.version == "v2" and os.path.exists(kill_file):
                try:
                    with open(kill_file, "w") as f:
                        f.write("1")
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def remove(self) -> None:
        """Remove the (empty) cgroup directory; a no-op if it is gone or still busy."""
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)  # killed tasks leave the cgroup once they are reaped
