"""The asynchronous trainer, one subpackage per role in data-flow order.

* :mod:`.rollout`: rollout workers play episodes and hand trajectories to the buffer;
* :mod:`.learning`: the learner packs a batch, scores it, steps once and discards it;
* :mod:`.reporting`: metrics, evaluation, samples and trackers of a run;
* :mod:`.persistence`: checkpoints and the run's output directory;
* :mod:`.run`: the loop (:class:`Trainer`) that builds the parts and drives them.

:mod:`.errors` holds the exceptions every part raises. Ray rollout workers and the torchrun
learner live a layer above, in :mod:`flashreinforce.distributed`, which the trainer never imports:
a run receives them as a :class:`~flashreinforce.trainer.run.scale_out.ScaleOut`.
"""

from flashreinforce.trainer.run.loop import Trainer

__all__ = ["Trainer"]
