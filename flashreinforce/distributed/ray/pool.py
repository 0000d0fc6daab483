"""The rollout worker pool and its supervisor (:class:`RayRolloutBackend`).

:meth:`RayRolloutBackend.start` checks that some live node could hold each worker (else a clear
error at once), creates the worker actors (:class:`~flashreinforce.distributed.ray.placement.WorkerPlacement`),
waits until Ray placed and built every one (a bounded wait with a message naming the flags), and
starts each worker's loop. A supervisor thread then watches the loops:

* a loop that *returned* (stopped, or the buffer closed) is done;
* a loop whose *own code gave up* (five episode errors in a row) leaves the worker stopped; the
  tickets it held are handed out again (counted as lost);
* a worker whose *process or node died*: the tickets its incarnation held are released (counted
  as ``lost_groups`` / ``lost_trajectories``, handed out again first) and the incarnation is marked
  dead in the buffer actor, so anything it still sends is refused (``late_calls``); Ray restarts
  the actor (``max_restarts``, on any node that can hold it: a node that joins later does), and the
  supervisor starts the next incarnation's loop once it answers (``worker_restarts``). While a
  worker waits for a node it logs why, once a minute. The learner never waits for a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from flashreinforce.distributed.ray.buffer import RemoteBuffer
from flashreinforce.distributed.ray.calls import ActorGone, import_ray
from flashreinforce.distributed.ray.placement import WorkerPlacement, describe_nodes
from flashreinforce.distributed.ray.workers import RolloutWorkerActor, WorkerRecipe
from flashreinforce.trainer.errors import RolloutFailed
from flashreinforce.trainer.rollout.backend import RolloutBackend, engine_failure, fair_share

__all__ = ["RayRolloutBackend"]

log = logging.getLogger(__name__)

#: Counters of a worker's statistics that add up over its incarnations.
_STAT_KEYS = ("idle_s", "busy_s", "episodes", "errors", "weight_loads", "quarantined_episodes", "env_timeouts",
              "weight_sync_s_total", "inflight_pauses")
#: Per-worker values that describe its latest event (not summed over incarnations).
_LAST_KEYS = ("last_weight_sync_s", "last_weight_sync_bytes")

#: A worker not back this long after its death gets a log line saying what it waits for (seconds),
#: repeated every :data:`REVIVE_REPORT_EVERY_S`.
REVIVE_REPORT_AFTER_S = 10.0
REVIVE_REPORT_EVERY_S = 60.0


def root_cause(err: BaseException) -> str:
    """The last ``SomeError: message`` line of a (Ray-wrapped) error: the original exception, without
    Ray's frames and banners around it."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ":" in ln and head.isidentifier() and head.endswith(("Error", "Exception")):
            return ln
    return lines[-1] if lines else type(err).__name__


def _cluster_lost(err: BaseException) -> bool:
    """Whether ``err`` says that an actor, a node or the whole Ray cluster is out of reach rather than
    a bug of ours: an :class:`ActorGone`, a broken connection, one of Ray's own errors, or any error
    raised inside Ray's code (``ray.nodes()`` without a cluster, say)."""
    if isinstance(err, (ActorGone, ConnectionError)) or type(err).__module__.split(".")[0] == "ray":
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").split(".")[0] == "ray"


def _add_counts(a: dict[str, int], b: Any) -> dict[str, int]:
    """``a`` plus the counts of ``b`` (a dict of counts, or nothing), as a new dict."""
    out = dict(a)
    if isinstance(b, dict):
        for k, n in b.items():
            out[k] = out.get(k, 0) + int(n)
    return out


def _quietly(what: str, fn):
    """``fn()`` for a cleanup step; ``None`` and one log line when it fails (see
    :meth:`RayRolloutBackend.stop`)."""
    try:
        return fn()
    except Exception as err:
        log.info("%s failed during cleanup: %s", what, root_cause(err))
        return None


