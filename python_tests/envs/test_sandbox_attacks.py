"""The attack suite: every attack of ``sandbox_attacks.py`` must be contained, in every configuration.

Configurations (each one a separate runner process holding a secret in its environment):

- ``default``: every layer the machine offers, as the python_tool environment uses it;
- ``landlock-off``: Landlock forced off, so the mount tree, seccomp and the rest must hold
  (and without Landlock's signal scoping, the signals the kernel sends to a file description's
  owner meet the seccomp filter alone, as on kernels before Linux 6.12);
- ``namespaces-off``: no user namespace (no mount tree, no network namespace), so Landlock,
  seccomp and the rest must hold (the situation of a machine without user namespaces);
- ``hook-off``: no audit hook at all (what any bypass of it achieves);
- ``unprivileged``: the default layers with the trainer running as an unprivileged uid
  (65534), where file permissions no longer stop anything on the sandbox's behalf and the
  symlink-during-cleanup attack applies;
- ``unprivileged-namespaces-off``: the same without user namespaces (a typical cluster node:
  Landlock and seccomp, RLIMIT_NPROC counted over all of the user's processes);
- ``unprivileged-landlock-off``: the unprivileged user with the mount tree alone;
- ``seccomp-only`` and ``unprivileged-seccomp-only``: Landlock and namespaces off
  (``allow_weak_isolation``): the ``seccomp`` level, where files are not confined;
- ``no-kernel-layers`` and ``unprivileged-no-kernel-layers``: the seccomp filter off too: the
  ``none`` level, only the limits and the cleanup.

Each configuration runs the attacks that its level claims to contain (``Attack.level``: the
weakest level that does): at ``filesystem`` and ``full`` all of them, at ``seccomp`` the ones
the filter stops, at ``none`` the limits.

Each runner has a session of its own, so that an attack on the sandbox's parent and its process
group can reach nothing above the runner. The numbers (attempts, contained, escaped per
configuration) are printed at the end of the pytest run (python_tests/envs/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict

import pytest

from flashreinforce.envs.sandbox import probe_isolation
from flashreinforce.envs.sandbox.levels import LEVELS
from python_tests.envs.sandbox_attacks import ATTACKS, Attack
from python_tests.envs.unprivileged import REPO, UNPRIVILEGED_UID, readable_sources
# (configuration, attack) -> "contained" / "escaped: ..." ; read by conftest's summary.
OUTCOMES: dict[tuple[str, str], str] = {}

_report = probe_isolation()
_below = None if _report.at_least("filesystem") else \
    f"this machine's sandbox isolation is {_report.level!r}, below the default minimum: " + "; ".join(_report.problems)
_tree = None if "mount_tree" in _report.guards else "no private mount tree here (user namespaces)"
_landlock = None if "landlock_fs" in _report.guards else "Landlock is not available on this kernel"
_filter = None if "seccomp" in _report.guards else "no seccomp filter on this machine"
_SECCOMP_ONLY = {"landlock": False, "namespaces": False, "allow_weak_isolation": True}
_NO_KERNEL_LAYERS = {**_SECCOMP_ONLY, "seccomp": False}
# name -> (Sandbox options, why it cannot run here or None, the level it must reach: at least
# that for "filesystem", exactly that below).
CONFIGS = {
    "default": ({}, _below, "filesystem"),
    "landlock-off": ({"landlock": False}, _tree, "filesystem"),
    "namespaces-off": ({"namespaces": False}, _landlock, "filesystem"),
    "seccomp-only": (_SECCOMP_ONLY, _filter, "seccomp"),
    "no-kernel-layers": (_NO_KERNEL_LAYERS, None, "none"),
    "hook-off": ({"audit_hook": False}, _below, "filesystem"),
    "unprivileged": ({}, _below, "filesystem"),
    "unprivileged-landlock-off": ({"landlock": False}, _tree, "filesystem"),
    "unprivileged-namespaces-off": ({"namespaces": False}, _landlock, "filesystem"),
    "unprivileged-seccomp-only": (_SECCOMP_ONLY, _filter, "seccomp"),
    "unprivileged-no-kernel-layers": (_NO_KERNEL_LAYERS, None, "none"),
}


def _applies(attack: Attack, config: str) -> bool:
    """Whether ``config``'s level claims to contain ``attack``."""
    return LEVELS.index(attack.level) <= LEVELS.index(CONFIGS[config][2])


def _unprivileged_python() -> tuple[str | None, str]:
    """An interpreter uid 65534 can run (and why there is none)."""
    if os.geteuid() != 0:
        return None, "the tests do not run as root, so they cannot switch to another uid"
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run([candidate, "-c", "import sys; sys.exit(sys.version_info < (3, 10))"],
                                  user=UNPRIVILEGED_UID, group=UNPRIVILEGED_UID, extra_groups=[],
                                  capture_output=True, timeout=30, cwd="/")
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return candidate, ""
    return None, f"no Python >= 3.10 that uid {UNPRIVILEGED_UID} may run (the test interpreter is under a private home)"


