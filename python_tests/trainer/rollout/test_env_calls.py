"""A rollout worker's environment calls run concurrently, each with its own timeout: slow tools of
different episodes overlap, a stuck call is abandoned without holding up the others, and an
environment class that cannot be called from several threads is called one call at a time."""

from __future__ import annotations

import threading
import time

import pytest

from flashreinforce.envs.base import Environment, StepResult
from flashreinforce.envs.tasks import DatasetEnvironment, Task
from flashreinforce.trainer.rollout.buffer import Ticket
from flashreinforce.trainer.rollout.env_calls import EnvCalls
from flashreinforce.trainer.errors import StopRequested
from flashreinforce.trainer.rollout.trajectory import Trajectory
from python_tests.trainer.run.test_fault_tolerance import _worker

class _Concurrency:
    """Counts the calls in progress; ``peak`` is the most seen at once."""

    def __init__(self):
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def call(self, fn):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            return fn()
        finally:
            with self.lock:
                self.now -= 1


def test_calls_run_at_the_same_time():
    # Every call waits at one barrier for all the others: that only returns if they all run at once.
    barrier = threading.Barrier(8, timeout=20)
    calls = EnvCalls(timeout_s=30, max_parallel=8)
    out = calls.run([(k, "env.step", lambda k=k: (barrier.wait(), k)[1], None) for k in range(8)])
    assert out == {k: ("ok", k) for k in range(8)}
    assert list(out) == list(range(8))  # in the order given
    calls.close()


def test_at_most_max_parallel_calls_run_at_once():
    seen = _Concurrency()
    gate = threading.Barrier(3, timeout=20)  # the first three meet, so the peak is reached
    calls = EnvCalls(timeout_s=30, max_parallel=3)
    first = calls.run([(k, "env.step", lambda: seen.call(gate.wait), None) for k in range(3)])
    assert all(status == "ok" for status, _ in first.values())
    more = calls.run([(k, "env.step", lambda: seen.call(lambda: time.sleep(0.02)), None) for k in range(12)])
    assert all(status == "ok" for status, _ in more.values())
    assert seen.peak == 3
    serial = _Concurrency()
    out = calls.run([(k, "env.step", lambda: serial.call(lambda: time.sleep(0.01)), None) for k in range(6)],
                    max_parallel=1)
    assert all(status == "ok" for status, _ in out.values()) and serial.peak == 1
    calls.close()


def test_a_stuck_call_times_out_alone_and_its_instance_is_closed_when_it_returns():
    closed = threading.Event()
    release = threading.Event()
    calls = EnvCalls(timeout_s=0.5, max_parallel=4)
    out = calls.run([
        ("ok", "env.step", lambda: 1, None),
        ("stuck", "env.step", lambda: release.wait(60), closed.set),
        ("raises", "env.reset", lambda: (_ for _ in ()).throw(RuntimeError("boom")), None),
        ("ok2", "env.reset", lambda: 2, None),
    ])
    assert out["ok"] == ("ok", 1) and out["ok2"] == ("ok", 2)
    assert out["stuck"] == ("timeout", 0.5)
    status, err = out["raises"]
    assert status == "error" and isinstance(err, RuntimeError) and str(err) == "boom"
    assert calls.timeouts == 1 and calls.timeouts_by_call == {"env.step": 1}
    assert not closed.is_set()
    release.set()  # the abandoned call returns: its thread closes the instance and ends
    assert closed.wait(10)
    # the worker goes on with fresh threads
    assert calls.run([("again", "env.step", lambda: 3, None)]) == {"again": ("ok", 3)}
    calls.close()


def test_a_stop_request_abandons_the_calls_in_progress():
    stop = threading.Event()
    closed = threading.Event()
    calls = EnvCalls(timeout_s=0, max_parallel=2)  # no timeout: only the stop ends the wait
    release = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(StopRequested):
        calls.run([("stuck", "env.step", lambda: release.wait(60), closed.set)], stop)
    assert calls.current is None
    release.set()  # the abandoned call returns: its thread closes the instance
    assert closed.wait(10)


def test_distinct_keys_and_a_positive_limit_are_required():
    with pytest.raises(ValueError, match="distinct"):
        EnvCalls(timeout_s=1).run([(1, "env.step", lambda: 0, None), (1, "env.step", lambda: 0, None)])
    with pytest.raises(ValueError, match="max_parallel"):
        EnvCalls(timeout_s=1, max_parallel=0)


# ------------------------------------------------------------------------------- through a worker
class _SlowToolEnv(Environment):
    """One-turn episodes whose step is a slow tool: it waits at ``barrier`` for the other episodes."""

    barrier: threading.Barrier
    seen: _Concurrency

    def reset(self, *, seed):
        return "say a:"

    def step(self, action):
        self.seen.call(lambda: self.barrier.wait())
        return StepResult("", 1.0, True)


class _SerialEnv(_SlowToolEnv):
    parallel_calls = False


def test_a_worker_runs_its_episodes_tool_calls_at_the_same_time():
    _SlowToolEnv.barrier, _SlowToolEnv.seen = threading.Barrier(8, timeout=20), _Concurrency()
    worker, _ = _worker(_SlowToolEnv, episodes_per_call=8, max_turns=1, env_timeout_s=30.0)
    groups = worker.run_tickets([Ticket(i, 10 + i, 1) for i in range(8)])
    assert all(isinstance(g[0], Trajectory) and g[0].reward == 1.0 for g in groups)
    assert _SlowToolEnv.seen.peak == 8


def test_an_environment_that_is_not_thread_safe_is_called_one_call_at_a_time():
    _SerialEnv.barrier, _SerialEnv.seen = threading.Barrier(1), _Concurrency()
    worker, _ = _worker(_SerialEnv, episodes_per_call=8, max_turns=1, env_timeout_s=30.0)
    groups = worker.run_tickets([Ticket(i, 10 + i, 1) for i in range(8)])
    assert all(isinstance(g[0], Trajectory) and g[0].reward == 1.0 for g in groups)
    assert _SerialEnv.seen.peak == 1


def test_a_dataset_wrapper_keeps_the_wrapped_environments_choice():
    class SerialTaskEnv(_SerialEnv):
        def set_task(self, task):
            self.task = task

    assert DatasetEnvironment(SerialTaskEnv(), [Task(prompt="p", ground_truth="g")]).parallel_calls is False
    assert DatasetEnvironment(type("ParallelTaskEnv", (SerialTaskEnv,), {"parallel_calls": True})(),
                              [Task(prompt="p", ground_truth="g")]).parallel_calls is True


def test_env_parallel_calls_bounds_the_worker():
    _SlowToolEnv.barrier, _SlowToolEnv.seen = threading.Barrier(2, timeout=20), _Concurrency()
    worker, _ = _worker(_SlowToolEnv, episodes_per_call=8, max_turns=1, env_timeout_s=30.0, env_parallel_calls=2)
    groups = worker.run_tickets([Ticket(i, 10 + i, 1) for i in range(8)])
    assert all(isinstance(g[0], Trajectory) for g in groups)
    assert _SlowToolEnv.seen.peak == 2
