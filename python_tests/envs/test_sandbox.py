"""The Python-tool sandbox: behaviour, limits, and the layers one by one.

The attacks themselves (bypasses, escapes, exhaustion) are in test_sandbox_attacks.py; the
parts that need no particular kernel (levels, the seccomp program, the cleanup) in
test_sandbox_parts.py.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from flashreinforce.envs.sandbox import REFUSED_EXIT, Sandbox, probe_isolation, run_python
from python_tests.envs.unprivileged import REPO
_REPORT = probe_isolation()
_HAS = set(_REPORT.guards)
# Everything here runs sandboxes at the default minimum level; test_sandbox_parts.py covers the
# rest on any machine.
pytestmark = pytest.mark.skipif(not _REPORT.at_least("filesystem"), reason=(
    f"this machine's sandbox isolation is {_REPORT.level!r}, below the default minimum 'filesystem': "
    + "; ".join(_REPORT.problems)))
needs_landlock = pytest.mark.skipif("landlock_fs" not in _HAS, reason="Landlock is not available on this kernel")
needs_tree = pytest.mark.skipif("mount_tree" not in _HAS, reason="no private mount tree here (user namespaces)")
needs_cgroup = pytest.mark.skipif("cgroup_pids" not in _HAS, reason="no writable pids cgroup (needs root or delegation)")


def test_normal_code_runs_and_reports():
    sandbox = Sandbox(timeout_s=10)
    result = sandbox.run("import sys\nx = sum(range(10))\nprint(x)\nprint('warn', file=sys.stderr)\nx * 2")
    assert result.ok and result.exit_code == 0 and not result.timed_out
    assert result.stdout == "45\n90\n"  # the final bare expression is printed, notebook style
    assert result.stderr == "warn\n"
    assert {"rlimits", "seccomp", "audit_hook"} <= set(result.guards)
    assert result.isolation == sandbox.isolation.level and sandbox.isolation.at_least("filesystem")
    assert not os.path.exists(result.workdir)


def test_libraries_import_and_stdin_is_closed():
    result = run_python("import numpy, sympy\nprint(sympy.factorint(360), int(numpy.arange(5).sum()))\n"
                        "try:\n    input()\nexcept EOFError:\n    print('eof')", timeout_s=30)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["{2: 3, 3: 2, 5: 1} 10", "eof"]


def test_threads_asyncio_and_ctypes_callbacks_work():
    code = ("import threading, asyncio\nout = []\nts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\nprint(sorted(out))\n"
            "async def f():\n    await asyncio.sleep(0)\n    return 'async ok'\nprint(asyncio.run(f()))\n"
            # A callback needs executable memory: libffi maps it anonymously, without a memfd.
            "import ctypes\nlibc = ctypes.CDLL(None)\narr = (ctypes.c_int * 4)(3, 1, 4, 2)\n"
            "cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))\n"
            "libc.qsort(arr, 4, ctypes.sizeof(ctypes.c_int), cmp(lambda a, b: a[0] - b[0]))\nprint(list(arr))")
    # asyncio's self-pipe is a socketpair and ctypes is refused by the audit hook: off.
    result = run_python(code, timeout_s=20, audit_hook=False)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == [str(list(range(8))), "async ok", "[1, 2, 3, 4]"]


def test_errors_show_the_users_traceback_only():
    result = run_python("def f():\n    return 1 / 0\nf()", timeout_s=10)
    assert result.exit_code == 1 and not result.ok
    assert 'File "main.py", line 2, in f' in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "sandbox" + os.sep not in result.stderr and "child.py" not in result.stderr  # no sandbox frames
    refused = run_python("import subprocess\nsubprocess.run(['true'])", timeout_s=10)
    assert "audit.py" not in refused.stderr and 'File "main.py", line 2' in refused.stderr
    syntax = run_python("def f(:\n  pass", timeout_s=10)
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


def test_the_code_compiles_as_python_main_py_would():
    # The sandbox's own modules postpone annotations (``from __future__ import annotations``); the code must
    # not inherit that: its annotations are evaluated, as ``python main.py`` evaluates them.
    result = run_python("class A:\n    pass\ndef f(x: A) -> int:\n    pass\nprint(f.__annotations__)\n"
                        "import __future__\nprint(bool(compile('x', 'e', 'eval').co_flags & __future__.annotations."
                        "compiler_flag))", timeout_s=10)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["{'x': <class '__main__.A'>, 'return': <class 'int'>}", "False"]
    last = run_python("x = 3\nx + 1", timeout_s=10, print_last_expression=True)
    assert last.stdout == "4\n"


def test_an_error_past_every_file_descriptor_is_still_reported():
    # The traceback module is imported when the code raises; with no descriptor left for that import, the
    # error is still named.
    result = run_python("import os, sys\nfor k in list(sys.modules):\n    if k.startswith('traceback') or k in "
                        "('linecache', 'tokenize', 'textwrap'):\n        del sys.modules[k]\n"
                        "fds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
                        "except OSError:\n    pass\nraise KeyError('after the descriptors')", timeout_s=10)
    assert result.exit_code == 1
    assert "KeyError" in result.stderr and "after the descriptors" in result.stderr


def test_timeout_kills_an_infinite_loop_quickly():
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.exit_code == -signal.SIGKILL and result.signal_name == "SIGKILL"
    assert 1.0 <= result.duration_s and elapsed < 8.0  # killed at the limit, not at some later point
    assert not os.path.exists(result.workdir)


def test_cpu_limit_stops_a_busy_loop():
    result = run_python("x = 0\nwhile True:\n    x += 1", timeout_s=30, cpu_s=1)
    assert result.timed_out and result.exit_code == -signal.SIGXCPU
    assert result.duration_s < 15


def test_memory_limit_stops_a_huge_allocation():
    result = run_python("x = bytearray(3 * 1024 ** 3)\nprint('allocated')", timeout_s=20, memory_mb=512)
    assert result.exit_code == 1 and "MemoryError" in result.stderr and "allocated" not in result.stdout
    ok = run_python("x = bytearray(64 * 1024 ** 2)\nprint(len(x))", timeout_s=20, memory_mb=512)
    assert ok.ok and ok.stdout == f"{64 * 1024 ** 2}\n"


def test_output_is_truncated_head_and_tail_with_a_marker():
    rng = random.Random()
    limit = rng.randrange(64, 512)
    n = rng.randrange(4 * limit, 20 * limit)
    result = run_python(f"print(''.join(chr(97 + i % 26) for i in range({n})))", timeout_s=10,
                        output_limit_bytes=limit)
    full = "".join(chr(97 + i % 26) for i in range(n)) + "\n"  # what an unlimited run prints
    head, tail = full[: limit - limit // 2], full[len(full) - limit // 2:]
    dropped = len(full) - len(head) - len(tail)
    assert result.stdout_dropped_bytes == dropped
    assert result.stdout == f"{head}\n[... {dropped} bytes truncated ...]\n{tail}"
    small = run_python("print('short')", timeout_s=10, output_limit_bytes=limit)
    assert small.stdout == "short\n" and small.stdout_dropped_bytes == 0


def test_endless_output_is_drained_without_blocking():
    result = run_python("while True:\n    print('x' * 1000)", timeout_s=1.0, output_limit_bytes=100)
    assert result.timed_out and len(result.stdout) < 200 and result.stdout_dropped_bytes > 10_000


def _barriers():
    """The file-system barriers, each alone and together (with the hook off: no Python help)."""
    return [pytest.param({}, id="all-layers"),
            pytest.param({"namespaces": False, "audit_hook": False}, id="landlock-only", marks=needs_landlock),
            pytest.param({"landlock": False, "audit_hook": False}, id="mount-tree-only", marks=needs_tree)]


@pytest.mark.parametrize("options", _barriers())
def test_writes_outside_the_working_directory_fail(tmp_path, options):
    outside = tmp_path / "outside"
    outside.mkdir()
    keep = outside / "keep.txt"
    keep.write_text("original")
    attempts = {
        "open-write": f"open({str(outside / 'new.txt')!r}, 'w').write('x')",
        "open-append": f"open({str(keep)!r}, 'a').write('x')",
        "os-open-creat": f"import os\nos.open({str(outside / 'raw.txt')!r}, os.O_WRONLY | os.O_CREAT)",
        "dir-fd-escape": f"import os\nfd = os.open({str(outside)!r}, os.O_RDONLY)\n"
                         "os.open('esc.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "chdir-then-write": f"import os\nos.chdir({str(outside)!r})\nopen('rel.txt', 'w').write('x')",
        "remove": f"import os\nos.remove({str(keep)!r})",
        "rename-out": f"open('mine.txt', 'w').write('x')\nimport os\nos.rename('mine.txt', {str(outside / 'moved.txt')!r})",
        "symlink-out": f"import os\nos.symlink({str(outside)!r}, 'link')\nopen('link/sym.txt', 'w').write('x')",
        "mkdir": f"import os\nos.mkdir({str(outside / 'sub')!r})",
        "truncate": f"import os\nos.truncate({str(keep)!r}, 0)",
    }
    sandbox = Sandbox(timeout_s=10, **options)
    for name, code in attempts.items():
        result = sandbox.run(code)
        assert result.exit_code == 1, (name, result.stdout, result.stderr)
        # PermissionError (Landlock, the hook), FileNotFoundError (not in the mount tree), or
        # OSError EROFS (the tree is read-only): all OSError subclasses.
        assert any(e in result.stderr for e in ("PermissionError", "FileNotFoundError", "OSError")), (name, result.stderr)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "original"


@pytest.mark.parametrize("options", _barriers())
def test_reads_outside_are_confined(tmp_path, options):
    secret = tmp_path / "secret.txt"
    secret.write_text("top-secret-" + os.urandom(4).hex())
    secret.chmod(0o644)
    allowed = Sandbox(timeout_s=10, extra_read_paths=[str(tmp_path)], **options)
    denied = Sandbox(timeout_s=10, **options)
    code = f"print(open({str(secret)!r}).read())"
    assert allowed.run(code).stdout.strip() == secret.read_text()
    result = denied.run(code)
    assert result.exit_code == 1 and secret.read_text() not in result.stdout + result.stderr


@pytest.mark.parametrize("options", _barriers())
def test_temporary_and_mapped_files_work_but_memfd_is_refused(options):
    # Unlinked temporary files count against disk_mb (a quota in the tree, else the launcher's
    # measurement); memfd files, which nothing would count, are refused.
    code = ("import mmap, os, tempfile\nwith tempfile.TemporaryFile() as f:\n    f.write(b'x' * (1 << 20))\n"
            "    f.flush()\n    m = mmap.mmap(f.fileno(), 1 << 20)\n    print(len(m), m[:2])\n    m.close()\n"
            "try:\n    os.memfd_create('m')\nexcept PermissionError:\n    print('memfd refused')")
    result = Sandbox(timeout_s=10, **options).run(code)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["1048576 b'xx'", "memfd refused"]


def test_writes_inside_the_working_directory_work_and_vanish():
    code = ("import os, tempfile\nos.mkdir('d')\nopen('d/a.txt', 'w').write('hi')\n"
            "os.rename('d/a.txt', 'b.txt')\nwith tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
            "    f.write('t')\nopen(os.devnull, 'w').write('discarded')\nos.symlink('b.txt', 'c.txt')\n"
            "print(open('c.txt').read(), os.getcwd(), os.environ['HOME'] == os.getcwd())")
    result = run_python(code, timeout_s=10)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["hi", result.workdir, "True"]
    assert not os.path.exists(result.workdir)


def test_file_metadata_changes_are_refused_even_inside():
    # chmod/chown/utime are denied by the seccomp filter everywhere (it cannot tell paths apart).
    result = run_python("import os\nopen('f', 'w').close()\nos.chmod('f', 0o600)", timeout_s=10)
    assert result.exit_code == 1 and "PermissionError" in result.stderr and "Operation not permitted" in result.stderr


def test_own_priority_may_be_lowered_but_not_a_group_or_user():
    # os.nice is setpriority(PRIO_PROCESS, 0); PRIO_PGRP and PRIO_USER with who 0 would reach the
    # caller's process group and every process of its uid (the attack suite tries every form).
    # The test may itself run niced (nice -n 10 pytest): the child starts at the caller's niceness.
    code = ("import os\nbefore = os.getpriority(os.PRIO_PROCESS, 0)\nos.nice(3)\n"
            "print(os.getpriority(os.PRIO_PROCESS, 0) - before)\n"
            "for which in (os.PRIO_PGRP, os.PRIO_USER):\n"
            "    try:\n        os.setpriority(which, 0, 19)\n    except PermissionError:\n        print('refused')")
    result = run_python(code, timeout_s=10, audit_hook=False)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["3", "refused", "refused"]


def test_code_with_a_lone_surrogate_fails_like_any_bad_code():
    # Text no UTF-8 encoder takes (a policy's output may hold it) reaches the interpreter, which
    # reports it: an error of the code, not of the sandbox's parent.
    result = run_python("print('a\ud800b')", timeout_s=10)
    assert result.exit_code == 1 and "surrogates not allowed" in result.stderr
    assert not os.path.exists(result.workdir)


def test_descriptor_flags_work_but_signal_owners_are_refused():
    # O_NONBLOCK and the other flags stay settable; an owner to signal, or O_ASYNC, does not.
    code = ("import fcntl, os\nr, w = os.pipe()\nos.set_blocking(w, False)\n"
            "print(os.get_blocking(w), fcntl.fcntl(w, fcntl.F_GETOWN))\n"
            "for cmd, arg in ((fcntl.F_SETOWN, os.getpid()), (fcntl.F_SETFL, os.O_ASYNC)):\n"
            "    try:\n        fcntl.fcntl(w, cmd, arg)\n    except PermissionError:\n        print('refused')")
    result = run_python(code, timeout_s=10)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["False", "0", "refused", "refused"]


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("FLASHREINFORCE_TEST_SECRET", "do-not-leak")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())",
                        timeout_s=10, env={"EXTRA": "1"})
    assert result.ok
    assert "FLASHREINFORCE_TEST_SECRET" not in result.stdout and "do-not-leak" not in result.stdout
    assert "'EXTRA'" in result.stdout and result.stdout.splitlines()[1] == "True"


def test_parent_environment_is_unreadable():
    # The parent must hold the secret in its initial environment (what /proc shows), so it is a
    # separate process, started with the secret.
    secret = "hf_" + os.urandom(8).hex()
    code = ("from flashreinforce.envs.sandbox import Sandbox\n"
            "print(Sandbox().run(\"import os\\nprint(open(f'/proc/{os.getppid()}/environ').read())\").stderr)")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HF_TOKEN": secret}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert secret not in done.stdout and "Error" in done.stdout


def test_audit_hook_gives_readable_messages():
    for code, needle in [
        ("import subprocess\nsubprocess.run(['true'])", "starting processes"),
        ("import os\nos.system('true')", "starting processes"),
        ("import os\nos.fork()", "starting processes"),
        (f"import os\nos.kill({os.getpid()}, 0)", "signalling other processes"),
        ("import socket\nsocket.socket()", "network access"),
        ("import ctypes\nctypes.CDLL('libc.so.6')", "ctypes"),
    ]:
        result = run_python(code, timeout_s=10)
        assert result.exit_code == 1 and needle in result.stderr, (code, result.stderr)


def test_the_kernel_refuses_without_the_audit_hook():
    for code in ["import subprocess\nsubprocess.run(['true'])", "import os\nos.fork()",
                 f"import os\nos.kill({os.getpid()}, 0)", "import socket\nsocket.socket()",
                 "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "if libc.fork() < 0:\n    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))"]:
        result = run_python(code, timeout_s=10, audit_hook=False)
        assert result.exit_code == 1 and "Operation not permitted" in result.stderr, (code, result.stderr)


def test_network_when_allowed(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(20)
    port = server.getsockname()[1]
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=10)\ns.sendall(b'hello')\n"
            "try:\n    socket.socket(socket.AF_UNIX)\nexcept PermissionError:\n    print('no unix')")
    result = run_python(code, timeout_s=20, allow_network=True, audit_hook=False)
    conn, _ = server.accept()
    assert conn.recv(5) == b"hello" and result.ok and result.stdout == "no unix\n", result.stderr
    conn.close()
    server.close()


def test_the_child_refuses_when_a_layer_is_lost_after_the_probe():
    sandbox = Sandbox(timeout_s=10)
    sandbox.seccomp = False  # as if the machine lost seccomp between the probe and this run
    result = sandbox.run("print('ran')")
    assert result.exit_code == REFUSED_EXIT and "ran" not in result.stdout
    assert "refusing to run the code" in result.stderr and "seccomp" in result.stderr
    assert result.isolation == "none"


@needs_landlock
def test_require_landlock():
    with pytest.raises(ValueError, match="require_landlock"):
        Sandbox(landlock=False, require_landlock=True)
    sandbox = Sandbox(require_landlock=True, timeout_s=10)
    sandbox.landlock = False  # lost after the probe: the child refuses
    result = sandbox.run("print('ran')")
    assert result.exit_code == REFUSED_EXIT and "require_landlock" in result.stderr and "ran" not in result.stdout


@needs_tree
def test_mount_tree_by_remounting_for_older_kernels(tmp_path):
    sandbox = Sandbox(timeout_s=10, landlock=False)
    sandbox._remount_fallback = True  # the path taken where mount_setattr (Linux 5.12) is missing
    code = ("import os\nopen('ok.txt', 'w').write('x')\nfor p in ('/usr/flashreinforce-x', '/tmp/x', '/etc/x'):\n"
            "    try:\n        open(p, 'w')\n    except OSError as e:\n        print(type(e).__name__, e.errno)\n"
            "print(sorted(os.listdir('/')))")
    result = sandbox.run(code)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith(("OSError 30", "PermissionError", "FileNotFoundError")) for line in lines[:3]), lines
    assert "mount_tree" in result.guards and "home" not in lines[3]


def test_runs_concurrently_from_threads():
    from concurrent.futures import ThreadPoolExecutor

    sandbox = Sandbox(timeout_s=30)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sandbox.run, [f"print({i} ** 2)" for i in range(8)]))
    assert [r.stdout for r in results] == [f"{i ** 2}\n" for i in range(8)]
    assert len({r.workdir for r in results}) == 8


@needs_cgroup
def test_cgroup_kills_a_setsid_child_without_seccomp():
    # With seccomp off the code can fork; a child that leaves the process group (setsid) must
    # still die with the run: the pids cgroup catches it.
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
            "print(pid, flush=True)\ntime.sleep(60)")
    result = run_python(code, timeout_s=1.0, audit_hook=False, seccomp=False, min_isolation="none",
                        allow_weak_isolation=True)
    assert result.timed_out
    child = int(result.stdout.split()[0])
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
