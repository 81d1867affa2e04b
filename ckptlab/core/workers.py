"""Tasks shared between this process and spawned worker processes (`shared`): a table of
predictions on two cores in the time of about half its tasks."""

from __future__ import annotations

import collections
import importlib
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Optional

import torch


def shared(tasks: list, workers: int, here: Callable, there: Callable,
           done_one: Optional[Callable[[object], None]] = None) -> list:
    """Each task's result, in order, from `workers` processes: this one (`here(task)`) and
    `workers` - 1 spawned (`there(task)`: a module-level function, the task picklable). This
    process takes the tasks from the back at once; a spawned one, once it has started and
    imported `there`'s module (seconds: torch and the model's libraries), takes them from the
    front, one at a time: order them longest first. A call that this process finishes before a
    spawned one has started returns without waiting for it (the process, at its exit, waits for
    that start: seconds). The first error stops the handing out (the tasks under way finish)
    and is raised. `done_one(result)`, if given, is called for each task as it finishes (a
    progress bar's step), one call at a time and none once `shared` has returned, from a thread
    of this process where a spawned one did the task; its error is raised as a task's."""
    said = threading.Lock()
    listening = [done_one is not None]

    def finished(result) -> None:
        with said:
            if listening[0]:
                done_one(result)

    def here_and_said(task):
        result = here(task)
        finished(result)
        return result

    if workers <= 1 or len(tasks) <= 1:
        return [here_and_said(task) for task in tasks]
    left = collections.deque(range(len(tasks)))
    done, errors = {}, []
    state = threading.Condition()
    handed = 0   # tasks a worker holds

    def take(front: bool) -> Optional[int]:
        nonlocal handed
        with state:
            if not left:
                return None
            handed += front
            return left.popleft() if front else left.pop()

    def feed() -> None:
        nonlocal handed
        try:
            pool.submit(_ready, there.__module__).result()
        except BaseException as exc:   # the worker could not start: this process does the rest
            errors.append(exc)
            return
        while (i := take(front=True)) is not None:
            try:
                result = pool.submit(there, tasks[i]).result()
                finished(result)
                done[i] = result   # a task whose result or whose done_one failed is not done
            except BaseException as exc:
                errors.append(exc)
                with state:
                    left.clear()
            finally:
                with state:
                    handed -= 1
                    state.notify_all()

    spawned = min(workers, len(tasks)) - 1
    pool = ProcessPoolExecutor(spawned, mp_context=multiprocessing.get_context("spawn"),
                               initializer=torch.set_num_threads, initargs=(1,))
    try:
        for _ in range(spawned):
            threading.Thread(target=feed, daemon=True).start()
        while (i := take(front=False)) is not None:
            done[i] = here_and_said(tasks[i])
        with state:
            state.wait_for(lambda: handed == 0)
    except BaseException:
        with state:
            left.clear()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)   # a worker still starting is not waited for
        with said:
            listening[0] = False   # a task still under way when an error ends the call says nothing more
    if len(done) < len(tasks):   # a worker's task failed (a worker that could not start left its tasks here)
        raise errors[0]
    return [done[i] for i in range(len(tasks))]


def _ready(module: str) -> None:
    """Run in a spawned worker before its first task: its imports paid."""
    importlib.import_module(module)


__all__ = ["shared"]
