"""The sandboxed child program: sets up every layer, then runs ``main.py`` as ``__main__``.

Started by the launcher as ``python -I -B -c BOOTSTRAP /path/to/child.py CONFIG CODES`` in
the working directory, with a clean environment, stdin on ``/dev/null`` and a private status
pipe. The bootstrap runs this module, from the code objects the launcher compiled (``CODES``, a
marshal file, when the interpreter is the launcher's own) or from this file, and calls
:func:`main`. It is standard library only and loads its sibling modules the same way, because
the interpreter that runs the tool code (``Sandbox(python=...)``) need not have
``flashreinforce`` installed.

Order (each step needs the privileges that the later ones take away):

1. join the run's pids cgroup, when the launcher made one;
2. user, mount, IPC, UTS (and network) namespaces, then the private mount tree;
3. Landlock (after the mounts: a Landlock domain may not mount);
4. resource limits (RLIMIT_AS, CPU, FSIZE, CORE, NOFILE, NPROC; soft = hard);
5. capabilities dropped (as root they would allow raising the limits again);
6. the seccomp filter (it denies the calls used above), last;
7. the level reached is reported on the status pipe; below the configured minimum the child
   refuses (exit status 70) unless weaker isolation was allowed;
8. the audit hook (friendly messages only; listed as ``audit_hook``), then the code.
"""

from __future__ import annotations

import marshal
import os
import sys

REFUSED_EXIT = 70
_HERE = os.path.dirname(os.path.abspath(__file__))

# Read-only paths besides the interpreter's own: the C library and system libraries, what the
# C library and Python's standard library read from /etc, and the CPU list sysconf() reads.
_SYSTEM_READ_ROOTS = (
    "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
    "/etc/ld.so.conf.d", "/etc/localtime", "/etc/timezone", "/etc/nsswitch.conf", "/etc/passwd",
    "/etc/group", "/etc/hosts", "/etc/host.conf", "/etc/resolv.conf", "/etc/gai.conf", "/etc/services",
    "/etc/protocols", "/etc/ssl", "/etc/pki", "/etc/ca-certificates", "/etc/mime.types",
    "/etc/os-release", "/sys/devices/system/cpu",
)


def _load(name: str):
    """A sibling module under a private name (no package import): from the launcher's compiled
    code when the bootstrap passed it (``_PRECOMPILED``), else from its file."""
    path = os.path.join(_HERE, f"{name}.py")
    code = globals().get("_PRECOMPILED", {}).get(name)
    if code is not None:
        import types

        module = types.ModuleType(f"_flashreinforce_sandbox_{name}")
        module.__file__ = path
        sys.modules[module.__name__] = module
        exec(code, module.__dict__)
        return module
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_flashreinforce_sandbox_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_roots(extra: list[str]) -> list[str]:
    """Absolute paths the code may read: the Python installation, system files, ``extra``.

    The installation is the interpreter's prefixes (for a virtual environment, its directory and
    the installation it was made from) and the interpreter's directory. Of ``sys.path``, only
    the entries inside those or inside the system roots are kept: a directory that a ``.pth``
    file adds, such as the source checkout of an editable install, is not readable unless
    ``extra`` names it. ``/`` is never included (it would allow everything).
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    installation = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                    os.path.dirname(os.path.realpath(sys.executable)), *_SYSTEM_READ_ROOTS,
                    f"/etc/python{version}", f"/etc/python{sys.version_info.major}"]
    # As named and as resolved: a site-packages that is a symlink inside the prefix stays.
    bases = {f(p) for p in installation if p and os.path.isabs(p) for f in (os.path.normpath, os.path.realpath)}
    bases.discard("/")

    def inside(path: str) -> bool:
        return any(p == base or p.startswith(base + "/")
                   for p in (os.path.normpath(path), os.path.realpath(path)) for base in bases)

    out = []
    for path in [*installation, *[p for p in sys.path if p and os.path.isabs(p) and inside(p)], *extra]:
        if path and os.path.isabs(path):
            path = os.path.normpath(path)
            if path != "/" and path not in out:
                out.append(path)
    return out


def _nproc_limit(cfg: dict, in_userns: bool) -> int:
    """RLIMIT_NPROC for ``max_threads`` tasks. Call before Landlock (it may read /proc)."""
    threads = cfg["max_threads"]
    if in_userns:
        return threads  # counted per user namespace (Linux >= 5.14): this sandbox's tasks only
    if os.getuid() != 0:
        # Counted over all of the user's tasks, this process included: room for the others
        # as they are now, plus ``threads`` for the sandbox (approximate: others come and go).
        return _tasks_of_user(os.getuid()) - 1 + threads
    return threads  # root is exempt from RLIMIT_NPROC; the pids cgroup bounds threads


def _set_limits(cfg: dict, guards: list[str], problems: list[str], in_userns: bool, nproc: int) -> None:
    import resource

    limits = [("RLIMIT_AS", cfg["memory_bytes"]), ("RLIMIT_CPU", cfg["cpu_s"]),
              ("RLIMIT_FSIZE", cfg["file_size_bytes"]), ("RLIMIT_CORE", 0),
              ("RLIMIT_NOFILE", cfg["max_open_files"]), ("RLIMIT_NPROC", nproc)]
    uid = os.getuid()
    for name, value in limits:
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        # Hard = soft, so the code cannot raise it again. For CPU the soft limit sends SIGXCPU
        # (which kills) and the hard one, a second later, SIGKILL.
        new_hard = soft + 1 if name == "RLIMIT_CPU" else soft
        if hard != resource.RLIM_INFINITY:
            new_hard = min(new_hard, hard)
        resource.setrlimit(limit, (soft, new_hard))
    guards.append("rlimits")
    if uid != 0:
        # In a fresh user namespace the count starts at this process; outside one it includes
        # the user's other processes, so the bound is only approximate ("nproc_uid").
        guards.append("nproc" if in_userns else "nproc_uid")
    else:
        problems.append("RLIMIT_NPROC is set but not enforced for root (use a pids cgroup)")


def _tasks_of_user(uid: int) -> int:
    """Number of tasks (threads) whose real uid is ``uid``, from /proc (approximate)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        except OSError:
            continue
        if int(fields.get(b"Uid", b"-1").split()[0]) == uid:
            count += int(fields.get(b"Threads", b"1").strip())
    return count


