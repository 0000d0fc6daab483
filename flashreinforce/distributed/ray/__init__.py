"""The Ray rollout backend (``--rollout.backend ray``): rollout workers as Ray actors.

Everything is created by the learner process (the Ray *driver*) and owned by it: when the driver
disconnects, Ray removes it. One module per role:

* :mod:`.buffer`: the buffer actor (one :class:`~flashreinforce.trainer.rollout.buffer.RolloutBuffer` whose
  tickets remember the worker *incarnation* holding them) and its clients, the learner's
  :class:`RemoteBuffer` and a worker's :class:`WorkerBufferClient`;
* :mod:`.weights`: policy weights by version through the object store (:class:`RayWeightStore`,
  the :class:`WeightRegistry` actor);
* :mod:`.workers`: the rollout worker actor and the :class:`WorkerRecipe` it builds itself from;
* :mod:`.placement`: what each worker reserves and how Ray places it (:class:`WorkerPlacement`);
* :mod:`.pool`: the worker pool and its supervisor (:class:`RayRolloutBackend`: restarts, prompts of
  dead workers handed out again);
* :mod:`.session`: the connection (:class:`RayConnection`: join a cluster or start a local instance,
  stop only what the run started) and the run's Ray side (:class:`RayRollout`);
* :mod:`.calls`: the one mechanism for calling actors (:class:`ActorClient`, :func:`delegate`).

Importing this package does not import Ray; the first call that needs it does (:func:`import_ray`).
"""

from flashreinforce.distributed.ray.buffer import (MAX_BLOCK_S, BufferActor, OwnedBuffer, RemoteBuffer,
                                                   StaleIncarnation, WorkerBufferClient)
from flashreinforce.distributed.ray.calls import ActorClient, ActorGone, delegate, import_ray
from flashreinforce.distributed.ray.placement import WorkerPlacement
from flashreinforce.distributed.ray.pool import RayRolloutBackend
from flashreinforce.distributed.ray.session import RayConnection, RayRollout
from flashreinforce.distributed.ray.weights import RayWeightStore, WeightRegistry
from flashreinforce.distributed.ray.workers import RolloutWorkerActor, WorkerRecipe

__all__ = ["MAX_BLOCK_S", "ActorClient", "ActorGone", "BufferActor", "OwnedBuffer", "RayConnection", "RayRollout",
           "RayRolloutBackend", "RayWeightStore", "RemoteBuffer", "RolloutWorkerActor", "StaleIncarnation",
           "WeightRegistry", "WorkerBufferClient", "WorkerPlacement", "WorkerRecipe", "delegate", "import_ray"]
