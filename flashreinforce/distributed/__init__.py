"""Scale-out: Ray rollout workers (:mod:`.ray`) and the data-parallel learner (:mod:`.data_parallel`).

The trainer does not import this package: ``flashreinforce train`` and :func:`flashreinforce.train`
hand a run :class:`.scale_out.DistributedScaleOut`, through which it builds both.

Neither submodule is imported by ``import flashreinforce``: Ray is an optional dependency and
``torch.distributed`` is only set up under ``torchrun``.
"""
