"""What the sandbox attacks share: the code put before them, their set-ups and their checks.

An attack (:class:`Attack`) is Python source run in the sandbox; it prints ``BLOCKED:<what>:...``
when the operation it tries fails and ``ESCAPED:<what>:...`` when it succeeds (``HELPERS``'
``_attempt``). The set-ups prepare host-side targets (files, a decoy process, listening
sockets) and the checks judge containment from outside (host files unchanged, decoys alive,
listeners silent, secrets absent, no survivor, the parent not signalled, a limit enforced).
The attacks themselves are in ``sandbox_attacks.py`` and ``sandbox_attacks_indirect.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import textwrap
from dataclasses import dataclass, field
from typing import Callable

# -- code shared by the attacks -----------------------------------------------------------

HELPERS = textwrap.dedent('''
    import os, sys
    def _attempt(what, fn):
        try:
            value = fn()
        except (Exception, MemoryError) as exc:
            print(f"BLOCKED:{what}:{type(exc).__name__}:{getattr(exc, 'errno', None)}", flush=True)
            return None
        print(f"ESCAPED:{what}:{value!r}"[:400], flush=True)
        return value
''')

# Switch the audit hook off by replacing the function its closures call to refuse, found with
# gc (works on any hook that refuses through a closure variable named ``refuse``).
GC_BYPASS = textwrap.dedent('''
    import gc
    def _noop(*args, **kwargs):
        return None
    for _f in gc.get_objects():
        if type(_f).__name__ == "function" and _f.__closure__ and _f.__code__.co_filename != "main.py":
            for _c in _f.__closure__:
                try:
                    if getattr(_c.cell_contents, "__name__", "") == "refuse":
                        _c.cell_contents = _noop
                except ValueError:
                    pass
''')

# Get a refusal, walk its traceback into the hook's frames and empty every set/dict they use
# (their closure variables) and every event table in their globals.
TRACEBACK_BYPASS = textwrap.dedent('''
    try:
        os.kill(1, 0)
    except PermissionError as _exc:
        _tb = _exc.__traceback__
        while _tb is not None:
            _frame = _tb.tb_frame
            if _frame.f_code.co_filename != "main.py":
                for _value in list(_frame.f_locals.values()):
                    if isinstance(_value, (set, dict)):
                        _value.clear()
                for _key, _value in list(_frame.f_globals.items()):
                    if isinstance(_value, frozenset):
                        _frame.f_globals[_key] = frozenset()
                    elif isinstance(_value, dict) and _key.startswith("_") and _key[1:2].isupper():
                        _frame.f_globals[_key] = {}
            _tb = _tb.tb_next
''')

# Make every isinstance() answer True: a hook that returns early for "fd arguments"
# (isinstance(path, int)) then lets every open() through.
ISINSTANCE_BYPASS = textwrap.dedent('''
    import builtins
    _real_isinstance = builtins.isinstance
    builtins.isinstance = lambda obj, types: True
''')

CTYPES = textwrap.dedent('''
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syscall.restype = ctypes.c_long
    def _syscall(nr, *args):
        rc = _libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return rc
''')


def syscall_nr(x86_64: int, aarch64: int) -> int:
    return x86_64 if os.uname().machine == "x86_64" else aarch64


# -- attacks, set-ups and checks -------------------------------------------------------


@dataclass
class Attack:
    """One attack: ``code`` is formatted with the context ``setup`` returns (``{name}`` keys).

    setup(base_dir, uid) -> dict: prepares host-side artifacts (owned by ``uid``, the uid the
        sandbox runs as, so that only the sandbox, not file permissions, can stop the attack).
    check(ctx, result, runner) -> str | None: None when contained, else what escaped.
    prefix: code put before the attack (helpers, audit-hook bypasses).
    needs_blocked: the output must contain a BLOCKED line (the attack reached its attempt).
    options: Sandbox options for this attack (limits).
    level: the weakest isolation level that claims to contain it (docs/sandbox.md, "Levels"):
        ``none`` for the limits, ``seccomp`` for what the filter stops (processes, signals,
        sockets, scheduling, kernel interfaces, metadata), ``filesystem`` for reads and writes
        of files (``/proc`` entries of other processes included). It runs in every configuration
        at that level or above.
    """

    name: str
    category: str
    code: str
    setup: Callable[[str, int], dict] = lambda base, uid: {}
    check: Callable[[dict, dict, dict], str | None] = lambda ctx, result, runner: None
    prefix: str = HELPERS
    needs_blocked: bool = True
    options: dict = field(default_factory=dict)
    skip_reason: str | None = None
    level: str = "filesystem"

    def source(self, ctx: dict) -> str:
        return self.prefix + "\n" + textwrap.dedent(self.code).format(**ctx)


def _own(path: str, uid: int) -> None:
    os.chown(path, uid, uid)


def host_files(base: str, uid: int) -> dict:
    """A host directory outside the sandbox with a secret, a target file and nothing else."""
    directory = os.path.join(base, "host")
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o755)
    secret = "secret-" + os.urandom(8).hex()
    for name, text, mode in (("secret.txt", secret, 0o644), ("target.txt", "original", 0o640)):
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
        os.utime(path, (1_000_000_000, 1_000_000_000))
        _own(path, uid)
    _own(directory, uid)
    target = os.path.join(directory, "target.txt")
    return {"dir": directory, "secret_path": os.path.join(directory, "secret.txt"), "secret": secret,
            "target": target, "target_stat": _stat_tuple(target), "entries": sorted(os.listdir(directory))}


def _stat_tuple(path: str) -> tuple:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size


def check_host_files(ctx: dict, result: dict, runner: dict) -> str | None:
    if _stat_tuple(ctx["target"]) != ctx["target_stat"]:
        return f"target file changed: {ctx['target_stat']} -> {_stat_tuple(ctx['target'])}"
    with open(ctx["target"]) as f:
        if f.read() != "original":
            return "target file content changed"
    if sorted(os.listdir(ctx["dir"])) != ctx["entries"]:
        return f"host directory changed: {sorted(os.listdir(ctx['dir']))}"
    return None


def decoy(base: str, uid: int) -> dict:
    """A host process (as ``uid``) the attack will try to kill or trace; plus host files."""
    import subprocess

    ctx = host_files(base, uid)
    kwargs = {"user": uid, "group": uid, "extra_groups": []} if os.geteuid() == 0 and uid != 0 else {}
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True, **kwargs)
    ctx.update(decoy=proc.pid, decoy_proc=proc)
    return ctx


def check_decoy(ctx: dict, result: dict, runner: dict) -> str | None:
    proc = ctx["decoy_proc"]
    alive = proc.poll() is None
    tracer = "0"
    if alive:
        with open(f"/proc/{proc.pid}/status") as f:
            tracer = next((line.split()[1] for line in f if line.startswith("TracerPid:")), "0")
    proc.kill()
    proc.wait()
    if not alive:
        return f"decoy process was killed (status {proc.returncode})"
    if tracer != "0":
        return f"decoy process is being traced by {tracer}"
    return None


def listeners(base: str, uid: int) -> dict:
    """Loopback TCP and UDP, a UNIX socket file and an abstract UNIX socket, all listening."""
    ctx = host_files(base, uid)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    path = os.path.join(ctx["dir"], "unix.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(path)
    os.chmod(path, 0o777)
    unix.listen(8)
    abstract_name = "\0flashreinforce-attack-" + os.urandom(6).hex()
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(abstract_name)
    abstract.listen(8)
    for s in (tcp, udp, unix, abstract):
        s.setblocking(False)
    ctx.update(tcp_port=tcp.getsockname()[1], udp_port=udp.getsockname()[1], unix_path=path,
               abstract=abstract_name[1:], sockets=(tcp, udp, unix, abstract), entries=sorted(os.listdir(ctx["dir"])))
    return ctx


def check_listeners(ctx: dict, result: dict, runner: dict) -> str | None:
    received = []
    tcp, udp, unix, abstract = ctx["sockets"]
    for name, s in (("tcp", tcp), ("unix", unix), ("abstract", abstract)):
        try:
            conn, _ = s.accept()
            conn.close()
            received.append(name)
        except BlockingIOError:
            pass
    try:
        udp.recvfrom(100)
        received.append("udp")
    except BlockingIOError:
        pass
    for s in ctx["sockets"]:
        s.close()
    return f"connections reached the host: {received}" if received else check_host_files(ctx, result, runner)


def check_secret(ctx: dict, result: dict, runner: dict) -> str | None:
    text = result["stdout"] + result["stderr"]
    for key in ("secret", "env_secret"):
        if ctx.get(key) and ctx[key] in text:
            return f"{key} appeared in the output"
    return check_host_files(ctx, result, runner) if "target" in ctx else None


def check_no_survivor(ctx: dict, result: dict, runner: dict) -> str | None:
    pids = [int(line.split(":")[1]) for line in result["stdout"].splitlines() if line.startswith("CHILDPID:")]
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"processes survived the run: {survivors}" if survivors else check_host_files(ctx, result, runner)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def check_parent(ctx: dict, result: dict, runner: dict) -> str | None:
    if runner.get("signals_received"):
        return f"the sandbox's parent received signals: {runner['signals_received']}"
    return check_secret(ctx, result, runner)


def check_denied(ctx: dict, result: dict, runner: dict) -> str | None:
    """Every attempt failed with EPERM (or ENOSYS): refused by policy, not by bad arguments."""
    bad = [line for line in result["stdout"].splitlines()
           if line.startswith("BLOCKED:") and line.rsplit(":", 1)[1] not in ("1", "38")]
    return f"failed for another reason than a refusal: {bad}" if bad else check_host_files(ctx, result, runner)


def limit_check(predicate: Callable[[dict], bool], what: str) -> Callable[[dict, dict, dict], str | None]:
    def check(ctx: dict, result: dict, runner: dict) -> str | None:
        return None if predicate(result) else f"{what} not enforced: exit {result['exit_code']}, " \
                                              f"stdout {result['stdout'][-300:]!r}, stderr {result['stderr'][-300:]!r}"
    return check


def counted(prefix: str, result: dict) -> int:
    values = [int(line.split(":")[1]) for line in result["stdout"].splitlines() if line.startswith(prefix)]
    return values[-1] if values else -1
