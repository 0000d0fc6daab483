"""The sandbox's seccomp-BPF filter: which system calls the tool code may make.

Standard library only: the sandboxed child loads this file by path (it must not import
``flashreinforce``), and the parent imports it for tests and the isolation report.

The policy is a deny list over a default of "allow", bounded from above: system calls newer
than the tables below are answered with ENOSYS, so a future kernel's new calls are not
reachable until they are reviewed here. Denied calls fail with EPERM (the caller sees
``PermissionError: [Errno 1] Operation not permitted``), except ``clone3``, which fails with
ENOSYS so that the C library falls back to ``clone``, whose flags the filter can inspect
(``clone3`` passes them in memory, out of the filter's sight).

Denied (see docs/sandbox.md for why each one):

- new processes: ``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD`` (threads stay
  possible) or with a namespace flag, ``clone3`` (ENOSYS), ``execve``, ``execveat``;
- sockets of every family (``socket``); with ``allow_network`` only ``AF_INET`` and
  ``AF_INET6``; ``socketpair`` only for ``AF_UNIX`` (an anonymous connected pair, used by
  ``asyncio``; it reaches nothing outside the process); without ``allow_network``,
  ``sendmsg`` and ``sendmmsg`` (the only way to put a descriptor in flight, ``SCM_RIGHTS``,
  where it would hold an unlinked file out of the launcher's sight; ``send`` is ``sendto``)
  and ``setsockopt`` of the buffer sizes (``SO_SNDBUF``, ``SO_RCVBUF``: up to
  ``net.core.wmem_max`` of kernel memory per socket, outside ``RLIMIT_AS``);
- file metadata: the ``chmod``, ``chown``, ``utime`` and ``*xattr`` families, ``file_setattr``,
  ``mknod``; ``ioctl`` requests that set inode flags (``chattr``) or push input into a terminal;
- other processes: ``ptrace``, ``process_vm_readv``/``writev``, ``process_madvise``,
  ``process_mrelease``, ``kcmp``, ``pidfd_open``/``getfd``/``send_signal``, ``migrate_pages``,
  ``move_pages``; ``kill``/``tkill``/``tgkill``/``rt_(tg)sigqueueinfo`` unless aimed at the
  process itself (or ``kill(0, ...)``: its own process group, in which it is alone);
  ``sched_set*`` unless aimed at itself (``0``); ``setpriority`` unless ``PRIO_PROCESS`` of
  itself (``0`` or its pid: ``PRIO_PGRP`` and ``PRIO_USER`` with ``0`` name its process group
  and every process of its uid); ``ioprio_set`` (any ``which``);
- signals the kernel would send on the caller's behalf, to the owner of a file description
  (whenever it becomes readable or writable, or a lease or a directory changes): ``fcntl``
  ``F_SETOWN``, ``F_SETOWN_EX``, ``F_SETSIG``, ``F_SETLEASE``, ``F_NOTIFY``, ``F_SETFL`` turning
  ``O_ASYNC`` on, ``ioctl`` ``FIOASYNC``, ``FIOSETOWN`` and ``SIOCSPGRP``; the filter reads the
  request, not the descriptor, so a ``dup``'ed descriptor is no way around it (``fcntl64``
  exists only in the 32-bit ABIs, which are killed);
- limits and identity: ``setrlimit``, ``prlimit64`` that sets a limit or names another
  process, the ``set*uid``/``set*gid`` family, ``setgroups``, ``capset``, ``setsid``,
  ``setpgid``;
- the kernel's attack surface and the host: ``mount``, ``umount2``, ``pivot_root``,
  ``chroot``, the new mount API, ``unshare``, ``setns``, ``bpf``, ``perf_event_open``,
  ``keyctl``/``add_key``/``request_key``, ``io_uring_*``, ``userfaultfd``, ``personality``,
  module loading, ``kexec_*``, ``reboot``, ``acct``, ``swapon``/``swapoff``, ``syslog``,
  ``vhangup``, ``quotactl*``, host and domain names, clocks, ``iopl``/``ioperm``/``modify_ldt``,
  ``uselib``, ``_sysctl``, ``lookup_dcookie``, ``name_to_handle_at``/``open_by_handle_at``
  (opening any file by handle), ``fanotify_init``, SysV IPC (``shm*``, ``msg*``, ``sem*``),
  POSIX message queues (``mq_open``, ``mq_unlink``), ``lsm_set_self_attr``;
- memory outside ``RLIMIT_AS``: ``memfd_create`` and ``memfd_secret`` (files in memory that
  no quota counts), ``fcntl`` ``F_SETPIPE_SZ`` (pipes keep their 64 KiB);
- any other architecture or ABI than the one the filter was built for (the i386 ``int 0x80``
  entry on x86_64, 32-bit ARM on aarch64): the process is killed; x32 system calls: ENOSYS.

Only x86_64 and aarch64 are supported; elsewhere :func:`build_filter` raises
:class:`UnsupportedArchitecture` and the sandbox reports seccomp as unavailable.
"""

