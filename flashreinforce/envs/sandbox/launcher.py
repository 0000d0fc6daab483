"""The parent side of the sandbox: start the child, feed it, time it, drain it, kill it, clean up.

See the package docstring for usage and docs/sandbox.md for the threat model and the layers.
"""

from __future__ import annotations

import atexit
import ast
import marshal
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from flashreinforce.envs.sandbox.cgroups import PidsCgroup
from flashreinforce.envs.sandbox.cleanup import remove_tree
from flashreinforce.envs.sandbox.disk_watch import over_disk_limit
from flashreinforce.envs.sandbox.isolation import IsolationError, IsolationReport
from flashreinforce.envs.sandbox.levels import LEVELS, missing_for

__all__ = ["Sandbox", "SandboxResult", "run_python", "REFUSED_EXIT"]


# Exit status of a child that refuses to run the code (its isolation is below the minimum).
REFUSED_EXIT = 70
_HERE = os.path.dirname(os.path.abspath(__file__))
_CHILD = os.path.join(_HERE, "child.py")
_CHILD_MODULES = ("child", "levels", "seccomp", "namespaces", "landlock", "audit")
# argv: child.py's path, the configuration, and a file of the child modules' code objects
# compiled by this process (marshal; same interpreter only) or "" to load child.py by path.
# Compiling ~1,000 lines on every call would cost more than the layers themselves.
_BOOTSTRAP = """import sys
path, config, codes = sys.argv[1:4]
if codes:
    import marshal, types
    try:
        with open(codes, "rb") as f:
            codes = marshal.load(f)
    except (OSError, EOFError, ValueError, TypeError):
        codes = None
if codes:
    module = types.ModuleType("_flashreinforce_sandbox_child")
    module.__file__, module._PRECOMPILED = path, codes
    sys.modules[module.__name__] = module
    exec(codes["child"], module.__dict__)
else:
    import importlib.util
    spec = importlib.util.spec_from_file_location("_flashreinforce_sandbox_child", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
module.main([path, config])
"""
_code_file: tuple[int, str] | None = None  # (pid of the process that wrote it, path)
_code_lock = threading.Lock()


def _precompiled_code_file() -> str:
    """Path of a private file holding the child modules' code objects (written once per process;
    again in a forked process, whose parent may remove its own file at exit)."""
    global _code_file
    with _code_lock:
        if _code_file is None or _code_file[0] != os.getpid() or not os.path.exists(_code_file[1]):
            codes = {}
            for name in _CHILD_MODULES:
                path = os.path.join(_HERE, f"{name}.py")
                with open(path, encoding="utf-8") as f:
                    codes[name] = compile(f.read(), path, "exec", dont_inherit=True)
            directory = tempfile.mkdtemp(prefix="flashreinforce-sandbox-code-")  # 0700, this user's
            path = os.path.join(directory, "child.marshal")
            with open(path, "wb") as f:
                marshal.dump(codes, f)
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            _code_file = (os.getpid(), path)
        return _code_file[1]
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# How often the launcher measures the working directory when no tmpfs quota bounds it.
_DISK_POLL_S = 0.25

