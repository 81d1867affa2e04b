"""The planner's input: for each block and option (keep, selective, full), what it keeps and
what its recompute costs. `profile_blocks` measures it once per workload / shape / dtype:

- memory, from three fake-tensor training steps (`ckptlab.estimate.fake_step`): all blocks keep,
  all selective, all full, instrumented at block boundaries: for every block j and option o, the
  bytes its forward leaves alive for backward (kept[j][o]) and the peak of live bytes while its
  backward runs (bwd_peak[j][o]); the peak before the first block's backward (forward + loss head)
  and after the last (embedding backward + optimizer);
- time: measured (what an option adds to the block's forward + backward, framework overhead
  included), or roofline for shapes that do not fit here (the FLOPs and bytes of the ops it
  recomputes, on an assumed accelerator).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, checkpoint
from torch.utils.flop_counter import flop_registry

from ..checkpoint.blocks import hidden_state
from ..checkpoint.wrap import selective_context_fn, selective_policy_fn
from ..core.policy import PLAN_OPTIONS as OPTIONS
from ..core.policy import plan_policy
from ..estimate.fake_step import fake_model, fake_modes, fake_training_step
from ..probe.memory import track_memory
from ..probe.step import autocast_dtype, with_dtype
from ..workloads.base import Workload
from ..workloads.registry import as_workload
from ..workloads.stacks import find_blocks

# Roofline for shapes too large to time here: a modern accelerator's realistic dense throughput
# and memory bandwidth (stated assumptions, not measurements).
ROOFLINE_FLOPS = 400e12
ROOFLINE_BYTES_PER_S = 2.0e12


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
        cost_basis (str): how cost_ms was had: measured, roofline or given.
        meta (dict): what it was profiled for (model, loss_fn, batch_size, seq_len, dtype,
            optimizer) and profile_s, the seconds profiling took.
    """

    n_blocks: int
    kept: list[dict[str, int]]
    bwd_peak: list[dict[str, int]]
    head: dict[str, int]
    tail: dict[str, int]
    cost_ms: list[dict[str, float]]
    peak: dict[str, int]
    cost_basis: str = "measured"
    meta: dict = field(default_factory=dict)

    def delta(self, j: int, option: str) -> int:
        """Bytes block j keeps under `option` beyond what it keeps under keep (negative: it saves)."""
        return self.kept[j][option] - self.kept[j]["keep"]


class _Marker(torch.autograd.Function):
    """Identity whose backward calls `fn`: marks when a block's backward begins/ends."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


def _memory_profile_run(workload: Workload, batch_size: int, seq_len: int, option: str, dtype: str,
                        optimizer: str, device: dict) -> dict:
    """One instrumented fake training step with every block at `option`; `device` holds
    fake_training_step's device, card and attention."""
    n = len(_blocks_of(workload))
    policy = plan_policy([option] * n)
    with fake_training_step(workload, batch_size, seq_len, policy, dtype, optimizer, **device) as (
            model, handle, batch, opt, step):
        blocks = handle.blocks
        marks = {"fwd_pre": [None] * n, "fwd_post": [None] * n, "bwd_start": [None] * n, "bwd_end": [None] * n}
        state = {}

        def pre_hook(j):
            def hook(module, args):
                marks["fwd_pre"][j] = set(state["t"].live_bytes()) if "t" in state else None
                if j == 0 and torch.is_grad_enabled() and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                    end = lambda: marks["bwd_end"].__setitem__(0, len(state["t"].timeline))
                    return (_Marker.apply(args[0], end),) + tuple(args[1:])
            return hook

        def post_hook(j):
            def hook(module, args, out):
                if "t" in state:
                    marks["fwd_post"][j] = set(state["t"].live_bytes())
                h = hidden_state(out)
                if torch.is_grad_enabled() and h.requires_grad:
                    start = lambda: marks["bwd_start"].__setitem__(j, len(state["t"].timeline))
                    marked = _Marker.apply(h, start)
                    return marked if isinstance(out, torch.Tensor) else (marked,) + tuple(out[1:])
            return hook

        hooks = [b.register_forward_pre_hook(pre_hook(j)) for j, b in enumerate(blocks)]
        hooks += [b.register_forward_hook(post_hook(j)) for j, b in enumerate(blocks)]
        try:
            with track_memory(model, opt, inputs=batch, device="cpu") as tracker:
                state["t"] = tracker
                snapshot = {}

                class _Phases:
                    def phase(self, name):
                        if name == "backward" and not snapshot:
                            snapshot.update(tracker.live_bytes())
                        tracker.phase(name)

                step(_Phases())
            timeline = tracker.timeline
        finally:
            for h in hooks:
                h.remove()
    if marks["bwd_end"][0] is None:  # the first block's input needs no grad: its backward ends the pass
        marks["bwd_end"][0] = next((i for i, (ph, _) in enumerate(timeline) if ph == "optimizer"), len(timeline))
    if any(v is None for v in marks["bwd_start"]):
        raise RuntimeError("plan profile: block-boundary markers did not fire; the model must call its "
                           "blocks in order with the hidden state as first argument")
    totals = [t for _, t in timeline]
    kept = []
    for j in range(n):
        new = marks["fwd_post"][j] - marks["fwd_pre"][j]
        kept.append(sum(snapshot.get(k, 0) for k in new))
    starts = marks["bwd_start"]
    bwd_peak = []
    for j in range(n):
        lo = starts[j] - 1
        hi = starts[j - 1] if j > 0 else marks["bwd_end"][0]
        bwd_peak.append(max(totals[max(lo, 0):max(hi, lo + 1)]))
    head = max(totals[:max(starts[n - 1], 1)])
    tail = max(totals[max(marks["bwd_end"][0] - 1, 0):])
    return {"kept": kept, "bwd_peak": bwd_peak, "head": head, "tail": tail, "peak": max(totals)}