from __future__ import annotations

import ctypes
import os
import struct

__all__ = ["UnsupportedArchitecture", "SYSCALLS", "current_arch", "build_filter", "install"]

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian only here).
_OFF_NR, _OFF_ARCH = 0, 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i


def _arg_hi(i: int) -> int:
    return 20 + 8 * i


# Classic BPF opcodes used by the filter.
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x15, 0x35, 0x45, 0x06

_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_EPERM, _ENOSYS = 1, 38

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

# System call numbers: name -> (x86_64, aarch64); None where the architecture lacks the call.
# From the kernel's arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    "fork": (57, None), "vfork": (58, None), "clone": (56, 220), "clone3": (435, 435),
    "execve": (59, 221), "execveat": (322, 281),
    "socket": (41, 198), "socketpair": (53, 199),
    "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452),
    "chown": (92, None), "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54),
    "utime": (132, None), "utimes": (235, None), "futimesat": (261, None), "utimensat": (280, 88),
    "setxattr": (188, 5), "lsetxattr": (189, 6), "fsetxattr": (190, 7), "removexattr": (197, 14),
    "lremovexattr": (198, 15), "fremovexattr": (199, 16), "setxattrat": (463, 463),
    "removexattrat": (466, 466), "file_setattr": (469, 469),
    "mknod": (133, None), "mknodat": (259, 33),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "process_madvise": (440, 440), "process_mrelease": (448, 448), "kcmp": (312, 272),
    "pidfd_open": (434, 434), "pidfd_getfd": (438, 438), "pidfd_send_signal": (424, 424),
    "migrate_pages": (256, 238), "move_pages": (279, 239),
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "setpriority": (141, 140), "sched_setaffinity": (203, 122), "sched_setscheduler": (144, 119),
    "sched_setparam": (142, 118), "sched_setattr": (314, 274), "ioprio_set": (251, 30),
    "setrlimit": (160, 164), "prlimit64": (302, 261),
    "setuid": (105, 146), "setgid": (106, 144), "setreuid": (113, 145), "setregid": (114, 143),
    "setresuid": (117, 147), "setresgid": (119, 149), "setfsuid": (122, 151), "setfsgid": (123, 152),
    "setgroups": (116, 159), "capset": (126, 91), "setsid": (112, 157), "setpgid": (109, 154),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "move_mount": (429, 429), "open_tree": (428, 428), "open_tree_attr": (467, 467),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268), "bpf": (321, 280), "perf_event_open": (298, 241),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "userfaultfd": (323, 282), "personality": (135, 92),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142),
    "acct": (163, 89), "swapon": (167, 224), "swapoff": (168, 225), "syslog": (103, 116),
    "vhangup": (153, 58), "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "sethostname": (170, 161), "setdomainname": (171, 162), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None), "uselib": (134, None),
    "_sysctl": (156, None), "lookup_dcookie": (212, 18),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265), "fanotify_init": (300, 262),
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197),
    "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "semget": (64, 190), "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192),
    "mq_open": (240, 180), "mq_unlink": (241, 181), "ioctl": (16, 29), "fcntl": (72, 25),
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "sendmsg": (46, 211), "sendmmsg": (307, 269),
    "setsockopt": (54, 208),
    "lsm_set_self_attr": (460, 460), "seccomp": (317, 277),
}

# The highest system call number the tables were reviewed against (file_setattr, Linux 6.17);
# anything above is answered with ENOSYS.
MAX_REVIEWED_NR = 469