class RayRolloutBackend(RolloutBackend):
    """``num_workers`` :class:`~flashreinforce.distributed.ray.workers.RolloutWorkerActor` s and the
    supervisor thread that restarts them.

    Args:
        recipe: how every worker builds itself.
        num_workers: how many workers.
        buffer: the :class:`~flashreinforce.distributed.ray.buffer.RemoteBuffer` of the buffer actor.
        registry: the weight registry's actor handle.
        placement: resources and scheduling strategy of each worker.
        max_restarts: restarts per worker after its process dies (-1: unlimited).
        poll_s: how often the supervisor looks for finished or dead workers.
        placement_timeout_s: how long :meth:`start` waits for Ray to place and build every worker.
    """

    def __init__(self, recipe: WorkerRecipe, num_workers: int, buffer: RemoteBuffer, registry, *,
                 placement: WorkerPlacement | None = None, max_restarts: int = 3, poll_s: float = 0.2,
                 placement_timeout_s: float = 600.0) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers must be positive, got {num_workers}")
        self.recipe = recipe
        self.num_workers = num_workers
        self.buffer = buffer
        self.registry = registry
        self.placement = placement or WorkerPlacement()
        self.max_restarts = int(max_restarts)
        self.poll_s = poll_s
        self.placement_timeout_s = placement_timeout_s
        self.revive_report_after_s = REVIVE_REPORT_AFTER_S
        self.revive_report_every_s = REVIVE_REPORT_EVERY_S
        self.actors: list = []
        self.locations: list[dict[str, Any]] = []  # per worker: pid, device, node, ip (updated on restart)
        self._runs: list = []
        self.incarnation: list[int] = []
        self.restarts: list[int] = []
        self.lost_groups = 0
        self._failures: dict[int, BaseException] = {}
        self._last_stats: list[dict[str, Any]] = []
        self._base_stats: list[dict[str, float]] = []
        self._base_timeouts: list[dict[str, int]] = []  # env_timeouts_by_call of dead incarnations
        self._reviving: dict[int, Any] = {}  # worker -> pending "are you up?" call after a death
        self._ping_again: dict[int, float] = {}  # worker -> when to ask again
        self._dead_since: dict[int, float] = {}  # worker -> when its death was seen (until it is back)
        self._reported: dict[int, float] = {}  # worker -> when its wait was last reported
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._supervisor_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        ray = import_ray()
        self._check_placeable(ray.nodes())
        actor_cls = ray.remote(RolloutWorkerActor)
        if self.recipe.torch_threads is None:  # as many intra-op threads as CPUs reserved, not the node's all
            self.recipe.torch_threads = max(1, int(self.placement.num_cpus))
        if self.recipe.max_prompts_per_call is None:
            self.recipe.max_prompts_per_call = fair_share(self.buffer.batch_groups, self.buffer.async_queue_size,
                                                          self.num_workers)
        self._recipe_ref = ray.put(self.recipe)
        for i in range(self.num_workers):
            actor = actor_cls.options(**self.placement.options(i), max_restarts=self.max_restarts,
                                      max_task_retries=0, max_concurrency=4,
                                      name=None).remote(i, [self._recipe_ref], self.buffer.handle, self.registry)
            self.actors.append(actor)
        try:
            self.locations = self._wait_ready()
        except BaseException:
            for a in self.actors:
                ray.kill(a, no_restart=True)
            raise
        for i, where in enumerate(self.locations):
            log.info("Ray rollout worker %d: node %s (%s), pid %s, %s; reserves %s", i, where["node"][:8],
                     where["ip"], where["pid"], where["device"], self.placement.describe(i))
        self.incarnation = [0] * self.num_workers
        self.restarts = [0] * self.num_workers
        self._last_stats = [{k: 0.0 for k in _STAT_KEYS} for _ in range(self.num_workers)]
        self._base_stats = [{k: 0.0 for k in _STAT_KEYS} for _ in range(self.num_workers)]
        self._base_timeouts = [{} for _ in range(self.num_workers)]
        self._runs = [a.run.remote(0) for a in self.actors]
        self._thread = threading.Thread(target=self._supervise, name="ray-rollout-supervisor", daemon=True)
        self._thread.start()

    def _check_placeable(self, nodes) -> None:
        """Refuse at once a worker that no live node could hold (Ray would keep it pending forever)."""
        bad = [i for i in range(self.num_workers) if self.placement.unplaceable(i, nodes)]
        if bad:
            i = bad[0]
            raise RuntimeError(
                f"no node of the Ray cluster can hold rollout worker {i} ({len(bad)} of {self.num_workers} workers "
                f"cannot be placed): it reserves {self.placement.describe(i)}; live nodes: {describe_nodes(nodes)}. "
                "Check --ray.worker_resources, --ray.num_cpus_per_worker and --ray.num_gpus_per_worker, or start "
                "nodes that have these resources (ray start --resources '{\"NAME\": N}')")

    def _wait_ready(self) -> list[dict[str, Any]]:
        """Wait until every worker actor is placed and built; a clear error when the cluster cannot
        place them in time (Ray would otherwise keep them pending forever)."""
        ray = import_ray()
        refs = [a.ready.remote() for a in self.actors]
        index = {ref: i for i, ref in enumerate(refs)}
        start = time.monotonic()
        while True:
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=min(30.0, self.placement_timeout_s))
            for ref in done:  # a worker whose constructor failed: report it now, not after the others
                try:
                    ray.get(ref)
                except Exception as err:
                    raise RuntimeError(f"Ray rollout worker {index[ref]} could not be built: {root_cause(err)}") from err
            if not pending:
                return ray.get(refs)
            waited = time.monotonic() - start
            need = "; ".join(sorted({self.placement.describe(i) for i in range(self.num_workers)}))
            if waited >= self.placement_timeout_s:
                raise TimeoutError(
                    f"Ray placed only {len(done)} of {len(refs)} rollout workers in {waited:.0f} s (each reserves "
                    f"{need}; available now: {ray.available_resources()}); lower --ray.num_cpus_per_worker / "
                    "--ray.num_gpus_per_worker / --ray.worker_resources or the number of workers, or add nodes")
            log.warning("waiting for Ray to place %d more rollout worker(s) (each reserves %s; available: %s)",
                        len(pending), need, ray.available_resources())

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loops, close the buffer, collect the final statistics and remove the worker actors.

        Never raises: this is the cleanup of a run that may be ending because its cluster went away,
        and that first error is the one to report. A step that fails is logged in one line (nothing
        when the buffer actor was already known to be gone) and the next step runs.
        """
        ray = import_ray()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for a in self.actors:
            _quietly("stopping a rollout worker", lambda: a.stop.remote())
        if self.buffer.gone is None:
            _quietly("closing the buffer actor", self.buffer.close)
        live = {r: i for i, r in enumerate(self._runs) if r is not None}
        if live and self.buffer.gone is None:
            done = _quietly("waiting for the rollout loops to end",
                            lambda: ray.wait(list(live), num_returns=len(live), timeout=timeout)[0]) or []
            for ref in done:  # a loop's return value is its final statistics
                try:
                    self._last_stats[live[ref]] = ray.get(ref, timeout=1.0)
                except Exception:  # it failed or died; the last statistics seen stand
                    pass
        if self.buffer.gone is None:
            closing = _quietly("closing the rollout workers", lambda: [a.close.remote() for a in self.actors]) or []
            if closing:
                _quietly("closing the rollout workers", lambda: ray.wait(closing, num_returns=len(closing),
                                                                          timeout=10.0))
        for a in self.actors:
            _quietly("removing a rollout worker actor", lambda: ray.kill(a, no_restart=True))

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
                        self._reviving[i] = self.actors[i].ready.remote()
                self._report_waiting()
                if time.monotonic() - last_stats > 0.5:
                    self._refresh_stats()
                    last_stats = time.monotonic()
        except BaseException as err:  # surfaced by check()
            if _cluster_lost(err):  # check() raises it as one line; a traceback would only repeat it
                self._supervisor_error = err if isinstance(err, ActorGone) else ActorGone(
                    f"the Ray cluster went away ({root_cause(err)}); once it is back, continue with --resume from "
                    "the last checkpoint")
                log.debug("the Ray rollout supervisor stopped: %s", root_cause(err))
            else:
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
            lost = self.buffer.release(i, self.incarnation[i], f"worker {i} stopped: {err}")
            self.lost_groups += lost
            log.error("rollout worker %d stopped: %s", i, err)
            return
        lost = self.buffer.release(i, self.incarnation[i], f"worker {i} died: {type(death).__name__}")
        self.lost_groups += lost
        for k in _STAT_KEYS:  # the dead incarnation's counters, as last seen, stay in the totals
            self._base_stats[i][k] += float(self._last_stats[i].get(k, 0.0))
        self._base_timeouts[i] = _add_counts(self._base_timeouts[i], self._last_stats[i].get("env_timeouts_by_call"))
        self._last_stats[i] = {k: 0.0 for k in _STAT_KEYS}
        where = self.locations[i] if i < len(self.locations) else {}
        on = f"on node {where.get('node', '?')[:8]} ({where.get('ip', '?')})"
        if 0 <= self.max_restarts <= self.restarts[i]:
            self._failures[i] = death
            self._runs[i] = None
            log.error("rollout worker %d %s died (%d prompt(s) lost and handed out again) and has no restart left "
                      "(--ray.max_restarts %d)", i, on, lost, self.max_restarts)
            return
        self.restarts[i] += 1
        self.incarnation[i] += 1
        log.warning("rollout worker %d %s died (%s); %d prompt(s) it held are handed out again; restart %d",
                    i, on, type(death).__name__, lost, self.restarts[i])
        # Ray restarts the actor process (max_restarts); the next incarnation's loop starts once it
        # answers (a call made while it restarts can fail as unavailable instead of waiting).
        self._runs[i] = None
        self._dead_since[i] = time.monotonic()
        self._reviving[i] = self.actors[i].ready.remote()

    def _revived(self, i: int, ref) -> None:
        ray = import_ray()
        from ray.exceptions import RayActorError

        # Newer Ray answers "restarting, try again" with ActorUnavailableError; older Ray queues the call.
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        self._reviving[i] = None
        try:
            where = ray.get(ref)
        except unavailable:  # still restarting: ask again shortly
            self._ping_again[i] = time.monotonic() + self.poll_s
            return
        except RayActorError as err:  # gone for good (e.g. its constructor fails now)
            self._failures[i] = err
            self._dead_since.pop(i, None)
            log.error("rollout worker %d could not be restarted: %s", i, err)
            return
        if self._stopping.is_set():
            return
        down = time.monotonic() - self._dead_since.pop(i, time.monotonic())
        self._reported.pop(i, None)
        if i < len(self.locations):
            self.locations[i] = where
        log.warning("rollout worker %d is back on node %s (%s) after %.1f s; incarnation %d starts",
                    i, where["node"][:8], where["ip"], down, self.incarnation[i])
        self._runs[i] = self.actors[i].run.remote(self.incarnation[i])

    def _report_waiting(self) -> None:
        """One log line a minute per worker that Ray has not brought back yet, saying what it needs."""
        now = time.monotonic()
        waiting = [i for i, t in self._dead_since.items() if now - t >= self.revive_report_after_s
                   and now - self._reported.get(i, -float("inf")) >= self.revive_report_every_s]
        if not waiting:
            return
        nodes = import_ray().nodes()
        running = sum(r is not None for r in self._runs)
        for i in waiting:
            self._reported[i] = now
            why = ("no live node has what it reserves" if self.placement.unplaceable(i, nodes)
                   else "its resources are busy or Ray is still starting it")
            log.warning("rollout worker %d has waited %.0f s for Ray to restart it: %s (%s; live nodes: %s); the run "
                        "goes on with %d of %d workers", i, now - self._dead_since[i], why,
                        self.placement.describe(i), describe_nodes(nodes), running, self.num_workers)

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
            err = self._supervisor_error
            if isinstance(err, ActorGone):
                raise ActorGone(f"the Ray rollout supervisor stopped: {err}") from err
            raise RuntimeError(f"the Ray rollout supervisor failed: {err!r}") from err
        failed = engine_failure(self._last_stats)
        if failed is not None:
            raise failed
        reviving = any(r is not None for r in self._reviving.values()) or self._ping_again
        if self._runs and all(r is None for r in self._runs) and self._failures and not reviving:
            i, err = next(iter(self._failures.items()))
            detail = self._last_stats[i].get("last_error") or ""
            raise RolloutFailed(f"every rollout worker has stopped: worker {i}: {err!r}\n{detail}")

    def stats(self) -> list[dict[str, Any]]:
        """Per worker, as last seen (refreshed twice a second): the counters summed over its
        incarnations (``env_timeouts_by_call`` by call kind too), ``restarts``, and the call its
        loop is inside (``current_call``, ``current_call_s``; for the watchdog's message)."""
        out = []
        for i in range(self.num_workers):
            last = self._last_stats[i]
            s: dict[str, Any] = {k: self._base_stats[i][k] + float(last.get(k, 0.0)) for k in _STAT_KEYS}
            s["env_timeouts_by_call"] = _add_counts(self._base_timeouts[i], last.get("env_timeouts_by_call"))
            s["restarts"] = self.restarts[i]
            s.update({k: float(last.get(k, 0.0)) for k in _LAST_KEYS})
            running = i < len(self._runs) and self._runs[i] is not None
            s["current_call"] = last.get("current_call", "") if running else ""
            s["current_call_s"] = float(last.get("current_call_s", 0.0)) if running else 0.0
            out.append(s)
        return out

    def running(self) -> int:
        """Workers whose loop runs now (not dead, not waiting for a restart, not stopped)."""
        return sum(r is not None for r in self._runs)

    # ------------------------------------------------------------------ introspection (tests, tools)
    def worker_pid(self, i: int) -> int:
        return import_ray().get(self.actors[i].pid.remote())

    def held(self, i: int) -> int:
        """Tickets worker ``i`` holds in the buffer now."""
        return self.buffer.held(i)
