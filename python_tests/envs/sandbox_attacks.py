"""The sandbox attack suite: the attacks, and the runner process that is the sandbox's parent.

Used by ``test_sandbox_attacks.py``. An attack is Python source run in the sandbox; it prints
``BLOCKED:<what>:...`` when the operation it tries fails and ``ESCAPED:<what>:...`` when it
succeeds, so an attack that breaks for an unrelated reason (a typo, a missing module) never
counts as contained: a contained attack must show its ``BLOCKED`` line (or, for resource
attacks, the limit that stopped it). Containment is then checked from the outside too: host
files keep their content, mode, owner and times, decoy processes stay alive, listeners
receive nothing, secrets never appear in the output, no process survives the run. What the
attacks share (helpers, set-ups, checks) is in ``sandbox_attack_kit.py``.

The sandbox's parent is a separate runner process (this module's ``__main__``), started with a
secret in its environment and counting the signals it receives, so that "read the parent's
environ", "signal the parent" and "ptrace the parent" attack a process that holds a secret
and whose death would fail the suite. Everything is local (loopback, files under a temporary
directory) and bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from python_tests.envs.sandbox_attack_kit import (CTYPES, GC_BYPASS, HELPERS, ISINSTANCE_BYPASS, TRACEBACK_BYPASS,
                                                  Attack, check_decoy, check_denied, check_host_files,
                                                  check_listeners, check_no_survivor, check_parent, check_secret,
                                                  counted, decoy, host_files, limit_check, listeners, syscall_nr)
from python_tests.envs.sandbox_attacks_indirect import indirect_attacks
from python_tests.envs.sandbox_attacks_scheduling import process_state, scheduling_attacks

__all__ = ["ATTACKS", "Attack", "run_attacks"]


def _attacks() -> list[Attack]:
    bypass = HELPERS + GC_BYPASS + CTYPES
    fork_exec = '''
        import _posixsubprocess
        def spawn():
            # The child execs /bin/echo with our stdout. Python 3.11.0-3.11.x and 3.12 differ by
            # a trailing allow_vfork argument: try both signatures.
            args = [[b"/bin/echo", b"ESCAPED:fork_exec"], [b"/bin/echo"], True, (), None, None,
                    -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None]
            try:
                pid = _posixsubprocess.fork_exec(*args, False)
            except TypeError:
                pid = _posixsubprocess.fork_exec(*args)
            os.waitpid(pid, 0)
            return pid
        _attempt("fork_exec", spawn)
    '''
    attacks = [
        # --- the audit-hook bypasses found in review, each followed by what they unlocked ---
        Attack("bypass-isinstance-then-write-host-file", "audit-hook bypass", '''
            _attempt("write", lambda: open({target!r}, "w").write("pwned"))
            _attempt("create", lambda: open({dir!r} + "/new.txt", "w").write("pwned"))
            builtins.isinstance = _real_isinstance
        ''', host_files, check_host_files, prefix=HELPERS + ISINSTANCE_BYPASS),
        Attack("bypass-gc-closure-then-subprocess", "audit-hook bypass", '''
            import subprocess
            _attempt("subprocess", lambda: subprocess.run(["/bin/echo", "ESCAPED:subprocess"]).returncode)
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("bypass-gc-closure-then-ctypes-fork", "audit-hook bypass", '''
            def fork():
                pid = _libc.fork()
                if pid == 0:
                    os._exit(0)
                if pid < 0:
                    raise OSError(ctypes.get_errno(), "fork")
                return pid
            _attempt("ctypes-fork", fork)
        ''', host_files, check_host_files, prefix=bypass),
        Attack("bypass-gc-closure-then-udp", "audit-hook bypass", '''
            import socket
            _attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {udp_port})))
        ''', listeners, check_listeners, prefix=HELPERS + GC_BYPASS),
        Attack("bypass-gc-closure-then-af-unix-connect", "audit-hook bypass", '''
            import socket
            _attempt("af_unix", lambda: socket.socket(socket.AF_UNIX).connect({unix_path!r}))
        ''', listeners, check_listeners, prefix=HELPERS + GC_BYPASS),
        Attack("bypass-gc-closure-then-chmod-host-file", "audit-hook bypass", '''
            _attempt("chmod", lambda: os.chmod({target!r}, 0o777))
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("bypass-traceback-then-chown-host-file", "audit-hook bypass", '''
            _attempt("chown", lambda: os.chown({target!r}, 12345, 12345))
        ''', host_files, check_host_files, prefix=HELPERS + TRACEBACK_BYPASS),
        Attack("bypass-traceback-then-utime-host-file", "audit-hook bypass", '''
            _attempt("utime", lambda: os.utime({target!r}, (2_000_000_000, 2_000_000_000)))
        ''', host_files, check_host_files, prefix=HELPERS + TRACEBACK_BYPASS),
        Attack("bypass-traceback-then-subprocess", "audit-hook bypass", '''
            import subprocess
            _attempt("subprocess", lambda: subprocess.run(["/bin/echo", "ESCAPED:subprocess"]).returncode)
        ''', host_files, check_host_files, prefix=HELPERS + TRACEBACK_BYPASS),
        # --- processes, without any bypass ---
        Attack("posixsubprocess-fork-exec", "processes", fork_exec, host_files, check_host_files),
        Attack("multiprocessing-spawn", "processes", '''
            import multiprocessing
            def start():
                p = multiprocessing.get_context("spawn").Process(target=print, args=("ESCAPED:multiprocessing",))
                p.start()
                p.join(5)
                return p.exitcode
            if __name__ == "__main__":
                _attempt("multiprocessing", start)
        ''', host_files, check_host_files),
        Attack("fork-setsid-survivor", "processes", '''
            import time
            def fork():
                pid = os.fork()
                if pid == 0:
                    os.setsid()
                    time.sleep(60)
                    os._exit(0)
                print(f"CHILDPID:{{pid}}", flush=True)
                return pid
            _attempt("fork+setsid", fork)
        ''', host_files, check_no_survivor, prefix=HELPERS + GC_BYPASS),
        Attack("execv", "processes", '''
            _attempt("execv", lambda: os.execv("/bin/echo", ["echo", "ESCAPED:execv"]))
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("fork-bomb", "processes", '''
            def bomb():
                for _ in range(64):
                    if os.fork() == 0:
                        import time
                        time.sleep(30)
                        os._exit(0)
                return "forked 64"
            _attempt("fork-bomb", bomb)
        ''', host_files, check_no_survivor, prefix=HELPERS + GC_BYPASS),
        # --- the trainer: its environment, memory, signals ---
        Attack("parent-environ", "parent", '''
            _attempt("environ", lambda: open(f"/proc/{{os.getppid()}}/environ", "rb").read().decode(errors="replace"))
        ''', host_files, check_secret),
        Attack("parent-memory-via-proc", "parent", '''
            def read_stack():
                maps = open(f"/proc/{{os.getppid()}}/maps").read()
                line = next(l for l in maps.splitlines() if "[stack]" in l)
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                with open(f"/proc/{{os.getppid()}}/mem", "rb") as mem:
                    mem.seek(start)
                    data = mem.read(end - start)
                return data[data.find(b"HF_TOKEN"):][:80]
            _attempt("proc-mem", read_stack)
        ''', host_files, check_secret),
        Attack("parent-process-vm-readv", "parent", '''
            class iovec(ctypes.Structure):
                _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
            def readv():
                buf = ctypes.create_string_buffer(64)
                local, remote = iovec(ctypes.addressof(buf), 64), iovec(0x400000, 64)
                return _syscall({nr_vm_readv}, os.getppid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            _attempt("process_vm_readv", readv)
        ''', lambda b, u: {**host_files(b, u), "nr_vm_readv": syscall_nr(310, 270)}, check_secret, prefix=bypass),
        Attack("parent-ptrace", "parent", '''
            _attempt("ptrace-seize", lambda: _syscall({nr_ptrace}, 0x4206, os.getppid(), 0, 0))
        ''', lambda b, u: {**host_files(b, u), "nr_ptrace": syscall_nr(101, 117)}, check_parent, prefix=bypass),
        Attack("parent-signal", "parent", '''
            import signal
            _attempt("kill-parent", lambda: os.kill(os.getppid(), signal.SIGUSR1))
        ''', host_files, check_parent, prefix=HELPERS + GC_BYPASS),
        Attack("decoy-sigkill", "parent", '''
            import signal
            _attempt("kill-decoy", lambda: os.kill({decoy}, signal.SIGKILL))
            _attempt("killpg-decoy", lambda: os.killpg({decoy}, signal.SIGKILL))
            _attempt("tgkill-decoy", lambda: _syscall({nr_tgkill}, {decoy}, {decoy}, 9))
        ''', lambda b, u: {**decoy(b, u), "nr_tgkill": syscall_nr(234, 131)}, check_decoy, prefix=bypass),
        Attack("decoy-ptrace", "parent", '''
            _attempt("ptrace-attach", lambda: _syscall({nr_ptrace}, 16, {decoy}, 0, 0))
        ''', lambda b, u: {**decoy(b, u), "nr_ptrace": syscall_nr(101, 117)}, check_decoy, prefix=bypass),
        # --- sockets of every family ---
        Attack("tcp-connect-loopback", "network", '''
            import socket
            _attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {tcp_port}), timeout=2))
        ''', listeners, check_listeners, prefix=HELPERS + GC_BYPASS),
        Attack("abstract-unix-connect", "network", '''
            import socket
            _attempt("abstract", lambda: socket.socket(socket.AF_UNIX).connect("\\0" + {abstract!r}))
        ''', listeners, check_listeners, prefix=HELPERS + GC_BYPASS),
        Attack("socket-families", "network", '''
            import socket
            for family, kind in ((socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_DGRAM),
                                 (socket.AF_UNIX, socket.SOCK_DGRAM), (socket.AF_NETLINK, socket.SOCK_RAW),
                                 (socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_VSOCK, socket.SOCK_STREAM)):
                _attempt(f"socket-{{family.name}}", lambda: socket.socket(family, kind))
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("socket-raw-syscall", "network", '''
            for family in (1, 2, 10, 16, 17, 40):
                _attempt(f"socket({{family}})", lambda: _syscall({nr_socket}, family, 2, 0))
        ''', lambda b, u: {**host_files(b, u), "nr_socket": syscall_nr(41, 198)}, check_denied, prefix=bypass),
        # --- files ---
        Attack("read-host-file", "files", '''
            _attempt("read-secret", lambda: open({secret_path!r}).read())
            _attempt("list-host-dir", lambda: os.listdir({dir!r}))
        ''', host_files, check_secret),
        Attack("read-system-secrets", "files", '''
            for path in ("/etc/shadow", "/root/.bashrc", "/proc/1/environ", "/proc/1/cmdline"):
                _attempt(f"read {{path}}", lambda: open(path, "rb").read(40))
        ''', host_files, check_host_files),
        Attack("write-host-file", "files", '''
            _attempt("write", lambda: open({target!r}, "a").write("pwned"))
            _attempt("create", lambda: open({dir!r} + "/new.txt", "w").write("pwned"))
            _attempt("truncate", lambda: os.truncate({target!r}, 0))
            _attempt("remove", lambda: os.remove({target!r}))
            _attempt("rename", lambda: os.rename({target!r}, {dir!r} + "/moved.txt"))
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("write-via-dir-fd", "files", '''
            def escape():
                fd = os.open({dir!r}, os.O_RDONLY | os.O_DIRECTORY)
                return os.open("esc.txt", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
            _attempt("dir-fd", escape)
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("hardlink-host-file", "files", '''
            def link():
                os.link({target!r}, "linked.txt")
                open("linked.txt", "a").write("pwned")
            _attempt("hardlink", link)
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("symlink-then-write", "files", '''
            def through_link():
                os.symlink({target!r}, "link.txt")
                open("link.txt", "a").write("pwned")
            _attempt("symlink-write", through_link)
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("metadata-host-file", "files", '''
            _attempt("chmod", lambda: os.chmod({target!r}, 0o777))
            _attempt("chown", lambda: os.chown({target!r}, 4321, 4321))
            _attempt("utime", lambda: os.utime({target!r}, None))
            _attempt("fchmod", lambda: os.fchmod(os.open({target!r}, os.O_RDONLY), 0o777))
            _attempt("setxattr", lambda: os.setxattr({target!r}, "user.x", b"1"))
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("symlink-cleanup-chmod", "files", '''
            # Read-only directory holding a link to a host file: a cleanup that chmods what it
            # cannot delete would chmod the host file through the link.
            def plant():
                os.mkdir("d")
                os.symlink({target!r}, "d/link")
                os.chmod("d", 0o500)
                return "planted"
            _attempt("plant", plant)
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        Attack("dev-shm-write", "files", '''
            _attempt("dev-shm", lambda: open("/dev/shm/flashreinforce-attack-{token}", "w").write("x"))
        ''', lambda b, u: {**host_files(b, u), "token": os.urandom(4).hex()},
            lambda ctx, r, run: ("file created in /dev/shm"
                                 if os.path.exists(f"/dev/shm/flashreinforce-attack-{ctx['token']}") else None),
            prefix=HELPERS + GC_BYPASS),
        Attack("mknod-block-device", "files", '''
            _attempt("mknod", lambda: os.mknod("disk", 0o600 | 0o060000, os.makedev(8, 0)))
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        # --- kernel interfaces the filter denies ---
        Attack("kernel-interfaces", "kernel", '''
            for name, nr, args in {calls!r}:
                _attempt(name, lambda: _syscall(nr, *args))
        ''', lambda b, u: {**host_files(b, u), "calls": [
            ("unshare-user", syscall_nr(272, 97), (0x10000000,)), ("mount", syscall_nr(165, 40), (0, 0, 0, 0, 0)),
            ("bpf", syscall_nr(321, 280), (0, 0, 0)), ("perf_event_open", syscall_nr(298, 241), (0, 0, -1, -1, 0)),
            ("io_uring_setup", syscall_nr(425, 425), (1, 0)), ("userfaultfd", syscall_nr(323, 282), (0,)),
            ("keyctl", syscall_nr(250, 219), (0, 0)), ("personality", syscall_nr(135, 92), (0x0040000,)),
            ("open_by_handle_at", syscall_nr(304, 265), (-100, 0, 0)), ("setuid", syscall_nr(105, 146), (0,)),
            ("setrlimit-as", syscall_nr(160, 164), (9, 0)), ("clone3", 435, (0, 0)),
            ("kexec_load", syscall_nr(246, 104), (0, 0, 0, 0)), ("init_module", syscall_nr(175, 105), (0, 0, 0))]},
            check_denied, prefix=bypass),
        Attack("raise-limits", "resources", '''
            import resource
            _attempt("setrlimit", lambda: resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2))
            _attempt("prlimit-parent", lambda: resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (16, 16)))
        ''', host_files, check_host_files, prefix=HELPERS + GC_BYPASS),
        # --- resources ---
        Attack("memory", "resources", '''
            chunks = []
            def grab():
                while True:
                    chunks.append(bytearray(64 * 1024 * 1024))
            _attempt("memory", grab)
            print(f"ALLOCATED:{{len(chunks) * 64}}", flush=True)
        ''', options={"memory_mb": 512},
            check=limit_check(lambda r: 0 <= counted("ALLOCATED:", r) <= 512, "memory limit")),
        Attack("cpu", "resources", "x = 0\nwhile True:\n    x += 1\n", needs_blocked=False, prefix="",
               options={"timeout_s": 30, "cpu_s": 1},
               check=limit_check(lambda r: r["timed_out"] and r["duration_s"] < 15, "CPU limit")),
        Attack("wall-clock", "resources", "import time\ntime.sleep(300)\n", needs_blocked=False, prefix="",
               options={"timeout_s": 1.0},
               check=limit_check(lambda r: r["timed_out"] and r["duration_s"] < 10, "wall-clock limit")),
        Attack("disk", "resources", '''
            written = 0
            def fill():
                global written
                block = b"x" * (1 << 20)
                for i in range(10_000):
                    with open(f"fill{{i}}.bin", "wb") as f:
                        for _ in range(4):
                            f.write(block)
                            f.flush()
                            written += 1
                    print(f"WRITTEN:{{written}}", flush=True)
            _attempt("disk", fill)
            print(f"WRITTEN:{{written}}", flush=True)
        ''', needs_blocked=False, options={"disk_mb": 32, "timeout_s": 20},
            # ENOSPC at the tmpfs quota, or the launcher's measurement stopped the run (it
            # checks every 0.25 s, so allow what a fast disk writes in that time).
            check=limit_check(lambda r: ("BLOCKED:disk" in r["stdout"] and counted("WRITTEN:", r) <= 32)
                              or ("disk_mb=32" in r["stderr"] and counted("WRITTEN:", r) <= 32 + 2048), "disk quota")),
        Attack("output-flood", "resources", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
               needs_blocked=False, prefix="", options={"timeout_s": 1.0, "output_limit_bytes": 1024},
               check=limit_check(lambda r: len(r["stdout"]) < 1200 and r["timed_out"], "output limit")),
        Attack("many-threads", "resources", '''
            import threading
            threading.stack_size(64 * 1024)
            stop = threading.Event()
            started = []
            def spawn():
                while len(started) < 5000:
                    t = threading.Thread(target=stop.wait)
                    t.start()
                    started.append(t)
            _attempt("threads", spawn)
            print(f"THREADS:{{len(started)}}", flush=True)
            stop.set()
        ''', options={"max_threads": 16},
            check=limit_check(lambda r: 0 <= counted("THREADS:", r) < 16, "thread bound")),
        Attack("open-files", "resources", '''
            fds = []
            def grab():
                while len(fds) < 100_000:
                    fds.append(os.open("/dev/null", os.O_RDONLY))
            _attempt("fds", grab)
            print(f"FDS:{{len(fds)}}", flush=True)
        ''', check=limit_check(lambda r: 0 <= counted("FDS:", r) <= 256, "open-file limit")),
    ]
    attacks += indirect_attacks()
    attacks += scheduling_attacks()
    if os.uname().machine == "x86_64":
        attacks.append(Attack("i386-syscall-abi", "kernel", '''
            import mmap
            # mov eax, 20 (i386 getpid); int 0x80; ret -- the 32-bit entry the filter must kill.
            code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])
            page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
            page.write(code)
            address = ctypes.addressof(ctypes.c_char.from_buffer(page))
            print("CALLING", flush=True)
            _attempt("int80", lambda: ctypes.CFUNCTYPE(ctypes.c_int)(address)())
        ''', host_files, prefix=bypass, needs_blocked=False,
            check=limit_check(lambda r: "ESCAPED" not in r["stdout"] and "CALLING" in r["stdout"]
                              # SIGSYS: killed by the filter's architecture check (SIGSEGV: a kernel
                              # without 32-bit emulation, where the entry does not exist at all).
                              and (r["exit_code"] in (-signal.SIGSYS, -signal.SIGSEGV)
                                   or "BLOCKED:int80" in r["stdout"]),
                              "foreign system call ABI")))
    for attack in attacks:
        attack.level = "none" if attack.name in _LIMITS else "filesystem" if attack.name in _FILES else "seccomp"
    return attacks


# The weakest isolation level that claims to contain each attack (docs/sandbox.md, "Levels and the
# minimum"): the limits hold at every level; reads and writes of files, /proc entries of other
# processes and /dev/shm included, need the file-system barrier; everything else is the filter's.
_LIMITS = frozenset({"memory", "cpu", "wall-clock", "disk", "output-flood", "many-threads", "open-files",
                     "unlinked-files-held-open", "unlinked-files-held-by-mappings"})
_FILES = frozenset({"bypass-isinstance-then-write-host-file", "parent-environ", "parent-memory-via-proc",
                    "read-host-file", "read-system-secrets", "write-host-file", "write-via-dir-fd",
                    "hardlink-host-file", "symlink-then-write", "dev-shm-write", "shared-memory-beyond-memory-limit",
                    "read-source-checkout", "parent-proc-files"})
ATTACKS = _attacks()


def run_attacks(requests: list[dict], sandbox_options: dict) -> list[dict]:
    """In the runner process: run each ``{"name", "code", "options"}`` in a sandbox."""
    from flashreinforce.envs.sandbox import Sandbox

    out = []
    for request in requests:
        options = {"timeout_s": 10.0, **sandbox_options, **request["options"]}
        received.clear()
        before = process_state(os.getpid())
        result = Sandbox(**options).run(request["code"])
        out.append({"name": request["name"], "stdout": result.stdout, "stderr": result.stderr,
                    "exit_code": result.exit_code, "timed_out": result.timed_out, "duration_s": result.duration_s,
                    "guards": list(result.guards), "isolation": result.isolation,
                    "signals_received": list(received), "parent_state_before": before,
                    "parent_state": process_state(os.getpid())})
    return out


received: list[int] = []


def main() -> None:
    """Runner: JSON ``{"requests": [...], "options": {...}}`` on stdin, JSON results on stdout."""
    # Counted rather than fatal: SIGIO is what a file description's owner gets by default.
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGIO):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    job = json.loads(sys.stdin.read())
    results = run_attacks(job["requests"], job["options"])
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
