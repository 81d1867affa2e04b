"""Choosing a checkpoint plan for a memory budget.

For each block ckptlab picks one of three options — keep (save everything), selective (op-level:
keep matmul and attention outputs, recompute the rest), full (keep only the block input) — to
minimise the recompute time subject to the predicted peak <= budget.

1. Profile (`profile_blocks`, once per workload/shape/dtype):
   - memory, from three fake-tensor training steps (`ckptlab.probe.fake_step`), all blocks keep, all
     selective, all full, instrumented at block boundaries: for every block j and option o, the
     bytes its forward leaves alive for backward (kept[j][o]) and the peak of live bytes while its
     backward runs (bwd_peak[j][o]); the peak before the first block's backward (forward + loss
     head) and after the last (embedding backward + optimizer);
   - time: measured, an option's cost is what it adds to the block's forward + backward (the
     fastest of interleaved repeats of each option, minus keep's), framework overhead included;
     roofline (shapes that do not fit here), the FLOPs and bytes of the ops it recomputes (all of
     them for full, those the selective policy does not save for selective) on an assumed
     accelerator.
2. Peak model of a plan o_0..o_{N-1} (d_i(o) = kept[i][o] - kept[i][keep]):
       head   = max_o (head_o - sum_i d_i(o)) + sum_i d_i(o_i)
       block j = bwd_peak[j][o_j] - sum_{i<j} d_i(o_j) + sum_{i<j} d_i(o_i)
       tail   = max_o tail_o
       peak   = max(head, max_j block j, tail)
   While block j runs backward, the blocks after it have freed their activations and the blocks
   before it still hold what their option kept; that is the only way the others' choices enter.
3. Solve exactly (`solve`): dynamic programming over the blocks in order, the state being the
   prefix sum D_j = sum_{i<j} d_i(o_i); feasibility later depends only on D (smaller is never
   worse) and the cost is additive, so keeping the Pareto front of (D, cost) is exact — a
   knapsack with prefix constraints. `brute_force` enumerates all 3^N plans (N <= 10) to check it.
4. Verify: the chosen plan's peak is predicted again by a fake run of the real plan; if the model
   was optimistic the budget is tightened by the excess and the plan re-solved.

An infeasible budget raises ValueError stating the minimum achievable peak (`min_peak`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.utils import benchmark
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, checkpoint
from torch.utils.flop_counter import flop_registry

from ..checkpoint.blocks import find_blocks, hidden_state
from ..checkpoint.wrap import selective_context_fn, selective_policy_fn
from ..core.policy import Policy, parse_policy
from ..core.units import format_bytes, parse_bytes
from ..workloads.base import Workload
from ..workloads.registry import get_workload
from .fake_step import fake_memory, fake_model, fake_modes, fake_training_step
from .memory import track_memory
from .step import DTYPES

OPTIONS = ("keep", "selective", "full")
LETTERS = {"keep": "k", "selective": "s", "full": "f"}
# Roofline for shapes too large to time here: a modern accelerator's realistic dense throughput
# and memory bandwidth (stated assumptions, not measurements).
ROOFLINE_FLOPS = 400e12
ROOFLINE_BYTES_PER_S = 2.0e12


@dataclass
class Profile:
    """Per-block memory and recompute-time profile: the planner's only input."""

    n_blocks: int
    kept: list[dict[str, int]]          # [block][option] bytes left alive for backward
    bwd_peak: list[dict[str, int]]      # [block][option] peak live bytes during its backward (uniform run)
    head: dict[str, int]                # [option] peak before the first block backward (uniform run)
    tail: dict[str, int]                # [option] peak after the last block backward
    cost_ms: list[dict[str, float]]     # [block][option] recompute time
    peak: dict[str, int]                # [option] predicted peak of the uniform run
    cost_basis: str = "measured"        # measured | roofline | given
    meta: dict = field(default_factory=dict)

    def delta(self, j: int, option: str) -> int:
        return self.kept[j][option] - self.kept[j]["keep"]


# --------------------------------------------------------------------------- peak model + solvers

