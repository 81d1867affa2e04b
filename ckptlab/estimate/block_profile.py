"""What each block keeps and what recomputing it costs, predicted on fake tensors (nothing
allocated): the planner's memory profile and its roofline costs (`plan.profile` puts them together).

- `block_memory`: one fake training step (`estimate.fake_step`, composed where it can be:
  `estimate.compose`) with every block at one option (keep, selective, full), read at block
  boundaries: for every block, the bytes its forward leaves alive for backward and the peak of
  live bytes while its backward runs; the peak before the first block's backward (forward + loss
  head) and after the last (embedding backward + optimizer).
- `roofline_block_costs`: for shapes too large to time here, what an option recomputes priced by
  its ops' FLOPs and bytes on an assumed accelerator (`ROOFLINE_FLOPS`, `ROOFLINE_BYTES_PER_S`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from ..checkpoint.wrap import selective_policy_fn
from ..core.cards import Card
from ..core.loop import Loop, as_loop
from ..core.policy import plan_policy
from ..probe.block_timing import average_alike, block_inputs, cpu_autocast
from ..probe.memory import LiveCounts, track_memory
from ..probe.step import with_dtype
from ..workloads.base import Workload
from ..workloads.stacks import find_blocks
from .compose import NotComposable, composed_step
from .fake_step import as_card, built_model, gc_paused, model_as_built, prepared_step, stepped

# Roofline for shapes too large to time here: a modern accelerator's realistic dense throughput
# and memory bandwidth (stated assumptions, not measurements).
ROOFLINE_FLOPS = 400e12         # FLOP/s
ROOFLINE_BYTES_PER_S = 2.0e12   # bytes/s


@dataclass(frozen=True)
class BlockMemory:
    """One uniform run's memory at block boundaries: the training step with every block at one
    option, predicted on fake tensors. All values are bytes.

    Attributes:
        kept (list[int]): [block] bytes the block's forward leaves alive for backward.
        bwd_peak (list[int]): [block] peak live bytes while the block's backward runs.
        head (int): peak live bytes before the first block's backward (the forward, the loss and
            the head's backward).
        tail (int): peak live bytes after the last block's backward (the embeddings' backward and
            the optimizer step).
        peak (int): peak live bytes of the step.
    """

    kept: list[int]
    bwd_peak: list[int]
    head: int
    tail: int
    peak: int


def block_count(workload: Workload) -> int:
    """How many blocks the workload's model runs (built on fake tensors)."""
    return len(find_blocks(model_as_built(workload)))


@gc_paused()
def block_memory(workload: Workload, batch_size: int, seq_len: int, option: str, dtype: str = "fp32",
                 loop: Loop | str | None = None, device: str = "cpu", card: Optional[str | Card] = None,
                 attention: Optional[str] = None, *, torch_version: Optional[str] = None) -> BlockMemory:
    """The fake training step with every block at `option` (keep, selective, full), its memory at
    block boundaries (module docstring); `loop`, `device`, `card`, `attention` and `torch_version`
    as `predict`'s. The loop runs one micro-batch (accum_steps=1): the boundaries are a pass's.
    The step's events come from its composed trace where the step allows one (`compose`), else
    from the full trace: both are the same events."""
    loop = as_loop(loop)
    if loop.accum_steps != 1:
        raise ValueError(f"loop={str(loop)!r} is invalid here: a block profile is one forward and backward; "
                         "allowed is a loop with accum_steps=1")
    n = block_count(with_dtype(workload, dtype))   # the build its prepared steps copy
    policy = plan_policy([option] * n)
    card = as_card(card)
    try:
        events = composed_step(workload, batch_size, seq_len, policy, dtype, loop, device, card, attention,
                               torch_version=torch_version)[0].events
    except NotComposable:
        prepared = prepared_step(workload, policy, dtype, loop, device, (batch_size, seq_len))
        with stepped(prepared, batch_size, seq_len, card, attention, torch_version=torch_version) as (
                model, handle, batch, opt, step, _):
            with track_memory(model, opt, inputs=step.inputs(), device="cpu", blocks=handle.blocks) as tracker:
                step(tracker)
            events = tracker.events
    return block_memory_of(events, n)


