"""The sandbox's parts that need no particular kernel: isolation levels, the seccomp program, the
probe and the refusal below the minimum, argument checks, the cleanup and the measurement of a
working directory without a quota. They run on any machine.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from flashreinforce.envs.sandbox import IsolationError, Sandbox, levels, probe_isolation, seccomp
from flashreinforce.envs.sandbox.cleanup import remove_tree
from flashreinforce.envs.sandbox.disk_watch import held_unlinked_bytes, over_disk_limit
from python_tests.envs.unprivileged import REPO, UNPRIVILEGED_UID, readable_sources

_REPORT = probe_isolation()


def test_levels_of_guard_sets():
    assert levels.level_of([]) == "none"
    assert levels.level_of(["rlimits", "landlock_fs"]) == "none"  # nothing without seccomp
    assert levels.level_of(["seccomp"]) == "seccomp"
    assert levels.level_of(["seccomp", "userns", "netns"]) == "seccomp"
    assert levels.level_of(["seccomp", "landlock_fs"]) == "filesystem"
    assert levels.level_of(["seccomp", "mount_tree"]) == "filesystem"
    full = ["seccomp", "landlock_fs", "mount_tree", "netns", "nproc"]
    assert levels.level_of(full) == "full"
    assert levels.level_of(full[:-1] + ["cgroup_pids"]) == "full"
    assert levels.level_of(full[:-1]) == "filesystem"  # no thread bound
    assert levels.level_of(["seccomp", "landlock_fs", "mount_tree", "nproc"]) == "filesystem"
    assert levels.level_of(["seccomp", "landlock_fs", "mount_tree", "nproc"], allow_network=True) == "full"
    assert levels.missing_for("filesystem", ["seccomp"]) and not levels.missing_for("seccomp", ["seccomp"])
    with pytest.raises(ValueError, match="isolation level"):
        levels.missing_for("strong", [])


def test_probe_reports_the_machine():
    assert _REPORT.level in levels.LEVELS and _REPORT.python == sys.executable
    assert "rlimits" in _REPORT.guards
    assert ("landlock_fs" in _REPORT.guards) == (_REPORT.landlock_abi > 0)
    done = subprocess.run([sys.executable, "-m", "flashreinforce.envs.sandbox", "--min", "none"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and f"isolation level: {_REPORT.level}" in done.stdout, done.stderr
    assert "kernel:" in done.stdout and "meets --min none: yes" in done.stdout


def test_below_the_minimum_refuses_unless_allowed():
    with pytest.raises(IsolationError, match="allow_weak_isolation") as info:
        Sandbox(landlock=False, namespaces=False)
    assert "'seccomp'" in str(info.value) and "min_isolation='filesystem'" in str(info.value)
    weak = Sandbox(landlock=False, namespaces=False, allow_weak_isolation=True, timeout_s=10)
    result = weak.run("print('ran')")
    # "seccomp" wherever the filter is available ("none" on a machine without it).
    assert result.ok and result.stdout == "ran\n" and result.isolation == weak.isolation.level
    assert weak.isolation.level == ("seccomp" if "seccomp" in _REPORT.guards else "none")
    with pytest.raises(IsolationError):
        Sandbox(seccomp=False, min_isolation="seccomp")
    assert Sandbox(seccomp=False, min_isolation="none").isolation.level == "none"


def test_arguments_are_validated():
    for kwargs, message in [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": -1}, "memory_mb"),
                            ({"output_limit_bytes": 2}, "output_limit_bytes"), ({"max_threads": 0}, "max_threads"),
                            ({"disk_mb": 0}, "disk_mb"), ({"min_isolation": "strong"}, "min_isolation"),
                            ({"extra_read_paths": "relative/path"}, "extra_read_paths"),
                            ({"extra_read_paths": ["relative"]}, "extra_read_paths")]:
        with pytest.raises(ValueError, match=message):
            Sandbox(**kwargs)
    with pytest.raises(TypeError, match="code must be str"):
        Sandbox(allow_weak_isolation=True).run(b"print(1)")


def test_seccomp_filter_programs():
    for arch in ("x86_64", "aarch64"):
        program = seccomp.build_filter(own_pid=1234, arch=arch)
        assert len(program) % 8 == 0 and len(program) // 8 < 4096
        first = [program[i:i + 8] for i in range(0, 24, 8)]
        assert first[0] == bytes.fromhex("2000000004000000")  # ld [arch]
        assert first[2] == bytes.fromhex("0600000000000080")  # ret KILL_PROCESS on any other ABI
    assert seccomp.build_filter(own_pid=1, allow_network=True, arch="x86_64") != seccomp.build_filter(own_pid=1, arch="x86_64")
    with pytest.raises(seccomp.UnsupportedArchitecture, match="riscv64"):
        seccomp.build_filter(own_pid=1, arch="riscv64")
    assert seccomp.current_arch() == os.uname().machine


def _decide(program: bytes, arch: str, name: str, *args: int) -> str:
    """What the filter answers to system call ``name(*args)`` (a classic BPF interpreter for the
    few instructions the filter uses), as ``'allow'``, ``'kill'`` or the errno name."""
    import errno
    import struct

    nr = seccomp.SYSCALLS[name][0 if arch == "x86_64" else 1]
    audit_arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[arch]
    data = struct.pack("=iIQ6Q", nr, audit_arch, 0, *[a & (2 ** 64 - 1) for a in (*args, 0, 0, 0, 0, 0, 0)[:6]])
    code = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
            continue
        if op == 0x06:  # ret k
            action = k & 0xFFFF0000
            return {0x7FFF0000: "allow", 0x80000000: "kill"}.get(action) or errno.errorcode[k & 0xFFFF]
        taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
        pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_filter_decisions(arch):
    # Decisions on both architectures' tables, whatever machine this runs on.
    closed = seccomp.build_filter(own_pid=1234, arch=arch)
    networked = seccomp.build_filter(own_pid=1234, allow_network=True, arch=arch)
    F_SETFL, O_ASYNC, O_NONBLOCK = 4, 0o20000, 0o4000
    expected = [
        (("fcntl", 1, 8, 1), "EPERM"),  # F_SETOWN
        (("fcntl", 1, 15, 0), "EPERM"),  # F_SETOWN_EX
        (("fcntl", 1, 10, 9), "EPERM"),  # F_SETSIG
        (("fcntl", 3, 1024, 0), "EPERM"),  # F_SETLEASE
        (("fcntl", 3, 1026, 4), "EPERM"),  # F_NOTIFY
        (("fcntl", 3, 1031, 1 << 20), "EPERM"),  # F_SETPIPE_SZ
        (("fcntl", 1, F_SETFL, O_ASYNC | O_NONBLOCK), "EPERM"),
        (("fcntl", 1, F_SETFL, O_NONBLOCK), "allow"),
        (("fcntl", 1, 3, 0), "allow"),  # F_GETFL
        (("fcntl", 1, 1030, 3), "allow"),  # F_DUPFD_CLOEXEC
        (("ioctl", 1, 0x5452, 0), "EPERM"),  # FIOASYNC
        (("ioctl", 1, 0x8901, 0), "EPERM"),  # FIOSETOWN
        (("ioctl", 1, 0x8902, 0), "EPERM"),  # SIOCSPGRP
        (("ioctl", 1, 0x5421, 0), "allow"),  # FIONBIO
        (("memfd_create", 0, 0), "EPERM"),
        (("memfd_secret", 0), "EPERM"),
        (("sendmsg", 3, 0, 0), "EPERM"),
        (("sendmmsg", 3, 0, 0, 0), "EPERM"),
        (("setsockopt", 3, 1, 7, 0, 4), "EPERM"),  # SOL_SOCKET, SO_SNDBUF
        (("setsockopt", 3, 1, 8, 0, 4), "EPERM"),  # SO_RCVBUF
        (("setsockopt", 3, 1, 2, 0, 4), "allow"),  # SO_REUSEADDR
        (("kill", 999, 9), "EPERM"),
        (("kill", 1234, 9), "allow"),
    ]
    for call, answer in expected:
        assert _decide(closed, arch, *call) == answer, (arch, call)
    for call in (("sendmsg", 3, 0, 0), ("setsockopt", 3, 1, 7, 0, 4), ("fcntl", 1, F_SETFL, O_NONBLOCK)):
        assert _decide(networked, arch, *call) == "allow", (arch, call)
    assert _decide(networked, arch, "fcntl", 1, 8, 1) == "EPERM"  # signals stay refused with network
    assert _decide(closed, "x86_64" if arch == "aarch64" else "aarch64", "fcntl", 1, 3, 0) == "kill"  # other ABI


def _plant(root: str, target: str) -> None:
    """A tree a hostile run might leave: links to a host file and dir, unreadable directories."""
    os.makedirs(os.path.join(root, "ro"))
    os.symlink(target, os.path.join(root, "ro", "link"))
    os.symlink(os.path.dirname(target), os.path.join(root, "dirlink"))
    os.makedirs(os.path.join(root, "closed", "inner"))
    with open(os.path.join(root, "closed", "inner", "f"), "w") as f:
        f.write("x")
    os.chmod(os.path.join(root, "closed", "inner"), 0)
    os.chmod(os.path.join(root, "closed"), 0)
    os.chmod(os.path.join(root, "ro"), 0o500)  # entries cannot be unlinked without repairing it


def test_cleanup_never_follows_links(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    target = host / "target.txt"
    target.write_text("original")
    target.chmod(0o600)
    work = tmp_path / "work"
    work.mkdir()
    _plant(str(work), str(target))
    remove_tree(str(work))
    assert not work.exists()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == "original"
    assert sorted(p.name for p in host.iterdir()) == ["target.txt"]


def test_read_roots_are_the_installation_not_what_sys_path_adds(monkeypatch):
    from flashreinforce.envs.sandbox import child

    # An editable install's .pth file puts the checkout on sys.path; it must not become readable.
    monkeypatch.setattr(sys, "path", [*sys.path, REPO, "/opt/flashreinforce-elsewhere"])
    roots = child.read_roots([])
    assert os.path.normpath(sys.prefix) in roots and os.path.normpath(sys.base_prefix) in roots
    assert any(p.endswith(("site-packages", "dist-packages")) for p in roots)
    assert not any(REPO == r or REPO.startswith(r + "/") for r in roots), roots
    assert "/opt/flashreinforce-elsewhere" not in roots and "/" not in roots
    assert REPO in child.read_roots([REPO])  # extra_read_paths can still name it


def test_disk_watch_counts_unlinked_files_still_held(tmp_path):
    # A process holds three 1 MiB files beneath the directory: one named, one unlinked but open,
    # one unlinked and closed but mapped (counted as a whole file_size_bytes file).
    code = ("import mmap, os, sys\nos.chdir(sys.argv[1])\nkeep = []\n"
            "for name in ('named', 'open', 'mapped'):\n"
            "    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)\n    os.write(fd, b'x' * (1 << 20))\n"
            "    if name == 'mapped':\n        keep.append(mmap.mmap(fd, 4096))\n"
            "    if name != 'named':\n        os.unlink(name)\n    keep.append(fd)\n"
            "print('ready', flush=True)\nsys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        # The mmap module keeps a descriptor of its own: both unlinked files are open, counted exactly.
        held = held_unlinked_bytes([holder.pid], str(tmp_path), 8 << 20)
        assert 2 << 20 <= held < 3 << 20
        assert over_disk_limit(str(tmp_path), [holder.pid], (3 << 20) - 1, 8 << 20)  # 3 MiB in all
        assert not over_disk_limit(str(tmp_path), [holder.pid], 4 << 20, 8 << 20)
        assert held_unlinked_bytes([holder.pid], str(tmp_path / "elsewhere"), 8 << 20) == 0
    finally:
        holder.communicate("")
    assert held_unlinked_bytes([holder.pid], str(tmp_path), 8 << 20) == 0  # gone: holds nothing


def test_disk_watch_counts_a_file_held_by_a_mapping_alone(tmp_path):
    code = ("import ctypes, os, sys\nos.chdir(sys.argv[1])\nlibc = ctypes.CDLL(None)\n"
            "libc.mmap.restype = ctypes.c_void_p\n"
            "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, "
            "ctypes.c_long]\nfd = os.open('f', os.O_RDWR | os.O_CREAT, 0o600)\nos.write(fd, b'x' * 4096)\n"
            "assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)\n"
            "os.close(fd)\nos.unlink('f')\nprint('ready', flush=True)\nsys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        assert held_unlinked_bytes([holder.pid], str(tmp_path), 8 << 20) == 8 << 20  # its size is not readable
    finally:
        holder.communicate("")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged uid needs root")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no /usr/bin/python3 for the unprivileged user")
def test_cleanup_never_follows_links_as_an_unprivileged_user():
    # As non-root a directory without write permission makes unlink fail; a cleanup that
    # "repairs" by chmod-ing the failing path chmods the host file behind a link.
    base = tempfile.mkdtemp(prefix="flashreinforce-cleanup-test-")  # not under pytest's 0700 directory
    os.chmod(base, 0o777)
    code = ("import os, sys, stat\nsys.path.insert(0, sys.argv[1])\n"
            "from flashreinforce.envs.sandbox.cleanup import remove_tree\n"
            "base = sys.argv[2]\ntarget = os.path.join(base, 'target.txt')\nopen(target, 'w').write('original')\n"
            "os.chmod(target, 0o600)\nwork = os.path.join(base, 'work')\nos.mkdir(work)\n"
            "exec(sys.argv[3])\n_plant(work, target)\nremove_tree(work)\n"
            "print(oct(stat.S_IMODE(os.stat(target).st_mode)), os.path.exists(work), sorted(os.listdir(base)))")
    import inspect

    plant_source = inspect.getsource(_plant)
    done = subprocess.run(["/usr/bin/python3", "-c", code, readable_sources(), str(base), plant_source],
                          user=UNPRIVILEGED_UID, group=UNPRIVILEGED_UID,
                          extra_groups=[], capture_output=True, text=True, timeout=60, cwd="/")
    shutil.rmtree(base)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0o600", "False", "['target.txt']"]


@pytest.mark.skipif("seccomp" not in _REPORT.guards, reason="no seccomp filter here to simulate a smaller kernel with")
@pytest.mark.parametrize("missing, level", [("landlock", "filesystem"), ("userns", "filesystem"),
                                            ("landlock,userns", "seccomp")])
def test_machines_with_less(missing, level):
    # A filter in a helper process makes the kernel answer like one without Landlock (ENOSYS)
    # and/or without unprivileged user namespaces (EPERM); the probe and the minimum follow.
    code = f"""
import os, sys
from flashreinforce.envs.sandbox import IsolationError, Sandbox, probe_isolation, seccomp as s
p = s._Program()
p.load(0)
deny = {{"landlock": ((444, 38), (445, 38), (446, 38)), "userns": ((s.SYSCALLS["unshare"][0 if s.current_arch() == "x86_64" else 1], 1),)}}
for nr, err in [x for k in {missing!r}.split(",") for x in deny[k]]:
    p.jump(s._JEQ_K, nr, 0, 1)
    p.ret(s._RET_ERRNO | err)
p.ret(s._RET_ALLOW)
s.install(p.assemble())
report = probe_isolation()
print(report.level)
try:
    result = Sandbox(timeout_s=10).run("print(6 * 7)")
    print("ran", result.isolation, result.stdout.strip())
except IsolationError as exc:
    print("refused", "allow_weak_isolation" in str(exc))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0] == level
    if level == "seccomp":
        assert lines[1] == "refused True"
    else:
        assert lines[1] == f"ran {level} 42"