def _consts(profile: Profile):
    n = profile.n_blocks
    head = max(profile.head[o] - sum(profile.delta(i, o) for i in range(n)) for o in OPTIONS)
    tail = max(profile.tail.values())
    # block j's backward peak with the blocks before it at option o removed: m[j][o]
    m = [{o: profile.bwd_peak[j][o] - sum(profile.delta(i, o) for i in range(j)) for o in OPTIONS}
         for j in range(n)]
    return head, tail, m


def model_peak(profile: Profile, options: Sequence[str]) -> int:
    """The peak model (module docstring, step 2) for one plan."""
    head, tail, m = _consts(profile)
    peak, prefix = tail, 0
    for j, o in enumerate(options):
        peak = max(peak, m[j][o] + prefix)
        prefix += profile.delta(j, o)
    return max(peak, head + prefix)


def plan_cost(profile: Profile, options: Sequence[str]) -> float:
    return sum(profile.cost_ms[j][o] for j, o in enumerate(options))


def solve(profile: Profile, budget_bytes: int) -> Optional[list[str]]:
    """Exact minimum-cost plan with model_peak <= budget_bytes (None if none exists).

    Pareto front of (prefix bytes D, cost) over the blocks; ties go to the smaller peak."""
    head, tail, m = _consts(profile)
    if tail > budget_bytes:
        return None
    front: list[tuple[int, float, tuple]] = [(0, 0.0, ())]
    for j in range(profile.n_blocks):
        nxt = []
        for d, cost, choice in front:
            for o in OPTIONS:
                if m[j][o] + d <= budget_bytes:
                    nxt.append((d + profile.delta(j, o), cost + profile.cost_ms[j][o], choice + (o,)))
        front = _pareto(nxt)
        if not front:
            return None
    feasible = [(cost, d, choice) for d, cost, choice in front if head + d <= budget_bytes]
    if not feasible:
        return None
    best = min(cost for cost, _, _ in feasible)
    ties = [c for c in feasible if c[0] <= best + 1e-12]
    return list(min(ties, key=lambda c: (model_peak(profile, c[2]), c[2]))[2])


def _pareto(states):
    states.sort(key=lambda s: (s[0], s[1]))
    out, best_cost = [], math.inf
    for s in states:
        if s[1] < best_cost - 1e-12:
            out.append(s)
            best_cost = s[1]
    return out


def min_peak(profile: Profile) -> tuple[int, list[str]]:
    """The smallest model peak any plan reaches, and a plan reaching it (exact: Pareto front of
    (prefix bytes, running peak))."""
    head, tail, m = _consts(profile)
    front = [(0, tail, ())]
    for j in range(profile.n_blocks):
        nxt = [(d + profile.delta(j, o), max(run, m[j][o] + d), choice + (o,))
               for d, run, choice in front for o in OPTIONS]
        nxt.sort(key=lambda s: (s[0], s[1]))
        front, best = [], math.inf
        for s in nxt:
            if s[1] < best:
                front.append(s)
                best = s[1]
    peak, choice = min(((max(run, head + d), choice) for d, run, choice in front), key=lambda x: x[0])
    return peak, list(choice)


def brute_force(profile: Profile, budget_bytes: int) -> Optional[list[str]]:
    """All 3^N plans (N <= 10): the minimum-cost one within the budget, ties to the smaller peak."""
    if profile.n_blocks > 10:
        raise ValueError(f"n_blocks={profile.n_blocks} is invalid for brute_force: allowed is <= 10")
    best = None
    for options in itertools.product(OPTIONS, repeat=profile.n_blocks):
        peak = model_peak(profile, options)
        if peak <= budget_bytes:
            key = (round(plan_cost(profile, options), 9), peak, options)
            if best is None or key < best:
                best = key
    return list(best[2]) if best else None


