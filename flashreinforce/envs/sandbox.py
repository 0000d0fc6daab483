"""Run a snippet of Python in a separate, constrained process (the tool of ``PythonToolEnv``).

Usable on its own::

    from flashreinforce.envs.sandbox import Sandbox
    result = Sandbox(timeout_s=5.0, memory_mb=1024).run("print(sum(range(10)))")
    result.stdout        # '45\\n'

Every call starts a fresh interpreter (``python -I -B``: isolated mode, no user site, no
``PYTHON*`` variables, no bytecode writes) in its own process group and session, with:

- a wall-clock limit: at ``timeout_s`` the whole process group is killed (SIGKILL);
- resource limits set inside the child before the code runs (soft = hard, so the code cannot
  raise them again): address space ``memory_mb`` (RLIMIT_AS), CPU seconds (RLIMIT_CPU), the
  size of any one file it writes (RLIMIT_FSIZE), no core files, a bounded number of open files;
- a throwaway working directory (``tempfile.mkdtemp``) that is also ``HOME`` and ``TMPDIR``,
  removed after the run whatever happened;
- a minimal environment (no variable of the parent is inherited: no tokens, no keys);
- stdin connected to ``/dev/null`` (reads see end-of-file); stdout and stderr captured
  separately and cut to ``output_limit_bytes`` each (head and tail kept, with a marker that
  says how many bytes were dropped), while the rest is drained so the child never blocks;
- two independent guards against writing outside the working directory:

  * **Landlock** (Linux >= 5.13, unprivileged, enforced by the kernel): the child restricts
    itself so that every file-system write right (create, write, truncate, remove, rename,
    link, mkdir, mknod, symlink) is granted only beneath its working directory (and writing
    to ``/dev/null``). With Landlock ABI >= 4 TCP bind/connect are denied too (unless
    ``allow_network``), and with ABI >= 6 the child cannot signal processes outside itself
    (it cannot kill the trainer). This holds for native code as well as Python code.
  * **an audit hook** (``sys.addaudithook``, PEP 578) installed before the code runs: it
    refuses ``open`` for writing and path mutations (``os.remove``, ``os.rename``,
    ``os.mkdir``, ``os.chmod``, ``os.symlink``, ``sqlite3.connect``, ...) outside the working
    directory (paths resolved with ``realpath``, ``dir_fd`` and file descriptors resolved via
    ``/proc/self/fd``), opening a directory outside it (which would give a ``dir_fd``),
    starting processes (``subprocess``, ``os.system``, ``os.fork``, ``os.exec*``, spawn),
    signalling other processes, creating sockets (unless ``allow_network``), and loading
    libraries or reading raw memory through ``ctypes``.

  :attr:`SandboxResult.guards` lists the guards the child confirmed before running the code.

What this does **not** protect against: it is not a security boundary in the way a container
or a VM is. Reads are not restricted (the code can read any file the trainer's user can read).
Without Landlock (older kernels, or a seccomp profile that blocks its syscalls), only the audit
hook stands between the code and the file system, and native code (C extensions, or a way
around the ``ctypes`` block) does not pass through audit hooks. CPU and memory limits are per
process. Run untrusted models' code inside a container, gVisor, nsjail or a VM as well.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["Sandbox", "SandboxResult", "run_python"]

# Exit status the child uses when it refuses to run (a guard that was required is missing).
_REFUSED_EXIT = 70

# The program the sandboxed interpreter runs first (``python -I -B -c _PRELUDE CONFIG``). It
# sets the limits, applies Landlock, installs the audit hook, reports which guards are active on
# a private pipe, and then executes ``main.py`` of the working directory as ``__main__``. It is
# kept self-contained (standard library only) because the child must not import flashreinforce.
_PRELUDE = r'''
import json, os, sys
_cfg = json.loads(sys.argv[1])
sys.argv = ["main.py"]
sys.dont_write_bytecode = True


def _set_limits(cfg):
    import resource
    for name, value in (("RLIMIT_AS", cfg["memory_bytes"]), ("RLIMIT_CPU", cfg["cpu_s"]),
                        ("RLIMIT_FSIZE", cfg["file_size_bytes"]), ("RLIMIT_CORE", 0),
                        ("RLIMIT_NOFILE", cfg["max_open_files"])):
        if value is None or not hasattr(resource, name):
            continue
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        # Hard = soft, so the code cannot raise it again. For CPU the soft limit sends SIGXCPU
        # (which kills) and the hard one, a second later, SIGKILL.
        new_hard = soft + 1 if name == "RLIMIT_CPU" else soft
        if hard != resource.RLIM_INFINITY:
            new_hard = min(new_hard, hard)
        resource.setrlimit(limit, (soft, new_hard))


def _landlock(root, allow_network):
    """Restrict writes to ``root`` with Landlock; returns the guard names it enabled."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    create, add_rule, restrict = 444, 445, 446  # same numbers on every Linux architecture
    abi = syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock unavailable: " + os.strerror(ctypes.get_errno()))
    write_file, truncate = 1 << 1, 1 << 14
    fs = write_file | sum(1 << bit for bit in (4, 5, 6, 7, 8, 9, 10, 11, 12))  # remove/make rights
    if abi >= 2:
        fs |= 1 << 13  # REFER (rename/link across directories)
    if abi >= 3:
        fs |= truncate
    net = 0b11 if abi >= 4 and not allow_network else 0  # BIND_TCP | CONNECT_TCP
    scoped = 0b11 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = RulesetAttr(fs, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for path, allowed in ((root, fs), ("/dev/null", write_file | (truncate if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(allowed, fd)
        if syscall(add_rule, ruleset, 1, ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_add_rule failed for " + path)
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, required by restrict_self
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if syscall(restrict, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)
    guards = ["landlock_fs"]
    if net:
        guards.append("landlock_net")
    if scoped:
        guards.append("landlock_signal")
    return guards


def _install_audit_hook(root, allow_network):
    import stat
    realpath, fsdecode, fspath, sep = os.path.realpath, os.fsdecode, os.fspath, os.sep
    root = realpath(root)
    devices = {"/dev/null", "/dev/stdout", "/dev/stderr"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    own_pid = os.getpid()

    def resolve(path, dir_fd=None):
        if isinstance(path, int):
            return realpath("/proc/self/fd/%d" % path)
        path = fsdecode(fspath(path))
        if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):
            path = os.path.join(realpath("/proc/self/fd/%d" % dir_fd), path)
        return realpath(path)

    def inside(path, dir_fd=None):
        resolved = resolve(path, dir_fd)
        return resolved == root or resolved.startswith(root + sep) or resolved in devices

    def refuse(what):
        raise PermissionError("sandbox: " + what)

    def check_paths(event, paths, dir_fd=None):
        for path in paths:
            if path is not None and not inside(path, dir_fd):
                refuse("%s outside the working directory is not allowed: %r" % (event, path))

    processes = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                 "subprocess.Popen", "pty.spawn", "os.startfile"}
    mutations = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
                 "os.truncate": 1, "os.utime": 1, "os.chflags": 1, "os.lchflags": 1,
                 "os.setxattr": 1, "os.removexattr": 1, "os.mkfifo": 1, "os.mknod": 1,
                 "os.rename": 2, "os.link": 2, "os.symlink": 2}
    ctypes_events = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata",
                     "ctypes.cdata/buffer"}

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & write_flags)
            if inside(path):
                return
            if writing:
                refuse("writing outside the working directory is not allowed: %r" % (path,))
            try:
                is_dir = stat.S_ISDIR(os.stat(path).st_mode)
            except OSError:
                return
            if is_dir:  # a directory fd outside would let dir_fd-relative opens escape
                refuse("opening a directory outside the working directory is not allowed: %r" % (path,))
        elif event in mutations:
            n = mutations[event]
            dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod",
                                           "os.chown", "os.utime", "os.mkfifo", "os.mknod") else None
            if event == "os.symlink":
                # The link lives at args[1] (relative to dir_fd); its target must stay inside too.
                check_paths(event, [args[1]], args[2])
                target = args[0]
                if not isinstance(target, int) and not os.path.isabs(fsdecode(fspath(target))):
                    target = os.path.join(os.path.dirname(resolve(args[1], args[2])), fsdecode(fspath(target)))
                check_paths(event, [target])
            elif event in ("os.rename", "os.link"):
                check_paths(event, [args[0]], args[2])
                check_paths(event, [args[1]], args[3])
            else:
                check_paths(event, list(args[:n]), dir_fd if isinstance(dir_fd, int) else None)
        elif event == "sqlite3.connect":
            database = args[0]
            if database not in (":memory:", "", b":memory:", b"") and not inside(database):
                refuse("sqlite3.connect outside the working directory is not allowed: %r" % (database,))
        elif event in processes:
            refuse("starting processes is not allowed (%s)" % event)
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in (0, own_pid, os.getpgid(0)):
                refuse("signalling other processes is not allowed (%s)" % event)
        elif event == "signal.pthread_kill":
            return
        elif event == "socket.__new__" and not allow_network:
            refuse("network access is not allowed")
        elif event in ctypes_events:
            refuse("ctypes library loading and raw memory access are not allowed (%s)" % event)

    sys.addaudithook(hook)


