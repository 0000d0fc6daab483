"""The launcher's measurement of a working directory without a tmpfs quota, hidden files included.

Without the mount tree, the working directory is a plain directory of the host (by default in
the system temporary directory, on a disk or a tmpfs, where files are memory) and only this
measurement bounds it: the launcher calls it every 0.25 s and stops the run past ``disk_mb``. A
walk of the directory (:func:`~flashreinforce.envs.sandbox.cleanup.disk_usage`) sees named
files only, while a file unlinked as long as the code holds it keeps its blocks until the last
holder goes. The code can hold one

- by a descriptor: ``/proc/<pid>/fd`` shows it as ``<path> (deleted)``; it counts exactly (its
  allocated blocks, read through the link);
- by a mapping alone (the descriptor closed after ``mmap``): ``/proc/<pid>/maps`` shows it, but
  its size cannot be read there without privileges, so each such file counts as
  ``file_size_bytes``, the most ``RLIMIT_FSIZE`` lets it hold;
- by a descriptor in flight in a socket pair (``SCM_RIGHTS``): that shows nowhere, so the seccomp
  filter refuses ``sendmsg`` and ``sendmmsg`` (the only calls that send one) without network.

A process whose ``/proc`` entries the launcher may not read (it made itself non-dumpable)
counts as over the limit: what it holds cannot be measured.
"""

from __future__ import annotations

import os
import stat
from typing import Iterable

from flashreinforce.envs.sandbox.cleanup import disk_usage

__all__ = ["held_unlinked_bytes", "over_disk_limit"]

_DELETED = " (deleted)"


def held_unlinked_bytes(pids: Iterable[int], workdir: str, file_size_bytes: int) -> int | None:
    """Bytes of files beneath ``workdir`` that are unlinked but held by the processes ``pids``.

    None when a process's ``/proc`` entries cannot be read (see the module docstring); a process
    that has gone holds nothing.
    """
    prefix = os.path.realpath(workdir) + "/"
    seen: set[tuple[int, int]] = set()
    total = 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            for fd in fds:
                link = f"/proc/{pid}/fd/{fd}"
                try:
                    target = os.readlink(link)
                    if not (target.startswith(prefix) and target.endswith(_DELETED)):
                        continue
                    st = os.stat(link)
                except (FileNotFoundError, ProcessLookupError):
                    continue  # closed meanwhile
                if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                maps = f.read().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process has ended
        except PermissionError:
            return None
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) < 6 or not (fields[5].startswith(prefix) and fields[5].endswith(_DELETED)):
                continue
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            key = (os.makedev(major, minor), int(fields[4]))
            if key not in seen:  # held by the mapping alone: at most a full-size file
                seen.add(key)
                total += file_size_bytes
    return total


def over_disk_limit(workdir: str, pids: Iterable[int], limit_bytes: int, file_size_bytes: int) -> bool:
    """True when the named files beneath ``workdir`` and the unlinked ones ``pids`` hold there
    exceed ``limit_bytes``, or when what they hold cannot be measured."""
    held = held_unlinked_bytes(pids, workdir, file_size_bytes)
    return held is None or held + disk_usage(workdir, limit_bytes) > limit_bytes
