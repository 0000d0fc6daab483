"""The Ray rollout backend (``--rollout.backend ray``): rollout workers as Ray actors.

Pieces (all created by the learner process, the Ray *driver*, and owned by it: when the driver
disconnects, Ray removes them):

* **buffer actor** (:class:`BufferActor`, ``num_cpus=0``, threaded): one
  :class:`~flashreinforce.trainer.buffer.RolloutBuffer` reachable by every worker and by the learner,
  wrapped in an :class:`OwnedBuffer` that remembers which worker *incarnation* holds each ticket.
  The learner talks to it through :class:`RemoteBuffer` (``take`` / ``update_done`` / ``stats`` /
  ``state_dict`` ...), a worker through :class:`WorkerBufferClient` (``acquire`` / ``put`` / ``cancel``).
  Finished trajectories travel through Ray's object store (``ray.put`` by the worker).
* **weight registry** (:class:`WeightRegistry`, ``num_cpus=0``): the newest published version and
  an object-store reference to its weights. :class:`RayWeightStore` puts each version in the object
  store once (``ray.put`` of numpy arrays, read zero-copy from shared memory by workers on the same
  node) and workers ``ray.get`` it by version before a ``generate`` call, exactly as with
  :class:`~flashreinforce.engines.LocalWeightStore`; a trajectory records the versions that sampled it.
* **rollout workers** (:class:`RolloutWorkerActor`): each builds its own engine (``local``: the policy
  from its config, weights from the registry; ``vllm``: a vLLM engine) and its own environments, and
  runs the same :class:`~flashreinforce.trainer.rollout.RolloutWorker` loop as the local backend. Placement
  through Ray resources: ``--ray.num_cpus_per_worker`` / ``--ray.num_gpus_per_worker``.
* **supervisor** (:class:`RayRolloutBackend`, a thread of the driver): when a worker process dies
  (crash, OOM kill, node loss), the tickets its incarnation held are released: counted as
  ``lost_groups`` / ``lost_trajectories`` and their prompts handed out again first; Ray restarts the
  actor (``max_restarts``, ``--ray.max_restarts``) and the supervisor starts the next incarnation's
  loop (``worker_restarts``). Anything a dead incarnation still sends (a late ``put``) is dropped and
  counted (``late_puts``): a prompt is never trained on twice. The learner never waits for a
  restart; it keeps taking batches from the other workers.

Cluster: :class:`RayConnection` connects to ``--ray.address`` (or ``$RAY_ADDRESS``; ``auto`` finds a
cluster started on this node with ``ray start --head``), or starts a local Ray instance. On close it
only disconnects (``ray.shutdown()`` of this driver); a cluster it did not start keeps running, and
a local instance it started stops with it. If Ray was already initialized by the calling program,
it is used and left initialized.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from flashreinforce.trainer.buffer import Batch, RolloutBuffer, Ticket
from flashreinforce.engines.base import WeightStore
from flashreinforce.trainer.rollout import RolloutBackend, RolloutSettings, fair_share

__all__ = ["BufferActor", "OwnedBuffer", "RayConnection", "RayRollout", "RayRolloutBackend", "RayWeightStore",
           "RemoteBuffer", "RolloutWorkerActor", "StaleIncarnation", "WeightRegistry", "WorkerBufferClient",
           "WorkerRecipe", "import_ray"]

log = logging.getLogger(__name__)

#: Longest single blocking call a client makes into the buffer actor (seconds); longer waits loop,
#: so no actor thread is held indefinitely by one caller.
MAX_BLOCK_S = 1.0


def import_ray():
    """The ``ray`` module, or an ``ImportError`` that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("--rollout.backend ray needs Ray: pip install 'flashreinforce[ray]' "
                          "(or pip install 'ray>=2.9')") from err
    return ray