def _join_cgroup(path: str, guards: list[str], problems: list[str]) -> None:
    try:
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0\n")
        finally:
            os.close(fd)
        guards.append("cgroup_pids")
    except OSError as exc:
        problems.append(f"joining the pids cgroup {path} failed: {exc}")


def _setup(cfg: dict, source: str | None, modules: dict) -> dict:
    """Applies the layers in order; returns the status record (guards, problems, level, ...)."""
    guards: list[str] = []
    problems: list[str] = []
    status = {"guards": guards, "problems": problems, "landlock_abi": 0, "arch": None, "skipped_read_roots": []}
    workdir = os.getcwd()
    levels, seccomp, namespaces = modules["levels"], modules["seccomp"], modules["namespaces"]
    try:
        arch = seccomp.current_arch()
        status["arch"] = arch
    except seccomp.UnsupportedArchitecture as exc:
        arch = None
        problems.append(str(exc))
    if cfg["cgroup"]:
        _join_cgroup(cfg["cgroup"], guards, problems)
    roots = read_roots(cfg["extra_read_paths"])
    in_userns: bool | None = False  # None: in a new user namespace, but unmapped
    if cfg["namespaces"]:
        try:
            guards += namespaces.enter(network=cfg["allow_network"])
            in_userns = True
        except namespaces.UnmappedNamespace as exc:
            # In a new user namespace all the same (tasks are counted there), but without ids:
            # no mount tree.
            in_userns = None
            problems.append(f"user namespace without an id mapping: {exc}")
        except OSError as exc:
            problems.append(f"user namespaces unavailable: {exc}")
        if in_userns and arch is None:
            problems.append("mount tree skipped: unsupported architecture")
        elif in_userns:
            try:
                tree, skipped = namespaces.build_mount_tree(
                    workdir, roots, disk_bytes=cfg["disk_bytes"], max_inodes=cfg["max_inodes"], arch=arch,
                    use_mount_setattr=not cfg.get("_remount_fallback", False))
                guards += tree
                status["skipped_read_roots"] += skipped
            except namespaces.MountTreeBroken:
                raise
            except OSError as exc:
                problems.append(f"private mount tree unavailable: {exc}")
                namespaces.undo_mount_tree(workdir)
    if source is not None and "mount_tree" in guards:
        with open("main.py", "w", encoding="utf-8", errors="surrogatepass") as f:  # the new, empty working directory
            f.write(source)
    nproc = _nproc_limit(cfg, in_userns is not False)
    if cfg["landlock"]:
        # Its own /proc entries stay readable (outside the mount tree, where /proc is empty).
        own_proc = [] if "mount_tree" in guards else ["/proc/self"]
        try:
            abi, names, skipped = modules["landlock"].restrict(workdir, roots + own_proc,
                                                               allow_network=cfg["allow_network"])
            status["landlock_abi"] = abi
            guards += names
            status["skipped_read_roots"] += [p for p in skipped if p not in status["skipped_read_roots"]]
        except OSError as exc:
            problems.append(str(exc))
    _set_limits(cfg, guards, problems, in_userns is True, nproc)
    if arch is not None:
        try:
            namespaces.drop_capabilities(arch)
        except OSError as exc:
            problems.append(f"dropping capabilities failed: {exc}")
    if cfg["seccomp"] and arch is not None:
        try:
            seccomp.install(seccomp.build_filter(own_pid=os.getpid(), allow_network=cfg["allow_network"], arch=arch))
            guards.append("seccomp")
        except OSError as exc:
            problems.append(f"seccomp unavailable: {exc}")
    elif cfg["seccomp"]:
        problems.append("seccomp skipped: unsupported architecture")
    status["level"] = levels.level_of(guards, cfg["allow_network"])
    need = levels.missing_for(cfg["min_isolation"], guards, cfg["allow_network"])
    refused = bool(need) and not cfg["allow_weak_isolation"]
    if cfg["require_landlock"] and "landlock_fs" not in guards:
        need.append("Landlock (require_landlock=True)")
        refused = True
    status["refused"] = refused
    status["missing"] = need
    return status