_probe_cache: dict[tuple, IsolationReport] = {}
_probe_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run produced.

    stdout, stderr: decoded output (UTF-8, undecodable bytes replaced), each cut to the byte
        limit: the head and the tail are kept around a line ``[... N bytes truncated ...]``.
    exit_code: the interpreter's exit status; negative when killed by a signal (``-9`` after a
        timeout, ``-24`` SIGXCPU at the CPU limit); 1 for an uncaught exception (a
        ``MemoryError`` at the memory limit shows in stderr); 70 when the child refused to run
        the code (isolation below the minimum; the reason is in stderr).
    timed_out: a time limit was reached: the wall-clock one (the process group was killed,
        exit code -9) or the CPU one (SIGXCPU, exit code -24).
    duration_s: wall-clock seconds from start to the end of the process.
    stdout_dropped_bytes, stderr_dropped_bytes: bytes removed by truncation (0 if none).
    guards: the layers the child confirmed before running the code (see
        :class:`IsolationReport`); empty when it died before reporting.
    workdir: the working directory it ran in (already deleted when you get the result).
    pid: the child's process id, which is also its process group and session id (the group
        is gone by the time you get the result).
    isolation: the isolation level those guards reach (``none``, ``seccomp``, ``filesystem``,
        ``full``).
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    duration_s: float
    stdout_dropped_bytes: int
    stderr_dropped_bytes: int
    guards: tuple[str, ...]
    workdir: str
    pid: int
    isolation: str = "none"

    @property
    def ok(self) -> bool:
        """True when the code ran to the end without an error and within the time limit."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def signal_name(self) -> str | None:
        """Name of the signal that ended the process (``'SIGKILL'``), or None."""
        if self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"


class _Capture:
    """Keeps the first and last ``limit // 2`` bytes of a stream and counts what it dropped."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit - limit // 2
        self.tail_limit = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        excess = len(self.tail) - self.tail_limit
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        head = self.head.decode("utf-8", errors="replace")
        if not self.dropped:
            return head + self.tail.decode("utf-8", errors="replace")
        return (head + f"\n[... {self.dropped} bytes truncated ...]\n"
                + self.tail.decode("utf-8", errors="replace"))