# --------------------------------------------------------------------------- profiling

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
                        optimizer: str) -> dict:
    """One instrumented fake training step with every block at `option`."""
    letters = LETTERS[option]
    n = len(_blocks_of(workload))
    policy = Policy("plan", letters * n)
    with fake_training_step(workload, batch_size, seq_len, policy, dtype, optimizer) as (model, handle, batch, opt, step):
        blocks = handle.blocks
        marks = {"fwd_pre": [None] * n, "fwd_post": [None] * n, "bwd_start": [None] * n, "bwd_end": [None] * n}
        state = {}

        def tracker_live():
            return state["t"]._tracker

        def pre_hook(j):
            def hook(module, args):
                marks["fwd_pre"][j] = set(tracker_live().live) if "t" in state else None
                if j == 0 and torch.is_grad_enabled() and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                    end = lambda: marks["bwd_end"].__setitem__(0, len(tracker_live().timeline))
                    return (_Marker.apply(args[0], end),) + tuple(args[1:])
            return hook

        def post_hook(j):
            def hook(module, args, out):
                if "t" in state:
                    marks["fwd_post"][j] = set(tracker_live().live)
                h = hidden_state(out)
                if torch.is_grad_enabled() and h.requires_grad:
                    start = lambda: marks["bwd_start"].__setitem__(j, len(tracker_live().timeline))
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
                            snapshot.update({k: v[0] for k, v in tracker._tracker.live.items()})
                        tracker.phase(name)

                step(_Phases())
            timeline = tracker._tracker.timeline
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
    if fake:
        model = fake_model(workload, mode)
    else:
        torch.manual_seed(workload.seed)
        model = workload.new_model()
    with mode:
        model.train()
        gen = torch.Generator().manual_seed(workload.seed + 1)
        batch = tuple(workload.make_batch(workload.config, batch_size, seq_len, gen))
        blocks = find_blocks(model)
        captured: list = [None] * len(blocks)
        hooks = [b.register_forward_pre_hook(
            lambda mod, args, kwargs, j=j: captured.__setitem__(j, (args, kwargs)), with_kwargs=True)
            for j, b in enumerate(blocks)]
        autocast = DTYPES[dtype]
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
                   optimizer: str = "adamw", cost: str = "auto") -> Profile:
    """The planner's per-block profile (module docstring, step 1). `cost`: measured (per-op wall
    time of a real forward, CPU), roofline (FLOPs and bytes of a fake forward, for shapes that do
    not fit here) or auto (measured if the uniform keep peak is under 4 GiB). Cached per shape."""
    workload = get_workload(workload) if isinstance(workload, str) else workload
    if cost not in ("auto", "measured", "roofline"):
        raise ValueError(f"cost={cost!r} is invalid: allowed are auto, measured, roofline")
    key = (workload.identity, batch_size, seq_len, dtype, optimizer, cost)
    if key in _PROFILE_CACHE:
        return _PROFILE_CACHE[key]
    t0 = time.perf_counter()
    runs = {o: _memory_profile_run(workload, batch_size, seq_len, o, dtype, optimizer) for o in OPTIONS}
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


# --------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    """A chosen plan: one option per block, with what it is predicted to cost and hold."""

    options: list[str]
    budget_bytes: int
    predicted_peak_bytes: int          # a fake-run prediction of the real plan
    model_peak_bytes: int              # the planner's peak model
    recompute_ms: float                # sum of the chosen options' recompute cost
    full_recompute_ms: float           # the same for full checkpointing, for scale
    none_peak_bytes: int               # uniform keep (no checkpointing)
    full_peak_bytes: int               # uniform full
    cost_basis: str
    iterations: int = 1
    loss_fn: str = ""                  # the training step's loss the plan was made for (its memory counts)

    @property
    def letters(self) -> str:
        return "".join(LETTERS[o] for o in self.options)

    @property
    def policy(self) -> Policy:
        return Policy("plan", self.letters)

    def record(self) -> dict:
        return {"plan": self.letters, "plan_budget_bytes": self.budget_bytes,
                "plan_predicted_peak_bytes": self.predicted_peak_bytes,
                "plan_model_peak_bytes": self.model_peak_bytes, "plan_recompute_ms": self.recompute_ms,
                "plan_cost_basis": self.cost_basis, "plan_loss_fn": self.loss_fn}

    def __str__(self) -> str:
        counts = {o: self.options.count(o) for o in OPTIONS}
        lines = [
            f"plan {self.letters}  (k keep, s selective, f full): "
            f"{counts['keep']} keep, {counts['selective']} selective, {counts['full']} full",
            f"  budget {format_bytes(self.budget_bytes)}; predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(none {format_bytes(self.none_peak_bytes)}, full {format_bytes(self.full_peak_bytes)})",
            f"  recompute {self.recompute_ms:.2f} ms/step ({self.cost_basis}) vs "
            f"{self.full_recompute_ms:.2f} ms for full checkpointing",
            f"  made for the training step with loss {self.loss_fn}: another loss keeps other tensors",
        ]
        return "\n".join(lines)


