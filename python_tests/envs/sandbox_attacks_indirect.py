"""Sandbox attacks that reach their target indirectly, through the kernel rather than a direct call.

- Signals the kernel sends on the code's behalf: a file description's owner (``F_SETOWN``,
  ``F_SETOWN_EX``, ``FIOSETOWN``, ``SIOCSPGRP``) receives a signal (``F_SETSIG``, SIGIO by
  default) whenever the description becomes readable or writable with ``O_ASYNC`` on (set by
  ``F_SETFL`` or ``FIOASYNC``). No ``kill`` is ever made, so only the refusal of those
  requests, or Landlock's signal scoping (ABI 6), stops it. The code's own stdout pipe fires
  each time the launcher reads it; a socket pair fires when the code writes to its other end.
  Aimed at the sandbox's parent (the runner, which counts SIGUSR1, SIGUSR2 and SIGIO and runs
  in a session of its own, so nothing above it can be reached), at the parent's process
  group, and at a decoy's process and process group with SIGKILL. Leases, directory
  notifications and pipe resizing (signal and kernel-memory sources) must be refused too.
- Memory outside the address-space limit: ``memfd_create`` and ``memfd_secret`` files,
  POSIX and SysV shared memory, shared anonymous and ``/dev/zero`` mappings, socket buffers
  grown with ``SO_SNDBUF`` (in 40 socket pairs), and files in the
  working directory that are unlinked while something still holds them (a descriptor, a
  mapping, a descriptor in flight in a socket pair): without the mount tree's tmpfs quota,
  those are invisible to a walk of the directory.
- The source checkout that an editable install puts on the interpreter's ``sys.path``.

The checks are those of ``sandbox_attack_kit.py``: nothing escaped, the parent received no
signal, the decoy is alive, the amounts held stay within the limits.
"""

from __future__ import annotations

import os
import textwrap

from python_tests.envs.sandbox_attack_kit import (CTYPES, GC_BYPASS, HELPERS, Attack, check_decoy, check_denied,
                                                  check_host_files, check_parent, counted, decoy, host_files,
                                                  limit_check, syscall_nr)
from python_tests.envs.unprivileged import REPO

__all__ = ["indirect_attacks"]

# fcntl and ioctl requests (the same numbers on x86_64 and aarch64).
FCNTL = '''
import fcntl, signal, struct, time
F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE, F_NOTIFY, F_SETPIPE_SZ = 8, 10, 15, 1024, 1026, 1031
F_OWNER_PID, F_OWNER_PGRP = 1, 2
FIOASYNC, FIOSETOWN, SIOCSPGRP = 0x5452, 0x8901, 0x8902
def _async_on(fd):
    return fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
'''

# Fill 8 MiB files in the working directory one after the other, each hidden by ``hide(fd,
# name)`` once written, pausing between files so that a measurement every 0.25 s can see them.
HIDDEN_FILES = '''
import time
held = 0
def fill():
    global held
    block = b"x" * (1 << 20)
    for i in range(24):
        fd = os.open(f"h{{i}}", os.O_RDWR | os.O_CREAT, 0o600)
        for _ in range(8):
            os.write(fd, block)
        hide(fd, f"h{{i}}")
        held += 8
        print(f"HELD:{{held}}", flush=True)
        time.sleep(0.3)
    return f"{{held}} MiB"
_attempt("hide", fill)
print(f"HELD:{{held}}", flush=True)
'''
# disk_mb=32: the tree's quota stops the fifth file; the launcher's measurement (without the
# tree) may lag a few files behind under load.
_HIDDEN_OPTIONS = {"disk_mb": 32, "file_size_mb": 8, "timeout_s": 30}
_HIDDEN_CHECK = limit_check(lambda r: 0 <= counted("HELD:", r) <= 64 and (
    "BLOCKED:hide" in r["stdout"] or "disk_mb=32" in r["stderr"]), "disk quota for unlinked files")


def _checkout(base: str, uid: int) -> dict:
    """The checkout this suite runs from, and files in it the sandbox's user could read."""
    ctx = host_files(base, uid)
    files = [os.path.join(REPO, name) for name in ("pyproject.toml", ".git/config", ".git/HEAD")]
    ctx.update(checkout=REPO, checkout_files=[f for f in files if os.path.isfile(f)],
               checkout_names=[n for n in ("pyproject.toml", ".git", "flashreinforce", "README.md")
                               if os.path.exists(os.path.join(REPO, n))])
    return ctx


def _no_shm_file(ctx: dict, result: dict, runner: dict) -> str | None:
    path = f"/dev/shm/flashreinforce-attack-{ctx['token']}"
    if os.path.exists(path):
        os.unlink(path)
        return "a POSIX shared memory object was created in /dev/shm"
    return limit_check(lambda r: all(0 <= counted(k, r) <= 128 for k in ("SHARED:", "ZERO:")),
                       "memory limit for shared mappings")(ctx, result, runner)


