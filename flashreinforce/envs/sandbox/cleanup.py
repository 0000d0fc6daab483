"""Removing a sandbox's working directory without ever following a link the code planted.

The code controls everything beneath its working directory: symlinks to host files, symlinked
directories, directories without permissions, hard links. The launcher (possibly root) must
delete all of it and touch nothing else, so the walk is done with file descriptors:

- every directory is opened relative to its parent's descriptor with ``O_NOFOLLOW |
  O_DIRECTORY``, so a symlink is never entered (it is unlinked like a file);
- entries are removed with ``unlinkat``/``rmdir`` relative to that descriptor, which act on the
  link itself, never on its target;
- a directory the code made unreadable is repaired with ``fchmod`` on a descriptor of that very
  directory (opened ``O_PATH | O_NOFOLLOW`` and checked to be a directory), never by path, so
  no ``chmod`` can land on a host file through a link.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["remove_tree", "disk_usage"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    """Descriptor of directory ``name`` (relative to ``dir_fd``), or None if it is not one."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
            return None  # a symlink, a file, or gone
        if exc.errno != errno.EACCES:
            raise
    # No permission to read it (a non-root launcher, and the code did chmod 0): pin the
    # directory itself with O_PATH, make sure it is one, and repair its mode through the pin.
    pin = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISDIR(os.fstat(pin).st_mode):
            return None
        os.chmod(f"/proc/self/fd/{pin}", 0o700)  # the pinned inode, not a path the code controls
        return os.open(f"/proc/self/fd/{pin}", _DIR_FLAGS & ~os.O_NOFOLLOW)
    finally:
        os.close(pin)


def _empty(fd: int) -> None:
    """Remove everything beneath the directory open as ``fd`` (it stays)."""
    try:
        os.fchmod(fd, 0o700)  # make sure entries can be removed (owner rights on this directory)
    except OSError:
        pass
    for entry in list(os.scandir(fd)):
        child = _open_dir(entry.name, fd) if entry.is_dir(follow_symlinks=False) else None
        if child is None:
            try:
                os.unlink(entry.name, dir_fd=fd)
            except IsADirectoryError:  # raced into a directory: handle it as one
                child = _open_dir(entry.name, fd)
            except FileNotFoundError:
                continue
        if child is not None:
            try:
                _empty(child)
            finally:
                os.close(child)
            os.rmdir(entry.name, dir_fd=fd)


def remove_tree(path: str) -> None:
    """Delete directory ``path`` and everything beneath it; links are removed, never followed.

    ``path`` itself must be a real directory (a symlink there is only unlinked). Missing is fine.
    """
    parent, name = os.path.split(os.path.abspath(path))
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = _open_dir(name, parent_fd)
        if fd is None:
            try:
                os.unlink(name, dir_fd=parent_fd)
            except FileNotFoundError:
                pass
            return
        try:
            _empty(fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)


def disk_usage(path: str, limit_bytes: int, max_entries: int = 100_000) -> int:
    """Bytes allocated beneath ``path`` (not following links), counting stops past ``limit_bytes``.

    More than ``max_entries`` entries counts as over the limit (returns ``limit_bytes + 1``):
    a directory of millions of empty files is an attack on the disk too.
    """
    total, seen, stack = 0, 0, [path]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > max_entries:
                return limit_bytes + 1
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            if total > limit_bytes:
                return total
    return total