# Denied outright (EPERM). Calls with argument checks are handled separately below.
_DENIED = (
    "fork", "vfork", "execve", "execveat",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "setxattrat", "removexattrat", "file_setattr", "mknod", "mknodat",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "process_mrelease",
    "kcmp", "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "migrate_pages", "move_pages",
    "ioprio_set", "setrlimit",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid",
    "setgroups", "capset", "setsid", "setpgid",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "open_tree_attr",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "unshare", "setns", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "personality",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "acct", "swapon", "swapoff", "syslog", "vhangup", "quotactl", "quotactl_fd",
    "sethostname", "setdomainname", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "iopl", "ioperm", "modify_ldt", "uselib", "_sysctl", "lookup_dcookie",
    "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semctl", "semtimedop", "mq_open", "mq_unlink", "lsm_set_self_attr",
    "memfd_create", "memfd_secret",
)

_CLONE_THREAD = 0x00010000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET: never with a thread.
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_AF_UNIX, _AF_INET, _AF_INET6 = 1, 2, 10
# SOL_SOCKET; SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE (the same on x86_64 and aarch64).
_SOL_SOCKET, _SOCKET_BUFFER_OPTIONS = 1, (7, 8, 32, 33)
# ioctl requests: FS_IOC_SETFLAGS (long and int forms), FS_IOC_FSSETXATTR (chattr +i, project
# ids), TIOCSTI (push input into a terminal), TIOCLINUX (console control), FIOASYNC (signal-driven
# I/O on), FIOSETOWN and SIOCSPGRP (the process or group a socket signals).
_DENIED_IOCTLS = (0x40086602, 0x40046602, 0x401C5820, 0x5412, 0x541C, 0x5452, 0x8901, 0x8902)
# fcntl commands that make the kernel signal a process of the caller's choosing, or at all:
# F_SETOWN, F_SETOWN_EX (the owner a description signals), F_SETSIG (which signal), F_SETLEASE
# and F_NOTIFY (leases and directory notifications, delivered as signals); and F_SETPIPE_SZ (up
# to 1 MiB of kernel memory per pipe, outside RLIMIT_AS). F_SETFL may not turn O_ASYNC on.
_F_SETFL, _O_ASYNC = 4, 0o20000
# setpriority's "which": PRIO_PROCESS (PRIO_PGRP is 1, PRIO_USER 2).
_PRIO_PROCESS = 0
_DENIED_FCNTLS = (8, 15, 10, 1024, 1026, 1031)


class UnsupportedArchitecture(RuntimeError):
    """The running process's architecture/ABI has no system call table here."""


def current_arch() -> str:
    """``'x86_64'`` or ``'aarch64'`` for the running interpreter's ABI; raises otherwise.

    The ABI is what matters, not the machine: a 32-bit interpreter on an x86_64 kernel makes
    i386 system calls, which a filter built for x86_64 would kill.
    """
    machine = os.uname().machine
    if machine in _AUDIT_ARCH and struct.calcsize("P") == 8:
        return machine
    raise UnsupportedArchitecture(
        f"no seccomp system call table for machine {machine!r} with {8 * struct.calcsize('P')}-bit "
        f"pointers (supported: {', '.join(sorted(_AUDIT_ARCH))}, 64-bit)")