def indirect_attacks() -> list[Attack]:
    bypass = HELPERS + GC_BYPASS + CTYPES
    return [
        # --- signals sent by the kernel to a file description's owner ---
        Attack("fasync-stdout-signals-parent", "parent", '''
            dup = os.dup(1)
            _attempt("F_SETOWN-parent", lambda: fcntl.fcntl(1, F_SETOWN, os.getppid()))
            _attempt("F_SETOWN-parent-dup", lambda: fcntl.fcntl(dup, F_SETOWN, os.getppid()))
            _attempt("F_SETSIG", lambda: fcntl.fcntl(1, F_SETSIG, signal.SIGUSR1))
            _attempt("O_ASYNC", lambda: _async_on(1))
            for i in range(20):  # each read of the pipe by the launcher signals the owner
                print("output", i, flush=True)
                time.sleep(0.05)
        ''', host_files, check_parent, prefix=HELPERS + FCNTL),
        Attack("fasync-stderr-signals-parent-group", "parent", '''
            group = os.getpgid(os.getppid())
            _attempt("F_SETOWN_EX-group", lambda: fcntl.fcntl(2, F_SETOWN_EX, struct.pack("ii", F_OWNER_PGRP, group)))
            _attempt("F_SETOWN-group", lambda: fcntl.fcntl(1, F_SETOWN, -group))
            _attempt("F_SETSIG-2", lambda: fcntl.fcntl(2, F_SETSIG, signal.SIGUSR2))
            _attempt("F_SETSIG-1", lambda: fcntl.fcntl(1, F_SETSIG, signal.SIGUSR2))
            _attempt("FIOASYNC", lambda: fcntl.ioctl(2, FIOASYNC, struct.pack("i", 1)))
            _attempt("O_ASYNC", lambda: _async_on(1))
            for i in range(20):
                print("output", i, flush=True)
                print("error", i, file=sys.stderr, flush=True)
                time.sleep(0.05)
        ''', host_files, check_parent, prefix=HELPERS + FCNTL),
        Attack("fasync-socketpair-kills-decoy", "parent", '''
            import socket
            def armed(how):
                a, b = socket.socketpair()
                how(a.fileno())
                return a, b
            def fire(pair):
                pair[1].send(b"x")  # a becomes readable: its owner is signalled
                time.sleep(0.2)
            def by_fcntl(fd):
                fcntl.fcntl(fd, F_SETOWN, {decoy})
                fcntl.fcntl(fd, F_SETSIG, signal.SIGKILL)
                _async_on(fd)
            def by_fcntl_group(fd):
                fcntl.fcntl(fd, F_SETOWN_EX, struct.pack("ii", F_OWNER_PGRP, {decoy}))
                fcntl.fcntl(fd, F_SETSIG, signal.SIGKILL)
                _async_on(fd)
            def by_ioctl(fd):  # SIGIO, whose default action ends the decoy
                fcntl.ioctl(fd, FIOSETOWN, struct.pack("i", {decoy}))
                fcntl.ioctl(fd, FIOASYNC, struct.pack("i", 1))
            def by_ioctl_group(fd):
                fcntl.ioctl(fd, SIOCSPGRP, struct.pack("i", -{decoy}))
                fcntl.ioctl(fd, FIOASYNC, struct.pack("i", 1))
            for name, how in (("fcntl", by_fcntl), ("fcntl-group", by_fcntl_group), ("ioctl", by_ioctl),
                              ("ioctl-group", by_ioctl_group)):
                pair = _attempt(f"arm-{{name}}", lambda: armed(how))
                if pair is not None:
                    fire(pair)
        ''', decoy, check_decoy, prefix=HELPERS + GC_BYPASS + FCNTL),
        Attack("fcntl-lease-notify-pipe-size", "parent", '''
            open("leased", "w").close()
            leased = os.open("leased", os.O_RDONLY)
            here = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
            r, w = os.pipe()
            _attempt("F_SETLEASE", lambda: fcntl.fcntl(leased, F_SETLEASE, fcntl.F_RDLCK))
            _attempt("F_NOTIFY", lambda: fcntl.fcntl(here, F_NOTIFY, fcntl.DN_CREATE | fcntl.DN_MULTISHOT))
            _attempt("F_SETPIPE_SZ", lambda: fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20))
        ''', host_files, check_denied, prefix=HELPERS + FCNTL),
        # --- memory outside RLIMIT_AS ---
        Attack("memfd-beyond-memory-limit", "resources", '''
            fds = []
            def hold():
                block = b"x" * (1 << 20)
                while len(fds) < 40:
                    fd = os.memfd_create("held")
                    for _ in range(15):
                        os.write(fd, block)
                    fds.append(fd)
                return f"{{15 * len(fds)}} MiB"
            _attempt("memfd_create", hold)
            print(f"HELD:{{15 * len(fds)}}", flush=True)
            _attempt("memfd_secret", lambda: _syscall(447, 0))
        ''', host_files, check=limit_check(lambda r: 0 <= counted("HELD:", r) <= 128, "memory limit for memfd"),
            prefix=bypass, options={"memory_mb": 128}),
        Attack("shared-memory-beyond-memory-limit", "resources", '''
            import mmap, _posixshmem
            name = "/flashreinforce-attack-{token}"
            _attempt("shm_open", lambda: _posixshmem.shm_open(name, os.O_CREAT | os.O_RDWR, 0o600))
            def fill(maps, fd):
                while len(maps) < 32:
                    m = mmap.mmap(fd, 16 << 20, flags=mmap.MAP_SHARED)
                    for offset in range(0, 16 << 20, 4096):
                        m[offset] = 1
                    maps.append(m)
            shared, zero = [], []
            _attempt("map-shared-anonymous", lambda: fill(shared, -1))
            print(f"SHARED:{{16 * len(shared)}}", flush=True)
            [m.close() for m in shared]
            def dev_zero():
                with open("/dev/zero", "r+b") as f:
                    fill(zero, f.fileno())
            _attempt("map-shared-dev-zero", dev_zero)
            print(f"ZERO:{{16 * len(zero)}}", flush=True)
            _attempt("shmget", lambda: _syscall({nr_shmget}, 0, 16 << 20, 0o1000 | 0o600))
        ''', lambda b, u: {**host_files(b, u), "token": os.urandom(4).hex(), "nr_shmget": syscall_nr(29, 194)},
            _no_shm_file, prefix=bypass, options={"memory_mb": 128}),
        Attack("socket-buffers-beyond-memory-limit", "resources", '''
            import socket
            held = 0
            def grow(s):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)  # capped at net.core.wmem_max
                return s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            def fill():
                global held
                for i in range(40):
                    pair = socket.socketpair()
                    for s in pair:
                        if i == 0:
                            _attempt("SO_SNDBUF", lambda: grow(s))
                        else:
                            try:
                                grow(s)
                            except OSError:
                                pass
                        s.setblocking(False)
                        try:
                            while True:
                                held += s.send(b"x" * 65536)
                        except BlockingIOError:
                            pass
                    pairs.append(pair)
            pairs = []
            fill()
            print(f"HELD:{{held >> 20}}", flush=True)
        ''', host_files, prefix=HELPERS + GC_BYPASS, options={"memory_mb": 128},
            check=limit_check(lambda r: 0 <= counted("HELD:", r) <= 128, "memory limit for socket buffers")),
        Attack("unlinked-files-held-open", "resources", textwrap.dedent('''
            kept = []
            def hide(fd, name):
                os.unlink(name)
                kept.append(fd)
        ''') + HIDDEN_FILES, host_files, _HIDDEN_CHECK, needs_blocked=False, options=_HIDDEN_OPTIONS),
        Attack("unlinked-files-held-by-mappings", "resources", textwrap.dedent('''
            _libc.mmap.restype = ctypes.c_void_p
            _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_long]
            def hide(fd, name):
                if _libc.mmap(None, 4096, 1, 1, fd, 0) in (None, ctypes.c_void_p(-1).value):  # PROT_READ, MAP_SHARED
                    raise OSError(ctypes.get_errno(), "mmap")
                os.close(fd)  # only the one-page mapping holds the 8 MiB file now
                os.unlink(name)
        ''') + HIDDEN_FILES, host_files, _HIDDEN_CHECK, needs_blocked=False, prefix=bypass, options=_HIDDEN_OPTIONS),
        Attack("unlinked-files-held-in-flight", "resources", textwrap.dedent('''
            import array, socket
            pair = socket.socketpair()
            def hide(fd, name):
                # The descriptor travels to the other end and is never received: the message holds it.
                pair[0].sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                os.close(fd)
                os.unlink(name)
        ''') + HIDDEN_FILES, host_files, _HIDDEN_CHECK, needs_blocked=False, prefix=HELPERS + GC_BYPASS,
            options=_HIDDEN_OPTIONS),
        # --- the source checkout on sys.path ---
        Attack("read-source-checkout", "files", '''
            for path in {checkout_files!r}:
                _attempt(f"read {{path}}", lambda: open(path).read(200))
            def list_checkout():
                # The mount tree holds the directories leading to its read roots (/work/main/.venv
                # makes a /work/main with only .venv in it): a leak is a name of the checkout's own.
                leaked = sorted(set(os.listdir({checkout!r})) & set({checkout_names!r}))
                if not leaked:
                    raise LookupError("none of the checkout's own names")
                return leaked
            _attempt("list-checkout", list_checkout)
            def import_package():
                import flashreinforce
                return flashreinforce.__file__
            _attempt("import-flashreinforce", import_package)
        ''', _checkout, check_host_files),
    ]