def _positive_int(name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class Sandbox:
    """Runs Python code in a fresh, confined interpreter; see docs/sandbox.md.

    Limits:
        timeout_s: wall-clock limit in seconds (> 0); everything the run started is killed.
        memory_mb: address-space limit (RLIMIT_AS) in MiB. It counts virtual memory:
            importing numpy and sympy takes about 150 MiB of it. Memory that no mapping shows
            is refused (memfd, SysV and POSIX shared memory) or counted in ``disk_mb``.
        cpu_s: CPU-time limit in seconds; default ``ceil(timeout_s) + 1``.
        output_limit_bytes: bytes kept of stdout and of stderr, each (>= 16).
        file_size_mb: the largest file the code may write, in MiB (RLIMIT_FSIZE).
        disk_mb: the most the working directory may hold, in MiB (a tmpfs quota in the mount
            tree; elsewhere the launcher measures it every 0.25 s, with the unlinked files the
            code still holds there, and kills the run past it).
        max_open_files: RLIMIT_NOFILE.
        max_threads: the most tasks (main thread included) the code may run at once.

    Isolation:
        min_isolation: the weakest level the sandbox accepts (``'none'``, ``'seccomp'``,
            ``'filesystem'``, ``'full'``; default ``'filesystem'``). The constructor probes
            the machine once per process and option set and raises :class:`IsolationError`
            when the level is lower, unless ``allow_weak_isolation``.
        allow_weak_isolation: run anyway below ``min_isolation`` (the level in force is in
            ``sandbox.isolation`` and in every result's ``isolation``).
        allow_network: allow ``AF_INET``/``AF_INET6`` sockets (default False: no socket at
            all, no network namespace interfaces, Landlock TCP rules).
        extra_read_paths: more absolute paths the code may read (datasets, say, or the source
            tree of a package installed editable: of ``sys.path`` only the entries inside the
            Python installation are readable); one that contains the working directory
            (``/tmp``) is not mounted in the mount tree.
        landlock, seccomp, namespaces, cgroup: use that layer when the machine offers it
            (default True). Turning one off is for testing the layers apart (the attack
            suite runs with Landlock forced off); it lowers the level.
        require_landlock: refuse when Landlock is not in force, whatever the level.
        audit_hook: install the audit hook that turns refusals into readable messages
            (default True). It is not a security layer.

    Other:
        print_last_expression: like a notebook cell, print ``repr`` of the value of a final
            bare expression when it is not None (default True).
        python: interpreter to run (default ``sys.executable``; it needs the packages the code
            imports, e.g. numpy or sympy, and not this package).
        base_dir: where the throwaway working directories are created (default the system
            temporary directory).
        env: extra environment variables for the child (added to the minimal set).
    """

    def __init__(self, *, timeout_s: float = 10.0, memory_mb: int = 1024, cpu_s: int | None = None,
                 output_limit_bytes: int = 4096, file_size_mb: int = 16, disk_mb: int = 64,
                 max_open_files: int = 256, max_threads: int = 64, allow_network: bool = False,
                 min_isolation: str = "filesystem", allow_weak_isolation: bool = False,
                 extra_read_paths: Sequence[str] = (), landlock: bool = True, seccomp: bool = True,
                 namespaces: bool = True, cgroup: bool = True, require_landlock: bool = False,
                 audit_hook: bool = True, print_last_expression: bool = True, python: str | None = None,
                 base_dir: str | None = None, env: dict[str, str] | None = None) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        self.memory_mb = _positive_int("memory_mb", memory_mb, 1)
        self.output_limit_bytes = _positive_int("output_limit_bytes", output_limit_bytes, 16)
        self.file_size_mb = _positive_int("file_size_mb", file_size_mb, 1)
        self.disk_mb = _positive_int("disk_mb", disk_mb, 1)
        self.max_open_files = _positive_int("max_open_files", max_open_files, 16)
        self.max_threads = _positive_int("max_threads", max_threads, 1)
        self.cpu_s = _positive_int("cpu_s", math.ceil(timeout_s) + 1 if cpu_s is None else cpu_s, 1)
        if min_isolation not in LEVELS:
            raise ValueError(f"min_isolation must be one of {LEVELS}, got {min_isolation!r}")
        if isinstance(extra_read_paths, (str, bytes)) or not all(
                isinstance(p, str) and os.path.isabs(p) for p in extra_read_paths):
            raise ValueError(f"extra_read_paths must be a list of absolute paths, got {extra_read_paths!r}")
        if require_landlock and not landlock:
            raise ValueError("require_landlock=True contradicts landlock=False")
        if base_dir is not None and not os.path.isdir(base_dir):
            raise ValueError(f"base_dir {base_dir!r} is not a directory")
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("env must map str to str")
        self.timeout_s = float(timeout_s)
        self.allow_network = bool(allow_network)
        self.min_isolation = min_isolation
        self.allow_weak_isolation = bool(allow_weak_isolation)
        self.extra_read_paths = tuple(extra_read_paths)
        self.landlock, self.seccomp = bool(landlock), bool(seccomp)
        self.namespaces, self.cgroup = bool(namespaces), bool(cgroup)
        self.require_landlock = bool(require_landlock)
        self.audit_hook = bool(audit_hook)
        self.print_last_expression = bool(print_last_expression)
        self.python = python or sys.executable
        self.base_dir = base_dir
        self.env = dict(env or {})
        self._remount_fallback = False  # tests: the mount tree's path for kernels before 5.12
        self.isolation = self._probe()
        missing = missing_for(self.min_isolation, self.isolation.guards, self.allow_network)
        if self.require_landlock and "landlock_fs" not in self.isolation.guards:
            raise IsolationError("require_landlock=True but Landlock is not in force: "
                                 + "; ".join(self.isolation.problems))
        if missing and not self.allow_weak_isolation:
            raise IsolationError(
                f"the sandbox's isolation on this machine is {self.isolation.level!r}, below min_isolation="
                f"{self.min_isolation!r}: missing {'; '.join(missing)}. Kernel answers: "
                f"{'; '.join(self.isolation.problems) or 'none'}. Run where these are available (see "
                "docs/sandbox.md and `python -m flashreinforce.envs.sandbox`), lower min_isolation, or pass "
                "allow_weak_isolation=True (python_tool: --env.kwargs '{\"allow_weak_isolation\": true}') "
                "to run with what there is.")

    # -- the child -----------------------------------------------------------------------

    def _probe(self) -> IsolationReport:
        key = (self.python, self.landlock, self.seccomp, self.namespaces, self.cgroup, self.allow_network,
               self.extra_read_paths, self.base_dir)
        with _probe_lock:
            report = _probe_cache.get(key)
            if report is None:
                status = self._spawn(None).status
                report = IsolationReport(
                    level=status.get("level", "none"), guards=tuple(status.get("guards", ())),
                    problems=tuple(status.get("problems", ())), landlock_abi=int(status.get("landlock_abi", 0)),
                    arch=status.get("arch"), python=self.python)
                _probe_cache[key] = report
        return report

    def _child_env(self, workdir: str) -> dict[str, str]:
        env = {
            "PATH": _DEFAULT_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            # One thread per BLAS/OpenMP pool: keeps the address space (RLIMIT_AS), the thread
            # bound and the shared CPU cores of the machine in check.
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }
        env.update(self.env)
        return env

    def _config(self, status_fd: int, cgroup: PidsCgroup | None, probe: bool) -> dict:
        return {
            "probe": probe, "status_fd": status_fd, "cgroup": cgroup.path if cgroup else None,
            "memory_bytes": self.memory_mb * 1024 * 1024, "cpu_s": self.cpu_s,
            "file_size_bytes": self.file_size_mb * 1024 * 1024, "max_open_files": self.max_open_files,
            "max_threads": self.max_threads, "disk_bytes": self.disk_mb * 1024 * 1024,
            # tmpfs inodes cost kernel memory: one per 4 KiB of quota, at least 1024.
            "max_inodes": max(1024, self.disk_mb * 256),
            "allow_network": self.allow_network, "extra_read_paths": list(self.extra_read_paths),
            "landlock": self.landlock, "seccomp": self.seccomp, "namespaces": self.namespaces,
            "require_landlock": self.require_landlock, "min_isolation": self.min_isolation,
            "allow_weak_isolation": self.allow_weak_isolation, "audit_hook": self.audit_hook,
            "print_last_expression": self.print_last_expression, "_remount_fallback": self._remount_fallback,
        }

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (Python source text) as ``__main__`` and return what happened."""
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        return self._spawn(code).result

    def _spawn(self, code: str | None) -> "_Run":
        workdir = tempfile.mkdtemp(prefix="flashreinforce-sandbox-", dir=self.base_dir)
        status_r, status_w = os.pipe()
        proc = cgroup = None
        try:
            if code is not None:
                # A lone surrogate (text no UTF-8 encoder accepts) travels as it is: the
                # interpreter then reports it like any other error of the code.
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
                    f.write(code)
            if self.cgroup:
                cgroup, _ = PidsCgroup.create(self.max_threads)
            cfg = self._config(status_w, cgroup, probe=code is None)
            start = time.monotonic()
            # start_new_session (not preexec_fn, which is unsafe in threaded programs such as
            # the trainer's rollout workers) makes the child a session and group leader.
            same_interpreter = os.path.realpath(self.python) == os.path.realpath(sys.executable)
            codes = _precompiled_code_file() if same_interpreter else ""
            proc = subprocess.Popen(
                [self.python, "-I", "-B", "-c", _BOOTSTRAP, _CHILD, _encode_config(cfg), codes],
                cwd=workdir, env=self._child_env(workdir), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                start_new_session=True, close_fds=True)
            os.close(status_w)
            status_w = -1
            stdout, stderr = _Capture(self.output_limit_bytes), _Capture(self.output_limit_bytes)
            # Without the mount tree's tmpfs quota, the launcher measures the directory itself,
            # with the unlinked files the code still holds there.
            watch = None if code is None or "mount_tree" in self.isolation.guards else \
                _disk_watch(workdir, self.disk_mb * 1024 * 1024, proc.pid, cgroup, self.file_size_mb * 1024 * 1024)
            timed_out, over_disk = self._drain(proc, {proc.stdout: stdout, proc.stderr: stderr},
                                               start + self.timeout_s, watch)
            exit_code = proc.wait()
            duration = time.monotonic() - start
            timed_out = timed_out or exit_code == -signal.SIGXCPU
            _kill_all(proc.pid, cgroup)  # anything the code left behind
            if over_disk:
                stderr.add(f"\nsandbox: the working directory, with the unlinked files the code held there, grew "
                           f"past disk_mb={self.disk_mb} (or could not be measured); the run was stopped\n".encode())
            status = _read_status(status_r)
            result = SandboxResult(
                stdout=stdout.text(), stderr=stderr.text(), exit_code=exit_code,
                timed_out=timed_out, duration_s=duration, stdout_dropped_bytes=stdout.dropped,
                stderr_dropped_bytes=stderr.dropped, guards=tuple(status.get("guards", ())),
                workdir=workdir, pid=proc.pid, isolation=status.get("level", "none"))
            return _Run(result, status)
        finally:
            if proc is not None and proc.poll() is None:
                _kill_all(proc.pid, cgroup)
                proc.wait()
            if cgroup is not None:
                cgroup.kill_all()
                cgroup.remove()
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            if proc is not None:
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            remove_tree(workdir)

    @staticmethod
    def _drain(proc: subprocess.Popen, captures: dict, deadline: float,
               watch: Callable[[], bool] | None) -> tuple[bool, bool]:
        """Reads both pipes until they close; kills at ``deadline`` or when ``watch()`` is True.

        Returns ``(timed_out, stopped_by_watch)``.
        """
        timed_out = stopped = False
        next_watch = time.monotonic() + _DISK_POLL_S
        with selectors.DefaultSelector() as sel:
            for stream in captures:
                sel.register(stream, selectors.EVENT_READ)
            while sel.get_map():
                now = time.monotonic()
                if watch is not None and not stopped and now >= next_watch:
                    next_watch = now + _DISK_POLL_S
                    if watch():
                        stopped = True
                        _kill_group(proc.pid)
                        deadline = min(deadline, now + 1.0)
                remaining = deadline - now
                if remaining <= 0 and not timed_out and not stopped:
                    timed_out = True
                    _kill_group(proc.pid)
                    # After the kill the pipes close promptly; bound the wait anyway.
                    deadline = time.monotonic() + 1.0
                    continue
                if remaining <= 0:
                    break
                for key, _ in sel.select(timeout=min(remaining, _DISK_POLL_S)):
                    data = os.read(key.fd, 65536)
                    if data:
                        captures[key.fileobj].add(data)
                    else:
                        sel.unregister(key.fileobj)
        if not timed_out and proc.poll() is None:
            # Pipes closed but the process lingers (it closed its own stdout/stderr).
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
        return timed_out, stopped


@dataclass(frozen=True)
class _Run:
    result: SandboxResult
    status: dict


def _disk_watch(workdir: str, limit: int, pid: int, cgroup: PidsCgroup | None,
                file_size: int) -> Callable[[], bool]:
    def over() -> bool:
        pids = {pid, *(cgroup.pids() if cgroup is not None else ())}
        return over_disk_limit(workdir, pids, limit, file_size)
    return over


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all(pgid: int, cgroup: PidsCgroup | None) -> None:
    _kill_group(pgid)
    if cgroup is not None:
        cgroup.kill_all()


def _encode_config(cfg: dict) -> str:
    """The child's configuration as its argv carries it: marshal format 2 (read by every Python 3, for a
    ``python=`` interpreter of another version too), in hex. The child decodes it with the builtin
    ``marshal``: ``json`` would import ``re`` and ``enum``, about a third of the child's start-up."""
    return marshal.dumps(cfg, 2).hex()


def _read_status(fd: int) -> dict:
    """The child's status record: ``ascii()`` of a dict of plain values, written before the code runs
    (the pipe is closed to the code), parsed with ``ast.literal_eval`` (literals only); ``{}`` when
    missing or unreadable."""
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 1 << 20)
    except (BlockingIOError, OSError):
        return {}
    try:
        status = ast.literal_eval(data.decode("ascii"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError):
        return {}
    return status if isinstance(status, dict) else {}


def run_python(code: str, **sandbox_options) -> SandboxResult:
    """One-shot helper: ``Sandbox(**sandbox_options).run(code)``."""
    return Sandbox(**sandbox_options).run(code)