def _run_main(print_last_expression):
    import ast, traceback
    with open("main.py", "r", encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"}
    try:
        tree = ast.parse(source, "main.py")
        last = None
        if print_last_expression and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "main.py", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "main.py", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as exc:
        # Drop this prelude's frames (its file name is "<string>") from the traceback and from
        # chained ones, so the policy sees only its own code and the libraries it called.
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        pending, seen = [report], set()
        while pending:
            te = pending.pop()
            if id(te) in seen:
                continue
            seen.add(id(te))
            te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != "<string>"])
            pending += [x for x in (te.__cause__, te.__context__) if x is not None]
        sys.stderr.write("".join(report.format()))
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def _main(cfg):
    guards, problems = [], []
    _set_limits(cfg)
    guards.append("rlimits")
    import ctypes  # imported before the audit hook so that ``import ctypes`` later stays possible
    if cfg["landlock"]:
        try:
            guards += _landlock(os.getcwd(), cfg["allow_network"])
        except (OSError, AttributeError) as exc:
            problems.append(str(exc))
    if cfg["audit_hook"]:
        _install_audit_hook(os.getcwd(), cfg["allow_network"])
        guards.append("audit_hook")
    refused = cfg["require_landlock"] and "landlock_fs" not in guards
    os.write(cfg["status_fd"], json.dumps({"guards": guards, "problems": problems, "refused": refused}).encode())
    os.close(cfg["status_fd"])
    if refused:
        sys.stderr.write("sandbox: Landlock is required but unavailable: %s\n" % "; ".join(problems))
        sys.exit(__REFUSED_EXIT__)
    _run_main(cfg["print_last_expression"])