# ---------------------------------------------------------------------------- the cluster
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
        if ray.is_initialized():
            log.info("using the Ray connection this program already opened")
            return
        target = address or os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if target:
            ray.init(address=target, **kwargs)
        else:
            # "local": always a new instance (plain ray.init() would join a `ray start` cluster found
            # on this machine, which this run must not treat as its own).
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
            self.started_local = True
        self.connected_here = True
        log.info("Ray: %s (%s)", "started a local instance" if self.started_local else f"connected to {target}",
                 ray.cluster_resources())

    def close(self) -> None:
        """Disconnect; stops the Ray instance only if this process started it locally."""
        if self.connected_here:
            import_ray().shutdown()
            self.connected_here = False


# ---------------------------------------------------------------------------- the buffer
class StaleIncarnation(RuntimeError):
    """A worker incarnation that was declared lost asked for more work (its loop must end)."""


class OwnedBuffer:
    """A :class:`~flashreinforce.trainer.buffer.RolloutBuffer` whose tickets remember who holds them.

    Workers identify themselves by ``(worker_id, incarnation)``; an incarnation is one run of a
    worker's loop (a restarted actor starts a new one). :meth:`release` hands out again every
    ticket an incarnation held and marks it dead, so that what it still sends is refused: a late
    ``put`` never lands on a ticket that was re-issued to another worker. Thread-safe.
    """

    def __init__(self, buffer: RolloutBuffer) -> None:
        self.buffer = buffer
        self._lock = threading.Lock()
        self._owner: dict[int, tuple[int, int]] = {}
        self._tickets: dict[int, Ticket] = {}
        self._dead: set[tuple[int, int]] = set()
        self.late_calls = 0

    # worker side
    def acquire_many(self, worker_id: int, incarnation: int, n: int, timeout: float | None) -> list[Ticket]:
        """Up to ``n`` tickets for the incarnation (see :meth:`RolloutBuffer.acquire_many`)."""
        with self._lock:
            if (worker_id, incarnation) in self._dead:
                self.late_calls += 1
                raise StaleIncarnation(f"worker {worker_id} incarnation {incarnation} was released")
        tickets = self.buffer.acquire_many(n, timeout=timeout)
        with self._lock:
            if (worker_id, incarnation) in self._dead:  # released while this call waited
                for ticket in tickets:
                    self.buffer.cancel(ticket, f"worker {worker_id} incarnation {incarnation} is gone", lost=True)
                self.late_calls += 1
                return []
            for ticket in tickets:
                self._owner[ticket.prompt_id] = (worker_id, incarnation)
                self._tickets[ticket.prompt_id] = ticket
        return tickets

    def put_many(self, worker_id: int, incarnation: int, groups) -> list[int]:
        """Queue the samples of each ``(ticket, trajectories)``; -1 for (and nothing queued from) a
        ticket the caller no longer holds. The lock is held across the put, so a ticket released and
        re-issued in between can never receive the old holder's samples."""
        out = []
        with self._lock:
            for ticket, trajectories in groups:
                if self._owner.get(ticket.prompt_id) != (worker_id, incarnation):
                    self.late_calls += 1
                    log.warning("dropped a put for prompt %d from worker %d incarnation %d: it no longer holds it",
                                ticket.prompt_id, worker_id, incarnation)
                    out.append(-1)
                    continue
                del self._owner[ticket.prompt_id]
                del self._tickets[ticket.prompt_id]
                out.append(self.buffer.put(ticket, trajectories))
        return out

    def cancel(self, worker_id: int, incarnation: int, ticket: Ticket, reason: str = "") -> None:
        with self._lock:
            if self._owner.get(ticket.prompt_id) != (worker_id, incarnation):
                self.late_calls += 1
                return
            del self._owner[ticket.prompt_id]
            del self._tickets[ticket.prompt_id]
            self.buffer.cancel(ticket, reason)

    def release(self, worker_id: int, incarnation: int, reason: str = "") -> int:
        """The incarnation is gone: hand its tickets out again (counted as lost); returns how many."""
        with self._lock:
            self._dead.add((worker_id, incarnation))
            held = [pid for pid, owner in self._owner.items() if owner == (worker_id, incarnation)]
            for pid in held:
                ticket = self._tickets.pop(pid)
                del self._owner[pid]
                self.buffer.cancel(ticket, reason, lost=True)
        return len(held)

    def held(self, worker_id: int) -> int:
        """Tickets any incarnation of ``worker_id`` holds now."""
        return len(self.held_prompts(worker_id))

    def held_prompts(self, worker_id: int) -> list[int]:
        """Prompt ids of the tickets any incarnation of ``worker_id`` holds now."""
        with self._lock:
            return sorted(pid for pid, (w, _) in self._owner.items() if w == worker_id)

    def stats(self) -> dict[str, int]:
        out = self.buffer.stats()
        out["late_calls"] = self.late_calls
        return out


