"""Sandbox attacks on other processes' scheduling: priority, I/O priority, policy, CPUs, limits.

Each system call that takes a ``which``/``who`` pair, or a process id where 0 means "the caller",
is tried in every form that reaches beyond the sandboxed process: ``setpriority`` with
``PRIO_PROCESS`` (the parent, a decoy), ``PRIO_PGRP`` (the parent's and the decoy's process
groups) and ``PRIO_USER`` (``who`` 0, which is every process of the caller's uid, and the uid
itself); ``ioprio_set`` with each of ``IOPRIO_WHO_PROCESS``, ``_PGRP`` and ``_USER``;
``sched_setscheduler``, ``sched_setparam``, ``sched_setattr`` and ``sched_setaffinity`` on the
parent and the decoy; ``prlimit`` on the decoy; and ``kill`` with ``-1`` (every process the
caller may signal) and a negative process group, with signal 0 so that a success changes nothing.

The ``PRIO_USER`` and ``IOPRIO_WHO_USER`` forms run only as a uid other than 0: as root they
would reach every root process of the machine if they escaped. They are what the unprivileged
configurations are for (as uid 65534 they would reach only the test's own processes; a nice value
once raised cannot be lowered again by that user, so an escape stays visible).

Judged from outside: the decoy's and the parent's nice value, I/O priority, scheduling policy and
CPU affinity are what they were, and every attempt was refused by policy (EPERM or ENOSYS).

The same effects through files (``parent-proc-files``): the parent's ``/proc`` entries that its
owner may write, ``autogroup`` (the nice value of every process in its session) and
``oom_score_adj``. Those are files, so only the levels that confine files claim to stop them.
"""

from __future__ import annotations

import ctypes
import os

from python_tests.envs.sandbox_attack_kit import (CTYPES, GC_BYPASS, HELPERS, Attack, check_decoy, check_denied,
                                                  check_host_files, decoy, host_files, syscall_nr)

__all__ = ["process_state", "scheduling_attacks"]

_IOPRIO_WHO_PROCESS = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def process_state(pid: int) -> dict:
    """What the attacks try to change about process ``pid``, read from outside it."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ioprio = _libc.syscall(ctypes.c_long(syscall_nr(252, 31)), ctypes.c_long(_IOPRIO_WHO_PROCESS),
                           ctypes.c_long(pid))
    state = {"nice": int(fields[16]), "policy": int(fields[38]), "ioprio": int(ioprio),
             "affinity": sorted(os.sched_getaffinity(pid))}
    for name in ("autogroup", "oom_score_adj"):  # the first only where the kernel has autogroups
        try:
            with open(f"/proc/{pid}/{name}") as f:
                state[name] = f.read().split()[-1]
        except OSError:
            pass
    return state


def _decoy_with_state(base: str, uid: int) -> dict:
    ctx = decoy(base, uid)
    ctx["decoy_state"] = process_state(ctx["decoy"])
    ctx.update(nr_ioprio_set=syscall_nr(251, 30), nr_sched_setattr=syscall_nr(314, 274))
    return ctx


def _check(ctx: dict, result: dict, runner: dict) -> str | None:
    problems = []
    try:
        after = process_state(ctx["decoy"])
    except OSError as err:
        after = {"error": str(err)}
    if after != ctx["decoy_state"]:
        problems.append(f"the decoy's scheduling changed: {ctx['decoy_state']} -> {after}")
    if runner.get("parent_state") != runner.get("parent_state_before"):
        problems.append(f"the parent's scheduling changed: {runner.get('parent_state_before')} -> "
                        f"{runner.get('parent_state')}")
    for check in (check_decoy, check_denied):
        problem = check(ctx, result, runner)
        if problem:
            problems.append(problem)
    return "; ".join(problems) or None


def _check_parent(ctx: dict, result: dict, runner: dict) -> str | None:
    if runner.get("parent_state") != runner.get("parent_state_before"):
        return (f"the parent's scheduling changed: {runner.get('parent_state_before')} -> "
                f"{runner.get('parent_state')}")
    return check_host_files(ctx, result, runner)


def scheduling_attacks() -> list[Attack]:
    return [
        Attack("renice-other-processes", "scheduling", '''
            import struct
            parent, group = os.getppid(), os.getpgid(os.getppid())
            forms = [("process-parent", os.PRIO_PROCESS, parent), ("process-decoy", os.PRIO_PROCESS, {decoy}),
                     ("group-parent", os.PRIO_PGRP, group), ("group-decoy", os.PRIO_PGRP, {decoy}),
                     ("group-own", os.PRIO_PGRP, 0)]
            io_forms = [("io-process-parent", 1, parent), ("io-process-decoy", 1, {decoy}),
                        ("io-group-parent", 2, group), ("io-group-own", 2, 0)]
            if os.getuid() != 0:
                forms += [("user-own", os.PRIO_USER, 0), ("user-uid", os.PRIO_USER, os.getuid())]
                io_forms += [("io-user-own", 3, 0), ("io-user-uid", 3, os.getuid())]
            for name, which, who in forms:
                _attempt(f"setpriority-{{name}}", lambda: os.setpriority(which, who, 19))
            idle = (3 << 13) | 7  # IOPRIO_CLASS_IDLE
            for name, which, who in io_forms:
                _attempt(f"ioprio_set-{{name}}", lambda: _syscall({nr_ioprio_set}, which, who, idle))
            attr = struct.pack("IIQiIQQQ", 48, 5, 0, 19, 0, 0, 0, 0)  # SCHED_IDLE, nice 19
            for name, pid in (("parent", parent), ("decoy", {decoy})):
                _attempt(f"sched_setscheduler-{{name}}", lambda: os.sched_setscheduler(pid, 5, os.sched_param(0)))
                _attempt(f"sched_setparam-{{name}}", lambda: os.sched_setparam(pid, os.sched_param(0)))
                _attempt(f"sched_setattr-{{name}}", lambda: _syscall({nr_sched_setattr}, pid, ctypes.c_char_p(attr), 0))
                _attempt(f"sched_setaffinity-{{name}}", lambda: os.sched_setaffinity(pid, {{0}}))
            import resource
            _attempt("prlimit-decoy", lambda: resource.prlimit({decoy}, resource.RLIMIT_NOFILE, (16, 16)))
            _attempt("kill-every-process", lambda: os.kill(-1, 0))
            _attempt("kill-decoy-group", lambda: os.kill(-{decoy}, 0))
        ''', _decoy_with_state, _check, prefix=HELPERS + GC_BYPASS + CTYPES),
        # The same through files: the parent's autogroup nice value (every process of its
        # session) and its OOM score, which the owner of a process may raise.
        Attack("parent-proc-files", "scheduling", '''
            for name, value in (("autogroup", "19"), ("oom_score_adj", "1000")):
                def write():
                    with open(f"/proc/{{os.getppid()}}/{{name}}", "w") as f:
                        return f.write(value)
                _attempt(f"write-{{name}}", write)
        ''', host_files, _check_parent, prefix=HELPERS + GC_BYPASS),
    ]
