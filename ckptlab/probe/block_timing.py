"""What a checkpoint option (keep, selective, full) adds to one block's forward + backward, timed
on a real model: the planner's measured recompute costs (`plan.profile`). Each block runs on the
inputs it receives in the model's own forward, captured once (`block_inputs`).

Timing is `torch.utils.benchmark.Timer.blocked_autorange` per (option, round): the library sets
the thread count, warms up and picks the block size. The rounds are interleaved over the options
(the timing protocol's idea, `probe.timing`), so load drift hits every option alike; the Timer
alone would time one option after the other. Framework overhead is included: selective
checkpointing intercepts every op in Python, which at small sizes costs more than the ops it saves.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..checkpoint.wrap import selective_context_fn
from ..core.policy import PLAN_OPTIONS as OPTIONS
from ..workloads.base import Workload
from ..workloads.stacks import find_blocks
from .step import autocast_dtype, with_dtype

BLOCK_MIN_RUN_S = 1e-3   # per Timer measurement: after its warm-up, one or a few block runs
REPS = 5                 # interleaved rounds per option; the fastest counts


def cpu_autocast(dtype: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context a block of a `dtype` step runs in on the CPU: autocast for bf16,
    nothing otherwise."""
    in_dtype = autocast_dtype(dtype)
    return (lambda: torch.autocast("cpu", dtype=in_dtype)) if in_dtype else contextlib.nullcontext


def block_inputs(workload: Workload, model: nn.Module, batch: tuple, amp: Callable) -> list[tuple[tuple, dict]]:
    """Per block of `model`, the (args, kwargs) it receives in one forward of the workload's loss
    on `batch` (no grad, under `amp()`); tensor arguments detached, floating ones requiring grad,
    so a block's backward can run on its own. Runs under whatever tensor mode the caller holds."""
    blocks = find_blocks(model)
    captured: list = [None] * len(blocks)
    hooks = [b.register_forward_pre_hook(
        lambda mod, args, kwargs, j=j: captured.__setitem__(j, (args, kwargs)), with_kwargs=True)
        for j, b in enumerate(blocks)]
    try:
        with torch.no_grad(), amp():
            workload.loss(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return [(tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                   for a in args), kwargs) for args, kwargs in captured]


def average_alike(blocks: list[nn.Module], costs: list[dict[str, float]]) -> list[dict[str, float]]:
    """Blocks of one type and parameter shapes do the same work: each gets the mean of their
    costs, so a plan is chosen by where a block sits (memory), not by timer noise."""
    groups: dict = {}
    for j, block in enumerate(blocks):
        sig = (type(block), tuple(tuple(p.shape) for p in block.parameters()))
        groups.setdefault(sig, []).append(j)
    costs = list(costs)
    for members in groups.values():
        mean = {o: sum(costs[j][o] for j in members) / len(members) for o in costs[members[0]]}
        for j in members:
            costs[j] = dict(mean)
    return costs


def block_option_ms(block: nn.Module, args: tuple, kwargs: dict, amp: Callable, reps: int = REPS,
                    options: tuple = OPTIONS) -> dict[str, float]:
    """Per option (of `options`, keep among them), milliseconds the fastest forward + backward of
    `block` takes beyond keep's (>= 0; keep 0), in `reps` rounds interleaved over the options
    (module docstring)."""

    def run(option):
        with amp():
            if option == "keep":
                out = block(*args, **kwargs)
            else:
                extra = {"context_fn": selective_context_fn("mm")} if option == "selective" else {}
                out = checkpoint(block, *args, use_reentrant=False, **extra, **kwargs)
            out = out if isinstance(out, torch.Tensor) else out[0]
        out.backward(torch.ones_like(out))

    # In-function: importing it costs 0.12 s (setuptools, through cpp_extension) in every process
    # that imports ckptlab, and only this measurement uses it.
    from torch.utils import benchmark  # noqa: PLC0415 - a heavy import, for this function only

    timers = {o: benchmark.Timer(stmt="run(option)", globals={"run": run, "option": o},
                                 num_threads=torch.get_num_threads()) for o in options}
    best = {o: math.inf for o in options}
    for _ in range(reps):
        for option in options:
            best[option] = min(best[option], timers[option].blocked_autorange(min_run_time=BLOCK_MIN_RUN_S).median * 1e3)
    return {o: max(0.0, best[o] - best["keep"]) for o in options}


def measured_block_costs(workload: Workload, batch_size: int, seq_len: int, dtype: str = "fp32",
                         reps: int = REPS, options: tuple = OPTIONS) -> list[dict[str, float]]:
    """Per block and option (of `options`), the milliseconds recomputing adds to one step (keep 0),
    timed on the CPU on the workload's real model at this shape and dtype, alike blocks averaged."""
    workload = with_dtype(workload, dtype)
    torch.manual_seed(workload.seed)
    model = workload.new_model()
    model.train()
    batch = workload.new_batch(batch_size, seq_len, torch.Generator().manual_seed(workload.seed + 1))
    amp = cpu_autocast(dtype)
    blocks = find_blocks(model)
    costs = [block_option_ms(block, args, kwargs, amp, reps, options)
             for block, (args, kwargs) in zip(blocks, block_inputs(workload, model, batch, amp))]
    return average_alike(blocks, costs)


__all__ = ["BLOCK_MIN_RUN_S", "average_alike", "block_inputs", "block_option_ms", "cpu_autocast",
           "measured_block_costs"]
