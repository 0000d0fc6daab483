"""The ``local`` rollout backend: the rollout workers as threads of the learner's process.

:class:`ThreadRolloutPool` (a :class:`~flashreinforce.trainer.rollout.backend.RolloutBackend`) runs
each :class:`~flashreinforce.trainer.rollout.worker.RolloutWorker` in a thread of the learner's process;
the Ray backend (:mod:`flashreinforce.distributed.ray`) runs them as actors.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from flashreinforce.trainer.rollout.buffer import RolloutBuffer
from flashreinforce.trainer.errors import RolloutFailed
from flashreinforce.trainer.rollout.backend import RolloutBackend, engine_failure, fair_share
from flashreinforce.trainer.rollout.worker import RolloutWorker

__all__ = ["ThreadRolloutPool"]


class ThreadRolloutPool(RolloutBackend):
    """The ``local`` backend: each :class:`RolloutWorker` in a thread of this process."""

    def __init__(self, workers: Sequence[RolloutWorker]) -> None:
        if not workers:
            raise ValueError("ThreadRolloutPool needs at least one worker")
        self.workers = list(workers)
        for w in self.workers:
            if w.max_prompts_per_call is None and isinstance(w.buffer, RolloutBuffer):
                w.max_prompts_per_call = fair_share(w.buffer.batch_groups, w.buffer.async_queue_size,
                                                    len(self.workers))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._failures: dict[int, BaseException] = {}

    def _run(self, worker: RolloutWorker) -> None:
        try:
            worker.run(self._stop)
        except BaseException as err:  # recorded; the trainer reports it when no worker is left
            self._failures[worker.worker_id] = err
        finally:
            worker.close()

    def start(self) -> None:
        for w in self.workers:
            t = threading.Thread(target=self._run, args=(w,), name=f"rollout-worker-{w.worker_id}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for w in self.workers:
            w.buffer.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def check(self) -> None:
        failed = engine_failure([{"engine_failure": w.engine.failure()} for w in self.workers])
        if failed is not None:
            raise failed
        if self._threads and not any(t.is_alive() for t in self._threads):
            last = next(iter(self._failures.values()), None)
            detail = "" if last is None else f": {last!r}\n" + (self.workers[0].last_error or "")
            raise RolloutFailed(f"every rollout worker has stopped{detail}")

    def stats(self) -> list[dict[str, float]]:
        return [w.stats() for w in self.workers]
