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

The checks are those of ``sandbox_attack_kit.py``: nothing escaped, the parent received no
signal, the decoy is alive.
"""

from __future__ import annotations

from python_tests.envs.sandbox_attack_kit import (GC_BYPASS, HELPERS, Attack, check_decoy, check_denied, check_parent,
                                                  decoy, host_files)

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


def indirect_attacks() -> list[Attack]:
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
    ]
