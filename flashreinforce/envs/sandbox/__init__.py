"""Run a snippet of Python in a fresh, confined process (the tool of ``PythonToolEnv``).

Usable on its own::

    from flashreinforce.envs.sandbox import Sandbox
    sandbox = Sandbox(timeout_s=5.0, memory_mb=1024)
    result = sandbox.run("print(sum(range(10)))")
    result.stdout          # '45\\n'
    result.isolation       # 'full' on a recent Linux with user namespaces, see below

The code is hostile by assumption (it is written by a policy being trained). The kernel
confines it, not Python: a seccomp-BPF filter (no processes, sockets, signals or ptrace of
others, metadata changes, mounts, ...), Landlock and/or a private mount tree in a user
namespace (reads of the interpreter and system files only, writes only in a quota-limited
working directory, no other process's ``/proc``), resource limits, a pids cgroup or
RLIMIT_NPROC for threads, a clean environment, and a cleanup that never follows a link.
The audit hook that turns refusals into readable messages is a convenience, not a layer.

The constructor probes what the machine provides and refuses (:class:`IsolationError`) below
``min_isolation`` (default ``'filesystem'``) unless ``allow_weak_isolation=True``.
``python -m flashreinforce.envs.sandbox`` prints the report. docs/sandbox.md has the threat
model, the layers and what each one stops, and what is not covered.

Modules: ``launcher`` (the parent side), ``child`` (the program the sandboxed interpreter
runs), ``seccomp`` (the filter), ``landlock``, ``namespaces`` (user namespace and mount tree),
``cgroups``, ``cleanup``, ``disk_watch`` (the working directory's measurement without the mount
tree), ``levels``, ``isolation`` (the report and the refusal), ``probe``, ``audit`` (the message
layer).
"""

from flashreinforce.envs.sandbox.launcher import REFUSED_EXIT, Sandbox, SandboxResult, run_python
from flashreinforce.envs.sandbox.levels import LEVELS
from flashreinforce.envs.sandbox.isolation import IsolationError, IsolationReport
from flashreinforce.envs.sandbox.probe import probe_isolation

__all__ = ["Sandbox", "SandboxResult", "run_python", "IsolationError", "IsolationReport", "probe_isolation",
           "LEVELS", "REFUSED_EXIT"]
