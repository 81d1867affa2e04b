"""Step timing: warm-up, then repeated steps; CUDA events on GPU, perf_counter on CPU."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    step_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def min_ms(self) -> float:
        return min(self.step_ms)

    @property
    def max_ms(self) -> float:
        return max(self.step_ms)


def time_steps(step: Callable[[], object], steps: int, warmup: int, device: torch.device | str = "cpu") -> Timing:
    """Run `step` `warmup` times untimed, then `steps` times timed, one measurement per step.

    On CUDA each step is bracketed by events and synchronized, so the number is GPU time of the
    whole step, not the time to enqueue it.
    """
    device = torch.device(device)
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(times)