class BufferActor:
    """Ray actor body hosting one :class:`OwnedBuffer` (create it with :func:`ray.remote`; threaded)."""

    def __init__(self, buffer_kwargs: Mapping[str, Any], prompt_kwargs: Mapping[str, Any]) -> None:
        from flashreinforce.trainer.buffer import PromptStream

        self.owned = OwnedBuffer(RolloutBuffer(**buffer_kwargs, prompts=PromptStream(**prompt_kwargs)))

    # workers
    def acquire_many(self, worker_id: int, incarnation: int, n: int, timeout: float | None) -> list[Ticket]:
        return self.owned.acquire_many(worker_id, incarnation, n, timeout)

    def put_many(self, worker_id: int, incarnation: int, groups) -> list[int]:
        return self.owned.put_many(worker_id, incarnation, groups)

    def cancel(self, worker_id: int, incarnation: int, ticket: Ticket, reason: str = "") -> None:
        self.owned.cancel(worker_id, incarnation, ticket, reason)

    # supervisor and learner
    def release(self, worker_id: int, incarnation: int, reason: str = "") -> int:
        return self.owned.release(worker_id, incarnation, reason)

    def held(self, worker_id: int) -> int:
        return self.owned.held(worker_id)

    def held_prompts(self, worker_id: int) -> list[int]:
        return self.owned.held_prompts(worker_id)

    def take(self, learner_version: int, timeout: float | None) -> Batch | None:
        return self.owned.buffer.take(learner_version, timeout=timeout)

    def update_done(self) -> None:
        self.owned.buffer.update_done()

    def close(self) -> None:
        self.owned.buffer.close()

    def closed(self) -> bool:
        return self.owned.buffer.closed

    def stats(self) -> dict[str, int]:
        return self.owned.stats()

    def in_flight(self) -> int:
        return self.owned.buffer.in_flight()

    def state_dict(self) -> dict:
        return self.owned.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.owned.buffer.load_state_dict(state)


class RemoteBuffer:
    """The learner's side of the buffer actor, with :class:`~flashreinforce.trainer.buffer.RolloutBuffer`'s
    learner-side interface (``take`` waits in slices of at most :data:`MAX_BLOCK_S`)."""

    def __init__(self, handle, *, batch_groups: int, group_size: int, async_queue_size: int = 1) -> None:
        self.handle = handle
        self.batch_groups = batch_groups
        self.group_size = group_size
        self.async_queue_size = async_queue_size

    def _get(self, ref):
        return import_ray().get(ref)

    def take(self, learner_version: int, timeout: float | None = None) -> Batch | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = MAX_BLOCK_S if deadline is None else max(0.0, min(MAX_BLOCK_S, deadline - time.monotonic()))
            batch = self._get(self.handle.take.remote(learner_version, wait))
            if batch is not None or self.closed or (deadline is not None and time.monotonic() >= deadline):
                return batch

    def update_done(self) -> None:
        self._get(self.handle.update_done.remote())

    def close(self) -> None:
        self._get(self.handle.close.remote())

    @property
    def closed(self) -> bool:
        return self._get(self.handle.closed.remote())

    def stats(self) -> dict[str, int]:
        return self._get(self.handle.stats.remote())

    def in_flight(self) -> int:
        return self._get(self.handle.in_flight.remote())

    def state_dict(self) -> dict:
        return self._get(self.handle.state_dict.remote())

    def load_state_dict(self, state: dict) -> None:
        self._get(self.handle.load_state_dict.remote(state))

    def held(self, worker_id: int) -> int:
        return self._get(self.handle.held.remote(worker_id))


