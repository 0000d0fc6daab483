"""Where rollout worker actors may run: the resources each reserves and Ray's scheduling strategy.

Flags: ``--ray.num_cpus_per_worker``, ``--ray.num_gpus_per_worker``, ``--ray.worker_resources``
(custom Ray resources: one JSON object for every worker, or a list of objects taken in turn, e.g.
``[{"node_a": 1}, {"node_b": 1}]`` puts even workers on nodes started with ``--resources
'{"node_a": N}'`` and odd ones on ``node_b`` nodes) and ``--ray.scheduling_strategy`` (``default``:
Ray's, which fills the nodes near the driver first; ``spread``: over as many nodes as possible).

:meth:`WorkerPlacement.unplaceable` compares one worker's needs with every live node's *total*
resources: a worker no node could ever hold is an error at start (Ray would keep it pending
forever), while a worker that only waits for busy resources to free up is waited for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# The flag's parser lives with the flags (the configuration checks it without importing this package).
from flashreinforce.config.checks import parse_worker_resources

__all__ = ["STRATEGIES", "WorkerPlacement", "describe_nodes", "parse_worker_resources"]

STRATEGIES = ("default", "spread")


@dataclass(frozen=True)
class WorkerPlacement:
    """What each rollout worker actor reserves and how Ray places it.

    num_cpus / num_gpus: Ray CPUs and GPUs per worker (fractions share). resources: custom
    resources, worker ``i`` takes ``resources[i % len(resources)]`` (empty: none). strategy: ``default``
    or ``spread`` (Ray's ``SPREAD`` scheduling strategy).
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: tuple[dict[str, float], ...] = field(default_factory=tuple)
    strategy: str = "default"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--ray.scheduling_strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if not self.num_cpus >= 0 or not self.num_gpus >= 0:
            raise ValueError(f"worker CPUs and GPUs must be >= 0, got {self.num_cpus} and {self.num_gpus}")
        object.__setattr__(self, "resources", parse_worker_resources(self.resources or None))

    def custom(self, i: int) -> dict[str, float]:
        """Worker ``i``'s custom resources."""
        return dict(self.resources[i % len(self.resources)]) if self.resources else {}

    def needs(self, i: int) -> dict[str, float]:
        """Everything worker ``i`` reserves (Ray resource name -> amount; zero amounts left out)."""
        out = {"CPU": float(self.num_cpus), "GPU": float(self.num_gpus), **self.custom(i)}
        return {k: v for k, v in out.items() if v > 0}

    def options(self, i: int) -> dict[str, Any]:
        """Keyword arguments of ``ActorClass.options`` for worker ``i``."""
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        custom = self.custom(i)
        if custom:
            out["resources"] = custom
        if self.strategy == "spread":
            out["scheduling_strategy"] = "SPREAD"
        return out

    def describe(self, i: int) -> str:
        needs = self.needs(i)
        text = ", ".join(f"{k} {v:g}" for k, v in needs.items()) or "no resources"
        return text + (" (SPREAD)" if self.strategy == "spread" else "")

    def unplaceable(self, i: int, nodes: Sequence[Mapping[str, Any]]) -> bool:
        """True when no live node of ``nodes`` (``ray.nodes()`` records) has, in total, what worker ``i`` needs."""
        needs = self.needs(i)
        for node in nodes:
            if not node.get("Alive", False):
                continue
            total = node.get("Resources", {})
            if all(total.get(k, 0.0) >= v for k, v in needs.items()):
                return False
        return True


def describe_nodes(nodes: Sequence[Mapping[str, Any]]) -> str:
    """One line per live node: id prefix, address and total resources (Ray's per-node ``node:`` markers left out)."""
    lines = []
    for node in nodes:
        if not node.get("Alive", False):
            continue
        res = {k: v for k, v in node.get("Resources", {}).items() if not k.startswith("node:")}
        res_text = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()) if k != "memory"
                             and k != "object_store_memory")
        lines.append(f"node {node.get('NodeID', '?')[:8]} at {node.get('NodeManagerAddress', '?')}: "
                     f"{res_text or 'no CPU, GPU or custom resource'}")
    return "; ".join(lines) or "no live node"
