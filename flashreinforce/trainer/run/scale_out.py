"""What a run asks of the scale-out layer, which the trainer does not import: :class:`ScaleOut`.

Ray rollout workers (``--rollout.backend ray``) and the data-parallel learner (``torchrun``) live a
layer above the trainer, in :mod:`flashreinforce.distributed`, which imports the trainer's parts.
The trainer receives them from its caller as a :class:`ScaleOut`: ``flashreinforce train`` and
:func:`flashreinforce.train` pass :class:`flashreinforce.distributed.scale_out.DistributedScaleOut`.
A :class:`~flashreinforce.trainer.run.loop.Trainer` built without one runs in one process with its
rollout workers as threads, and refuses, as a configuration error, what needs more.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping

from flashreinforce.config import ConfigError

__all__ = ["ScaleOut", "require_scale_out"]


class ScaleOut(abc.ABC):
    """The scale-out parts a run builds: the torchrun learner and the Ray rollout side."""

    @abc.abstractmethod
    def data_parallel_context(self, device: str) -> Any:
        """This rank's ``torch.distributed`` context under ``torchrun`` (``device``: ``--device``); it has
        ``device``, ``rank``, ``world_size``, ``is_leader`` and ``close()``."""

    @abc.abstractmethod
    def data_parallel_learner(self, model: Any, settings: Any, ctx: Any, *, pad_token_id: int,
                              strategy: str) -> Any:
        """The learner across the ranks of ``ctx`` (a
        :class:`~flashreinforce.trainer.learning.learner.PolicyLearner` on rank 0)."""

    @abc.abstractmethod
    def require_ray(self) -> None:
        """Raise ``ImportError`` (with what to install) when Ray cannot be used."""

    @abc.abstractmethod
    def ray_rollout(self, *, address: str | None, buffer_kwargs: Mapping[str, Any],
                    prompt_kwargs: Mapping[str, Any]) -> Any:
        """The run's Ray side (``buffer``, ``weights``, ``backend(recipe, num_workers, ...)``, ``close()``):
        connect to ``address`` (or start a local instance), create the buffer actor and the weight store."""

    @abc.abstractmethod
    def worker_recipe(self, **fields: Any) -> Any:
        """What a Ray rollout worker builds itself from (the fields of the recipe)."""


def require_scale_out(scale_out: ScaleOut | None, what: str) -> ScaleOut:
    """``scale_out``, or a :class:`~flashreinforce.config.ConfigError` naming ``what`` needed it."""
    if scale_out is None:
        raise ConfigError(f"{what} needs the scale-out layer: build the Trainer with "
                          "scale_out=flashreinforce.distributed.scale_out.DistributedScaleOut() "
                          "(flashreinforce train and flashreinforce.train do)")
    return scale_out
