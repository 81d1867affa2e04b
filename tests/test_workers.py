"""core.workers.shared: tasks split between this process (from the back, at once) and spawned
workers (from the front, once started), results in order, the first error raised with no task
handed out after it; a worker that cannot start leaves its tasks to this process."""

import concurrent.futures
import threading
import time

import pytest

from ckptlab.core import workers


def pool_of(start_s: float, ran: list, fails_to_start: bool = False):
    """A process pool whose worker starts in `start_s` (its `_ready` task) and runs each task in
    the feeding thread, one at a time with this process's (a lock); `ran` records its tasks."""

    class Pool:
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, fn, task):
            future = concurrent.futures.Future()
            if fn is workers._ready:
                time.sleep(start_s)
                if fails_to_start:
                    future.set_exception(concurrent.futures.process.BrokenProcessPool("the worker died"))
                else:
                    future.set_result(None)
                return future
            with LOCK:
                ran.append(task)
                try:
                    future.set_result(fn(task))
                except Exception as exc:
                    future.set_exception(exc)
            return future

        def shutdown(self, **kwargs):
            pass

    return Pool


LOCK = threading.Lock()


def here_fn(here: list, seconds: float = 0.01, fail: bool = False):
    def run(task):
        with LOCK:
            here.append(task)
            time.sleep(seconds)
            if fail:
                raise RuntimeError(f"task {task} failed here")
            return -task
    return run


def test_spawned_take_tasks_from_the_front_this_process_from_the_back(monkeypatch):
    ran, here, finished = [], [], []
    monkeypatch.setattr(workers, "ProcessPoolExecutor", pool_of(0.02, ran))
    assert workers.shared(list(range(8)), 2, here_fn(here), lambda task: -task, finished.append) == [
        -t for t in range(8)]
    assert ran and here and ran + here[::-1] == list(range(8))
    assert here[0] == 7   # this process starts at once, with the last task
    assert sorted(finished) == [-t for t in reversed(range(8))]   # each task said done once, wherever it ran


def test_a_table_done_before_the_worker_starts_does_not_wait_for_it(monkeypatch):
    ran, here = [], []
    monkeypatch.setattr(workers, "ProcessPoolExecutor", pool_of(2.0, ran))
    start = time.perf_counter()
    assert workers.shared([1, 2, 3], 2, here_fn(here), lambda task: -task) == [-1, -2, -3]
    assert time.perf_counter() - start < 1.0 and not ran and here == [3, 2, 1]


def test_a_worker_that_cannot_start_leaves_its_tasks_here(monkeypatch):
    ran, here = [], []
    monkeypatch.setattr(workers, "ProcessPoolExecutor", pool_of(0.0, ran, fails_to_start=True))
    assert workers.shared(list(range(5)), 2, here_fn(here, 0.02), lambda task: -task) == [-t for t in range(5)]
    assert not ran and sorted(here) == list(range(5))


def test_one_worker_or_one_task_runs_here(monkeypatch):
    monkeypatch.setattr(workers, "ProcessPoolExecutor", None)   # no pool is made
    finished = []
    assert workers.shared([1, 2, 3], 1, lambda t: t * 2, None, finished.append) == [2, 4, 6] == finished
    assert workers.shared([5], 4, lambda t: t * 2, None) == [10]


def test_done_one_is_called_one_at_a_time_and_its_error_is_raised(monkeypatch):
    ran, here, inside, most = [], [], [0], [0]
    monkeypatch.setattr(workers, "ProcessPoolExecutor", pool_of(0.0, ran))

    def slow_listener(result):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.02)
        inside[0] -= 1

    assert workers.shared(list(range(8)), 2, here_fn(here, 0.0), lambda task: -task, slow_listener) == [
        -t for t in range(8)]
    assert ran and most[0] == 1

    def failing_listener(result):
        if result == 0:   # the first task: a spawned one's
            raise RuntimeError("the bar broke")

    with pytest.raises(RuntimeError, match="the bar broke"):
        workers.shared([0, 1], 2, here_fn([], 0.2), lambda task: -task, failing_listener)


@pytest.mark.parametrize("failing_side", ["here", "there"])
def test_the_first_error_is_raised_and_stops_the_handing_out(monkeypatch, failing_side):
    ran, here = [], []
    monkeypatch.setattr(workers, "ProcessPoolExecutor", pool_of(0.02, ran))   # this process has a task first

    def fail(task):
        raise RuntimeError(f"task {task} failed there")

    with pytest.raises(RuntimeError, match="failed"):
        workers.shared(list(range(20)), 2, here_fn(here, 0.05, fail=failing_side == "here"),
                       fail if failing_side == "there" else (lambda t: -t))
    assert len(ran) + len(here) < 20   # handing out stopped: not every task started
