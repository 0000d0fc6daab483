"""The output directory of a run: one run at a time in it, and nothing left of a run that never started.

:class:`RunLock` is an exclusive ``fcntl.flock`` on ``OUTPUT/.flashreinforce.lock``, held from
before the run looks at the directory until the process ends. The kernel drops the lock with the
process, however it ends (``kill -9`` included), so a killed run never leaves it stuck; a second
``flashreinforce train`` on the same ``--output`` (a re-queued cluster job, a second terminal) is
refused with one line naming the process that holds it. The file holds that process's id, host and
start time for the message; it is never deleted while a run may hold it (a run that deleted it
could let a third process lock a new file while a second still holds the old one). It is opened
without following a symbolic link (``O_NOFOLLOW``: a link planted there is refused, never written
through), created with mode 0600, and must be a regular file of this user; the output directory
itself must belong to this user (:func:`check_owner`): a run is refused in another user's directory.

:func:`create_output` makes the directory and remembers which folders it made, so that a run that
stops during start-up (a refused setting, Ctrl-C) removes them again when they hold nothing but
its lock: it leaves no empty run directory behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from flashreinforce.config import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "check_owner", "create_output", "remove_created"]

#: The lock file in the output directory.
LOCK_NAME = ".flashreinforce.lock"


class RunLock:
    """The output directory's lock; :meth:`acquire` raises :class:`ConfigError` when another process holds it."""

    def __init__(self, out: str | Path) -> None:
        self.path = Path(out) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        out = self.path.parent
        check_owner(out)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise ConfigError(f"--output {out}: its lock file {LOCK_NAME} is a symbolic link, which a run never "
                                  f"follows (it would write through it): remove it ({self.path})") from None
            raise ConfigError(f"--output {out}: cannot create its lock file {LOCK_NAME} "
                              f"({err.strerror or err})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else (
                f"owned by another user (uid {st.st_uid})" if st.st_uid != os.geteuid() else "a hard link")
            raise ConfigError(f"--output {out}: its lock file {LOCK_NAME} is {what}; a run writes its process id "
                              f"there: remove it ({self.path})")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"--output {self.path.parent} is in use by another run ({holder}); two runs in one "
                                  "output directory would mix their records and checkpoints: wait for it to end "
                                  "(or stop it), or give another --output") from None
            raise ConfigError(f"--output {self.path.parent}: cannot lock {LOCK_NAME} ({err.strerror or err}); the "
                              "file system may not support locks") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the lock


def check_owner(out: Path) -> None:
    """:class:`ConfigError` when the output directory ``out`` (a link followed) is not this user's: a run
    there would write its checkpoints and exports where another user can replace or read them."""
    try:
        st = os.stat(out)
    except OSError as err:
        raise ConfigError(f"--output {out}: {err.strerror or err}") from None
    if st.st_uid != os.geteuid():
        try:
            import pwd

            owner = f"{pwd.getpwuid(st.st_uid).pw_name} (uid {st.st_uid})"
        except (ImportError, KeyError):
            owner = f"uid {st.st_uid}"
        raise ConfigError(f"--output {out} belongs to another user, {owner}: a run there could have its records, "
                          "checkpoints and exports replaced or read by that user; give an --output of your own")


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"process {int(info['pid'])} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which yet"


def create_output(out: Path) -> list[Path]:
    """Create ``out`` (and missing parents); return the folders this call made, deepest first.

    Raises :class:`ConfigError` naming ``--output`` when it cannot be created.
    """
    made = []
    path = out.absolute()
    while not path.exists():
        made.append(path)
        path = path.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output {out}: cannot create the directory ({err.strerror}: {err.filename})") from None
    return made


def remove_created(made: list[Path]) -> None:
    """Remove the folders :func:`create_output` made, deepest first, each only while it holds
    nothing (the lock file aside); stop at the first that holds something."""
    for path in made:
        try:
            (path / LOCK_NAME).unlink(missing_ok=True)
            path.rmdir()
        except OSError:
            return