class WorkerBufferClient:
    """A rollout worker's side of the buffer actor: ``acquire`` / ``put`` / ``cancel`` as one
    incarnation of worker ``worker_id``. Trajectories go through the object store (``ray.put``)."""

    def __init__(self, handle, worker_id: int, group_size: int) -> None:
        self.handle = handle
        self.worker_id = worker_id
        self.group_size = group_size
        self.incarnation = 0

    def acquire_many(self, n: int, timeout: float | None = None) -> list[Ticket]:
        """Up to ``n`` tickets in one round trip (waits in slices of at most :data:`MAX_BLOCK_S`)."""
        ray = import_ray()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = MAX_BLOCK_S if deadline is None else max(0.0, min(MAX_BLOCK_S, deadline - time.monotonic()))
            tickets = ray.get(self.handle.acquire_many.remote(self.worker_id, self.incarnation, int(n), wait))
            if tickets or (deadline is not None and time.monotonic() >= deadline) or self.closed:
                return tickets

    def acquire(self, timeout: float | None = None) -> Ticket | None:
        tickets = self.acquire_many(1, timeout)
        return tickets[0] if tickets else None

    def put_many(self, groups) -> list[int]:
        """All finished groups of one ``generate`` round in one object-store put and one call."""
        ray = import_ray()
        ref = ray.put([(ticket, list(trajs)) for ticket, trajs in groups])
        return ray.get(self.handle.put_many.remote(self.worker_id, self.incarnation, ref))

    def put(self, ticket: Ticket, trajectories) -> int:
        return self.put_many([(ticket, trajectories)])[0]

    def cancel(self, ticket: Ticket, reason: str = "") -> None:
        import_ray().get(self.handle.cancel.remote(self.worker_id, self.incarnation, ticket, reason))

    def close(self) -> None:
        """Workers never close the shared buffer (the learner does)."""

    @property
    def closed(self) -> bool:
        return import_ray().get(self.handle.closed.remote())


# ---------------------------------------------------------------------------- weights
class WeightRegistry:
    """Ray actor body: the newest published weight version and its object-store reference."""

    def __init__(self) -> None:
        self.version = -1
        self.refs: list = []

    def publish(self, version: int, refs: list) -> None:
        if version <= self.version:
            raise ValueError(f"publish: version {version} is not newer than {self.version}")
        self.version, self.refs = int(version), list(refs)

    def latest(self) -> int:
        return self.version

    def fetch(self, newer_than: int):
        if self.version <= newer_than:
            return None
        return self.version, self.refs


def _to_arrays(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, Any]]:
    """CPU numpy copies of ``state`` (bfloat16 as int16 bits), for zero-copy reads from the object store."""
    out = {}
    for name, t in state.items():
        t = t.detach()
        full = getattr(t, "full_tensor", None)
        if callable(full):
            t = full()
        t = t.to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        out[name] = (dtype, t.numpy())
    return out


