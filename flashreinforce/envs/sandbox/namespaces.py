"""Namespaces for the sandboxed child: its own user, mount, network, IPC and UTS namespaces.

Standard library only (the child loads this file by path). Everything here is done by the
child to itself, unprivileged, through an unprivileged user namespace; where the kernel or its
configuration refuses (``user.max_user_namespaces = 0``, an LSM policy, a container's seccomp
profile), the caller records the error and carries on without this layer.

:func:`enter` unshares the namespaces and maps the caller's own uid and gid (so the code runs
as the same user, with no extra privilege on the host). :func:`build_mount_tree` then replaces
the file system the code sees by a new root: a small read-only tmpfs holding read-only bind
mounts of the read roots (the interpreter, ``sys.path``, system libraries, a few ``/etc``
files), five ``/dev`` nodes, an empty ``/proc`` and, at the working directory's path, a
size-limited tmpfs that is the only writable place. The host's other files, other processes'
``/proc`` entries and other sandboxes' directories do not exist in it.
:func:`drop_capabilities` empties the capability sets (the user namespace gives all of them
inside it; as root outside one, this removes the DAC overrides and the right to raise limits).
"""

from __future__ import annotations

import ctypes
import os
import stat

__all__ = ["enter", "build_mount_tree", "drop_capabilities", "undo_mount_tree", "MountTreeBroken",
           "UnmappedNamespace"]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
MNT_DETACH = 2
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 0x1, 0x2
_MOUNT_SETATTR = 442  # the same on every architecture
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_CAPSET = {"x86_64": 126, "aarch64": 91}
# statvfs f_flag bits -> mount flags that a read-only remount must repeat (locked flags).
_ST_TO_MS = ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME),
             (4096, MS_RELATIME))
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


class UnmappedNamespace(OSError):
    """``unshare`` worked but writing the id maps failed: the process is in the new namespaces,
    as the overflow uid, with no usable privilege there."""


class MountTreeBroken(OSError):
    """A step after ``pivot_root`` failed: the process's view of the file system is neither the
    host's nor the finished tree, so the code must not run."""


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    _check(libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           f"mount {fstype or source} on {target}")


def enter(*, network: bool) -> list[str]:
    """Unshare user, mount, IPC and UTS namespaces (and network unless ``network``).

    Returns the guard names in force (``userns``, and ``netns`` without network). Raises
    OSError (naming the step) when the kernel refuses; the process is then unchanged, or
    :class:`UnmappedNamespace` when only the id mapping failed.
    """
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (0 if network else CLONE_NEWNET)
    _check(libc.unshare(flags), "unshare(user, mount, ipc, uts" + ("" if network else ", net") + ")")
    # Map only our own ids: inside, the code is the same user as outside, nothing more.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1\n"), ("gid_map", f"{gid} {gid} 1\n")):
        try:
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            raise UnmappedNamespace(exc.errno, f"writing /proc/self/{name}: {exc.strerror}") from exc
    return ["userns"] + ([] if network else ["netns"])


def _make_mountpoint(new_root: str, path: str, is_dir: bool) -> str:
    target = new_root + path
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    return target


def _replicate_links(new_root: str, path: str) -> str:
    """Recreate in the new root the symlinks met along ``path``; returns the resolved path.

    ``/lib/x86_64-linux-gnu`` on a merged-/usr system becomes a symlink ``/lib -> usr/lib``
    in the new root (same target text, so it resolves the same way there) and the returned
    ``/usr/lib/x86_64-linux-gnu`` is what gets mounted.
    """
    parts = [p for p in path.split("/") if p]
    current = ""
    for i, part in enumerate(parts):
        current += "/" + part
        if os.path.islink(current):
            copy = new_root + current
            if not os.path.lexists(copy):
                os.makedirs(os.path.dirname(copy), exist_ok=True)
                os.symlink(os.readlink(current), copy)
            rest = "/".join(parts[i + 1:])
            resolved = os.path.realpath(current)
            return _replicate_links(new_root, f"{resolved}/{rest}" if rest else resolved)
    return current or "/"


def _readonly_by_remount(libc, target: str) -> None:
    """Read-only remount of one bind mount, repeating its locked flags (kernels before 5.12)."""
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    st_flags = os.statvfs(target).f_flag
    for st_bit, ms_bit in _ST_TO_MS:
        if st_flags & st_bit:
            flags |= ms_bit
    _mount(libc, None, target, None, flags)


