"""Weights handed to an engine process through memory both processes share, without pickling a tensor.

An engine that runs its model in another process on the same machine (vLLM's worker) receives a
weight version as one buffer both processes map, plus a small manifest of plain values: each
tensor's name, dtype, shape and byte offset. The trainer copies the tensors into the buffer once
(:class:`SharedWeightWriter`); the engine process reads every tensor as a view of it
(:func:`views_of`), so the only copy on its side is the model's own ``load_weights``. Nothing but
the manifest crosses the process boundary: no tensor is pickled, chunked or sent through a socket.

* On the CPU the buffer is a file in ``/dev/shm`` (memory, not disk) where it exists, else in the
  temporary directory, removed by :meth:`SharedWeightWriter.close` (and at interpreter exit). Other
  users of the machine can neither read nor replace it: it is created exclusively
  (``O_CREAT | O_EXCL | O_NOFOLLOW``, so a planted file or symlink of that name is an error, never
  written through) under an unguessable name, with mode 0600 whatever the umask; the reader maps
  only a regular file of its own user that no other user may read (:func:`read_manifest`).
* On a CUDA device it is one device allocation, exported once as a CUDA IPC handle
  (:meth:`SharedWeightWriter.cuda_ipc_handles`).

Every tensor keeps its slot from the first version on (a later version may write a subset: only
the tensors that changed). A tensor that does not fit the layout (a new name or a larger shape)
starts a new buffer, so a reader never sees one change size under it.
"""

from __future__ import annotations

import base64
import os
import pickle
import secrets
import stat
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

__all__ = ["ALIGNMENT", "Manifest", "SharedWeightWriter", "check_private_file", "map_shared", "read_manifest",
           "shared_memory_dir", "views_of"]

#: Byte alignment of every tensor in the buffer (any dtype's view, and a cache line).
ALIGNMENT = 64


def shared_memory_dir() -> str:
    """``/dev/shm`` when it is a writable directory (memory-backed on Linux), else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared weights: {name!r} is not a torch dtype")
    return dtype


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def views_of(buf: torch.Tensor, entries: list) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` of each manifest entry ``[name, dtype name, shape, byte offset]`` of the flat
    ``uint8`` buffer ``buf``."""
    out = []
    for name, dtype_name, shape, offset in entries:
        dt = _dtype(dtype_name)
        out.append((name, buf[offset:offset + _nbytes(shape, dt)].view(dt).view(tuple(int(s) for s in shape))))
    return out


@dataclass(frozen=True)
class Manifest:
    """Where one version's tensors lie: the buffer (a file path, or the key of a CUDA buffer), its
    size in bytes, and per tensor ``[name, dtype name, shape, byte offset]``. Plain values only."""

    path: str
    size: int
    entries: list

    def as_plain(self) -> dict:
        return {"path": self.path, "size": self.size, "entries": self.entries}

    @staticmethod
    def from_plain(data: Mapping) -> "Manifest":
        return Manifest(str(data["path"]), int(data["size"]), [list(e) for e in data["entries"]])