def _from_arrays(arrays: Mapping[str, tuple[str, Any]]) -> dict[str, torch.Tensor]:
    out = {}
    with warnings.catch_warnings():
        # Object-store arrays are read-only; engines copy them into their own parameters.
        warnings.simplefilter("ignore", UserWarning)
        for name, (dtype, arr) in arrays.items():
            t = torch.from_numpy(arr)
            out[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


class RayWeightStore(WeightStore):
    """:class:`~flashreinforce.engines.WeightStore` on Ray: one ``ray.put`` per published version,
    its reference kept by the :class:`WeightRegistry` actor ``registry``; ``fetch`` is one small call
    to the registry, plus one ``ray.get`` of the weights when a newer version exists."""

    def __init__(self, registry) -> None:
        self.registry = registry
        self._ref = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        ray = import_ray()
        ref = ray.put(_to_arrays(state_dict))
        ray.get(self.registry.publish.remote(int(version), [ref]))  # in a list: passed as a reference
        self._ref = ref

    def latest_version(self) -> int:
        return import_ray().get(self.registry.latest.remote())

    def fetch(self, newer_than: int):
        ray = import_ray()
        got = ray.get(self.registry.fetch.remote(int(newer_than)))
        if got is None:
            return None
        version, refs = got
        return version, _from_arrays(ray.get(refs[0]))


# ---------------------------------------------------------------------------- workers
@dataclass
class WorkerRecipe:
    """What a remote rollout worker builds itself from (picklable; no model weights).

    model_config: the policy's ``transformers`` config (weights come from the weight store).
    engine / engine_options: :func:`~flashreinforce.engines.create_engine`'s kind and options.
    tokenizer: the run's tokenizer object. env: the :class:`~flashreinforce.trainer.EnvSpec`.
    settings: the :class:`~flashreinforce.trainer.rollout.RolloutSettings`. group_size: samples per prompt
    (the buffer's). engine_options: extra engine arguments (vLLM). torch_threads: intra-op threads
    of the worker process (``None``: torch's default). max_prompts_per_call: the worker's share of
    the prompts that may be in flight (set by :class:`RayRolloutBackend`, see :func:`fair_share`).
    """

    model_config: Any
    engine: str
    tokenizer: Any
    env: Any
    settings: RolloutSettings
    group_size: int = 1
    engine_options: dict[str, Any] = field(default_factory=dict)
    torch_threads: int | None = None
    max_prompts_per_call: int | None = None


class RolloutWorkerActor:
    """Ray actor body: one rollout worker with its own engine and environments (threaded actor:
    ``run`` holds one thread, ``stop`` / ``stats`` / ``pid`` answer on others)."""

    def __init__(self, worker_id: int, recipe_ref: list, buffer_handle, registry_handle) -> None:
        import transformers

        from flashreinforce.engines import create_engine
        from flashreinforce.trainer.rollout import RolloutWorker

        # The recipe comes by reference (the driver keeps it alive), so a restarted actor finds it again.
        recipe: WorkerRecipe = import_ray().get(recipe_ref[0])
        if recipe.torch_threads:
            torch.set_num_threads(int(recipe.torch_threads))
        ray = import_ray()
        device = torch.device("cuda:0") if ray.get_gpu_ids() and torch.cuda.is_available() else torch.device("cpu")
        if recipe.engine == "local":
            model = transformers.AutoModelForCausalLM.from_config(recipe.model_config)
            model = model.to(device=device, dtype=torch.float32)
        else:
            model = recipe.model_config
        engine = create_engine(recipe.engine, model, pad_token_id=recipe.tokenizer.pad_token_id, version=-1,
                               options=recipe.engine_options)
        buffer = WorkerBufferClient(buffer_handle, worker_id, recipe.group_size)
        self.worker = RolloutWorker(worker_id, engine, recipe.env.factory(recipe.tokenizer), recipe.tokenizer,
                                    buffer, RayWeightStore(registry_handle), recipe.settings)
        self.worker.max_prompts_per_call = recipe.max_prompts_per_call
        self._stop = threading.Event()
        self._running = threading.Lock()
        self.device = str(device)

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "device": self.device, "node": import_ray().get_runtime_context().get_node_id()}

    def pid(self) -> int:
        return os.getpid()

    def run(self, incarnation: int) -> dict[str, float]:
        """Roll out until stopped or the buffer closes (as incarnation ``incarnation``).

        One loop at a time: should an earlier incarnation's loop still run in this process (the actor
        was only unreachable for a while), it ends at its next request (:class:`StaleIncarnation`)
        and this one waits for it.
        """
        with self._running:
            self.worker.buffer.incarnation = int(incarnation)
            self._stop.clear()
            self.worker.run(self._stop)
            return self.stats()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        out = dict(self.worker.stats())
        out["last_error"] = self.worker.last_error
        return out

    def close(self) -> None:
        self.worker.close()