class Batch:
    """All attacks of one configuration, run once by a runner process."""

    def __init__(self, config: str, base: str) -> None:
        options, skip, _ = CONFIGS[config]
        python, uid = sys.executable, os.geteuid()
        run_as = {}
        sources = REPO
        if config.startswith("unprivileged"):
            if skip:
                pytest.skip(skip)
            python, reason = _unprivileged_python()
            if python is None:
                pytest.skip(reason)
            uid = UNPRIVILEGED_UID
            run_as = {"user": uid, "group": uid, "extra_groups": []}
            sources = readable_sources()
            os.chmod(base, 0o755)
        elif skip:
            pytest.skip(skip)
        self.secret = "hf_" + os.urandom(12).hex()
        self.contexts: dict[str, dict] = {}
        requests = []
        for index, attack in enumerate(ATTACKS):
            if not _applies(attack, config):
                continue
            directory = os.path.join(base, f"a{index}")  # short: UNIX socket paths are limited to 107 bytes
            os.makedirs(directory)
            os.chmod(directory, 0o755)
            ctx = attack.setup(directory, uid)
            ctx["env_secret"] = self.secret
            self.contexts[attack.name] = ctx
            requests.append({"name": attack.name, "code": attack.source(ctx), "options": attack.options})
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": sources, "HF_TOKEN": self.secret,
               "LANG": "C.UTF-8"}
        job = json.dumps({"requests": requests, "options": options})
        # A session of its own: a signal an escape aims at the runner's process group reaches the
        # runner (which counts it, or dies and fails the configuration), never pytest.
        self.done = subprocess.run([python, "-m", "python_tests.envs.sandbox_attacks"], input=job, text=True,
                                   capture_output=True, cwd=sources, env=env, timeout=900, start_new_session=True,
                                   **run_as)
        if run_as and "IsolationError" in self.done.stderr:
            # The unprivileged user may get fewer layers than root (user namespaces for root only).
            pytest.skip(f"below the minimum as uid {uid}: {self.done.stderr.strip().splitlines()[-1]}")
        self.results = {r["name"]: r for r in json.loads(self.done.stdout)} if self.done.returncode == 0 else {}

    def close(self) -> None:
        for ctx in self.contexts.values():
            proc = ctx.get("decoy_proc")
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            for s in ctx.get("sockets", ()):
                s.close()


_batches: dict[str, Batch] = {}


@pytest.fixture(scope="module")
def batches():
    # Host artifacts live under /tmp, not pytest's private (0700) directory: the unprivileged
    # configuration must meet only the sandbox, not file permissions, on its way to them.
    bases = []

    def get(config: str) -> Batch:
        if config not in _batches:
            bases.append(tempfile.mkdtemp(prefix="flashreinforce-attacks-"))
            os.chmod(bases[-1], 0o755)
            _batches[config] = Batch(config, bases[-1])
        return _batches[config]

    yield get
    for batch in _batches.values():
        batch.close()
    _batches.clear()
    for base in bases:
        shutil.rmtree(base, ignore_errors=True)


def verdict(attack: Attack, ctx: dict, result: dict) -> str | None:
    """None when the attack was contained, else what went wrong."""
    problem = attack.check(ctx, result, result)  # always: it also kills what an escape left running
    if "ESCAPED" in result["stdout"]:
        return "escaped: " + "; ".join(line for line in result["stdout"].splitlines() if "ESCAPED" in line)[:500]
    if attack.needs_blocked and "BLOCKED:" not in result["stdout"]:
        return (f"the attack did not reach its attempt (exit {result['exit_code']}): "
                f"stdout {result['stdout'][-300:]!r} stderr {result['stderr'][-600:]!r}")
    if result["exit_code"] == 70:
        return "the sandbox refused to run: " + result["stderr"][-300:]
    return None if problem is None else "escaped: " + problem


# Configuration by configuration: each batch's checks follow its run (its decoys live two minutes).
_CASES = [(config, attack) for config in CONFIGS for attack in ATTACKS if _applies(attack, config)]


@pytest.mark.parametrize("config,attack", _CASES, ids=[f"{a.name}-{c}" for c, a in _CASES])
def test_attack_is_contained(batches, config, attack):
    batch = batches(config)
    assert batch.done.returncode == 0, (
        f"the runner (the sandbox's parent) failed, which an escaped kill or limit change can cause: "
        f"exit {batch.done.returncode}, stderr {batch.done.stderr[-2000:]}")
    result = batch.results[attack.name]
    problem = verdict(attack, batch.contexts[attack.name], result)
    OUTCOMES[(config, attack.name)] = "contained" if problem is None else problem
    assert problem is None, f"{config}/{attack.name}: {problem}\nguards: {result['guards']}"
    level = CONFIGS[config][2]
    if level == "filesystem":
        assert result["isolation"] in ("filesystem", "full")
    else:
        assert result["isolation"] == level


def summary() -> list[str]:
    """Lines for the terminal summary: attempts, contained, escaped per configuration."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for (config, _), outcome in OUTCOMES.items():
        counts[config][0] += 1
        counts[config][1 if outcome == "contained" else 2] += 1
    lines = [f"{'configuration':<28} {'attempts':>8} {'contained':>9} {'escaped':>7}"]
    lines += [f"{config:<28} {a:>8} {c:>9} {e:>7}" for config, (a, c, e) in counts.items()]
    lines += [f"  {config}/{name}: {outcome}" for (config, name), outcome in OUTCOMES.items() if outcome != "contained"]
    return lines
