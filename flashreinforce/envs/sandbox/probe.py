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

from flashreinforce.envs.sandbox.isolation import IsolationReport
from flashreinforce.envs.sandbox.launcher import Sandbox

__all__ = ["probe_isolation", "kernel_facts"]


def probe_isolation(**sandbox_options) -> IsolationReport:
    """The report for a :class:`Sandbox` built with ``sandbox_options`` (never refuses)."""
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
