"""The scale-out layer as the trainer receives it: :class:`DistributedScaleOut`.

The trainer does not import this package; its callers (``flashreinforce train``,
:func:`flashreinforce.train`) hand it a :class:`DistributedScaleOut`, whose methods import Ray
(:mod:`.ray`) and ``torch.distributed`` (:mod:`.data_parallel`) only when a run needs them.
"""

from __future__ import annotations

from typing import Any, Mapping

from flashreinforce.trainer.run.scale_out import ScaleOut

__all__ = ["DistributedScaleOut"]


class DistributedScaleOut(ScaleOut):
    """Ray rollout workers (:mod:`flashreinforce.distributed.ray`) and the data-parallel learner
    (:mod:`flashreinforce.distributed.data_parallel`)."""

    def data_parallel_context(self, device: str) -> Any:
        from flashreinforce.distributed.data_parallel import distributed_context

        return distributed_context(device)

    def data_parallel_learner(self, model: Any, settings: Any, ctx: Any, *, pad_token_id: int,
                              strategy: str) -> Any:
        from flashreinforce.distributed.data_parallel import DataParallelLearner

        return DataParallelLearner(model, settings, ctx, pad_token_id=pad_token_id, strategy=strategy)

    def require_ray(self) -> None:
        from flashreinforce.distributed.ray import import_ray

        import_ray()

    def ray_rollout(self, *, address: str | None, buffer_kwargs: Mapping[str, Any],
                    prompt_kwargs: Mapping[str, Any]) -> Any:
        from flashreinforce.distributed.ray import RayRollout

        return RayRollout.create(address=address, buffer_kwargs=buffer_kwargs, prompt_kwargs=prompt_kwargs)

    def worker_recipe(self, **fields: Any) -> Any:
        from flashreinforce.distributed.ray import WorkerRecipe

        return WorkerRecipe(**fields)
