"""The asynchronous trainer, in data-flow order: trajectory -> rollout -> buffer -> packing -> learner.

The loop (:mod:`.loop`) wires them together; checkpoints and metrics of a run live beside it.
"""

from flashreinforce.trainer.loop import Trainer

__all__ = ["Trainer"]
