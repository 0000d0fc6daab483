"""The source tree as the unprivileged test user (uid 65534) can read it.

Tests that run code as uid 65534 put the repository on that process's ``PYTHONPATH``. A checkout
under a private directory (``mktemp -d`` makes 0700 directories) is out of that user's reach, and
the process would fail on ``import`` rather than meet the sandbox. :func:`readable_sources` then
copies the two Python packages it imports (``flashreinforce`` and ``python_tests``, sources only)
into a world-readable temporary directory once per test session, and returns that directory
instead; a readable checkout is used as it is.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile

__all__ = ["REPO", "UNPRIVILEGED_UID", "readable_sources"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNPRIVILEGED_UID = 65534


def _readable_by_unprivileged(path: str) -> bool:
    try:
        done = subprocess.run(["/bin/ls", path], user=UNPRIVILEGED_UID, group=UNPRIVILEGED_UID, extra_groups=[],
                              capture_output=True, timeout=30, cwd="/")
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@functools.lru_cache(maxsize=None)
def readable_sources() -> str:
    """A directory uid 65534 can import ``flashreinforce`` and ``python_tests`` from (the checkout
    when it can read it, else a world-readable copy of their ``.py`` files, removed at exit)."""
    if _readable_by_unprivileged(os.path.join(REPO, "flashreinforce")):
        return REPO
    copy = tempfile.mkdtemp(prefix="flashreinforce-sources-")
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    for package in ("flashreinforce", "python_tests"):
        shutil.copytree(os.path.join(REPO, package), os.path.join(copy, package),
                        ignore=lambda _dir, names: [n for n in names if n == "__pycache__" or
                                                    (not n.endswith(".py") and "." in n)])
    for root, dirs, files in os.walk(copy):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return copy
