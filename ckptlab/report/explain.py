"""Why memory did not drop: one prediction of a training step read as a diagnosis, and what
would lower its peak.

`explain()` predicts the step as it is (`ckptlab.predict`: the fake-tensor step and the
live-tensor tracker that `measure` runs), reads where the peak falls and what holds it, names the
cause in words, and predicts each lever -- another checkpoint policy, a plan at the capacity,
bf16, a smaller micro-batch with gradient accumulation, a chunked loss, another optimizer -- by
the same fake step with that one change (`Lever.change`, the settings it changes); a lever the
step already pulls (its own policy, as a plan too; its dtype; its optimizer) is not one. FSDP2 over N
ranks is not a fake step: it is modelled per rank (`ckptlab.estimate.fsdp`). Offload moves saved
activations to pinned host memory only on CUDA: predicted for a CUDA device, on the CPU it is a
no-op, listed but not predicted.

With `device="cuda"` every prediction is the CUDA one (`predict(device="cuda")`), and on a card
(`card=`, or a card's name as `capacity`) every number is the card's device bytes (reserved +
context) and the capacity is the card's usable bytes minus a margin: "predicted for <card>".

The waterfall (`Explanation.steps`) applies the levers one after another, the most effective
first, each step a prediction of every change so far, until the peak fits the capacity.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..core.cards import parse_capacity
from ..core.loop import Loop
from ..core.optimizers import implementation
from ..core.policy import as_policy, plan_policy
from ..core.units import format_bytes
from ..core.validate import integer
from ..estimate import answers
from ..estimate.fake_step import DEVICE_CATEGORIES, Prediction, as_card
from ..estimate.fsdp import fsdp_peak, fsdp_units
from ..estimate.predict import check_prediction, prediction_error
from ..plan.budget import measure as measure_step
from ..plan.budget import plan_budget, predict
from ..plan.profile import profile_blocks
from ..plan.solve import min_peak
from ..probe.step import with_dtype
from ..run.progress import Progress
from ..workloads.base import Workload
from ..workloads.models import GPTConfig, with_chunked_loss

BREAKDOWN = ("parameters", "frozen_parameters", "buffers", "gradients", "optimizer_state", "activations_in_blocks",
             "activations_outside_blocks", "temporaries")
CAUSES = ("optimizer", "logits", "blocks", "weights", "allocator", "not_applied", "double")

# The checkpoint policies tried as levers, and what each costs in words.
POLICY_LEVERS = {
    "none": "keeps every activation; recomputes nothing",
    "full": "recomputes every block's forward in backward: about one more forward pass per step",
    "selective": "keeps matmul and attention outputs, recomputes the cheap ops (norms, activations, dropout)",
    "segments=sqrt": "checkpoint_sequential with sqrt(N) segments: keeps sqrt(N) segment inputs, recomputes the rest",
}
LOSS_CHUNKS = 8
BF16_WEIGHTS_FROM = ("fp32", "bf16")   # the dtypes whose step keeps fp32 weights: the bf16 weights lever's
PLAN_COST = "roofline"   # the planner's recompute cost from FLOPs and bytes: no real run, any shape


@dataclass
class Lever:
    """One change and the peak it leads to. `change` is what it changes, as the step's settings:
    policy, dtype, batch_size, loss_chunks (a chunked GPT loss), a field of the loop (`core.loop.Loop`:
    optimizer, accum_steps, holds_output), or fsdp_ranks; empty for advice no setting expresses. `basis`: predicted (the same fake step
    with `change` applied), modelled (FSDP2: module docstring) or not predicted (`cost` says why)."""

    name: str
    predicted_peak_bytes: Optional[int]
    change: dict
    cost: str
    basis: str = "predicted"

    @property
    def policy(self) -> Optional[str]:
        """The policy it applies, for a checkpoint policy or plan; else None."""
        return self.change.get("policy")


@dataclass
class Explanation:
    """Why a training step peaks where it does, and what would lower it. Bytes are storage bytes
    at the peak, as `measure` and `predict` count them."""

    model: str
    batch_size: int
    seq_len: int
    policy: str
    dtype: str
    loop: Loop                            # the training loop (`core.loop`)
    n_blocks: int
    peak_bytes: int
    peak_phase: str                       # forward | backward | optimizer
    peak_block: Optional[int]             # the block whose backward holds the peak (None: not in one)
    breakdown: dict                       # BREAKDOWN name -> bytes at the peak
    checkpoint_floor_bytes: int           # the lowest peak any checkpoint policy reaches
    checkpoint_floor_policy: str
    cause: str                            # one sentence
    cause_kind: str                       # one of CAUSES
    levers: list = field(default_factory=list)      # Lever, sorted by predicted peak
    steps: list = field(default_factory=list)       # Lever: the waterfall, today's peak first
    capacity_bytes: Optional[int] = None  # what the levers' sizes may reach: a size, or a card's usable bytes less its margin
    capacity_card: str = ""               # the card every size is predicted for, in words ("": none)
    capacity_is_card: bool = False        # the capacity is that card's usable bytes less its margin (not a size)
    device: str = "cpu"
    card: Optional[str] = None            # its name
    device_bytes: Optional[int] = None    # on a card: reserved + context, what the levers' sizes are
    margin_bytes: Optional[int] = None    # on a card: usable - its margin - the step's device bytes
    fit: Optional[str] = None             # on a card: "yes", "with cache flushes" or "no" (predict's)
    fit_reason: str = ""                  # on a card: the answer with its numbers (Prediction.fit_reason)
    ranks: int = 8                        # the FSDP2 lever's world size
    recompute_count: int = 0              # block forwards the policy ran again in backward
    measured_peak_bytes: Optional[int] = None
    measured_note: str = ""
    explain_s: float = 0.0                # wall time of the explanation
    answered_from_cache: bool = False     # taken from the answers kept on disk (`estimate.answers`)

    def to_dict(self) -> dict:
        """Every field, the loop as its record columns (`Loop.record`)."""
        return {**{k: v for k, v in asdict(self).items() if k != "loop"}, **self.loop.record()}

    def figure(self, path=None):
        """The waterfall from today's peak towards the capacity, one step per lever (a matplotlib
        Figure; saved as PNG and SVG at `path`, without extension, when given)."""
        # matplotlib loads only for the figure: `import ckptlab` stays free of plotting libraries.
        from .plots import waterfall_plot  # noqa: PLC0415 - matplotlib is heavy; only figures need it
        title = f"{self.model} b={self.batch_size} s={self.seq_len} {self.policy} ({self.dtype})"
        return waterfall_plot([(s.name, s.predicted_peak_bytes, s.basis) for s in self.steps], self.capacity_bytes,
                              title, path)

    def __str__(self) -> str:
        b = self.breakdown
        where = _where(self.peak_phase, self.peak_block, b["activations_in_blocks"] > 0)
        lines = [f"{self.model} b={self.batch_size} s={self.seq_len} {self.policy} ({self.dtype}, loop {self.loop}): "
                 f"peak {format_bytes(self.peak_bytes)} {where}"]
        if self.card is not None:
            lines[0] += (f"; device {format_bytes(self.device_bytes)}, margin {format_bytes(self.margin_bytes)}: "
                         f"predicted for {self.capacity_card} (the floor and levers below in its device bytes)")
            lines.append(f"  {self.fit_reason}")
        elif self.device == "cuda":
            lines[0] += " (allocated, predicted for CUDA)"
        if self.answered_from_cache:
            lines.append(f"  answered from the explanations kept in {answers.folder()} (made before by this code; "
                         "CKPTLAB_CACHE=off explains again)")
        if self.measured_peak_bytes is not None or self.measured_note:
            lines.append(f"  measured here: {format_bytes(self.measured_peak_bytes)} {self.measured_note}".rstrip())
        lines.append("  at the peak: " + ", ".join(f"{name.replace('_', ' ')} {format_bytes(b[name])}"
                                                    for name in b))
        lines.append(f"  cause: {self.cause}")
        lines.append(f"  checkpoint floor: {format_bytes(self.checkpoint_floor_bytes)} ({self.checkpoint_floor_policy})")
        cap = f", capacity {format_bytes(self.capacity_bytes)}" if self.capacity_bytes else ""
        if self.capacity_is_card:
            cap += f": {self.capacity_card} less its margin"
        lines.append(f"  levers (one change each{cap}):")
        for lever in self.levers:
            peak = format_bytes(lever.predicted_peak_bytes) if lever.predicted_peak_bytes is not None else "-"
            mark = "" if lever.basis == "predicted" else f" [{lever.basis}]"
            lines.append(f"    {peak:>10}  {lever.name}{mark}{self._verdict(lever)}: {lever.cost}")
        if len(self.steps) > 1:
            path = " -> ".join(f"{s.name} ({format_bytes(s.predicted_peak_bytes)})" for s in self.steps)
            lines.append(f"  together: {path}")
        return "\n".join(lines)

    def _verdict(self, lever: Lever) -> str:
        """Whether a lever's peak fits the capacity, said for every lever with a peak: "fits", or
        how far over it stays."""
        if not self.capacity_bytes or lever.predicted_peak_bytes is None:
            return ""
        over = lever.predicted_peak_bytes - self.capacity_bytes
        return "  fits" if over <= 0 else f"  over by {format_bytes(over)}"


# --------------------------------------------------------------------------- the explanation

def explain(workload: Workload | str, batch_size: int, seq_len: int, policy: str = "none", *, dtype: str = "fp32",
            loop: Loop | str | None = None, capacity=None, measure: bool = False, ranks: int = 8, device: str = "cpu",
            card=None, attention: Optional[str] = None, torch_version: Optional[str] = None,
            alloc_conf: Optional[str] = None, progress: bool = True) -> Explanation:
    """Why the peak of one training step is what it is, and what each lever would make it.

    Everything comes from predictions (fake tensors), so any shape works on a laptop;
    `measure=True` also measures the step here and puts its peak beside the prediction.
    `capacity` (24GiB, bytes, or a card: its name or a `parse_capacity` Card) adds a plan that fits
    it and stops the waterfall there; `ranks` is the world size of the FSDP2 lever. `device`,
    `card` and `attention` are `predict`'s: on a card (or a card as capacity) every number is
    predicted for that card, its device bytes, and the capacity is its usable bytes less its
    margin. `loop` is the training loop (`core.loop`, `predict`'s): every prediction is for that
    loop, and levers change its fields (another optimizer, accumulation, releasing a held output);
    `torch_version` and the allocator's `alloc_conf` are `predict`'s too. Bad input raises
    ValueError before any work. On a terminal a bar counts its stages (`progress=False`: none)
    (benchmarks/predict_speed.py times a 7B LoRA's explanation)."""
    t0 = time.perf_counter()
    limit = parse_capacity(capacity) if capacity is not None else None
    on_card = as_card(card) if card is not None else limit if limit is not None and limit.arch else None
    if limit is not None and limit.arch and on_card is not None and limit.name != on_card.name:
        raise ValueError(f"capacity={capacity!r} is invalid with card={card!r}: a capacity that names a card is "
                         f"predicted for that card; allowed is capacity={on_card.name!r} or a size such as 24GiB, "
                         "or no card")
    if limit is not None and not limit.arch and on_card is not None:
        room = on_card.usable_bytes - on_card.required_margin_bytes
        if limit.usable_bytes - limit.required_margin_bytes > room:
            raise ValueError(f"capacity={capacity!r} is invalid with card={on_card.name!r}: it is more than the "
                             f"{format_bytes(room)} the card's device bytes may reach (its usable bytes less its "
                             f"margin); allowed is a size up to that, or no capacity")
    device = "cuda" if on_card is not None else device
    workload, parsed, loop = check_prediction(workload, batch_size, seq_len, as_policy(policy), dtype, loop, device,
                                              on_card, attention, torch_version=torch_version, alloc_conf=alloc_conf)
    if limit is None or limit.arch:   # on a card: what its device bytes may reach
        limit = on_card
    capacity_is_card = limit is not None and limit.arch is not None
    capacity_bytes = limit.usable_bytes - limit.required_margin_bytes if limit is not None else None
    on = {"device": device, "card": on_card, "attention": attention, "torch_version": torch_version,
          "alloc_conf": alloc_conf}
    integer("ranks", ranks, 2)
    if measure and device != "cpu":
        raise ValueError(f"measure=True is invalid with device={device!r}: the step is measured here, on the CPU; "
                         "allowed is measure=False for a prediction for CUDA")
    # A report made of predictions only is kept as they are; one with a measurement is made again.
    kept_as = None if measure else answers.key(workload, batch_size, seq_len, parsed, dtype, loop, device, on_card,
                                               attention, torch_version, alloc_conf, "fast",
                                               asked=("explain", capacity_bytes, repr(limit), ranks))
    kept = answers.fetch(kept_as) if kept_as else None
    if isinstance(kept, Explanation):
        return dataclasses.replace(kept, explain_s=time.perf_counter() - t0, answered_from_cache=True)
    stages = Progress("explain", progress)
    stages.phase("stages", 6 + measure, "stage")
    try:
        base = predict(workload, batch_size, seq_len, parsed, dtype, loop, **on)
        applied = f"plan={base.plan}" if base.plan else str(parsed)
        breakdown = peak_breakdown(base)
        stages.step("the step")

        memo: dict = {}   # each setting predicted once: the waterfall's steps repeat levers' settings
        levers = policy_levers(workload, base, applied, on, memo)
        stages.step("checkpoint policies")
        floor_lever = floor_plan_lever(workload, base, applied, levers, on) if base.n_blocks else None
        if floor_lever is not None:
            levers.append(floor_lever)
        stages.step("a plan at the floor")
        if capacity_bytes is not None and base.n_blocks:
            capacity_lever = capacity_plan_lever(workload, base, applied, capacity_bytes, on)
            if capacity_lever is not None:
                levers.append(capacity_lever)
        stages.step("a plan at the capacity")
        checkpoint_peaks = [(lv.predicted_peak_bytes, lv.policy) for lv in levers
                            if lv.policy and lv.policy != "none" and lv.predicted_peak_bytes is not None]
        if parsed.kind != "none":
            checkpoint_peaks.append((base.held_bytes, applied))
        # Ties go to the step's own policy: it already reaches that peak.
        floor, floor_policy = min(checkpoint_peaks, default=(base.held_bytes, "none: the model has no blocks to checkpoint"),
                                  key=lambda x: (x[0], x[1] != applied))

        kind, cause = diagnose(base, breakdown, floor, floor_policy, parsed)
        levers += other_levers(workload, base, applied, kind, breakdown, capacity_bytes, ranks, on, memo)
        stages.step("other levers")
        levers.sort(key=lambda lv: (lv.predicted_peak_bytes is None, lv.predicted_peak_bytes or 0, lv.name))

        explanation = Explanation(
            model=base.model, batch_size=batch_size, seq_len=seq_len, policy=str(parsed), dtype=dtype,
            loop=loop, n_blocks=base.n_blocks, peak_bytes=base.peak_bytes, peak_phase=base.peak_phase,
            peak_block=base.peak_block, breakdown=breakdown, checkpoint_floor_bytes=floor,
            checkpoint_floor_policy=floor_policy, cause=cause, cause_kind=kind, levers=levers,
            capacity_bytes=capacity_bytes, ranks=ranks, recompute_count=base.recompute_count, device=device,
            card=base.card, capacity_card=on_card.describe() if on_card else "", capacity_is_card=capacity_is_card,
            device_bytes=base.device_bytes,
            margin_bytes=base.margin_bytes, fit=base.fit, fit_reason=base.fit_reason,
        )
        explanation.steps = waterfall(workload, base, applied, levers, capacity_bytes, ranks, on, memo)
        stages.step("the waterfall")
        if measure:
            record = measure_step(workload, batch_size, seq_len, parsed, dtype=dtype, loop=loop, steps=1,
                                  warmup=0, max_seconds=0.5)
            if record["status"] == "ok":
                explanation.measured_peak_bytes = record["peak_bytes"]
                error = prediction_error(base.peak_bytes, record["peak_bytes"])
                explanation.measured_note = f"on {record['device']}: prediction error {error:+.1%}"
            else:
                explanation.measured_note = f"not measured here: {record['status']}: {record['message']}"
            stages.step("measured")
    finally:
        stages.close()
    explanation.explain_s = time.perf_counter() - t0
    if kept_as:
        answers.keep(kept_as, explanation)
    return explanation


def peak_breakdown(pred: Prediction) -> dict:
    """The prediction's categories at the peak, activations split into those the blocks' forwards
    allocated and the rest (embeddings, logits, loss); on CUDA the allocator's own after them."""
    by = pred.peak_by_category
    in_blocks = pred.peak_in_blocks_by_category.get("activations", 0)
    breakdown = {"parameters": by["parameters"], "frozen_parameters": by.get("frozen_parameters", 0),
                 "buffers": by.get("buffers", 0), "gradients": by["gradients"], "optimizer_state": by["optimizer_state"],
                 "activations_in_blocks": in_blocks, "activations_outside_blocks": by["activations"] - in_blocks,
                 "temporaries": by["temporaries"]}
    return breakdown | {c: by[c] for c in DEVICE_CATEGORIES if c in by}   # CUDA: workspaces, rounding, fragmentation


def _where(phase: str, block: Optional[int], block_activations_held: bool) -> str:
    """When the peak comes. In backward outside any block with block activations held, the
    backward has not reached the blocks yet: each block's backward frees what it saved."""
    if phase == "optimizer":
        return "in the optimizer step"
    if phase == "forward":
        return "in the forward pass"
    if block is not None:
        return f"in the backward of block {block}"
    if block_activations_held:
        return ("in backward, while the loss and the head run theirs, before any block's backward has freed "
                "its activations")
    return "in backward, outside any block's backward (the loss's, the head's or the embeddings')"


def diagnose(pred: Prediction, breakdown: dict, floor: int, floor_policy: str, policy) -> tuple[str, str]:
    """(kind, sentence): what holds the peak, in words, the known traps first."""
    f = format_bytes
    checkpoints = policy.kind not in ("none", "compile")
    # ckptlab's wrappers recompute a block through its forward, not its __call__: a block called
    # in backward is the model's own checkpointing recomputing it (transformers' hf policies do so too).
    if checkpoints and pred.block_calls_in_backward and policy.mechanism != "transformers":
        return "double", (
            f"Checkpointing is applied twice: the model already recomputes its blocks itself "
            f"({pred.block_calls_in_backward} block calls ran in backward) and {policy} checkpoints them again "
            f"inside that. The second layer adds recompute time and saves nothing the first does not; keep one.")
    if checkpoints and (pred.effective_density == 0 or (pred.recompute_count == 0 and pred.block_calls_in_backward == 0)):
        why = ("it selects none of them at this depth" if pred.effective_density == 0 else
               "they ran no recompute in backward: transformers' checkpointing is off in eval() mode and with use_cache")
        return "not_applied", (
            f"The policy {policy} did not apply: 0 of {pred.n_blocks} blocks were recomputed ({why}), so the step "
            f"keeps every activation as without checkpointing.")
    static = sum(breakdown[k] for k in ("parameters", "frozen_parameters", "buffers", "gradients", "optimizer_state"))
    # on a card the floor is device bytes (reserved + context), the peak allocated bytes: said so
    lowest = f(floor) + (" of device bytes" if pred.device_bytes is not None else "")
    if pred.peak_phase == "optimizer":
        return "optimizer", (
            f"The peak is in the optimizer step, where the weights ({f(breakdown['parameters'] + breakdown['frozen_parameters'])}), "
            f"their gradients ({f(breakdown['gradients'])}) and the optimizer state ({f(breakdown['optimizer_state'])}) "
            f"are held together. Activations are freed by then, so no checkpoint policy can lower it "
            f"(the lowest any reaches is {lowest}).")
    temporaries = breakdown["temporaries"]
    temporaries_in_blocks = pred.peak_in_blocks_by_category.get("temporaries", 0)
    if pred.peak_block is not None:   # a block's backward: its recompute and gradient buffers
        temporaries_in_blocks = temporaries
    blocks = breakdown["activations_in_blocks"] + temporaries_in_blocks
    outside = breakdown["activations_outside_blocks"] + temporaries - temporaries_in_blocks
    where = _where(pred.peak_phase, pred.peak_block, breakdown["activations_in_blocks"] > 0)
    # on a card, the allocator's own bytes inside the allocated peak: cuBLAS workspaces and rounding
    allocator = breakdown.get("workspaces", 0) + breakdown.get("rounding", 0)
    if allocator and allocator >= max(outside, blocks, static):
        return "allocator", (
            f"The allocator's own bytes hold the peak: cuBLAS workspaces {f(breakdown['workspaces'])} and rounding "
            f"{f(breakdown['rounding'])}, {f(allocator)} of {f(pred.peak_bytes)}, more than any kind of tensor "
            f"(weights, gradients and optimizer state {f(static)}, activations and temporaries {f(blocks + outside)}). "
            f"The peak comes {where}. A step this small pays them on any card; checkpointing lowers only "
            f"activations (to {lowest} at best).")
    if outside >= max(blocks, static):
        return "logits", (
            f"The logits, the loss and their gradients hold the peak: {f(outside)} of activations and temporaries "
            f"outside the blocks against {f(blocks)} in them. The peak comes {where}. Checkpointing the blocks lowers it only to {lowest} ({floor_policy}); "
            f"a chunked loss{' or a smaller micro-batch' if pred.batch_size > 1 else ''} shrinks the logits.")
    if blocks >= static:
        reach = (f"{floor_policy} brings the peak to {lowest}" if floor < pred.held_bytes else
                 f"{policy} already reaches the lowest peak checkpointing gets to, so only other levers can go below it")
        return "blocks", (
            f"Block activations hold the peak: {f(blocks)} of {f(pred.peak_bytes)}. The peak comes {where}. "
            f"Checkpointing is the lever: {reach}.")
    # the levers on them that the step does not already pull
    others = [name for name, open_ in (("bf16 weights", pred.dtype in BF16_WEIGHTS_FROM),
                                       ("another optimizer", breakdown["optimizer_state"] > 0),
                                       ("FSDP sharding", True)) if open_]
    return "weights", (
        f"Weights, gradients and optimizer state hold the peak: {f(static)} of {f(pred.peak_bytes)}. The peak "
        f"comes {where}. "
        f"Checkpointing lowers only activations (to {lowest} at best); {_either(others)} "
        f"{'lowers' if len(others) == 1 else 'lower'} the rest.")


def _either(words: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c"."""
    return " or ".join(filter(None, [", ".join(words[:-1]), words[-1]]))


# --------------------------------------------------------------------------- levers

def already_applied(policy: str, applied: str, n_blocks: int) -> bool:
    """Whether the checkpoint policy `policy` does what the step's own, `applied`, does (a lever
    never suggests it: full and plan=ffff are one)."""
    return as_policy(policy).checkpoints_like(as_policy(applied), n_blocks)


def policy_levers(workload: Workload, base: Prediction, applied: str, on: dict, memo: dict) -> list[Lever]:
    """Each checkpoint policy of POLICY_LEVERS other than the step's own, predicted."""
    if not base.n_blocks:
        return []
    return [predicted_lever(f"policy {policy}", workload, base, applied, {"policy": policy}, cost, on, memo)
            for policy, cost in POLICY_LEVERS.items() if not already_applied(policy, applied, base.n_blocks)]


def floor_plan_lever(workload: Workload, base: Prediction, applied: str, levers: list[Lever],
                     on: dict) -> Optional[Lever]:
    """The plan of keep/selective/full per block with the lowest peak (the planner's `min_peak`),
    its peak predicted by a fake run of that plan (or taken from `full`'s lever when it is full
    everywhere: the same model); None when the step's own policy is that plan."""
    tensors_on = {k: v for k, v in on.items() if k != "alloc_conf"}   # the profile counts tensors, not blocks
    profile = profile_blocks(workload, base.batch_size, base.seq_len, base.dtype, base.loop, PLAN_COST,
                             **tensors_on)
    _, options = min_peak(profile)
    policy = str(plan_policy(options))
    if already_applied(policy, applied, base.n_blocks):
        return None
    full = next((lv.predicted_peak_bytes for lv in levers if lv.policy == "full"), None)
    if set(options) == {"full"} and full is not None:
        peak = full
    else:
        peak = (predict(workload, base.batch_size, base.seq_len, policy, base.dtype, base.loop,
                            **on)).held_bytes
    return Lever("plan with the lowest peak", peak, {"policy": policy},
                 f"{options.count('full')} full, {options.count('selective')} selective, "
                 f"{options.count('keep')} kept blocks: the planner's lowest peak")


def capacity_plan_lever(workload: Workload, base: Prediction, applied: str, capacity: int,
                        on: dict) -> Optional[Lever]:
    """The least-recompute plan that fits `capacity` (`plan_budget`), or why none does; None when
    the step's own policy is that plan. On a card the plan's budget is in allocated bytes: the
    capacity less what the step holds beyond them (the context, and the fragmentation of today's
    step); the plan's device bytes are predicted."""
    beyond = base.held_bytes - base.peak_bytes
    budget = capacity - beyond
    if budget <= 0:
        return Lever(f"plan at {format_bytes(capacity)}", None, {},
                     f"no plan fits: the card's context and today's fragmentation ({format_bytes(beyond)}) take all "
                     "of the capacity", "not predicted")
    try:
        plan = plan_budget(workload, base.batch_size, base.seq_len, budget, base.dtype, base.loop, cost=PLAN_COST,
                           **on)
    except ValueError as exc:
        basis = (f" (in allocated bytes: the capacity less the {format_bytes(beyond)} the card's context and "
                 "today's fragmentation take)" if base.card is not None else "")
        return Lever(f"plan at {format_bytes(capacity)}", None, {}, f"no plan fits{basis}: {exc}", "not predicted")
    if already_applied(f"plan={plan.letters}", applied, base.n_blocks):
        return None
    peak = plan.predicted_peak_bytes
    if base.card is not None:
        peak = (predict(workload, base.batch_size, base.seq_len, f"plan={plan.letters}", base.dtype,
                            base.loop, **on)).held_bytes
    return Lever(f"plan at {format_bytes(capacity)}", peak, {"policy": f"plan={plan.letters}"},
                 f"recompute {plan.recompute_ms:.2f} ms/step against {plan.full_recompute_ms:.2f} ms for full "
                 f"({plan.cost_basis}: an assumed accelerator's FLOPs and bandwidth)")


def other_levers(workload: Workload, base: Prediction, applied: str, kind: str, breakdown: dict,
                 capacity: Optional[int], ranks: int, on: dict, memo: dict) -> list[Lever]:
    """The levers beyond checkpointing: bf16, micro-batches, a chunked loss, the optimizer, FSDP2, offload,
    and in a loop that holds the model's output, releasing it."""
    dtype, opt = base.dtype, base.loop.optimizer
    levers = []
    if dtype == "fp32":
        levers.append(predicted_lever("bf16 autocast", workload, base, applied, {"dtype": "bf16"},
                                      "matmuls in bf16: activations halve, weights stay fp32 (autocast keeps bf16 "
                                      "copies of them in the step)", on, memo))
    if dtype in BF16_WEIGHTS_FROM:
        levers.append(predicted_lever("bf16 weights", workload, base, applied, {"dtype": "bf16-weights"},
                                      "weights, gradients and optimizer state in bf16: no fp32 master copy, so "
                                      "small updates round away without a compensated optimizer", on, memo))
    if base.batch_size > 1:
        levers.append(micro_batch_lever(workload, base, applied, capacity, on, memo))
    if kind == "logits":
        if isinstance(workload.config, GPTConfig):
            levers.append(predicted_lever(f"chunked loss ({LOSS_CHUNKS} chunks)", workload, base, applied,
                                          {"loss_chunks": LOSS_CHUNKS}, "the head and loss run per chunk of tokens "
                                          "under checkpoint: the head's matmul runs twice", on, memo))
        else:
            levers.append(Lever("chunked loss", None, {}, "not predicted: ckptlab chunks the loss of its GPT "
                                "workloads; compute this model's head and loss per chunk of tokens under "
                                "checkpoint", "not predicted"))
    if opt.startswith("adamw") and (base.peak_phase == "optimizer" or
                                    breakdown["optimizer_state"] == max(breakdown.values())):
        levers.append(predicted_lever("SGD", workload, base, applied, {"optimizer": "sgd"},
                                      "no optimizer state (plain SGD): another training algorithm", on, memo))
        if implementation(opt, base.device) != "fused":
            levers.append(predicted_lever("AdamW fused", workload, base, applied, {"optimizer": "adamw-fused"},
                                          f"AdamW(fused=True): one kernel per step, without the "
                                          f"{implementation(opt, base.device)} implementation's temporaries "
                                          "(the same update)", on, memo))
    levers.append(Lever(f"FSDP2 over {ranks} ranks", fsdp_peak(base, fsdp_units(with_dtype(workload, dtype)), ranks),
                        {"fsdp_ranks": ranks},
                        f"{ranks} processes each hold 1/{ranks} of weights, gradients and optimizer state and "
                        "gather one unit at a time: all-gathers and reduce-scatters every step", "modelled"))
    if "+offload" not in applied:
        levers.append(offload_lever(workload, base, applied, on))
    if base.loop.holds_output:
        levers.append(predicted_lever("release the output", workload, base, applied, {"holds_output": False},
                                      "`del` the model's output (or keep it inside a function) before the next "
                                      "forward: the same training", on, memo))
    return levers


def offload_lever(workload: Workload, base: Prediction, applied: str, on: dict) -> Lever:
    """Saved activations to pinned host memory: predicted on CUDA (`cuda_device.HostOffload`);
    on a CPU offload is a no-op, so it is named, not predicted."""
    change = {"policy": f"{applied}+offload"}
    if base.device != "cuda":
        return Lever("offload", None, change, "CUDA only: saved activations go to pinned host memory and come back "
                     "in backward (host-device copies); on a CPU it is a no-op: predict for a card to see it",
                     "not predicted")
    pred = predict(workload, base.batch_size, base.seq_len, change["policy"], base.dtype, base.loop, **on)
    return Lever("offload", pred.held_bytes, change,
                 f"what the blocks save goes to pinned host memory ({format_bytes(pred.host_bytes)} held by the host "
                 "caching allocator, in powers of two) and "
                 "comes back in backward: host-device copies every step")


def setting_of(base: Prediction, applied: str) -> dict:
    """The step `base` predicted, as the settings a lever's `change` updates: its loop as the
    loop's fields."""
    return {"policy": applied, "dtype": base.dtype, "batch_size": base.batch_size, "loss_chunks": None,
            **dataclasses.asdict(base.loop)}


def predict_setting(workload: Workload, seq_len: int, setting: dict, on: dict, memo: dict) -> Prediction:
    """The fake step of `workload` at `seq_len` with these settings (`setting_of`, changed), on the
    device `on` names; `memo` holds the settings predicted before (for this workload, sequence and
    device: a prediction is deterministic)."""
    key = tuple(sorted(setting.items()))
    if key not in memo:
        chunked = with_chunked_loss(workload, setting["loss_chunks"]) if setting["loss_chunks"] else workload
        loop = Loop(**{f.name: setting[f.name] for f in dataclasses.fields(Loop)})
        memo[key] = predict(chunked, setting["batch_size"], seq_len, setting["policy"], setting["dtype"], loop, **on)
    return memo[key]


def predicted_lever(name: str, workload: Workload, base: Prediction, applied: str, change: dict, cost: str,
                    on: dict, memo: dict) -> Lever:
    """The lever making `change` to the step, its peak predicted; "not predicted" with the reason
    when the model cannot take it (segments out of order, code that assumes fp32 tensors)."""
    try:
        pred = predict_setting(workload, base.seq_len, {**setting_of(base, applied), **change}, on, memo)
    except (ValueError, RuntimeError) as exc:
        return Lever(name, None, change, f"not predicted: {type(exc).__name__}: {exc}", "not predicted")
    return Lever(name, pred.held_bytes, change, cost)


def micro_batch_lever(workload: Workload, base: Prediction, applied: str, capacity: Optional[int], on: dict,
                      memo: dict) -> Lever:
    """The largest micro-batch below `batch_size` that divides it (keeping the effective batch by
    accumulation: the loop's accum_steps times more) and fits `capacity`; without a capacity, the
    largest one."""
    b, accum = base.batch_size, base.loop.accum_steps
    pred = None
    for micro in [d for d in range(b - 1, 0, -1) if b % d == 0]:
        pred = predict_setting(workload, base.seq_len, {**setting_of(base, applied), "batch_size": micro,
                                                         "accum_steps": accum * (b // micro)}, on, memo)
        if capacity is None or pred.held_bytes <= capacity:
            break
    steps = accum * (b // pred.batch_size)
    return Lever(f"micro-batch {pred.batch_size} x {steps} accumulation steps", pred.held_bytes,
                 {"batch_size": pred.batch_size, "accum_steps": steps},
                 f"{steps} forward and backward passes per optimizer step: the same tokens, less parallelism per pass")


# --------------------------------------------------------------------------- waterfall

def waterfall(workload: Workload, base: Prediction, applied: str, levers: list[Lever], capacity: Optional[int],
              ranks: int, on: dict, memo: dict) -> list[Lever]:
    """Today's peak, then one lever after another, each step a prediction of every change so far:
    the best checkpoint lever, bf16, the micro-batch, the chunked loss, bf16 weights, SGD, releasing
    a held output -- those that lower the peak on their own, the most effective first, each kept
    only if it lowers the peak further -- then FSDP2 (modelled on the last step). Stops once the
    peak fits `capacity`."""
    steps = [Lever("today", base.held_bytes, {}, "")]
    setting = setting_of(base, applied)
    # One lever per setting it changes, the lowest peak's (levers are sorted by peak) or, for
    # checkpointing, the plan that fits the capacity (it recomputes least); the most effective first.
    chosen: dict = {}
    for lever in levers:
        if lever.basis != "predicted" or lever.predicted_peak_bytes >= base.held_bytes:
            continue
        changes = tuple(sorted(lever.change))
        if changes not in chosen or lever.name.startswith("plan at"):
            chosen[changes] = lever
    last = base
    for lever in sorted(chosen.values(), key=lambda lv: lv.predicted_peak_bytes):
        if capacity is not None and last.held_bytes <= capacity:
            break
        tried = {**setting, **lever.change}
        pred = predict_setting(workload, base.seq_len, tried, on, memo)
        if pred.held_bytes >= last.held_bytes:   # no lower together with the changes before it
            continue
        setting, last = tried, pred
        steps.append(Lever(lever.name, last.held_bytes, lever.change, lever.cost))
    if capacity is None or last.held_bytes > capacity:
        units = fsdp_units(with_dtype(workload, setting["dtype"]))
        steps.append(Lever(f"FSDP2 over {ranks} ranks", fsdp_peak(last, units, ranks), {"fsdp_ranks": ranks}, "",
                           "modelled"))
    return steps


__all__ = ["BREAKDOWN", "CAUSES", "Explanation", "Lever", "explain"]