def _blocks_of(workload: Workload):
    return find_blocks(fake_model(workload, fake_modes()))


class _OpTimer(TorchDispatchMode):
    def __init__(self, timed: bool):
        super().__init__()
        self.timed = timed
        self.ops: list[tuple[object, float, tuple, dict, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        ms = (time.perf_counter() - t0) * 1e3 if self.timed else 0.0
        self.ops.append((func, ms, args, kwargs, out))
        return out


def _roofline_ms(func, args, kwargs, out) -> float:
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


def _cost_profile(workload: Workload, batch_size: int, seq_len: int, dtype: str, cost: str,
                  reps: int = 5) -> list[dict[str, float]]:
    """Recompute time per block and option, from a per-op pass over each block's forward."""
    fake = cost == "roofline"
    mode = fake_modes() if fake else contextlib.nullcontext()
    workload = with_dtype(workload, dtype)
    if fake:
        model = fake_model(workload, mode)
    else:
        torch.manual_seed(workload.seed)
        model = workload.new_model()
    with mode:
        model.train()
        gen = torch.Generator().manual_seed(workload.seed + 1)
        batch = workload.new_batch(batch_size, seq_len, gen)
        blocks = find_blocks(model)
        captured: list = [None] * len(blocks)
        hooks = [b.register_forward_pre_hook(
            lambda mod, args, kwargs, j=j: captured.__setitem__(j, (args, kwargs)), with_kwargs=True)
            for j, b in enumerate(blocks)]
        autocast = autocast_dtype(dtype)
        amp = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext
        try:
            with torch.no_grad(), amp():
                workload.loss(model, batch)
        finally:
            for h in hooks:
                h.remove()
        costs = []
        for j, block in enumerate(blocks):
            args, kwargs = captured[j]
            args = tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                         for a in args)
            per_op = None
            for _ in range(1 if fake else reps):
                timer = _OpTimer(timed=not fake)
                with timer, amp():
                    block(*args, **kwargs)
                times = [_roofline_ms(f, a, k, o) if fake else ms for f, ms, a, k, o in timer.ops]
                per_op = times if per_op is None else [min(x, y) for x, y in zip(per_op, times)]
            policy_fn = selective_policy_fn("mm")
            saved = []
            for func, *_ in timer.ops:
                if func in SAC_IGNORED_OPS:
                    saved.append(True)
                    continue
                saved.append(policy_fn(None, func) in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE))
            full = sum(per_op)
            sel = sum(t for t, s in zip(per_op, saved) if not s)
            if not fake:
                # What the option really adds to the block's forward + backward, framework
                # overhead included (selective checkpointing intercepts every op in Python: at
                # small sizes that costs more than the ops it saves).
                extra = _block_option_ms(block, args, kwargs, amp, reps)
                full, sel = extra["full"], extra["selective"]
            costs.append({"keep": 0.0, "selective": sel, "full": full})
        # Blocks of one type and parameter shapes do the same work: average their timings, so
        # the plan is chosen by where a block sits (memory), not by timer noise.
        groups: dict = {}
        for j, block in enumerate(blocks):
            sig = (type(block), tuple(tuple(p.shape) for p in block.parameters()))
            groups.setdefault(sig, []).append(j)
        for members in groups.values():
            mean = {o: sum(costs[j][o] for j in members) / len(members) for o in OPTIONS}
            for j in members:
                costs[j] = dict(mean)
    return costs


