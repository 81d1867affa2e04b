"""The planner's input: for each block and option (keep, selective, full), what it keeps and
what its recompute costs. `profile_blocks` puts it together once per workload / shape / dtype
from what the layers below measure and predict:

- memory: three fake-tensor training steps, all blocks keep, all selective, all full,
  instrumented at block boundaries (`estimate.block_profile.block_memory`);
- time: measured on this machine (`probe.block_timing`: what an option adds to the block's
  forward + backward, framework overhead included), or roofline for shapes that do not fit here
  (`estimate.block_profile.roofline_block_costs`: the FLOPs and bytes of the ops it recomputes,
  on an assumed accelerator).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from ..core.loop import Loop, as_loop
from ..core.policy import PLAN_OPTIONS as OPTIONS
from ..estimate.block_profile import block_memory, roofline_block_costs
from ..estimate.predict import selective_failure
from ..probe.block_timing import measured_block_costs
from ..workloads.base import Workload
from ..workloads.registry import as_workload

MEASURED_BELOW_BYTES = 4 * 2**30   # cost="auto" times blocks here when the uniform keep peak is below this


@dataclass
class Profile:
    """Per-block memory and recompute-time profile: the planner's only input. An option is one of
    keep, selective, full; a uniform run is the training step with every block at one option.

    Attributes:
        n_blocks (int): the blocks of the model, in run order.
        kept (list[dict[str, int]]): [block][option] bytes the block's forward leaves alive for
            backward.
        bwd_peak (list[dict[str, int]]): [block][option] peak live bytes while the block's
            backward runs, in the uniform run.
        head (dict[str, int]): [option] peak live bytes before the first block's backward (the
            forward, the loss and the head's backward), in the uniform run.
        tail (dict[str, int]): [option] peak live bytes after the last block's backward (the
            embeddings' backward and the optimizer step), in the uniform run.
        cost_ms (list[dict[str, float]]): [block][option] milliseconds the option adds to one
            step by recomputing (0 for keep).
        peak (dict[str, int]): [option] peak live bytes of the uniform run.
        options (tuple[str, ...]): the options a block may take: keep, selective, full, or keep and
            full where torch's selective checkpointing refuses the step.
        refused (dict[str, str]): [option] why an option a block may not take was refused.
        cost_basis (str): how cost_ms was had: measured, roofline or given.
        meta (dict): what it was profiled for (model, loss_fn, batch_size, seq_len, dtype, the
            profiled loop) and profile_s, the seconds profiling took.
    """

    n_blocks: int
    kept: list[dict[str, int]]
    bwd_peak: list[dict[str, int]]
    head: dict[str, int]
    tail: dict[str, int]
    cost_ms: list[dict[str, float]]
    peak: dict[str, int]
    options: tuple = OPTIONS
    refused: dict = field(default_factory=dict)
    cost_basis: str = "measured"
    meta: dict = field(default_factory=dict)

    def delta(self, j: int, option: str) -> int:
        """Bytes block j keeps under `option` beyond what it keeps under keep (negative: it saves)."""
        return self.kept[j][option] - self.kept[j]["keep"]


_PROFILE_CACHE: dict = {}


def profile_blocks(workload: Workload | str, batch_size: int, seq_len: int, dtype: str = "fp32",
                   loop: Loop | str | None = None, cost: str = "auto", device: str = "cpu", card=None,
                   attention: str | None = None, *, torch_version: str | None = None) -> Profile:
    """The planner's per-block profile (module docstring). `cost`: measured (each block's
    forward + backward per option, timed on the CPU), roofline (FLOPs and bytes of a fake forward,
    for shapes that do not fit here) or auto (measured on device="cpu" if the uniform keep peak is
    under `MEASURED_BELOW_BYTES`, 4 GiB; roofline for a CUDA card, whose costs this CPU's timings do
    not tell). Cached per shape.
    The memory is the fake step's on `device` ("cuda": on `card`, with `attention`, under
    `torch_version`'s rules: `predict`'s), in `loop` (`core.loop`) as `profiled_loop` runs it."""
    workload, loop = as_workload(workload), profiled_loop(as_loop(loop))
    if cost not in ("auto", "measured", "roofline"):
        raise ValueError(f"cost={cost!r} is invalid: allowed are auto, measured, roofline")
    on_device = {"device": device, "card": card, "attention": attention, "torch_version": torch_version}
    key = (workload.identity, batch_size, seq_len, dtype, loop, cost, device, getattr(card, "name", card), attention,
           torch_version)
    if key in _PROFILE_CACHE:
        return _PROFILE_CACHE[key][1]
    t0 = time.perf_counter()
    runs, refused = {}, None
    for o in OPTIONS:
        try:
            runs[o] = block_memory(workload, batch_size, seq_len, o, dtype, loop, **on_device)
        except RuntimeError as exc:
            refused = selective_failure(exc) if o == "selective" else None
            if refused is None:
                raise
    options = tuple(runs)   # keep and full, and selective unless torch's selective checkpointing refuses the step
    if cost == "auto":
        cost = "measured" if device == "cpu" and runs["keep"].peak < MEASURED_BELOW_BYTES else "roofline"
    if cost == "measured":
        costs = measured_block_costs(workload, batch_size, seq_len, dtype, options=options)
    else:
        costs = [{o: c[o] for o in options} for c in roofline_block_costs(workload, batch_size, seq_len, dtype)]
    n = len(costs)
    profile = Profile(
        n_blocks=n,
        kept=[{o: runs[o].kept[j] for o in options} for j in range(n)],
        bwd_peak=[{o: runs[o].bwd_peak[j] for o in options} for j in range(n)],
        head={o: runs[o].head for o in options},
        tail={o: runs[o].tail for o in options},
        cost_ms=costs,
        peak={o: runs[o].peak for o in options},
        options=options,
        refused={"selective": refused} if refused else {},
        cost_basis=cost,
        meta={"model": workload.label, "loss_fn": workload.loss_name, "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype,
              "loop": str(loop), "profile_s": time.perf_counter() - t0},
    )
    _PROFILE_CACHE[key] = (workload, profile)   # the workload kept alive: its identity may hold ids
    return profile


def profiled_loop(loop: Loop) -> Loop:
    """The one-pass loop a block profile runs for `loop`: with accumulation its last micro-batch,
    whose forward runs beside the gradients the earlier ones accumulated, as a loop that keeps
    zero-filled gradients runs every forward. `plan_budget` verifies the plan in `loop` itself."""
    if loop.accum_steps == 1:
        return loop
    return dataclasses.replace(loop, accum_steps=1, zero_grad="zeros")


__all__ = ["Profile", "profile_blocks"]
