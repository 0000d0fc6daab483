"""Isolation levels: what the layers a sandboxed child confirmed add up to.

Standard library only (the child loads this file by path to decide whether to refuse).

The levels, weakest first (docs/sandbox.md has the full threat model):

``none``
    Nothing kernel-enforced beyond resource limits: the code can start processes, open
    sockets, signal the trainer, and read and write whatever the trainer's user can.
``seccomp``
    The seccomp filter is in force: no new processes, no sockets, no signals or ptrace aimed
    at other processes, no ownership/mode/time changes of files, no mounts or namespaces,
    none of the kernel interfaces the filter denies. Files are not confined.
``filesystem``
    ``seccomp`` and the file system confined by the kernel: reads only of the interpreter,
    its libraries and a few system files, writes only in the working directory, and no
    other process's ``/proc`` entries. Enforced by Landlock (``landlock_fs``) or by a private
    mount tree in a user namespace (``mount_tree``), either one.
``full``
    ``filesystem`` with both Landlock and the mount tree (two independent barriers), no
    network interfaces (``netns``, unless network access was allowed) and a kernel-enforced
    bound on threads (``nproc``: RLIMIT_NPROC counted in the sandbox's own user namespace, or
    ``cgroup_pids``: a pids cgroup).
"""

from __future__ import annotations

__all__ = ["LEVELS", "level_of", "missing_for"]

LEVELS = ("none", "seccomp", "filesystem", "full")


def level_of(guards, allow_network: bool = False) -> str:
    """The level (a name in :data:`LEVELS`) that the guard names ``guards`` add up to."""
    have = set(guards)
    if "seccomp" not in have:
        return "none"
    landlock, tree = "landlock_fs" in have, "mount_tree" in have
    if not (landlock or tree):
        return "seccomp"
    threads = "nproc" in have or "cgroup_pids" in have
    if landlock and tree and threads and (allow_network or "netns" in have):
        return "full"
    return "filesystem"


def missing_for(level: str, guards, allow_network: bool = False) -> list[str]:
    """Human-readable list of what ``guards`` lack to reach ``level`` (empty if nothing)."""
    if level not in LEVELS:
        raise ValueError(f"isolation level must be one of {LEVELS}, got {level!r}")
    have = set(guards)
    need = []
    if LEVELS.index(level) >= 1 and "seccomp" not in have:
        need.append("the seccomp filter")
    if LEVELS.index(level) >= 2 and not ({"landlock_fs", "mount_tree"} & have):
        need.append("a file-system barrier (Landlock, or a mount namespace in a user namespace)")
    if LEVELS.index(level) >= 3:
        if "landlock_fs" not in have:
            need.append("Landlock")
        if "mount_tree" not in have:
            need.append("the private mount tree (user namespaces)")
        if not allow_network and "netns" not in have:
            need.append("a network namespace")
        if not ({"nproc", "cgroup_pids"} & have):
            need.append("a thread bound (RLIMIT_NPROC in a user namespace as non-root, or a pids cgroup)")
    return need