def _block_option_ms(block, args, kwargs, amp, reps: int) -> dict[str, float]:
    """Fastest forward + backward of one block per option, minus keep's (>= 0).

    Each (option, round) is one `torch.utils.benchmark.Timer.blocked_autorange`: the library
    sets the thread count, warms up and picks the block size. The rounds are interleaved over
    the options (the timing protocol's idea, `ckptlab.probe.timing`), so load drift hits every
    option alike; the Timer alone would time one option after the other."""

    def run(option):
        with amp():
            if option == "keep":
                out = block(*args, **kwargs)
            else:
                extra = {"context_fn": selective_context_fn("mm")} if option == "selective" else {}
                out = checkpoint(block, *args, use_reentrant=False, **extra, **kwargs)
            out = out if isinstance(out, torch.Tensor) else out[0]
        out.backward(torch.ones_like(out))

    timers = {o: benchmark.Timer(stmt="run(option)", globals={"run": run, "option": o},
                                 num_threads=torch.get_num_threads()) for o in OPTIONS}
    best = {o: math.inf for o in OPTIONS}
    for _ in range(reps):
        for option in OPTIONS:
            best[option] = min(best[option], timers[option].blocked_autorange(min_run_time=BLOCK_MIN_RUN_S).median * 1e3)
    return {o: max(0.0, best[o] - best["keep"]) for o in OPTIONS}


BLOCK_MIN_RUN_S = 1e-3   # per Timer measurement: after its warm-up, one or a few block runs


_PROFILE_CACHE: dict = {}


def profile_blocks(workload: Workload | str, batch_size: int, seq_len: int, dtype: str = "fp32",
                   optimizer: str = "adamw", cost: str = "auto", device: str = "cpu", card=None,
                   attention: str | None = None) -> Profile:
    """The planner's per-block profile (module docstring). `cost`: measured (per-op wall
    time of a real forward, CPU), roofline (FLOPs and bytes of a fake forward, for shapes that do
    not fit here) or auto (measured if the uniform keep peak is under 4 GiB). Cached per shape.
    The memory is the fake step's on `device` ("cuda": on `card`, with `attention`: `predict`'s)."""
    workload = as_workload(workload)
    if cost not in ("auto", "measured", "roofline"):
        raise ValueError(f"cost={cost!r} is invalid: allowed are auto, measured, roofline")
    on_device = {"device": device, "card": card, "attention": attention}
    key = (workload.identity, batch_size, seq_len, dtype, optimizer, cost, device, getattr(card, "name", card), attention)
    if key in _PROFILE_CACHE:
        return _PROFILE_CACHE[key]
    t0 = time.perf_counter()
    runs = {o: _memory_profile_run(workload, batch_size, seq_len, o, dtype, optimizer, on_device) for o in OPTIONS}
    if cost == "auto":
        cost = "measured" if runs["keep"]["peak"] < 4 * 2**30 else "roofline"
    costs = _cost_profile(workload, batch_size, seq_len, dtype, cost)
    n = len(costs)
    profile = Profile(
        n_blocks=n,
        kept=[{o: runs[o]["kept"][j] for o in OPTIONS} for j in range(n)],
        bwd_peak=[{o: runs[o]["bwd_peak"][j] for o in OPTIONS} for j in range(n)],
        head={o: runs[o]["head"] for o in OPTIONS},
        tail={o: runs[o]["tail"] for o in OPTIONS},
        cost_ms=costs,
        peak={o: runs[o]["peak"] for o in OPTIONS},
        cost_basis=cost,
        meta={"model": workload.label, "loss_fn": workload.loss_name, "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype,
              "optimizer": optimizer, "profile_s": time.perf_counter() - t0},
    )
    _PROFILE_CACHE[key] = profile
    return profile


__all__ = ["Profile", "profile_blocks"]
