"""The learning side of the trainer: from a batch of trajectories to one optimizer step.

It owns packing (:mod:`.packing`), the row the model body runs (:mod:`.forward_row`), scoring the
policy (:mod:`.scoring`), the learner (:mod:`.learner`), its learning-rate schedules
(:mod:`.schedule`) and its model-FLOPs accounting (:mod:`.flops`). Of the rest of the trainer it
reads only the trajectory record (:mod:`flashreinforce.trainer.rollout.trajectory`).
"""