def build_mount_tree(workdir: str, read_roots: list[str], *, disk_bytes: int, max_inodes: int,
                     arch: str, use_mount_setattr: bool = True) -> tuple[list[str], list[str]]:
    """Pivot into a new root as described in the module docstring; call after :func:`enter`.

    workdir: absolute path of the working directory (its contents are not carried over: the
        caller writes what the code needs into the new tmpfs afterwards).
    read_roots: absolute paths kept readable (missing ones are skipped); symlinked paths are
        recreated as symlinks to their targets, which are mounted.
    disk_bytes, max_inodes: size and inode limits of the writable tmpfs at ``workdir``.
    arch: ``'x86_64'`` or ``'aarch64'`` (for the ``pivot_root`` system call number).
    use_mount_setattr: make the tree read-only with ``mount_setattr`` (Linux >= 5.12) when
        True, by remounting each bind mount when False or where it is missing.
    Returns ``(guards, skipped)``: ``['mount_tree', 'disk_quota']`` and the read roots that
    could not be mounted. Raises OSError naming the step that failed.
    """
    libc = _libc()
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    new_root = workdir  # any directory will do as the mount point; the workdir is ours
    _mount(libc, "tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    binds, bound, skipped = [], [], []
    inside = lambda path, base: path == base or path.startswith(base.rstrip("/") + "/")  # noqa: E731
    # Parents before children (by resolved path: /lib may be /usr/lib), so that a root inside
    # an already mounted one is skipped rather than mounted and then covered.
    def depth(path: str) -> tuple[int, str]:
        real = os.path.realpath(path)
        return real.count("/"), real

    for path in sorted({os.path.normpath(p) for p in read_roots}, key=depth):
        # Never the whole host root, nor anything holding the working directory (the new
        # root is mounted there).
        if path == "/" or inside(workdir, path) or not os.path.exists(path):
            skipped.append(path)
            continue
        try:
            real = _replicate_links(new_root, path)
            if real == "/" or inside(workdir, real):
                skipped.append(path)
                continue
            if any(inside(real, base) for base in bound):
                continue
            target = _make_mountpoint(new_root, real, stat.S_ISDIR(os.stat(real).st_mode))
            _mount(libc, real, target, None, MS_BIND | MS_REC)
        except OSError:
            skipped.append(path)
            continue
        bound.append(real)
        binds.append(target)
    for node in DEV_NODES:
        if os.path.exists(node):
            target = _make_mountpoint(new_root, node, False)
            _mount(libc, node, target, None, MS_BIND)
            binds.append(target)
    os.makedirs(new_root + "/proc", exist_ok=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new_root}/dev/{name}")
    work = _make_mountpoint(new_root, workdir, True)
    _mount(libc, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"mode=0700,size={disk_bytes},nr_inodes={max_inodes}")
    os.chdir(new_root)
    _check(libc.syscall(ctypes.c_long(_PIVOT_ROOT[arch]), b".", b"."), "pivot_root")
    try:
        _finish_tree(libc, workdir, [t[len(new_root):] for t in binds], use_mount_setattr)
    except OSError as exc:
        raise MountTreeBroken(exc.errno, f"mount tree after pivot_root: {exc.strerror}") from exc
    return ["mount_tree", "disk_quota"], skipped


def _finish_tree(libc, workdir: str, binds: list[str], use_mount_setattr: bool) -> None:
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    done = False
    if use_mount_setattr:
        attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
        rc = libc.syscall(ctypes.c_long(_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), b"/", ctypes.c_uint(_AT_RECURSIVE),
                          ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
        if rc == 0:
            attr = _MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0)
            _check(libc.syscall(ctypes.c_long(_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), _b(workdir), ctypes.c_uint(0),
                                ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
                   "mount_setattr (writable working directory)")
            done = True
        elif ctypes.get_errno() != 38:  # anything but ENOSYS is a real failure
            _check(rc, "mount_setattr (read-only tree)")
    if not done:
        for target in binds:
            _readonly_by_remount(libc, target)
        _readonly_by_remount(libc, "/")
    os.chdir(workdir)


def undo_mount_tree(workdir: str) -> None:
    """Best-effort removal of a half-built tree (a failure before ``pivot_root``)."""
    libc = _libc()
    libc.umount2(_b(workdir), MNT_DETACH)
    os.chdir(workdir)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities(arch: str) -> None:
    """Empty the effective, permitted and inheritable capability sets of the calling thread."""
    libc = _libc()
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two data structs
    data = (_CapData * 2)()
    _check(libc.syscall(ctypes.c_long(_CAPSET[arch]), ctypes.byref(header), ctypes.byref(data)), "capset")
