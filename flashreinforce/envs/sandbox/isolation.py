"""What a sandbox start confirmed about its isolation, and the refusal when that is too little.

:class:`IsolationReport` is what the child reports when it has set its layers up (the launcher
builds it, the probe returns it); :class:`IsolationError` is raised when the level is below the
configured minimum. The levels themselves are :mod:`.levels`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashreinforce.envs.sandbox.levels import LEVELS

__all__ = ["IsolationError", "IsolationReport"]


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
