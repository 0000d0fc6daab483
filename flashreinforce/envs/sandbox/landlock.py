"""Landlock for the sandboxed child: file reads and writes, TCP and signals confined by the kernel.

Standard library only (the child loads this file by path). Landlock (Linux >= 5.13, an LSM
that must be enabled at boot) lets an unprivileged process restrict itself; the restriction
holds for everything it runs afterwards, native code included, and cannot be lifted.

:func:`restrict` makes the calling process's domain:

- every file-system right handled (execute, read, write, truncate, remove, make, rename across
  directories), so what is not granted below is denied;
- beneath ``workdir``: read, write, truncate, remove, make directories, regular files and
  symlinks, rename within it; never execute, never device nodes, FIFOs or sockets;
- beneath each read root (the interpreter, ``sys.path``, system libraries, a few ``/etc``
  files): read only; ``/dev/null``: read and write;
- with ABI >= 4 and ``allow_network`` False: TCP bind and connect denied;
- with ABI >= 6: signals to, and abstract UNIX sockets of, processes outside the domain denied.

A Landlock domain also keeps the process from ptrace-ing (or reading ``/proc/<pid>/mem`` and
``environ`` of) processes outside it, for a caller without ``CAP_SYS_PTRACE``.
"""

from __future__ import annotations

import ctypes
import os
import stat

__all__ = ["abi_version", "restrict"]

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # the rights a non-directory rule may hold
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def abi_version() -> int:
    """The kernel's Landlock ABI version (>= 1), or raises OSError saying why there is none."""
    libc = _libc()
    abi = libc.syscall(ctypes.c_long(_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi < 1:
        err = ctypes.get_errno()
        raise OSError(err, f"Landlock unavailable: {os.strerror(err)}")
    return int(abi)


def restrict(workdir: str, read_roots: list[str], *, allow_network: bool) -> tuple[int, list[str], list[str]]:
    """Restrict the calling process as described in the module docstring.

    read_roots: paths (directories or files) that stay readable; missing ones are skipped.
    Returns ``(abi, guards, skipped)``: the ABI version, the guard names now in force
    (``landlock_fs``, and ``landlock_net``/``landlock_signal`` where the ABI has them) and the
    read roots that could not be added. Raises OSError if Landlock is unavailable or a step fails.
    """
    abi = abi_version()
    handled = EXECUTE | WRITE_FILE | READ_FILE | READ_DIR | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR \
        | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_BLOCK | MAKE_SYM
    if abi >= 2:
        handled |= REFER
    if abi >= 3:
        handled |= TRUNCATE
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 and not allow_network else 0
    scoped = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL if abi >= 6 else 0
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the struct grew with the ABI
    libc = _libc()
    attr = _RulesetAttr(handled, net, scoped)
    ruleset = libc.syscall(ctypes.c_long(_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset failed: {os.strerror(err)}")
    skipped = []
    try:
        work_rights = (READ_FILE | READ_DIR | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR
                       | MAKE_REG | MAKE_SYM) & handled | (REFER | TRUNCATE) & handled
        read_rights = READ_FILE | READ_DIR
        rules = [(workdir, work_rights, True), ("/dev/null", (READ_FILE | WRITE_FILE | TRUNCATE) & handled, True)]
        rules += [(path, read_rights, False) for path in read_roots]
        for path, rights, required in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                if required:
                    raise
                skipped.append(path)
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    rights &= _FILE_RIGHTS
                rule = _PathBeneath(rights, fd)
                if libc.syscall(ctypes.c_long(_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    err = ctypes.get_errno()
                    if required:
                        raise OSError(err, f"landlock_add_rule failed for {path}: {os.strerror(err)}")
                    skipped.append(path)
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, required by restrict_self
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(err)}")
        if libc.syscall(ctypes.c_long(_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self failed: {os.strerror(err)}")
    finally:
        os.close(ruleset)
    guards = ["landlock_fs"] + (["landlock_net"] if net else []) + (["landlock_signal"] if scoped else [])
    return abi, guards, skipped
