"""The run's Ray session: connect to a cluster or start a local instance, create the buffer actor
and the weight registry, hand out the worker pool, and on close remove only what the run created.

:class:`RayConnection` connects to ``--ray.address`` (or ``$RAY_ADDRESS``; ``auto`` finds a
cluster started on this node with ``ray start --head``), or starts a local Ray instance. On close it
only disconnects (``ray.shutdown()`` of this driver): a cluster it did not start keeps running, and a
local instance it started stops with it. If Ray was already initialized by the calling program, it
is used and left initialized.

:class:`RayRollout` pins the buffer actor and the weight registry to the driver's node (they hold
the run's state: they should fail only with the learner, not with a worker node), and removes both
on close.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from flashreinforce.distributed.ray.buffer import BufferActor, RemoteBuffer
from flashreinforce.distributed.ray.calls import import_ray
from flashreinforce.distributed.ray.placement import WorkerPlacement
from flashreinforce.distributed.ray.pool import RayRolloutBackend
from flashreinforce.distributed.ray.weights import RayWeightStore, WeightRegistry
from flashreinforce.distributed.ray.workers import WorkerRecipe

__all__ = ["RayConnection", "RayRollout"]

log = logging.getLogger(__name__)


class RayConnection:
    """This process's connection to a Ray cluster.

    Args:
        address: a cluster address (``auto``, ``HOST:PORT``, ``ray://...``); ``None``: ``$RAY_ADDRESS``
            if set, else start a local instance on this machine.
        num_cpus / num_gpus: resources of a local instance this process starts (``None``: detected).
    """

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 num_gpus: int | None = None) -> None:
        ray = import_ray()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.connected_here = False
        self.started_local = False
        self.address = None
        self._reporter: _ExitReporter | None = None
        if ray.is_initialized():
            log.info("using the Ray connection this program already opened")
            return
        target = address or os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if target:
            _check_reachable(target)
            try:
                ray.init(address=target, **kwargs)
            except ConnectionError as err:
                raise ConnectionError(f"--ray.address {target}: cannot connect to a Ray cluster there: {err}") from err
        else:
            # "local": always a new instance (plain ray.init() would join a `ray start` cluster found
            # on this machine, which this run must not treat as its own).
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
            self.started_local = True
        self.connected_here = True
        self.address = target
        self._reporter = _ExitReporter.start(target or "the local instance it started")
        log.info("Ray: %s (%s)", "started a local instance" if self.started_local else f"connected to {target}",
                 ray.cluster_resources())

    def close(self) -> None:
        """Disconnect; stops the Ray instance only if this process started it locally."""
        if self.connected_here:
            self.connected_here = False
            try:
                import_ray().shutdown()
            finally:  # the trainer ends on purpose even when the disconnect fails: the helper stays quiet
                if self._reporter is not None:
                    self._reporter.closed()
                    self._reporter = None


#: How long a connection attempt to ``--ray.address`` may take before the address counts as dead
#: (``ray.init`` itself retries an unreachable address for minutes).
CONNECT_TIMEOUT_S = 10.0


def _check_reachable(address: str) -> None:
    """A clear ``ConnectionError`` within :data:`CONNECT_TIMEOUT_S` when nothing listens at a
    ``HOST:PORT`` address (``auto`` is resolved the way Ray resolves it; ``ray://`` is left to Ray)."""
    if address.startswith("ray://"):
        return
    resolved = address
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address_or_die

            resolved = canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError as err:
            raise ConnectionError(f"--ray.address auto: no Ray cluster was started on this machine ({err})") from None
        except Exception:  # a Ray without this helper: let ray.init resolve it
            return
    host, _, port = resolved.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray.address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConnectionError(f"--ray.address {address}: no Ray cluster answers at {resolved} ({err}); start one "
                              f"with `ray start --head --port {port}` or fix the address") from None


# Runs in a small helper process: it waits until the trainer's end of its stdin closes and, unless
# the trainer said "closed" first, tells the user why the trainer vanished.
_REPORTER_SCRIPT = """
import sys
data = sys.stdin.buffer.read()
if not data.endswith(b"closed\\n"):
    sys.stderr.write(sys.argv[1] + "\\n")
    sys.stderr.flush()
"""


class _ExitReporter:
    """Says why the trainer vanished when Ray terminates it.

    When the Ray node a driver is attached to goes away (the cluster stopped, the head node died),
    Ray's core library ends the driver process at once with status 1 and writes the reason only to
    its own log file: no Python exception, nothing on the terminal. A helper process (own session,
    so Ctrl-C does not reach it) holds a pipe from the trainer and prints a message naming the
    cluster when the pipe closes without :meth:`closed` having been called.
    """

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @classmethod
    def start(cls, cluster: str) -> "_ExitReporter | None":
        ray = import_ray()
        try:
            logs = ray._private.worker._global_node.get_logs_dir_path()  # private: only for the message
        except Exception:
            logs = "the Ray session's logs directory"
        pid = os.getpid()
        message = (f"flashreinforce: the trainer (pid {pid}) ended without closing its Ray connection to {cluster}: "
                   "it was killed, or Ray terminated it (status 1) because its Ray node went away (the cluster "
                   f"stopped or its head node died; Ray's reason is in {logs}/python-core-driver-*_{pid}.log). "
                   "Once the cluster is back, continue with --resume from the last checkpoint.")
        try:
            proc = subprocess.Popen([sys.executable, "-c", _REPORTER_SCRIPT, message], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except OSError as err:  # only a nicety: never stop the run for it
            log.info("no exit reporter for the Ray connection: %s", err)
            return None
        return cls(proc)

    def closed(self) -> None:
        """The trainer disconnected on purpose: the helper exits quietly."""
        try:
            self.proc.stdin.write(b"closed\n")
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _on_this_node() -> dict[str, Any]:
    """Scheduling options that keep an actor on the driver's node (none where that is unknown)."""
    ray = import_ray()
    try:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
    except Exception as err:  # e.g. a Ray Client driver has no node of its own
        log.info("the buffer actor is placed by Ray (the driver's node is unknown: %s)", err)
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


@dataclass
class RayRollout:
    """The Ray side of a run: connection, buffer actor, weight registry, and the worker pool factory."""

    connection: RayConnection
    buffer: RemoteBuffer
    weights: RayWeightStore
    buffer_actor: Any
    registry_actor: Any

    @classmethod
    def create(cls, *, address: str | None, buffer_kwargs: Mapping[str, Any],
               prompt_kwargs: Mapping[str, Any]) -> "RayRollout":
        """Connect (or start a local instance), then create the buffer actor and the weight registry."""
        ray = import_ray()
        conn = RayConnection(address)
        try:
            here = _on_this_node()
            buffer_actor = ray.remote(BufferActor).options(num_cpus=0, max_concurrency=256, **here).remote(
                dict(buffer_kwargs), dict(prompt_kwargs))
            registry = ray.remote(WeightRegistry).options(num_cpus=0, **here).remote()
            remote = RemoteBuffer(buffer_actor, batch_groups=buffer_kwargs["batch_groups"],
                                  group_size=buffer_kwargs.get("group_size", 1),
                                  async_queue_size=buffer_kwargs.get("async_queue_size", 1))
            remote.stats()  # wait until the buffer actor is up (and surface its errors here)
        except BaseException:
            conn.close()
            raise
        return cls(conn, remote, RayWeightStore(registry), buffer_actor, registry)

    def backend(self, recipe: WorkerRecipe, num_workers: int, *, num_cpus: float, num_gpus: float,
                max_restarts: int, resources: Any = None, strategy: str = "default") -> RayRolloutBackend:
        """The pool of ``num_workers`` workers (not started). ``resources``: custom Ray resources per
        worker (see :class:`~flashreinforce.distributed.ray.placement.WorkerPlacement`); ``strategy``:
        ``default`` or ``spread``."""
        placement = WorkerPlacement(num_cpus=float(num_cpus), num_gpus=float(num_gpus), resources=resources or (),
                                    strategy=strategy)
        return RayRolloutBackend(recipe, num_workers, self.buffer, self.registry_actor, placement=placement,
                                 max_restarts=max_restarts)

    def close(self) -> None:
        """Remove the buffer actor and the registry, then disconnect (see :class:`RayConnection`).

        Never raises: it runs at the end of every run, also of one that ends because the cluster went
        away, whose first error is the one to report; a step that fails is logged in one line."""
        ray = import_ray()
        for what, actor in (("the buffer actor", self.buffer_actor), ("the weight registry", self.registry_actor)):
            try:
                if ray.is_initialized():
                    ray.kill(actor, no_restart=True)
            except Exception as err:
                log.info("removing %s failed during cleanup: %s: %s", what, type(err).__name__,
                         str(err).strip().splitlines()[0] if str(err).strip() else "")
        try:
            self.connection.close()
        except Exception as err:
            log.info("disconnecting from Ray failed during cleanup: %s: %s", type(err).__name__,
                     str(err).strip().splitlines()[0] if str(err).strip() else "")
