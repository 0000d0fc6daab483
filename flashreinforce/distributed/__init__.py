"""Scale-out: Ray rollout workers (:mod:`.ray`) and the data-parallel learner (:mod:`.data_parallel`).

Neither submodule is imported by ``import flashreinforce``: Ray is an optional dependency and
``torch.distributed`` is only set up under ``torchrun``.
"""
