"""Policy weights by version through Ray's object store.

The learner publishes each version once (:meth:`RayWeightStore.publish`: one ``ray.put`` of numpy
arrays, owned by the driver); the :class:`WeightRegistry` actor keeps the newest version number and
the reference. A worker asks the registry for anything newer than what its engine holds and
``ray.get`` s it: on the driver's node that is a zero-copy read from shared memory; on another node
Ray's object manager copies the object into that node's store first (one copy per node, shared by
the node's workers). :meth:`RayWeightStore.locations` tells which nodes hold a copy.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping

import torch

from flashreinforce.distributed.ray.calls import ActorClient, import_ray
from flashreinforce.engines.base import WeightStore

__all__ = ["RayWeightStore", "WeightRegistry", "from_arrays", "to_arrays"]


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

    def node(self) -> str:
        """The Ray node id this actor runs on."""
        return import_ray().get_runtime_context().get_node_id()


def to_arrays(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, Any]]:
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


def from_arrays(arrays: Mapping[str, tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """The tensors of :func:`to_arrays`' output (views of the arrays, no copy)."""
    out = {}
    with warnings.catch_warnings():
        # Object-store arrays are read-only; engines copy them into their own parameters.
        warnings.simplefilter("ignore", UserWarning)
        for name, (dtype, arr) in arrays.items():
            t = torch.from_numpy(arr)
            out[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


class _Registry(ActorClient):
    remote_methods = frozenset(("publish", "latest", "fetch", "node"))
    actor_name = "weight registry actor"


class RayWeightStore(WeightStore):
    """:class:`~flashreinforce.engines.WeightStore` on Ray: one ``ray.put`` per published version,
    its reference kept by the :class:`WeightRegistry` actor ``registry``; ``fetch`` is one small call
    to the registry, plus one ``ray.get`` of the weights when a newer version exists.

    Args:
        registry: the registry's actor handle.
        call_timeout_s: longest wait for the registry's answer (the weights themselves have no limit:
            a large model on a slow network may take long, and a lost owner fails the ``get``).
    """

    def __init__(self, registry, **kwargs) -> None:
        self.registry = registry
        self._client = _Registry(registry, **kwargs)
        self._ref = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, frozen: Iterable[str] = ()) -> None:
        # Every version travels whole: workers on other nodes may not hold the frozen tensors.
        ref = import_ray().put(to_arrays(state_dict))
        self._client.publish(int(version), [ref])  # in a list: passed as a reference, not resolved
        self._ref = ref

    def advance(self, version: int) -> None:
        """The newest version's object again under ``version`` (no new ``ray.put``); workers still
        ``get`` it once more, so their engines copy it (their loads compare tensor objects)."""
        if self._ref is None:
            raise ValueError(f"advance: this store published nothing before version {version}")
        self._client.publish(int(version), [self._ref])

    def latest_version(self) -> int:
        return self._client.latest()

    def fetch(self, newer_than: int):
        got = self._client.fetch(int(newer_than))
        if got is None:
            return None
        version, refs = got
        return version, from_arrays(import_ray().get(refs[0]))

    def locations(self) -> list[str]:
        """Node ids whose object store holds a copy of the newest version this process published
        (the driver's node first put it there; other nodes got copies by pulling it)."""
        if self._ref is None:
            return []
        from ray.experimental import get_object_locations

        return list(get_object_locations([self._ref])[self._ref]["node_ids"])
