"""Tasks shared between this process and spawned worker processes (`shared`): a table of
predictions on two cores in the time of about half its tasks."""

from __future__ import annotations

import collections
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Callable

import torch


def shared(tasks: list, workers: int, here: Callable, there: Callable) -> list:
    """Each task's result, in order, from `workers` processes: this one (`here(task)`) and
    `workers` - 1 spawned (`there(task)`: a module-level function, the task picklable). The
    spawned take the tasks from the front, one at a time each, and this process from the back,
    until none is left: order them longest first. This process works too, with its imports paid
    and what it prepared kept; a spawned one pays seconds to import torch before its first task.
    The first error stops the handing out (the tasks under way finish) and is raised."""
    if workers <= 1 or len(tasks) <= 1:
        return [here(task) for task in tasks]
    spawned = min(workers, len(tasks)) - 1
    left = collections.deque(range(len(tasks)))   # popped at both ends by several threads: deque's pops are atomic
    done = {}

    def feed(pool: ProcessPoolExecutor) -> None:
        while left:
            try:
                i = left.popleft()
            except IndexError:
                return
            try:
                done[i] = pool.submit(there, tasks[i]).result()
            except BaseException:
                left.clear()
                raise

    with ProcessPoolExecutor(spawned, mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(1,)) as pool, \
            ThreadPoolExecutor(spawned) as feeders:
        fed = [feeders.submit(feed, pool) for _ in range(spawned)]
        try:
            while left:
                try:
                    i = left.pop()
                except IndexError:
                    break
                done[i] = here(tasks[i])
        except BaseException:
            left.clear()
            raise
        for f in fed:
            f.result()
    return [done[i] for i in range(len(tasks))]


__all__ = ["shared"]