class SharedWeightWriter:
    """The trainer's side: copies named tensors into a shared buffer and describes them.

    ``device``: ``"cpu"`` (a shared-memory file) or a CUDA device (a device buffer shared by CUDA
    IPC). One writer per engine; :meth:`write` is serialized by a lock.
    """

    def __init__(self, device: str | torch.device = "cpu", prefix: str = "flashreinforce-weights") -> None:
        self.device = torch.device(device)
        self._prefix = prefix
        self._key: str | None = None
        self._size = 0
        self._buffer: torch.Tensor | None = None
        self._slots: dict[str, tuple[str, tuple[int, ...], int]] = {}  # name -> (dtype, shape, offset)
        self._handles: str | None = None
        self._lock = threading.Lock()
        from flashreinforce.engines.base import at_exit

        ref = weakref.ref(self)
        at_exit(lambda: ref() is not None and ref().close())

    @property
    def key(self) -> str | None:
        """The buffer's file path (CPU) or identifying key (CUDA); changes when a new buffer starts."""
        return self._key

    def _fits(self, items) -> bool:
        for name, t, dt in items:
            slot = self._slots.get(name)
            if slot is None or slot[0] != str(dt).removeprefix("torch.") or slot[1] != tuple(t.shape):
                return False
        return self._buffer is not None

    def prepare(self, layout: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> Manifest:
        """Lay out a new buffer for the tensors ``(name, shape, dtype)`` that later versions will write (in
        this order: a fused projection's parts given one after the other are adjacent in it) and fault
        its memory in now, so that the first version is written into pages already mapped. Returns the
        manifest of the whole buffer (no entries: nothing is written yet)."""
        items = [(str(name), torch.empty(tuple(shape), dtype=dtype, device="meta"), dtype) for name, shape, dtype in layout]
        if not items:
            raise ValueError("shared weights: nothing to prepare")
        with self._lock:
            self._new_buffer(items)
            page = 4096 if self.device.type == "cpu" else None
            if page is not None:
                self._buffer[::page].zero_()  # one write per page: each page is faulted in here, not later
            else:
                self._buffer.zero_()
            return Manifest(self._key, self._size, [])

    def _new_buffer(self, items) -> None:
        self.close()
        slots, total = {}, 0
        for name, t, dt in items:
            slots[name] = (str(dt).removeprefix("torch."), tuple(t.shape), total)
            total = _align(total + _nbytes(t.shape, dt))
        size = max(total, ALIGNMENT)
        key = f"{self._prefix}-{os.getpid()}-{secrets.token_hex(12)}"
        if self.device.type == "cpu":
            key = os.path.join(shared_memory_dir(), key)
            fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                # The sticky shared-memory directory lets no other user rename or remove this file, so the
                # path names the file just created.
                self._buffer = torch.from_file(key, shared=True, size=size, dtype=torch.uint8)
            except BaseException:
                os.unlink(key)
                raise
            finally:
                os.close(fd)
        else:
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._key, self._size, self._slots, self._handles = key, size, slots, None

    def write(self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> Manifest:
        """Copy ``(name, tensor)`` pairs (any device; cast to ``dtype`` when given) into the buffer.

        Returns the :class:`Manifest` of exactly these tensors. A first write, or one with a name or
        shape the buffer has no slot for, starts a new buffer laid out for the tensors given.
        """
        items = []
        for name, t in tensors:
            t = t.detach()
            full = getattr(t, "full_tensor", None)  # a DTensor shard of a sharded learner
            if callable(full):
                t = full()
            items.append((str(name), t, dtype or t.dtype))
        if not items:
            raise ValueError("shared weights: no tensors to write")
        with self._lock:
            if not self._fits(items):
                self._new_buffer(items)
            entries = []
            for name, t, dt in items:
                dtype_name, shape, offset = self._slots[name]
                view = self._buffer[offset:offset + _nbytes(shape, dt)].view(dt).view(shape)
                view.copy_(t, non_blocking=False)
                entries.append([name, dtype_name, list(shape), offset])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return Manifest(self._key, self._size, entries)

    def cuda_ipc_handles(self) -> str:
        """base64 of a pickled ``{GPU UUID: CUDA IPC reduction args}`` of the device buffer (exported
        once per buffer), for :func:`flashreinforce.engines.vllm.worker.open_cuda_buffer`."""
        if self.device.type != "cuda" or self._buffer is None:
            raise RuntimeError("cuda_ipc_handles: no CUDA buffer has been written yet")
        if self._handles is None:
            from torch.multiprocessing.reductions import reduce_tensor

            _, args = reduce_tensor(self._buffer)
            uuid_ = str(torch.cuda.get_device_properties(self.device).uuid)
            self._handles = base64.b64encode(pickle.dumps({uuid_: args})).decode("ascii")
        return self._handles

    def close(self) -> None:
        """Drop the buffer and remove its file (readers keep their mapping until they drop it)."""
        self._buffer = None
        key, self._key, self._size, self._slots, self._handles = self._key, None, 0, {}, None
        if key is not None and self.device.type == "cpu":
            try:
                os.unlink(key)
            except OSError:
                pass


_MAPPED: dict[str, torch.Tensor] = {}


def check_private_file(path: str) -> None:
    """``PermissionError`` unless ``path`` is a regular file (not a symlink) of this process's user that
    no other user may read or write: what a weight buffer of this package is."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"shared weights: {path} is not a private file of this user (mode "
                              f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}); refusing to read weights from it")


def _mapped(path: str, size: int) -> torch.Tensor:
    """The file ``path`` of ``size`` bytes mapped (once per path; the mapping of an earlier path is dropped)."""
    buf = _MAPPED.get(path)
    if buf is None or buf.numel() != size:
        check_private_file(path)
        _MAPPED.clear()
        buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        _MAPPED[path] = buf
    return buf


def map_shared(path: str, size: int) -> int:
    """The reader's side of :meth:`SharedWeightWriter.prepare`: map the buffer and touch every page of it
    (so that reading the first version faults nothing in); returns ``size``."""
    buf = _mapped(path, int(size))
    int(buf[::4096].sum())  # one read per page
    return int(size)


def read_manifest(manifest: Manifest | Mapping) -> list[tuple[str, torch.Tensor]]:
    """The reader's side on the CPU: ``(name, view)`` of every tensor of ``manifest`` (tensors sharing
    the file's memory, valid until the writer overwrites them with the next version). The file is
    mapped once per path; the mapping of an earlier path is dropped."""
    if not isinstance(manifest, Manifest):
        manifest = Manifest.from_plain(manifest)
    return views_of(_mapped(manifest.path, manifest.size), manifest.entries)