def resolve_budget(budget, none_peak: int) -> int:
    """A budget policy/str/number -> bytes: a fraction in (0, 1] of the no-checkpointing peak, or
    a size."""
    if isinstance(budget, Policy):
        if budget.kind != "budget":
            raise ValueError(f"policy={budget} is invalid here: expected budget=...")
        value = budget.value
    elif isinstance(budget, str):
        value = parse_policy(budget if budget.startswith("budget") else f"budget={budget}").value
    elif isinstance(budget, float) and 0 < budget <= 1:
        value = budget
    else:
        value = parse_bytes(budget, "budget")
    return int(value * none_peak) if isinstance(value, float) else int(value)


def plan_budget(workload: Workload | str, batch_size: int, seq_len: int, budget, dtype: str = "fp32",
                optimizer: str = "adamw", cost: str = "auto", max_iterations: int = 4) -> Plan:
    """Minimum-recompute plan of {keep, selective, full} per block whose predicted peak fits
    `budget` (e.g. "6GiB", "budget=0.5", 0.5, 6 * 2**30). Raises ValueError, stating the minimum
    achievable peak, if no plan fits."""
    workload = get_workload(workload) if isinstance(workload, str) else workload
    profile = profile_blocks(workload, batch_size, seq_len, dtype, optimizer, cost)
    budget_bytes = resolve_budget(budget, profile.peak["keep"])
    target = budget_bytes
    for iteration in range(1, max_iterations + 1):
        options = solve(profile, target)
        if options is None:
            lowest, lowest_plan = min_peak(profile)
            verified = fake_memory(workload, batch_size, seq_len, _plan_policy(lowest_plan), dtype,
                               optimizer)[0].peak_bytes
            raise ValueError(
                f"budget={format_bytes(budget_bytes)} ({budget_bytes} B) is infeasible for "
                f"{workload.label} at batch_size={batch_size}, seq_len={seq_len}, {dtype}: the minimum "
                f"achievable peak is {format_bytes(verified)} ({verified} B, plan "
                f"{''.join(LETTERS[o] for o in lowest_plan)}); allowed is a budget >= that"
            )
        predicted = fake_memory(workload, batch_size, seq_len, _plan_policy(options), dtype,
                            optimizer)[0].peak_bytes
        if predicted <= budget_bytes:
            break
        target -= predicted - budget_bytes  # the model was optimistic: tighten and re-solve
    else:
        raise ValueError(f"budget={format_bytes(budget_bytes)} could not be met after {max_iterations} "
                         f"re-plans (last predicted peak {format_bytes(predicted)}); try a larger budget")
    n = profile.n_blocks
    return Plan(
        options=options, budget_bytes=budget_bytes, predicted_peak_bytes=predicted,
        model_peak_bytes=model_peak(profile, options), recompute_ms=plan_cost(profile, options),
        full_recompute_ms=plan_cost(profile, ["full"] * n), none_peak_bytes=profile.peak["keep"],
        full_peak_bytes=profile.peak["full"], cost_basis=profile.cost_basis, iterations=iteration,
        loss_fn=workload.loss_name,
    )


def _plan_policy(options: Sequence[str]) -> Policy:
    return Policy("plan", "".join(LETTERS[o] for o in options))


__all__ = ["OPTIONS", "Plan", "Profile", "brute_force", "min_peak", "model_peak", "plan_budget",
           "plan_cost", "profile_blocks", "resolve_budget", "solve"]
