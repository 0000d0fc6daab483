"""The sandbox's audit hook: friendly error messages, not a security boundary.

Standard library only (the child loads this file by path). A PEP 578 audit hook sees what
Python code asks for and can refuse it with a message that says why ("sandbox: starting
processes is not allowed") before the kernel layers would refuse it with a bare errno. Code
in the same interpreter can switch a Python hook off (by replacing the objects it relies on,
finding its closure through ``gc``, or reaching its frame through a traceback), and native
code never passes through it: every refusal below is also enforced by seccomp, Landlock or
the mount tree, which is what the tests check with the hook bypassed or turned off.
"""

from __future__ import annotations

import os
import stat
import sys

__all__ = ["install"]

_PROCESS_EVENTS = frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                             "subprocess.Popen", "pty.spawn", "os.startfile"})
# event -> index of its dir_fd argument (None: no dir_fd), for single-path mutations.
_PATH_EVENTS = {"os.remove": -1, "os.rmdir": -1, "os.mkdir": -1, "os.chmod": -1, "os.chown": -1,
                "os.utime": -1, "os.mkfifo": -1, "os.mknod": -1, "os.truncate": None,
                "os.chflags": None, "os.lchflags": None, "os.setxattr": None, "os.removexattr": None}
_CTYPES_EVENTS = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata",
                            "ctypes.cdata/buffer"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install(root: str, allow_network: bool) -> None:
    """Install the hook for the working directory ``root``."""
    realpath, join, isabs, dirname = os.path.realpath, os.path.join, os.path.isabs, os.path.dirname
    fsdecode, fspath, is_int = os.fsdecode, os.fspath, int.__instancecheck__
    root = realpath(root)
    devices = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})
    own_pid = os.getpid()

    def resolve(path, dir_fd=None):
        if is_int(path):
            return realpath(f"/proc/self/fd/{path}")
        path = fsdecode(fspath(path))
        if is_int(dir_fd) and dir_fd >= 0 and not isabs(path):
            path = join(realpath(f"/proc/self/fd/{dir_fd}"), path)
        return realpath(path)

    def inside(path, dir_fd=None):
        resolved = resolve(path, dir_fd)
        return resolved == root or resolved.startswith(root + os.sep) or resolved in devices

    def refuse(message):
        raise PermissionError("sandbox: " + message)

    def require_inside(event, path, dir_fd=None):
        if path is not None and not inside(path, dir_fd):
            refuse(f"{event} outside the working directory is not allowed: {path!r}")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if is_int(path) or inside(path):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & _WRITE_FLAGS)
            if writing:
                refuse(f"writing outside the working directory is not allowed: {path!r}")
            try:
                is_dir = stat.S_ISDIR(os.stat(path).st_mode)
            except OSError:
                return
            if is_dir:  # a directory fd outside would let dir_fd-relative opens escape
                refuse(f"opening a directory outside the working directory is not allowed: {path!r}")
        elif event in _PATH_EVENTS:
            where = _PATH_EVENTS[event]
            require_inside(event, args[0], args[where] if where is not None else None)
        elif event == "os.symlink":
            require_inside(event, args[1], args[2])
            target = args[0]
            if not is_int(target) and not isabs(fsdecode(fspath(target))):
                target = join(dirname(resolve(args[1], args[2])), fsdecode(fspath(target)))
            require_inside(event, target)
        elif event in ("os.rename", "os.link"):
            require_inside(event, args[0], args[2])
            require_inside(event, args[1], args[3])
        elif event == "sqlite3.connect":
            if args[0] not in (":memory:", "", b":memory:", b"") and not inside(args[0]):
                refuse(f"sqlite3.connect outside the working directory is not allowed: {args[0]!r}")
        elif event in _PROCESS_EVENTS:
            refuse(f"starting processes is not allowed ({event})")
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in (0, own_pid):
                refuse(f"signalling other processes is not allowed ({event})")
        elif event == "socket.__new__" and not allow_network:
            refuse("network access is not allowed")
        elif event in _CTYPES_EVENTS:
            refuse(f"ctypes library loading and raw memory access are not allowed ({event})")

    sys.addaudithook(hook)