_main(_cfg)
'''.replace("__REFUSED_EXIT__", str(_REFUSED_EXIT))

_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run produced.

    stdout, stderr: decoded output (UTF-8, undecodable bytes replaced), each cut to the byte
        limit: the head and the tail are kept around a line ``[... N bytes truncated ...]``.
    exit_code: the interpreter's exit status; negative when killed by a signal (``-9`` after a
        timeout, ``-24`` SIGXCPU at the CPU limit); 1 for an uncaught exception (a
        ``MemoryError`` at the memory limit shows in stderr).
    timed_out: a time limit was reached: the wall-clock one (the process group was killed,
        exit code -9) or the CPU one (SIGXCPU, exit code -24).
    duration_s: wall-clock seconds from start to the end of the process.
    stdout_dropped_bytes, stderr_dropped_bytes: bytes removed by truncation (0 if none).
    guards: the protections the child confirmed before running the code (``rlimits``,
        ``landlock_fs``, ``landlock_net``, ``landlock_signal``, ``audit_hook``); empty when it
        died before reporting.
    workdir: the working directory it ran in (already deleted when you get the result).
    pid: the child's process id, which is also its process group id (the group is gone by
        the time you get the result).
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


class Sandbox:
    """Runs Python code in a fresh, constrained interpreter; see the module docstring.

    Args:
        timeout_s: wall-clock limit in seconds (> 0); the process group is killed at the limit.
        memory_mb: address-space limit (RLIMIT_AS) in MiB (> 0). Note it counts virtual memory:
            importing numpy and sympy takes about 150 MiB of it.
        cpu_s: CPU-time limit in seconds; default ``ceil(timeout_s) + 1``.
        output_limit_bytes: bytes kept of stdout and of stderr, each (>= 16).
        file_size_mb: the largest file the code may write, in MiB (RLIMIT_FSIZE).
        max_open_files: RLIMIT_NOFILE for the child.
        allow_network: allow sockets (default False: refused by the audit hook and, with
            Landlock ABI >= 4, TCP bind/connect refused by the kernel).
        landlock: apply the Landlock guard when the kernel offers it (default True).
        require_landlock: refuse to run code (exit status 70, message in stderr) when Landlock
            is unavailable, instead of relying on the audit hook alone.
        audit_hook: install the audit-hook guard (default True). Turning it off leaves process
            creation, sockets and ctypes unrestricted; it exists for testing the guards apart.
        print_last_expression: like a notebook cell, print ``repr`` of the value of a final
            bare expression when it is not None (default True).
        python: interpreter to run (default ``sys.executable``; it needs the packages the code
            imports, e.g. numpy or sympy).
        base_dir: where the throwaway working directories are created (default the system
            temporary directory).
        env: extra environment variables for the child (added to the minimal set).
    """

    def __init__(self, *, timeout_s: float = 10.0, memory_mb: int = 1024, cpu_s: int | None = None,
                 output_limit_bytes: int = 4096, file_size_mb: int = 16, max_open_files: int = 256,
                 allow_network: bool = False, landlock: bool = True, require_landlock: bool = False,
                 audit_hook: bool = True, print_last_expression: bool = True,
                 python: str | None = None, base_dir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        for name, value, low in (("memory_mb", memory_mb, 1), ("output_limit_bytes", output_limit_bytes, 16),
                                 ("file_size_mb", file_size_mb, 1), ("max_open_files", max_open_files, 16)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if cpu_s is None:
            cpu_s = math.ceil(timeout_s) + 1
        if not isinstance(cpu_s, int) or isinstance(cpu_s, bool) or cpu_s < 1:
            raise ValueError(f"cpu_s must be an integer >= 1, got {cpu_s!r}")
        if base_dir is not None and not os.path.isdir(base_dir):
            raise ValueError(f"base_dir {base_dir!r} is not a directory")
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("env must map str to str")
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.cpu_s = cpu_s
        self.output_limit_bytes = output_limit_bytes
        self.file_size_mb = file_size_mb
        self.max_open_files = max_open_files
        self.allow_network = bool(allow_network)
        self.landlock = bool(landlock)
        self.require_landlock = bool(require_landlock)
        self.audit_hook = bool(audit_hook)
        self.print_last_expression = bool(print_last_expression)
        self.python = python or sys.executable
        self.base_dir = base_dir
        self.env = dict(env or {})

    def _child_env(self, workdir: str) -> dict[str, str]:
        env = {
            "PATH": _DEFAULT_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            # One thread per BLAS/OpenMP pool: keeps the address space (RLIMIT_AS) and the
            # shared CPU cores of the machine in check.
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }
        env.update(self.env)
        return env

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (Python source text) as ``__main__`` and return what happened."""
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        workdir = tempfile.mkdtemp(prefix="flashreinforce-sandbox-", dir=self.base_dir)
        status_r, status_w = os.pipe()
        proc = None
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            cfg = {
                "memory_bytes": self.memory_mb * 1024 * 1024, "cpu_s": self.cpu_s,
                "file_size_bytes": self.file_size_mb * 1024 * 1024, "max_open_files": self.max_open_files,
                "landlock": self.landlock, "require_landlock": self.require_landlock,
                "audit_hook": self.audit_hook, "allow_network": self.allow_network,
                "print_last_expression": self.print_last_expression, "status_fd": status_w,
            }
            start = time.monotonic()
            # start_new_session (not preexec_fn, which is unsafe in threaded programs such as
            # the trainer's rollout workers) puts the child in its own process group.
            proc = subprocess.Popen(
                [self.python, "-I", "-B", "-c", _PRELUDE, json.dumps(cfg)],
                cwd=workdir, env=self._child_env(workdir), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                start_new_session=True, close_fds=True)
            os.close(status_w)
            status_w = -1
            stdout, stderr = _Capture(self.output_limit_bytes), _Capture(self.output_limit_bytes)
            timed_out = self._drain(proc, {proc.stdout: stdout, proc.stderr: stderr}, start + self.timeout_s)
            exit_code = proc.wait()
            duration = time.monotonic() - start
            timed_out = timed_out or exit_code == -signal.SIGXCPU
            _kill_group(proc.pid)  # anything the code left behind in its group
            guards = _read_status(status_r)
            return SandboxResult(
                stdout=stdout.text(), stderr=stderr.text(), exit_code=exit_code,
                timed_out=timed_out, duration_s=duration, stdout_dropped_bytes=stdout.dropped,
                stderr_dropped_bytes=stderr.dropped, guards=guards, workdir=workdir, pid=proc.pid)
        finally:
            if proc is not None and proc.poll() is None:
                _kill_group(proc.pid)
                proc.wait()
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            if proc is not None:
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            _remove_tree(workdir)

    @staticmethod
    def _drain(proc: subprocess.Popen, captures: dict, deadline: float) -> bool:
        """Reads both pipes until they close; kills the group at ``deadline``. Returns timed_out."""
        timed_out = False
        with selectors.DefaultSelector() as sel:
            for stream in captures:
                sel.register(stream, selectors.EVENT_READ)
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not timed_out:
                    timed_out = True
                    _kill_group(proc.pid)
                    # After the kill the pipes close promptly; bound the wait anyway in case
                    # a process outside the group (it cannot create one) kept them open.
                    deadline = time.monotonic() + 1.0
                    continue
                if remaining <= 0:
                    break
                for key, _ in sel.select(timeout=min(remaining, 0.25)):
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
        return timed_out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_status(fd: int) -> tuple[str, ...]:
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 65536)
    except (BlockingIOError, OSError):
        return ()
    try:
        return tuple(json.loads(data.decode()).get("guards", ()))
    except (ValueError, AttributeError):
        return ()


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func, p, _exc):
        # The code may have removed permissions from what it created; restore and retry once.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)


def run_python(code: str, **sandbox_options) -> SandboxResult:
    """One-shot helper: ``Sandbox(**sandbox_options).run(code)``."""
    return Sandbox(**sandbox_options).run(code)