def block_memory_of(events: list[tuple], n: int) -> BlockMemory:
    """`BlockMemory` of a step of `n` blocks from its tracked or composed events
    (`probe.memory.LiveCounts`): a block's forward runs from its "enter" to its "exit" (the last
    call's, where the block runs again), its backward from its "backward_block" to the block
    before's, the first block's ending at "backward_block" None (or, when the first block's input
    needs no gradient, where the optimizer phase begins). Storages are told apart by their number
    in the events, which no other storage takes."""
    counts = LiveCounts()
    entered, exited, starts = [None] * n, [None] * n, [None] * n
    end, at_backward = None, None
    for event in events:
        kind = event[0]
        if kind == "phase" and event[1] == "backward" and at_backward is None:
            at_backward = {key: entry.nbytes for key, entry in counts.live.items()}
        elif kind == "enter":
            entered[event[1]] = set(counts.live)
        elif kind == "backward_block":
            if event[1] is None:
                end = len(counts.timeline)
            else:
                starts[event[1]] = len(counts.timeline)
        counts.apply(event)
        if kind == "exit":
            exited[event[1]] = set(counts.live)
    if any(v is None for v in starts + entered + exited) or at_backward is None:
        raise RuntimeError("plan profile: the blocks' boundaries were not all seen; the model must call its "
                           "blocks in order with the hidden state as first argument")
    timeline = counts.timeline
    if end is None:   # the first block's input needs no grad: its backward ends the pass
        end = next((i for i, (phase, _) in enumerate(timeline) if phase == "optimizer"), len(timeline))
    totals = [t for _, t in timeline]
    kept = [sum(at_backward.get(k, 0) for k in exited[j] - entered[j]) for j in range(n)]
    bwd_peak = []
    for j in range(n):
        lo = starts[j] - 1
        hi = starts[j - 1] if j > 0 else end
        bwd_peak.append(max(totals[max(lo, 0):max(hi, lo + 1)]))
    head = max(totals[:max(starts[n - 1], 1)])
    tail = max(totals[max(end - 1, 0):])
    return BlockMemory(kept=kept, bwd_peak=bwd_peak, head=head, tail=tail, peak=max(totals))


class _OpRecorder(TorchDispatchMode):
    """Records every op a region runs, with its arguments and output."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[object, tuple, dict, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def roofline_ms(func, args, kwargs, out) -> float:
    """Milliseconds one op takes on the roofline: the slower of its FLOPs at `ROOFLINE_FLOPS` and
    the bytes of its inputs and outputs at `ROOFLINE_BYTES_PER_S`."""
    flops = 0
    formula = flop_registry.get(getattr(func, "_overloadpacket", None))
    if formula is not None:
        try:
            flops = formula(*args, **kwargs, out_val=out)
        except Exception:  # noqa: BLE001 - an op whose formula does not apply counts bytes only
            flops = 0
    nbytes = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                 if isinstance(t, torch.Tensor))
    return 1e3 * max(flops / ROOFLINE_FLOPS, nbytes / ROOFLINE_BYTES_PER_S)


def roofline_block_costs(workload: Workload, batch_size: int, seq_len: int, dtype: str = "fp32") -> list[dict[str, float]]:
    """Per block and option, the milliseconds recomputing adds to one step on the roofline (keep
    0): full recomputes every op of the block's forward, selective the ops selective
    checkpointing does not save (`checkpoint.wrap.selective_policy_fn`). Fake tensors, nothing
    allocated; alike blocks averaged."""
    workload = with_dtype(workload, dtype)
    mode, model = built_model(workload)   # a copy of the build its prepared steps copy
    amp = cpu_autocast(dtype)
    policy_fn = selective_policy_fn("mm")
    with mode:
        model.train()
        batch = workload.new_batch(batch_size, seq_len, torch.Generator().manual_seed(workload.seed + 1))
        blocks = find_blocks(model)
        costs = []
        for block, (args, kwargs) in zip(blocks, block_inputs(workload, model, batch, amp)):
            recorder = _OpRecorder()
            with recorder, amp():
                block(*args, **kwargs)
            full = sel = 0.0
            for func, a, k, out in recorder.ops:
                ms = roofline_ms(func, a, k, out)
                full += ms
                saved = func in SAC_IGNORED_OPS or policy_fn(None, func) in (CheckpointPolicy.MUST_SAVE,
                                                                            CheckpointPolicy.PREFER_SAVE)
                sel += 0.0 if saved else ms
            costs.append({"keep": 0.0, "selective": sel, "full": full})
        return average_alike(blocks, costs)


__all__ = ["BlockMemory", "ROOFLINE_BYTES_PER_S", "ROOFLINE_FLOPS", "block_count", "block_memory", "block_memory_of",
           "roofline_block_costs", "roofline_ms"]