_STAT_KEYS = ("idle_s", "busy_s", "episodes", "errors", "weight_loads")


class RayRolloutBackend(RolloutBackend):
    """``num_workers`` :class:`RolloutWorkerActor` s and the supervisor thread that restarts them.

    Args:
        recipe: how every worker builds itself.
        num_workers: how many workers.
        buffer: the :class:`RemoteBuffer` of the buffer actor.
        registry: the :class:`WeightRegistry` actor handle.
        num_cpus / num_gpus: Ray resources each worker actor reserves.
        max_restarts: restarts per worker after its process dies (-1: unlimited).
        poll_s: how often the supervisor looks for finished or dead workers.
        placement_timeout_s: how long :meth:`start` waits for Ray to place and build every worker.
    """

    def __init__(self, recipe: WorkerRecipe, num_workers: int, buffer: RemoteBuffer, registry, *,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, max_restarts: int = 3, poll_s: float = 0.2,
                 placement_timeout_s: float = 600.0) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers must be positive, got {num_workers}")
        self.recipe = recipe
        self.num_workers = num_workers
        self.buffer = buffer
        self.registry = registry
        self.num_cpus = float(num_cpus)
        self.num_gpus = float(num_gpus)
        self.max_restarts = int(max_restarts)
        self.poll_s = poll_s
        self.placement_timeout_s = placement_timeout_s
        self.actors: list = []
        self._runs: list = []
        self.incarnation: list[int] = []
        self.restarts: list[int] = []
        self.lost_groups = 0
        self._failures: dict[int, BaseException] = {}
        self._last_stats: list[dict[str, Any]] = []
        self._base_stats: list[dict[str, float]] = []
        self._reviving: dict[int, Any] = {}  # worker -> pending "are you up?" call after a death
        self._ping_again: dict[int, float] = {}  # worker -> when to ask again
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._supervisor_error: BaseException | None = None
        self.placement: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        ray = import_ray()
        actor_cls = ray.remote(RolloutWorkerActor)
        if self.recipe.torch_threads is None:  # as many intra-op threads as CPUs reserved, not the node's all
            self.recipe.torch_threads = max(1, int(self.num_cpus))
        if self.recipe.max_prompts_per_call is None:
            self.recipe.max_prompts_per_call = fair_share(self.buffer.batch_groups, self.buffer.async_queue_size,
                                                          self.num_workers)
        self._recipe_ref = ray.put(self.recipe)
        for i in range(self.num_workers):
            actor = actor_cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=self.max_restarts,
                                      max_task_retries=0, max_concurrency=4,
                                      name=None).remote(i, [self._recipe_ref], self.buffer.handle, self.registry)
            self.actors.append(actor)
        try:
            self.placement = self._wait_ready()
        except Exception as err:
            for a in self.actors:
                ray.kill(a, no_restart=True)
            if isinstance(err, TimeoutError):
                raise
            raise RuntimeError(f"a Ray rollout worker could not be built: {err}") from err
        log.info("Ray rollout workers: %s", self.placement)
        self.incarnation = [0] * self.num_workers
        self.restarts = [0] * self.num_workers
        self._last_stats = [{k: 0.0 for k in _STAT_KEYS} for _ in range(self.num_workers)]
        self._base_stats = [{k: 0.0 for k in _STAT_KEYS} for _ in range(self.num_workers)]
        self._runs = [a.run.remote(0) for a in self.actors]
        self._thread = threading.Thread(target=self._supervise, name="ray-rollout-supervisor", daemon=True)
        self._thread.start()

    def _wait_ready(self) -> list[dict[str, Any]]:
        """Wait until every worker actor is placed and built; a clear error when the cluster cannot
        place them (Ray would otherwise keep them pending forever)."""
        ray = import_ray()
        refs = [a.ready.remote() for a in self.actors]
        start = time.monotonic()
        while True:
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=30.0)
            if not pending:
                return ray.get(refs)
            waited = time.monotonic() - start
            need = f"{self.num_cpus:g} CPU and {self.num_gpus:g} GPU each"
            if waited >= self.placement_timeout_s:
                raise TimeoutError(
                    f"Ray placed only {len(done)} of {len(refs)} rollout workers in {waited:.0f} s ({need}; "
                    f"available now: {ray.available_resources()}); lower --ray.num_cpus_per_worker / "
                    "--ray.num_gpus_per_worker or the number of workers, or add nodes")
            log.warning("waiting for Ray to place %d more rollout worker(s) (%s; available: %s)", len(pending), need,
                        ray.available_resources())

    def stop(self, timeout: float = 30.0) -> None:
        ray = import_ray()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for a in self.actors:
            a.stop.remote()
        try:
            self.buffer.close()
        except Exception:  # the buffer actor may already be gone; the workers stop on their own
            log.exception("closing the buffer actor failed")
        live = {r: i for i, r in enumerate(self._runs) if r is not None}
        if live:
            done, _ = ray.wait(list(live), num_returns=len(live), timeout=timeout)
            for ref in done:  # a loop's return value is its final statistics
                try:
                    self._last_stats[live[ref]] = ray.get(ref)
                except Exception:  # it failed or died; the last statistics seen stand
                    pass
        closing = [a.close.remote() for a in self.actors]
        ray.wait(closing, num_returns=len(closing), timeout=10.0)
        for a in self.actors:
            ray.kill(a, no_restart=True)

    # ------------------------------------------------------------------ supervision
    def _supervise(self) -> None:
        ray = import_ray()
        last_stats = 0.0
        try:
            while not self._stopping.is_set():
                live = {r: i for i, r in enumerate(self._runs) if r is not None}
                pings = {r: i for i, r in self._reviving.items() if r is not None}
                if live or pings:
                    done, _ = ray.wait(list(live) + list(pings), num_returns=1, timeout=self.poll_s)
                else:
                    done = []
                    time.sleep(self.poll_s)
                for ref in done:
                    if ref in live:
                        self._finished(live[ref], ref)
                    else:
                        self._revived(pings[ref], ref)
                for i, when in list(self._ping_again.items()):
                    if time.monotonic() >= when:
                        del self._ping_again[i]
                        self._reviving[i] = self.actors[i].pid.remote()
                if time.monotonic() - last_stats > 0.5:
                    self._refresh_stats()
                    last_stats = time.monotonic()
        except BaseException as err:  # surfaced by check()
            self._supervisor_error = err
            log.exception("the Ray rollout supervisor failed")

    def _finished(self, i: int, ref) -> None:
        ray = import_ray()
        from ray.exceptions import RayActorError

        try:
            ray.get(ref)
            self._runs[i] = None  # returned: stopped, or the buffer closed
            return
        except RayActorError as err:
            if self._stopping.is_set():
                self._runs[i] = None
                return
            death = err
        except Exception as err:  # the worker's own loop gave up (consecutive episode errors)
            self._failures[i] = err
            self._runs[i] = None
            lost = ray.get(self.buffer.handle.release.remote(i, self.incarnation[i], f"worker {i} stopped: {err}"))
            self.lost_groups += lost
            log.error("rollout worker %d stopped: %s", i, err)
            return
        lost = ray.get(self.buffer.handle.release.remote(i, self.incarnation[i],
                                                         f"worker {i} died: {type(death).__name__}"))
        self.lost_groups += lost
        for k in _STAT_KEYS:  # the dead incarnation's counters, as last seen, stay in the totals
            self._base_stats[i][k] += float(self._last_stats[i].get(k, 0.0))
        self._last_stats[i] = {k: 0.0 for k in _STAT_KEYS}
        if 0 <= self.max_restarts <= self.restarts[i]:
            self._failures[i] = death
            self._runs[i] = None
            log.error("rollout worker %d died (%d prompt(s) lost and handed out again) and has no restart left",
                      i, lost)
            return
        self.restarts[i] += 1
        self.incarnation[i] += 1
        log.warning("rollout worker %d died (%s); %d prompt(s) it held are handed out again; restart %d",
                    i, type(death).__name__, lost, self.restarts[i])
        # Ray restarts the actor process (max_restarts); the next incarnation's loop starts once it
        # answers (a call made while it restarts can fail as unavailable instead of waiting).
        self._runs[i] = None
        self._reviving[i] = self.actors[i].pid.remote()

    def _revived(self, i: int, ref) -> None:
        ray = import_ray()
        from ray.exceptions import RayActorError

        # Newer Ray answers "restarting, try again" with ActorUnavailableError; older Ray queues the call.
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        self._reviving[i] = None
        try:
            ray.get(ref)
        except unavailable:  # still restarting: ask again shortly
            self._ping_again[i] = time.monotonic() + self.poll_s
            return
        except RayActorError as err:  # gone for good (e.g. its constructor fails now)
            self._failures[i] = err
            log.error("rollout worker %d could not be restarted: %s", i, err)
            return
        if not self._stopping.is_set():
            self._runs[i] = self.actors[i].run.remote(self.incarnation[i])

    def _refresh_stats(self) -> None:
        ray = import_ray()
        refs = {}
        for i, a in enumerate(self.actors):
            if self._runs[i] is not None:
                refs[a.stats.remote()] = i
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.5)
        for ref in done:
            try:
                self._last_stats[refs[ref]] = ray.get(ref)
            except Exception:  # a worker that is dying answers nothing; its next incarnation will
                pass

    def check(self) -> None:
        if self._supervisor_error is not None:
            raise RuntimeError(f"the Ray rollout supervisor failed: {self._supervisor_error!r}")
        reviving = any(r is not None for r in self._reviving.values()) or self._ping_again
        if self._runs and all(r is None for r in self._runs) and self._failures and not reviving:
            i, err = next(iter(self._failures.items()))
            detail = self._last_stats[i].get("last_error") or ""
            raise RuntimeError(f"every rollout worker has stopped: worker {i}: {err!r}\n{detail}")

    def stats(self) -> list[dict[str, float]]:
        out = []
        for i in range(self.num_workers):
            s = {k: self._base_stats[i][k] + float(self._last_stats[i].get(k, 0.0)) for k in _STAT_KEYS}
            s["restarts"] = self.restarts[i]
            out.append(s)
        return out

    # ------------------------------------------------------------------ introspection (tests, tools)
    def worker_pid(self, i: int) -> int:
        return import_ray().get(self.actors[i].pid.remote())

    def held(self, i: int) -> int:
        """Tickets worker ``i`` holds in the buffer now."""
        return self.buffer.held(i)


