"""The rollout side of the trainer: from prompts to finished trajectories in the buffer.

It owns the trajectory record (:mod:`.trajectory`), the buffer between rollout workers and the
learner (:mod:`.buffer`), one episode as a worker plays it (:mod:`.episode`, :mod:`.agent_episode`,
:mod:`.env_calls`, :mod:`.fault_records`), the workers (:mod:`.worker`, its episodes as a stream
:mod:`.stream`, :mod:`.agent_worker`) and where they run (:mod:`.thread_pool`). It imports nothing of the learning, reporting, persistence or
run parts of the trainer.
"""
