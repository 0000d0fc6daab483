"""The isolation probe: which layers a machine gives the sandbox, and the level they reach.

The probe is a real sandbox start (the child sets every layer up, reports, and exits without
running code), so what it reports is what a run gets, for the same interpreter and options.
:class:`~flashreinforce.envs.sandbox.Sandbox` probes once per process and option set, and
refuses to be built when the level is below its ``min_isolation`` (unless
``allow_weak_isolation``).

From a shell: ``python -m flashreinforce.envs.sandbox`` prints the report and the kernel
facts behind it (see docs/sandbox.md).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from flashreinforce.envs.sandbox.levels import LEVELS

__all__ = ["IsolationError", "IsolationReport", "probe_isolation", "kernel_facts"]


class IsolationError(RuntimeError):
    """The sandbox's isolation on this machine is below the configured minimum."""


@dataclass(frozen=True)
class IsolationReport:
    """What a sandbox start confirmed.

    level: one of ``none``, ``seccomp``, ``filesystem``, ``full`` (see docs/sandbox.md).
    guards: the layers in force (``seccomp``, ``landlock_fs``, ``landlock_net``,
        ``landlock_signal``, ``userns``, ``netns``, ``mount_tree``, ``disk_quota``, ``rlimits``,
        ``nproc`` / ``nproc_uid``, ``cgroup_pids``).
    problems: why the missing layers are missing (the kernel's answers).
    landlock_abi: the Landlock ABI version used (0: none).
    arch: the system call table used by the seccomp filter (None: unsupported).
    python: the interpreter probed.
    """

    level: str
    guards: tuple[str, ...]
    problems: tuple[str, ...]
    landlock_abi: int
    arch: str | None
    python: str

    def at_least(self, level: str) -> bool:
        """True when this report's level is ``level`` or stronger."""
        if level not in LEVELS:
            raise ValueError(f"isolation level must be one of {LEVELS}, got {level!r}")
        return LEVELS.index(self.level) >= LEVELS.index(level)

    def describe(self) -> str:
        """A few lines for people: the level, the layers, and the problems."""
        lines = [f"isolation level: {self.level}", f"layers in force: {', '.join(self.guards) or 'none'}",
                 f"Landlock ABI: {self.landlock_abi or 'unavailable'}",
                 f"seccomp system call table: {self.arch or 'unavailable'}", f"interpreter: {self.python}"]
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


def probe_isolation(**sandbox_options) -> IsolationReport:
    """The report for a :class:`Sandbox` built with ``sandbox_options`` (never refuses)."""
    from flashreinforce.envs.sandbox.launcher import Sandbox

    sandbox_options["allow_weak_isolation"] = True
    sandbox_options.setdefault("min_isolation", "none")
    return Sandbox(**sandbox_options).isolation


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def kernel_facts() -> dict[str, str]:
    """What the kernel says about the mechanisms, read from /proc and /sys (for the report)."""
    seccomp_line = next((line for line in _read("/proc/self/status").splitlines() if line.startswith("Seccomp:")),
                        "Seccomp: absent (kernel without CONFIG_SECCOMP)")
    return {
        "kernel": platform.release(),
        "machine": platform.machine(),
        "uid": str(os.geteuid()),
        "LSMs (/sys/kernel/security/lsm)": _read("/sys/kernel/security/lsm"),
        "seccomp of this process": seccomp_line.split(":", 1)[1].strip(),
        "user.max_user_namespaces": _read("/proc/sys/user/max_user_namespaces"),
        "kernel.unprivileged_userns_clone": _read("/proc/sys/kernel/unprivileged_userns_clone"),
        "kernel.apparmor_restrict_unprivileged_userns": _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns"),
        "cgroups of this process": " | ".join(_read("/proc/self/cgroup").splitlines()),
    }
