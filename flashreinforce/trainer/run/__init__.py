"""One run from start to end: the parts built from the configuration, wired and driven.

It owns the training loop (:mod:`.loop`, :class:`~.loop.Trainer`), the parts built from a resolved
configuration (:mod:`.components`, the rollout side in :mod:`.rollout_side`), what a run asks of the
scale-out layer it is handed (:mod:`.scale_out`), what is checked before the model loads
(:mod:`.prechecks`), a user's callbacks (:mod:`.callbacks`), Ctrl-C (:mod:`.interrupts`) and the
watchdog (:mod:`.watchdog`). It may import every other part of the trainer; no other part imports it.
"""