class _Program:
    """A tiny classic-BPF assembler: instructions with jump targets given as labels."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.code.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, op: int, k: int, true: object = 0, false: object = 0) -> None:
        """``true``/``false``: a relative count of instructions to skip, or a label name."""
        self.code.append((op, true, false, k))

    def ret(self, value: int) -> None:
        self.code.append((_RET_K, 0, 0, value))

    def assemble(self) -> bytes:
        out = []
        for index, (op, jt, jf, k) in enumerate(self.code):
            offsets = []
            for target in (jt, jf):
                if isinstance(target, str):
                    target = self.labels[target] - index - 1
                if not 0 <= target <= 255:
                    raise ValueError(f"BPF jump out of range at instruction {index}")
                offsets.append(target)
            out.append(struct.pack("=HBBI", op, offsets[0], offsets[1], k & 0xFFFFFFFF))
        return b"".join(out)


def _allow_if_first_arg_in(prog: _Program, nr: int, values: tuple[int, ...], tag: str) -> None:
    """If the call is ``nr``: allow when its first argument (low 32 bits) is in ``values``."""
    prog.jump(_JEQ_K, nr, 0, f"{tag}.next")
    prog.load(_arg_lo(0))
    for value in values:
        prog.jump(_JEQ_K, value, f"{tag}.allow", 0)
    prog.ret(_RET_ERRNO | _EPERM)
    prog.label(f"{tag}.allow")
    prog.ret(_RET_ALLOW)
    prog.label(f"{tag}.next")
    prog.load(_OFF_NR)


def build_filter(*, own_pid: int, allow_network: bool = False, arch: str | None = None) -> bytes:
    """The filter program (packed ``struct sock_filter`` array) for this process.

    own_pid: the pid (as the process sees itself, ``os.getpid()``) signals may be sent to.
    allow_network: also allow ``AF_INET``/``AF_INET6`` sockets, ``sendmsg``/``sendmmsg`` and
        socket buffer sizes.
    arch: ``'x86_64'`` or ``'aarch64'``; default the running interpreter's (see
        :func:`current_arch`).
    """
    arch = arch or current_arch()
    if arch not in _AUDIT_ARCH:
        raise UnsupportedArchitecture(f"no seccomp system call table for {arch!r}")
    column = 0 if arch == "x86_64" else 1

    def nr(name: str) -> int | None:
        return SYSCALLS[name][column]

    prog = _Program()
    prog.load(_OFF_ARCH)
    prog.jump(_JEQ_K, _AUDIT_ARCH[arch], 1, 0)
    prog.ret(_RET_KILL_PROCESS)  # another ABI entry (i386 on x86_64, arm32 on aarch64)
    prog.load(_OFF_NR)
    if arch == "x86_64":
        prog.jump(_JGE_K, _X32_SYSCALL_BIT, 0, 1)
        prog.ret(_RET_ERRNO | _ENOSYS)
    for name in _DENIED:
        number = nr(name)
        if number is not None:
            prog.jump(_JEQ_K, number, 0, 1)
            prog.ret(_RET_ERRNO | _EPERM)
    prog.jump(_JEQ_K, nr("clone3"), 0, 1)
    prog.ret(_RET_ERRNO | _ENOSYS)

    # clone: threads only (CLONE_THREAD set, no namespace flag).
    prog.jump(_JEQ_K, nr("clone"), 0, "clone.next")
    prog.load(_arg_lo(0))
    prog.jump(_JSET_K, _CLONE_THREAD, 0, "clone.deny")
    prog.jump(_JSET_K, _CLONE_NAMESPACES, "clone.deny", 0)
    prog.ret(_RET_ALLOW)
    prog.label("clone.deny")
    prog.ret(_RET_ERRNO | _EPERM)
    prog.label("clone.next")
    prog.load(_OFF_NR)

    # Signals: only to itself. kill(0, sig) is its own process group, where it is alone.
    _allow_if_first_arg_in(prog, nr("kill"), (own_pid, 0), "kill")
    for name in ("tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        _allow_if_first_arg_in(prog, nr(name), (own_pid,), name)
    # Scheduling of itself only (0 = the calling thread/process).
    for name in ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr"):
        _allow_if_first_arg_in(prog, nr(name), (0,), name)
    # setpriority(which, who, prio): the caller's own priority only, PRIO_PROCESS with who 0 or
    # its pid. who == 0 with PRIO_PGRP is its process group and with PRIO_USER every process of
    # its uid (the trainer's included, outside any namespace): both refused, like any other who.
    prog.jump(_JEQ_K, nr("setpriority"), 0, "setpriority.next")
    prog.load(_arg_lo(0))
    prog.jump(_JEQ_K, _PRIO_PROCESS, 0, "setpriority.deny")
    prog.load(_arg_lo(1))
    prog.jump(_JEQ_K, 0, "setpriority.allow", 0)
    prog.jump(_JEQ_K, own_pid, "setpriority.allow", "setpriority.deny")
    prog.label("setpriority.allow")
    prog.ret(_RET_ALLOW)
    prog.label("setpriority.deny")
    prog.ret(_RET_ERRNO | _EPERM)
    prog.label("setpriority.next")
    prog.load(_OFF_NR)

    # prlimit64(pid, resource, new, old): reading its own limits only (new == NULL).
    prog.jump(_JEQ_K, nr("prlimit64"), 0, "prlimit.next")
    prog.load(_arg_lo(2))
    prog.jump(_JEQ_K, 0, 0, "prlimit.deny")
    prog.load(_arg_hi(2))
    prog.jump(_JEQ_K, 0, 0, "prlimit.deny")
    prog.load(_arg_lo(0))
    prog.jump(_JEQ_K, 0, "prlimit.allow", 0)
    prog.jump(_JEQ_K, own_pid, "prlimit.allow", "prlimit.deny")
    prog.label("prlimit.allow")
    prog.ret(_RET_ALLOW)
    prog.label("prlimit.deny")
    prog.ret(_RET_ERRNO | _EPERM)
    prog.label("prlimit.next")
    prog.load(_OFF_NR)

    if not allow_network:
        for name in ("sendmsg", "sendmmsg"):
            prog.jump(_JEQ_K, nr(name), 0, 1)
            prog.ret(_RET_ERRNO | _EPERM)
        # setsockopt(fd, SOL_SOCKET, SO_SNDBUF/SO_RCVBUF(FORCE), ...): socket pairs keep the
        # system's default buffers.
        prog.jump(_JEQ_K, nr("setsockopt"), 0, "setsockopt.next")
        prog.load(_arg_lo(1))
        prog.jump(_JEQ_K, _SOL_SOCKET, 0, "setsockopt.allow")
        prog.load(_arg_lo(2))
        for option in _SOCKET_BUFFER_OPTIONS:
            prog.jump(_JEQ_K, option, "setsockopt.deny", 0)
        prog.label("setsockopt.allow")
        prog.ret(_RET_ALLOW)
        prog.label("setsockopt.deny")
        prog.ret(_RET_ERRNO | _EPERM)
        prog.label("setsockopt.next")
        prog.load(_OFF_NR)
    families = (_AF_INET, _AF_INET6) if allow_network else ()
    _allow_if_first_arg_in(prog, nr("socket"), families, "socket")
    _allow_if_first_arg_in(prog, nr("socketpair"), (_AF_UNIX,), "socketpair")

    # fcntl(fd, cmd, arg): the kernel reads cmd and F_SETFL's flags as 32-bit integers.
    prog.jump(_JEQ_K, nr("fcntl"), 0, "fcntl.next")
    prog.load(_arg_lo(1))
    for command in _DENIED_FCNTLS:
        prog.jump(_JEQ_K, command, "fcntl.deny", 0)
    prog.jump(_JEQ_K, _F_SETFL, 0, "fcntl.allow")
    prog.load(_arg_lo(2))
    prog.jump(_JSET_K, _O_ASYNC, "fcntl.deny", 0)
    prog.label("fcntl.allow")
    prog.ret(_RET_ALLOW)
    prog.label("fcntl.deny")
    prog.ret(_RET_ERRNO | _EPERM)
    prog.label("fcntl.next")
    prog.load(_OFF_NR)

    prog.jump(_JEQ_K, nr("ioctl"), 0, "ioctl.next")
    prog.load(_arg_lo(1))
    for request in _DENIED_IOCTLS:
        prog.jump(_JEQ_K, request, "ioctl.deny", 0)
    prog.ret(_RET_ALLOW)
    prog.label("ioctl.deny")
    prog.ret(_RET_ERRNO | _EPERM)
    prog.label("ioctl.next")
    prog.load(_OFF_NR)

    prog.jump(_JGE_K, MAX_REVIEWED_NR + 1, 0, 1)
    prog.ret(_RET_ERRNO | _ENOSYS)
    prog.ret(_RET_ALLOW)
    return prog.assemble()


_PR_SET_NO_NEW_PRIVS, _PR_GET_SECCOMP, _PR_SET_SECCOMP = 38, 21, 22
_SECCOMP_SET_MODE_FILTER, _SECCOMP_MODE_FILTER = 1, 2
_SECCOMP_FILTER_FLAG_TSYNC = 1


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(program: bytes) -> None:
    """Set ``no_new_privs`` and install ``program`` for every thread of this process.

    Raises OSError (with the failing step in the message) if the kernel refuses; the filter
    is confirmed with ``PR_GET_SECCOMP`` afterwards.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.syscall.restype = ctypes.c_long
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(err)}")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    number = SYSCALLS["seccomp"][0 if current_arch() == "x86_64" else 1]
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                      ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog))
    if rc != 0:
        err = ctypes.get_errno()
        if rc > 0:
            raise OSError(0, f"seccomp TSYNC failed: thread {rc} cannot take the filter")
        if err != _ENOSYS:
            raise OSError(err, f"seccomp(SECCOMP_SET_MODE_FILTER) failed: {os.strerror(err)}")
        # Kernels before 3.17 have no seccomp(2); prctl installs for the calling thread only,
        # which is every thread here (the child installs it before starting any).
        if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_SECCOMP) failed: {os.strerror(err)}")
    if libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) != _SECCOMP_MODE_FILTER:
        raise OSError(0, "seccomp filter not in force after installation")
