"""One run from start to end: the parts built from the configuration, wired and driven.

It owns the training loop (:mod:`.loop`, :class:`~.loop.Trainer`), the parts built from a resolved
configuration (:mod:`.components`, the rollout side in :mod:`.rollout_side`), what is checked before
the model loads (:mod:`.prechecks`), a user's callbacks (:mod:`.callbacks`), Ctrl-C
(:mod:`.interrupts`) and the watchdog (:mod:`.watchdog`). It is the only part of the trainer that
imports the others.
"""