@dataclass
class RayRollout:
    """The Ray side of a run: connection, buffer actor, weight registry, and the worker backend."""

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
            buffer_actor = ray.remote(BufferActor).options(num_cpus=0, max_concurrency=256).remote(
                dict(buffer_kwargs), dict(prompt_kwargs))
            registry = ray.remote(WeightRegistry).options(num_cpus=0).remote()
            remote = RemoteBuffer(buffer_actor, batch_groups=buffer_kwargs["batch_groups"],
                                  group_size=buffer_kwargs.get("group_size", 1),
                                  async_queue_size=buffer_kwargs.get("async_queue_size", 1))
            remote.stats()  # wait until the buffer actor is up (and surface its errors here)
        except BaseException:
            conn.close()
            raise
        return cls(conn, remote, RayWeightStore(registry), buffer_actor, registry)

    def backend(self, recipe: WorkerRecipe, num_workers: int, *, num_cpus: float, num_gpus: float,
                max_restarts: int) -> RayRolloutBackend:
        return RayRolloutBackend(recipe, num_workers, self.buffer, self.registry_actor, num_cpus=num_cpus,
                                 num_gpus=num_gpus, max_restarts=max_restarts)

    def close(self) -> None:
        """Remove the buffer actor and the registry, then disconnect (see :class:`RayConnection`)."""
        ray = import_ray()
        try:
            if ray.is_initialized():
                for a in (self.buffer_actor, self.registry_actor):
                    ray.kill(a, no_restart=True)
        finally:
            self.connection.close()