def _run_main(print_last_expression: bool) -> None:
    # The C module behind ``ast`` (``ast`` itself imports ``enum`` and ``contextlib``): only the syntax tree's
    # node types are used. ``traceback`` is imported when the code raises.
    import _ast

    with open("main.py", "r", encoding="utf-8", errors="surrogatepass") as f:
        source = f.read()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"}
    try:
        tree = compile(source, "main.py", "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
        last = None
        if print_last_expression and tree.body and isinstance(tree.body[-1], _ast.Expr):
            last = _ast.Expression(tree.body.pop().value)
        exec(compile(tree, "main.py", "exec", dont_inherit=True), namespace)
        if last is not None:
            value = eval(compile(last, "main.py", "eval", dont_inherit=True), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as exc:
        # Drop the sandbox's own frames (the bootstrap, this file, the audit hook) from the traceback and from
        # chained ones, so the policy sees only its own code and the libraries it called.
        try:
            import traceback
        except BaseException:  # the code used up what an import needs (memory, open files): the error alone
            sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        pending, seen = [report], set()
        while pending:
            te = pending.pop()
            if id(te) in seen:
                continue
            seen.add(id(te))
            te.stack = traceback.StackSummary.from_list(
                [f for f in te.stack
                 if f.filename != "<string>" and os.path.dirname(os.path.abspath(f.filename)) != _HERE])
            pending += [x for x in (te.__cause__, te.__context__) if x is not None]
        sys.stderr.write("".join(report.format()))
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def main(argv: list[str]) -> None:
    """``argv``: ``[path of this file, CONFIG]`` (the launcher's ``_encode_config``: marshal, in hex)."""
    cfg = marshal.loads(bytes.fromhex(argv[1]))
    sys.argv = ["main.py"]
    sys.dont_write_bytecode = True
    source = None
    if not cfg["probe"]:
        with open("main.py", "r", encoding="utf-8", errors="surrogatepass") as f:
            source = f.read()
    # The sandbox's own modules are loaded now: after the set-up this directory may no longer
    # be readable (the standard library stays readable). Only those the configuration uses.
    wanted = ["levels", "seccomp", "namespaces"] + ["landlock"] * cfg["landlock"] + ["audit"] * cfg["audit_hook"]
    modules = {name: _load(name) for name in wanted}
    try:
        status = _setup(cfg, source, modules)
    except Exception as exc:  # a half-built mount tree: never run code in it
        status = {"guards": [], "problems": [f"sandbox set-up failed: {exc}"], "level": "none",
                  "refused": True, "missing": ["a completed set-up"]}
    if cfg["audit_hook"] and not status["refused"] and not cfg["probe"]:
        modules["audit"].install(os.getcwd(), cfg["allow_network"])
        status["guards"].append("audit_hook")
    os.write(cfg["status_fd"], ascii(status).encode("ascii"))  # the launcher's _read_status: literal_eval
    os.close(cfg["status_fd"])
    if status["refused"]:
        sys.stderr.write(
            f"sandbox: refusing to run the code: isolation level {status['level']!r} is below the required "
            f"{cfg['min_isolation']!r}" + (" (require_landlock)" if cfg["require_landlock"] else "")
            + f"; missing: {'; '.join(status['missing'])}; problems: {'; '.join(status['problems']) or 'none'}\n")
        sys.exit(REFUSED_EXIT)
    if cfg["probe"]:
        sys.exit(0)
    _run_main(cfg["print_last_expression"])


if __name__ == "__main__":
    main(sys.argv)
