"""core.workers.shared: tasks split between this process (from the back) and spawned workers
(from the front), results in order, the first error raised with no task started after it."""

import concurrent.futures
import threading
import time

import pytest

from ckptlab.core import workers


class Pool:
    """A process pool that runs each task in the feeding thread, one at a time with this
    process's (a lock), after a spawned worker's slower start; records what it ran."""

    ran: list = []
    lock = threading.Lock()

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, task):
        time.sleep(0.02)
        future = concurrent.futures.Future()
        with self.lock:
            self.ran.append(task)
            try:
                future.set_result(fn(task))
            except Exception as exc:
                future.set_exception(exc)
        return future


def test_spawned_take_tasks_from_the_front_this_process_from_the_back(monkeypatch):
    monkeypatch.setattr(workers, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(Pool, "ran", [])
    here = []

    def here_fn(task):
        with Pool.lock:
            here.append(task)
            time.sleep(0.01)
            return -task

    results = workers.shared(list(range(8)), 2, here_fn, lambda task: -task)
    assert results == [-t for t in range(8)]
    assert Pool.ran and here and Pool.ran + here[::-1] == list(range(8))


def test_one_worker_or_one_task_runs_here(monkeypatch):
    monkeypatch.setattr(workers, "ProcessPoolExecutor", None)   # no pool is made
    assert workers.shared([1, 2, 3], 1, lambda t: t * 2, None) == [2, 4, 6]
    assert workers.shared([5], 4, lambda t: t * 2, None) == [10]


@pytest.mark.parametrize("failing_side", ["here", "there"])
def test_the_first_error_is_raised_and_stops_the_handing_out(monkeypatch, failing_side):
    monkeypatch.setattr(workers, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(Pool, "ran", [])
    here = []

    def fail(task):
        raise RuntimeError(f"task {task} failed")

    def here_fn(task):
        here.append(task)
        time.sleep(0.05)
        return fail(task) if failing_side == "here" else task

    with pytest.raises(RuntimeError, match="failed"):
        workers.shared(list(range(20)), 2, here_fn, fail if failing_side == "there" else (lambda t: t))
    assert len(Pool.ran) + len(here) < 20   # handing out stopped: not every task started
