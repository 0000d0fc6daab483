"""The rollout side of the trainer: from prompts to finished trajectories in the buffer.

It owns the trajectory record (:mod:`.trajectory`), the buffer between rollout workers and the
learner (:mod:`.buffer`), one episode as a worker plays it (:mod:`.episode`,
:mod:`.env_calls`, :mod:`.fault_records`), the workers (:mod:`.worker`, its episodes as a stream
:mod:`.stream`, which worker plays an environment :mod:`.worker_kinds`) and where they run
(:mod:`.thread_pool`). It imports nothing of the learning, reporting, persistence or run parts of the
trainer, nor of :mod:`flashreinforce.agents`, whose worker registers itself in :mod:`.worker_kinds`.
"""
