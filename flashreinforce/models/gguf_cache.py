"""A per-user cache of dequantized GGUF models, so that a ``.gguf`` file is dequantized once.

``transformers`` dequantizes a GGUF file tensor by tensor in Python and builds its tokenizer from
the file's vocabulary: 10-40 s for the 98 MB SmolLM2-135M file on a 2-core CPU, at every run,
evaluation and ``serve``. The first load writes the result (``config.json``, ``model.safetensors``,
the tokenizer files) to a folder of the cache; later loads of the same file read that folder.

* **Key**: the SHA-256 of the file's content, the ``transformers`` version (it does the dequantizing)
  and this format's version: another file, a changed file or another ``transformers`` get their own
  entry. The hash of a file is computed once per process for a given size, modification and change
  times and inode (a file rewritten in place changes its change time, whatever its modification time).
* **Where**: ``$FLASHREINFORCE_CACHE_DIR/gguf``, else ``$XDG_CACHE_HOME/flashreinforce/gguf``, else
  ``~/.cache/flashreinforce/gguf``.
* **Off**: ``FLASHREINFORCE_GGUF_CACHE=0`` (or ``off``, ``false``, ``no``): every load dequantizes the
  file and nothing is written.
* **Trust**: only this user's files are read. The cache folders are created private (``0700``, files
  ``0600``); an entry is used only when the cache folder, the entry and every file in it are this
  user's, not symbolic links, and writable by nobody else, and when every folder above the cache is
  owned by this user or by root and writable by nobody else (or sticky, like ``/tmp``), so that no
  other user can have put or swapped anything there. Anything else is ignored with one warning and the
  file is dequantized as without a cache. An entry is written under a temporary name and renamed into
  place once complete, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

__all__ = ["CACHE_ENV", "CACHE_OFF_ENV", "FORMAT", "cache_enabled", "cache_root", "cached_entry", "entry_for",
           "file_digest", "trusted_entry", "write_entry"]

log = logging.getLogger(__name__)

#: The cache's root folder (its ``gguf`` subfolder holds the entries).
CACHE_ENV = "FLASHREINFORCE_CACHE_DIR"
#: ``0``, ``off``, ``false`` or ``no``: no cache.
CACHE_OFF_ENV = "FLASHREINFORCE_GGUF_CACHE"
#: The entries' layout; a new one never reads an old one.
FORMAT = 1

_digests: dict[tuple, str] = {}
_warned: set[str] = set()
_lock = threading.Lock()


def cache_enabled() -> bool:
    return os.environ.get(CACHE_OFF_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def cache_root() -> Path:
    """The folder of the entries (see the module docstring)."""
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base) / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "flashreinforce" / "gguf"


def file_digest(path: str | Path) -> str:
    """SHA-256 (hex) of the file's content, remembered per (size, modification and change times, inode)."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    with _lock:
        if key in _digests:
            return _digests[key]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    with _lock:
        _digests[key] = digest
    return digest


def entry_for(path: str | Path, root: Path | None = None) -> Path:
    """The entry folder of the GGUF file ``path`` (it may not exist)."""
    import transformers

    digest = file_digest(path)
    tag = hashlib.sha256(f"{digest}:{transformers.__version__}:{FORMAT}".encode()).hexdigest()[:32]
    return (root or cache_root()) / f"{Path(path).stem}-{tag}"


def _warn_once(what: str, why: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("the GGUF cache %s is not used (%s); the file is dequantized without it", what, why)


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _safe_ancestors(folder: Path) -> str:
    """Why a folder above ``folder`` lets another user change what lies below it ('' when none does)."""
    for parent in folder.parents:
        try:
            st = os.lstat(parent)
        except OSError as err:
            return f"{parent}: {err.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{parent} is a symbolic link"
        if st.st_uid not in (os.getuid(), 0):
            return f"{parent} belongs to another user"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{parent} is writable by other users"
    return ""


def trusted_entry(entry: Path) -> str:
    """Why ``entry`` (a complete entry folder) may not be trusted: '' when it and the folders above it are
    this user's alone (see the module docstring)."""
    root = entry.parent
    for folder in (root, entry):
        try:
            st = os.lstat(folder)
        except OSError as err:
            return f"{folder}: {err.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{folder} is not a folder"
        if not _private(st):
            return f"{folder} belongs to another user or is writable by others"
    problem = _safe_ancestors(root)
    if problem:
        return problem
    for item in entry.iterdir():
        st = os.lstat(item)
        if not stat.S_ISREG(st.st_mode):
            return f"{item} is not a regular file"
        if not _private(st):
            return f"{item} belongs to another user or is writable by others"
    return ""


def cached_entry(path: str | Path) -> Path | None:
    """The complete, trusted entry of the GGUF file ``path``, or None (cache off, not written yet, or not
    trusted: then one warning)."""
    if not cache_enabled():
        return None
    entry = entry_for(path)
    if not (entry / "source.json").is_file():
        return None
    problem = trusted_entry(entry)
    if problem:
        _warn_once(str(entry), problem)
        return None
    return entry


def _make_private_root(root: Path) -> str:
    """Create the cache folder (``0700``); why it cannot be used ('' when it can)."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(root)
    except OSError as err:
        return f"{root}: {err.strerror}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return f"{root} is not a folder of this user"
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
    return _safe_ancestors(root)


def write_entry(path: str | Path, save: Callable[[Path], None], source: dict[str, Any] | None = None) -> Path | None:
    """Write the entry of the GGUF file ``path``: ``save(folder)`` writes the model and tokenizer files into
    a private temporary folder, which is renamed into place. Returns the entry, or None when the cache is
    off or cannot be written (nothing is left behind then)."""
    if not cache_enabled():
        return None
    entry = entry_for(path)
    problem = _make_private_root(entry.parent)
    if problem:
        _warn_once(str(entry.parent), problem)
        return None
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))  # 0700, this user's
    try:
        save(tmp)
        for item in tmp.iterdir():
            os.chmod(item, 0o600)
        record = {"file": str(Path(path).resolve()), "sha256": file_digest(path), "format": FORMAT, **(source or {})}
        (tmp / "source.json").write_text(json.dumps(record, indent=1) + "\n")
        os.chmod(tmp / "source.json", 0o600)
        try:
            tmp.rename(entry)
        except OSError:  # another process wrote it meanwhile (or something else is in the way)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cached_entry(path)
