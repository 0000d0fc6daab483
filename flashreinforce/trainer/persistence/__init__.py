"""What a run keeps on disk to be continued: checkpoints and the run's output directory.

It owns the checkpoints (:mod:`.checkpoints`, with what a checkpoint must mean in
:mod:`.checkpoint_validation` and its random states in :mod:`.checkpoint_rng`), the history a
checkpoint vouches for (:mod:`.run_history`) and the output directory's lock (:mod:`.run_dir`). It
imports no other part of the trainer but :mod:`flashreinforce.trainer.errors`.
"""
