"""The Python-tool sandbox: limits, truncation, isolation, and no writes outside its directory."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from flashreinforce.envs.sandbox import Sandbox, run_python

_LANDLOCK = "landlock_fs" in Sandbox(timeout_s=10).run("pass").guards


def _guard_configs():
    configs = [pytest.param({}, id="both-guards"), pytest.param({"landlock": False}, id="audit-hook-only")]
    marks = [] if _LANDLOCK else [pytest.mark.skip(reason="Landlock is not available on this kernel")]
    configs.append(pytest.param({"audit_hook": False}, id="landlock-only", marks=marks))
    return configs


def test_normal_code_runs_and_reports():
    result = run_python("import sys\nx = sum(range(10))\nprint(x)\nprint('warn', file=sys.stderr)\nx * 2",
                        timeout_s=10)
    assert result.ok and result.exit_code == 0 and not result.timed_out
    assert result.stdout == "45\n90\n"  # the final bare expression is printed, notebook style
    assert result.stderr == "warn\n"
    assert "rlimits" in result.guards and "audit_hook" in result.guards
    assert not os.path.exists(result.workdir)


def test_libraries_import_and_stdin_is_closed():
    result = run_python("import numpy, sympy\nprint(sympy.factorint(360), int(numpy.arange(5).sum()))\n"
                        "try:\n    input()\nexcept EOFError:\n    print('eof')", timeout_s=30)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["{2: 3, 3: 2, 5: 1} 10", "eof"]


def test_errors_show_the_users_traceback_only():
    result = run_python("def f():\n    return 1 / 0\nf()", timeout_s=10)
    assert result.exit_code == 1 and not result.ok
    assert 'File "main.py", line 2, in f' in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in result.stderr  # the prelude's frames are hidden
    syntax = run_python("def f(:\n  pass", timeout_s=10)
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


def test_timeout_kills_an_infinite_loop_quickly():
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.exit_code == -signal.SIGKILL and result.signal_name == "SIGKILL"
    assert 1.0 <= result.duration_s and elapsed < 6.0  # killed at the limit, not at some later point
    assert not os.path.exists(result.workdir)


def test_cpu_limit_stops_a_busy_loop():
    result = run_python("x = 0\nwhile True:\n    x += 1", timeout_s=30, cpu_s=1)
    assert result.timed_out and result.exit_code == -signal.SIGXCPU
    assert result.duration_s < 10


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


@pytest.mark.parametrize("options", _guard_configs())
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
    for name, code in attempts.items():
        result = run_python(code, timeout_s=10, **options)
        assert result.exit_code == 1, (name, result.stdout, result.stderr)
        assert "PermissionError" in result.stderr, (name, result.stderr)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "original"


def test_writes_inside_the_working_directory_work_and_vanish():
    code = ("import os, tempfile\nos.mkdir('d')\nopen('d/a.txt', 'w').write('hi')\n"
            "os.rename('d/a.txt', 'b.txt')\nwith tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
            "    f.write('t')\nopen(os.devnull, 'w').write('discarded')\nprint(open('b.txt').read(), os.getcwd())\n"
            "os.chmod('d', 0)")  # an unremovable-looking directory must not survive either
    result = run_python(code, timeout_s=10)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["hi", result.workdir]
    assert not os.path.exists(result.workdir)


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("FLASHREINFORCE_TEST_SECRET", "do-not-leak")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())",
                        timeout_s=10, env={"EXTRA": "1"})
    assert result.ok
    assert "FLASHREINFORCE_TEST_SECRET" not in result.stdout and "do-not-leak" not in result.stdout
    assert "'EXTRA'" in result.stdout and result.stdout.splitlines()[1] == "True"


def test_processes_signals_network_and_ctypes_are_refused():
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


@pytest.mark.skipif(not _LANDLOCK, reason="Landlock is not available on this kernel")
def test_landlock_alone_stops_signals_to_the_parent():
    result = run_python(f"import os\nos.kill({os.getpid()}, 0)", timeout_s=10, audit_hook=False)
    assert result.exit_code == 1 and "PermissionError" in result.stderr
    assert {"landlock_fs", "landlock_signal"} <= set(result.guards)


def test_require_landlock_refuses_to_run_without_it():
    result = run_python("print('ran')", timeout_s=10, landlock=False, require_landlock=True)
    assert result.exit_code == 70 and "ran" not in result.stdout and "Landlock is required" in result.stderr


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        Sandbox(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Sandbox(memory_mb=-1)
    with pytest.raises(ValueError, match="output_limit_bytes"):
        Sandbox(output_limit_bytes=2)
    with pytest.raises(TypeError, match="code must be str"):
        Sandbox().run(b"print(1)")


def test_runs_concurrently_from_threads():
    from concurrent.futures import ThreadPoolExecutor

    sandbox = Sandbox(timeout_s=20)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sandbox.run, [f"print({i} ** 2)" for i in range(8)]))
    assert [r.stdout for r in results] == [f"{i ** 2}\n" for i in range(8)]
    assert len({r.workdir for r in results}) == 8


def test_no_process_is_left_behind():
    # Without the audit hook the code may fork; the forked child must die with the group.
    result = run_python("import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    time.sleep(60)",
                        timeout_s=1.0, audit_hook=False)
    assert result.timed_out and result.duration_s < 6.0
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _group_alive(result.pid):
        time.sleep(0.05)
    assert not _group_alive(result.pid)


def _group_alive(pgid: int) -> bool:
    """True if a live (non-zombie) process is still in process group ``pgid``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
