"""The fast path of a prediction: trace the step on a few blocks of each stack, and compose the
whole step's events from that trace.

A stack's blocks trace alike: a block's forward, its backward and its recompute allocate and free
the same sizes in the same order as its neighbours', and refer to its neighbours' tensors the same
way (its input, the gradient flowing into it). So the step is run once, tracked as the full trace
is (`fake_step`), on the whole model with each stack's middle cut out: the stack's container
iterates over the kept blocks only (`_skipping_class`), while the model keeps all its parameters, so
setup, optimizer state, the optimizer step and `zero_grad` see every parameter, as in the full
step. What the cut blocks would have done is put back into the events:

- A stack of L blocks is split into its first block, its middle (L - 2 blocks, whose kinds repeat
  with a period P: a kind is the block's type, parameters and checkpoint mode) and its last
  block. Kept are the first block and two periods (the head), and the end of the stack from a
  multiple of P on (the tail); the cut blocks in between are copies of the head's last period
  (their `template`), whose neighbours all ran. The kept middle blocks of the tail must trace as
  their templates do (`_Units._check_alike`): the first block's influence (a tensor it makes
  that the next blocks keep) has died out by then. Where the events of a step so cut do not
  compose (the first block's output, which every block reads, is also the second's input), the
  step is traced again with three periods in the head (`_LongHeadCut`), and that refusal stands.
  A middle whose kinds do not repeat (a plan that checkpoints some blocks, say) is cut in its
  longest run of one kind instead, as if that run were the middle: its first two blocks (three
  with the long head) and its last two kept, and the blocks before and after it. The last of the
  run traces as the kind after it makes it, so the one before it is the one checked; a block
  after the run that refers to a block before the cut is refused
  (`_Units._check_references_across_runs`).
- The events are split into units: a block's forward unit runs from its predecessor's return to
  its own return, its backward unit from the gradient of its output to the next block's. A cut
  block's units are its template's, inserted in the forward after the head's last block and in
  the backward before it, with their storages renamed: a storage a unit allocates is that
  block's own; one it refers to that another block's unit allocated is the one at the same
  place of the block at the same distance (in the kept order) from it, so a block's input is its
  predecessor's output whether that predecessor ran or is a copy. Storages of everything outside
  the blocks (embeddings, head, parameters, optimizer state) keep their names, and so does one
  that the unit a period before refers to at the same place (a table every block reads; a first
  block's output that every block reads). Where something outside the blocks refers to one storage of every block in turn
  (autocast's cache of weight casts, released when autocast exits), it refers to the copies' too.
- The cut blocks' gradients come from their template's units. The trace stands zero gradients
  in for them when backward ends (so that the optimizer step and `zero_grad` run on every
  parameter as in the full step); those allocations are dropped and their storages renamed to
  the copies' gradients.

A step of several gradient-accumulation passes is composed pass by pass: each pass's units are
roles of their own (`_role`: "fwd", "bwd", "fwd2", "bwd2", ...), a cut block's units in a pass
are its template's in that pass, and a reference to a storage of an earlier pass (a gradient the
next pass accumulates into) is renamed as any other, to that pass's unit of the block at the same
distance. Above `micro_steps.TRACED` passes, that many are traced and composed, then extended to
all (`micro_steps.extended`); where they cannot be, the step is not composed.

The composed events are counted by `probe.memory.LiveCounts`, as a tracked step's own events are,
and on CUDA replayed through the caching allocator. A prepared model keeps its last composed
steps by shape and kernels (`TRACED_KEPT`): a step asked for again is not traced again, nor one
asked for on another card that answers the trace's questions about the card alike
(`CudaSemantics.ask`: the same attention backend, splits and kernels), whose replay is its own.
What a composed trace cannot know is refused
before it answers (`NotComposable`), and the prediction then runs the full trace and says why:
policies whose checkpoint regions span several blocks, transformers' own checkpointing, a step
that is not forward and backward passes then an optimizer step, a model that indexes its blocks, takes a part of them or counts them,
a model whose forward leaves tensors on its modules (a cache made on its first call, which the cut
blocks never make), an op outside the blocks that reads several middle blocks' tensors (`MemoryTracker.mark_reads`), blocks
whose order, units or gradients the trace cannot place. Not seen: model code that treats a block by
its position without indexing the container (`zip` with a per-layer list, a block reading its own
index), whose cut blocks are predicted as their template. The equality of the two paths is a test
(tests/test_fast_path.py), on models with repeated, alternating, shared, encoder-decoder blocks,
blocks that read an earlier block's tensor, and blocks alike but for a hook or a setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import types
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..core.cards import Card
from ..core.loop import Loop, as_loop
from ..core.policy import Policy
from ..probe.memory import MemoryReport, count_events, track_memory
from ..workloads.base import Workload
from ..workloads.specs import one_line
from . import micro_steps
from .batch_line import ON_LINE, BatchLine, ComposedStep
from .cuda_device import (
    BlasUse,
    HostOffload,
    LoopOrder,
    device_memory,
    host_block_bytes,
    parse_alloc_conf,
)
from .cuda_semantics import CudaSemantics, same_answers
from .fake_mode import kernel_failures_unlogged
from .fake_step import (
    FakeMemory,
    as_card,
    fake_memory,
    gc_paused,
    kernels_of,
    optimizer_event,
    optimizer_state_keys,
    prepared_step,
    stepped,
)
from .torch_versions import torch_rules

TRACED_KEPT = 16     # composed steps kept per prepared model, by shape and kernels (the last asked for):
                     # a table's searches on one card, for the next card's
LONGEST_PERIOD = 4   # of the block kinds in a stack's middle; a longer one is traced in full
HEAD_PERIODS = 2        # of the middle kept before the cut, the last the cut blocks' template
LONG_HEAD_PERIODS = 3   # where a step does not compose with HEAD_PERIODS (the first block's output,
                        # which every block reads, is also the second block's input)


FROM_ALIKE_CARD = "composed, from the step traced for"   # a prediction's `trace` when another card's step made it


def from_alike_card(trace: str) -> bool:
    """Whether a prediction with this `trace` was made from the step traced for another card."""
    return trace.startswith(FROM_ALIKE_CARD)


class NotComposable(Exception):
    """Why a step's events cannot be composed: the prediction runs the full trace instead."""


class _HeadTooShort(NotComposable):
    """Why a step traced with a short head (HEAD_PERIODS) does not compose: it is traced with the
    long one (`_LongHeadCut`) instead."""


@gc_paused()
def fast_memory(workload: Workload, batch_size: int, seq_len: int, policy: Policy, dtype: str = "fp32",
                loop: Loop | str | None = None, device: str = "cpu", card: Optional[str | Card] = None,
                attention: Optional[str] = None, *, torch_version: Optional[str] = None,
                alloc_conf: Optional[str] = None) -> FakeMemory:
    """`fake_step.fake_memory`'s answer, from a composed trace where the step allows one (module
    docstring), else from the full trace; `FakeMemory.trace` says which answered, and why not
    the composed one."""
    args = (workload, batch_size, seq_len, policy, dtype, loop, device, card, attention)
    options = dict(torch_version=torch_version, alloc_conf=alloc_conf)
    try:
        with kernel_failures_unlogged():
            return composed_memory(*args, **options)
    except NotComposable as why:
        reason = str(why)
    except Exception as exc:   # the model cannot run with its stacks cut: the full trace can say why
        reason = (f"the shortened step failed with {type(exc).__name__}: {one_line(exc)} (the model cannot run with "
                  "blocks cut: its other layers may be sized by the number of blocks)")
    full = fake_memory(*args, **options, extend_passes=True)
    if full.passes_traced is not None:
        reason += (f"; {full.passes_traced} of its {as_loop(loop).accum_steps} passes traced, the rest copies of the "
                   "last (`micro_steps`)")
    full.trace = f"full ({reason})"
    return full


def fallback_reason(trace: str) -> Optional[str]:
    """Why the fast path traced a step in full, from its `trace` ("full (why)", `fast_memory`);
    None where it composed the step or the full trace was asked for."""
    return trace[len("full ("):-1] if trace.startswith("full (") else None


def composed_memory(workload: Workload, batch_size: int, seq_len: int, policy: Policy, dtype: str = "fp32",
                    loop: Loop | str | None = None, device: str = "cpu", card: Optional[str | Card] = None,
                    attention: Optional[str] = None, *, torch_version: Optional[str] = None,
                    alloc_conf: Optional[str] = None) -> FakeMemory:
    """One fake training step from a composed trace (module docstring); NotComposable if the step
    does not allow one."""
    cuda, card = device == "cuda", as_card(card)
    composed, made_from, prepared, report = composed_step(workload, batch_size, seq_len, policy, dtype, loop, device,
                                                          card, attention, torch_version=torch_version)
    fake = _fake_memory(composed, prepared.handle, card, cuda, alloc_conf, bool(prepared.host), report)
    if made_from is not None:
        fake.trace = made_from
    accum = as_loop(loop).accum_steps
    if accum > micro_steps.TRACED:
        fake.passes_traced = micro_steps.TRACED
        fake.trace += f" ({micro_steps.TRACED} of its {accum} passes traced, the rest copies of the last: `micro_steps`)"
    return fake


def composed_step(workload: Workload, batch_size: int, seq_len: int, policy: Policy, dtype: str = "fp32",
                  loop: Loop | str | None = None, device: str = "cpu", card: Optional[Card] = None,
                  attention: Optional[str] = None, *, torch_version: Optional[str] = None) -> tuple:
    """The composed step (module docstring): (its `ComposedStep`, what made it where this step was
    not traced (a batch line, or the step traced for a card of the same kernels: the prediction's
    `trace`), else None, its `fake_step.PreparedStep`, and the count of its events, or None where
    they were not counted). NotComposable if the step does not allow one. Traced with the short
    head first (HEAD_PERIODS); where its events do not compose, with the long one, whose refusal
    is the one raised."""
    if policy.mechanism == "transformers":
        raise NotComposable("transformers' own checkpointing")
    args = (workload, batch_size, seq_len, policy, dtype, as_loop(loop), device, card, attention, torch_version)
    try:
        return _composed_step(*args, _Cut)
    except _HeadTooShort:
        return _composed_step(*args, _LongHeadCut)


def _composed_step(workload: Workload, batch_size: int, seq_len: int, policy: Policy, dtype: str, loop: Loop,
                   device: str, card: Optional[Card], attention: Optional[str], torch_version: Optional[str],
                   cut_type: type) -> tuple:
    """`composed_step` with the blocks cut by `cut_type`: a short head's refusal of the traced
    events (`_HeadTooShort`) is kept with its prepared step, raised again without tracing."""
    cuda = device == "cuda"
    blas = BlasUse(torch_rules(torch_version)) if cuda else contextlib.nullcontext()
    # A step of many accumulation passes is traced with micro_steps.TRACED of them, composed, and
    # extended to all (`micro_steps`): its kept steps and lines are the extended ones, by pass count.
    passes = min(loop.accum_steps, micro_steps.TRACED)
    prepared = prepared_step(workload, policy, dtype, dataclasses.replace(loop, accum_steps=passes), device,
                             (batch_size, seq_len), host_type=_MarkedHostOffload if cuda and policy.offload else None,
                             cut_type=cut_type)
    if prepared.refusal is not None:
        raise prepared.refusal
    host, cut = prepared.host, prepared.cut
    kernels_key = (kernels_of(card) if cuda else None, attention, torch_version, loop.accum_steps)
    line = cut.batch_lines.setdefault((seq_len, kernels_key), BatchLine())
    composed = line.step_at(batch_size)
    if composed is not None:
        return composed, f"{ON_LINE} (traced at batch sizes {', '.join(map(str, line.batch_sizes))})", prepared, None
    # A step traced before at this shape and on these kernels is the same step: a planner's
    # profile and its verification, or a lever and a waterfall's step, trace it once. So is one
    # traced on another card whose every question about the card (`CudaSemantics.ask`) this card
    # answers alike: only what lies outside the events, the cuBLAS workspaces and where a batch
    # line may start, is the card's own.
    key, traced_for = (batch_size, seq_len, kernels_key), _card_label(card) if cuda else None
    if key not in cut.traced and cuda:
        arch, sm_count = kernels_key[0]
        alike = next((t for k, t in cut.traced.items() if k[:2] == key[:2] and k[2][1:] == kernels_key[1:]
                      and same_answers(t.kernels.answers, arch, sm_count)), None)
        if alike is not None:
            shared = dataclasses.replace(alike.composed, workspaces=alike.blas.workspaces(arch),
                                         settled_from_batch=alike.kernels.settled_from_batch(sm_count))
            line.add(batch_size, shared)
            _keep(cut, key, dataclasses.replace(alike, composed=shared))
    if key in cut.traced:
        cut.traced.move_to_end(key)
        kept = cut.traced[key]
        taken = None if kept.card == traced_for else f"{FROM_ALIKE_CARD} {kept.card} (the same kernels)"
        return kept.composed, taken, prepared, kept.report
    with stepped(prepared, batch_size, seq_len, card, attention, torch_version=torch_version) as (
            model, handle, batch, opt, step, kernels):
        if host:
            host.reset()   # the warm-up step's copies are gone
        marks = None
        try:
            with track_memory(model, opt, inputs=step.inputs(), device="cpu", blocks=handle.blocks) as tracker, blas:
                cut.tracker = tracker
                if host:
                    host.tracker = tracker
                marks = _Marks(tracker, cut, cut.optimizer_phases.get(kernels_key))
                tracker.mark_reads()
                try:
                    step(marks)
                finally:
                    cut.tracker = None
                    if host:
                        host.tracker = None
        except _OptimizerPhaseKnown:
            model.zero_grad(set_to_none=loop.zero_grad == "set_to_none")   # as the step's own zero_grad, untracked
        if marks.spliced is not None:
            events = marks.spliced
        else:
            events = list(tracker.events)
            cut.optimizer_phases[kernels_key] = _OptimizerPhase.recorded(events)
        try:
            events = compose(events, cut)
        except NotComposable as why:
            if cut.head_periods >= LONG_HEAD_PERIODS:
                raise
            prepared.refusal = _HeadTooShort(str(why))   # the model stays as a traced step leaves it: kept
            raise prepared.refusal from None
        if passes < loop.accum_steps:
            try:
                events = micro_steps.extended(events, loop.accum_steps)
            except micro_steps.NotExtendable as why:
                raise NotComposable(f"accum={loop.accum_steps}: {why}") from None
        recomputes = (sum(1 for e in events if e[0] == "region_run")
                      - sum(e[1] for e in events if e[0] == "forward_runs"))
        composed = ComposedStep(events, tracker.report().param_bytes, recomputes, [], None,
                                kernels.attention_backend if cuda else None,
                                kernels.settled_from_batch() if cuda else 1)
        if cuda:
            composed.workspaces = blas.workspaces(kernels_key[0][0])
        report = count_events(events).report(events if cuda else None)
        if cuda:
            composed.loop_order = LoopOrder(optimizer_state_keys(report.trace, model, opt), optimizer_event(report))
        line.add(batch_size, composed)
        _keep(cut, key, _Traced(composed, report, kernels if cuda else None, blas if cuda else None, traced_for))
        return composed, None, prepared, report


def _card_label(card: Optional[Card]) -> str:
    """How a prediction's `trace` names the card a step was traced for."""
    return card.name if card else f"CUDA without a card ({kernels_of(card)[0]})"


def _keep(cut: "_Cut", key: tuple, traced: "_Traced") -> None:
    """Keep a composed step under its key, the TRACED_KEPT last asked for."""
    cut.traced[key] = traced
    while len(cut.traced) > TRACED_KEPT:
        cut.traced.popitem(last=False)


def _fake_memory(composed: ComposedStep, handle, card: Optional[Card], cuda: bool, alloc_conf: Optional[str],
                 host: bool, report=None) -> FakeMemory:
    """The prediction of a composed step: its events counted (unless `report` is their count),
    and on CUDA replayed for `card`."""
    if report is None:
        report = count_events(composed.events).report(composed.events if cuda else None)
    report.param_bytes = composed.param_bytes
    fake = FakeMemory(report, handle, recompute_count=composed.recompute_count, trace="composed")
    if not cuda:
        return fake
    fake.device = device_memory(report.trace, report.start_bytes, report.peak_bytes, composed.workspaces, card,
                                parse_alloc_conf(alloc_conf), loop_order=composed.loop_order)
    fake.device.host_bytes = _host_peak(composed.events) if host else None
    fake.attention_backend = composed.attention_backend
    return fake


@dataclass
class _Traced:
    """A composed step kept for its shape and kernels, with what it asked the card."""

    composed: ComposedStep
    report: MemoryReport                # the count of its events
    kernels: Optional[CudaSemantics]    # what its trace asked the card (CUDA)
    blas: Optional[BlasUse]             # which cuBLAS workspaces it used: their bytes per card (CUDA)
    card: Optional[str]                 # the card it was traced for (`_card_label`; CUDA)


# --------------------------------------------------------------------------- the cut

@dataclass
class _Stack:
    """One stack's cut: global block indices (into the checkpoint handle's blocks)."""

    first: int                 # the stack's first block
    length: int
    period: int = 1
    cut: range = range(0)      # the blocks that do not run
    run: range = range(0)      # the middle blocks whose kinds repeat with the period, the cut among them
    alike: range = range(0)    # the kept blocks of the run after the cut that must trace as their templates
    head_periods: int = HEAD_PERIODS   # of the run kept before the cut
    repeats: int = 0           # where its middle's kinds repeat in too few blocks to cut: their period,
    blocks_needed: int = 0     # and how many blocks a cut would need

    def template(self, block: int) -> int:
        """The head block whose units a cut block's are: one of the head's last period."""
        last_period = self.run.start + (self.head_periods - 1) * self.period
        return last_period + (block - last_period) % self.period

    @property
    def head_last(self) -> int:
        return self.cut.start - 1


@dataclass
class _Cut:
    """Which blocks a shortened step runs, and how its events become the whole step's."""

    stacks: list[_Stack] = field(default_factory=list)
    stack_of: dict[int, _Stack] = field(default_factory=dict)     # global block -> its stack
    param_template: dict[int, int] = field(default_factory=dict)  # a cut block's parameter -> its template's
    param_block: dict[int, int] = field(default_factory=dict)     # a cut block's parameter -> that block
    tracker: object = None
    params: list = field(default_factory=list)
    optimizer_phases: dict = field(default_factory=dict)   # the kernels a step ran -> its `_OptimizerPhase`
    batch_lines: dict = field(default_factory=dict)        # (seq_len, the kernels) -> its `BatchLine`
    traced: OrderedDict = field(default_factory=OrderedDict)  # (batch, seq, the kernels) -> `_Traced`
    head_periods: int = HEAD_PERIODS   # of each run kept before its cut

    Refusal = NotComposable   # what `shorten` raises before it changes the model

    def shorten(self, model: nn.Module, handle) -> Callable[[list], list]:
        """Cut the stacks' middles out of `model` (called once the policy is applied); returns
        what the warm-up's trained parameters become (the cut blocks' counterparts added).
        NotComposable, before anything is changed, for a model whose blocks cannot be cut."""
        if not handle.stacks:
            raise NotComposable("the blocks were given, not found in stacks")
        if any(stop - start > 1 for start, stop in handle.regions):
            raise NotComposable("checkpoint regions span several blocks")
        modes = handle.policy.modes(handle.n_blocks) if handle.policy.kind in ("selective", "plan") else [
            "full" if j in set(handle.checkpointed_blocks) else "keep" for j in range(handle.n_blocks)]
        start = 0
        for stack in handle.stacks:
            self.stacks.append(_plan_stack(stack.blocks, modes[start:start + len(stack.blocks)], start,
                                           self.head_periods))
            for j in range(start, start + len(stack.blocks)):
                self.stack_of[j] = self.stacks[-1]
            start += len(stack.blocks)
        if not any(s.cut for s in self.stacks):
            short = max(self.stacks, key=lambda s: s.length)   # the longest stack says why
            if short.blocks_needed:
                every = "every block" if short.repeats == 1 else f"every {short.repeats} blocks"
                raise NotComposable(f"no stack is long enough to compose: one of {short.length} blocks whose middle "
                                    f"repeats {every} needs {short.blocks_needed} or more")
            raise NotComposable("no stack has repeated middle blocks to compose")
        self.params = list(model.parameters())
        self._match_parameters(handle)
        for stack_plan, stack in zip(self.stacks, handle.stacks):
            if stack_plan.cut:
                container = model.get_submodule(stack.path) if stack.path else model
                kept = [b for i, b in enumerate(stack.blocks) if stack_plan.first + i not in stack_plan.cut]
                container.__class__ = _skipping_class(type(container), kept)   # for this prediction's model only
        self._count_regions(handle)
        return self.trained

    def _match_parameters(self, handle) -> None:
        """Each parameter of a cut block, matched with its template's, by position."""
        index = {id(p): i for i, p in enumerate(self.params)}
        cut_blocks = {j for s in self.stacks for j in s.cut}
        elsewhere = set()
        for j, block in enumerate(handle.blocks):
            if j not in cut_blocks:
                elsewhere.update(id(p) for p in block.parameters())
        in_blocks = {id(p) for block in handle.blocks for p in block.parameters()}
        elsewhere.update(id(p) for p in self.params if id(p) not in in_blocks)
        for j in sorted(cut_blocks):
            template = self.stack_of[j].template(j)
            own, theirs = list(handle.blocks[j].parameters()), list(handle.blocks[template].parameters())
            own_ids = {id(p) for p in own}
            for p, q in zip(own, theirs):
                if id(p) in elsewhere:
                    if p is not q:
                        raise NotComposable(f"block {j} shares a parameter with another block than its template")
                    continue
                if id(q) not in elsewhere or id(q) in own_ids:
                    raise NotComposable(f"block {j}'s parameters do not match block {template}'s")
                self.param_template[index[id(p)]] = index[id(q)]
                self.param_block[index[id(p)]] = j

    def _count_regions(self, handle) -> None:
        """Mark the checkpoint handle's counts in the events, so that the composed step counts
        the cut blocks' recomputes."""
        region_run, count_forward = handle.count_region_run, handle.count_forward

        def counted_region_run():
            region_run()
            if self.tracker is not None:
                self.tracker.mark(("region_run",))

        def counted_forward(blocks: int = 1):
            count_forward(blocks)
            if self.tracker is not None:
                self.tracker.mark(("forward_runs", blocks))

        handle.count_region_run, handle.count_forward = counted_region_run, counted_forward

    def trained(self, reached: list) -> list:
        """The warm-up's trained parameters with the cut blocks' counterparts of them."""
        ids = {id(p) for p in reached}
        return list(reached) + [self.params[p] for p, q in self.param_template.items() if id(self.params[q]) in ids]

    def stand_in_gradients(self, marks) -> None:
        """Zero gradients for the cut blocks' parameters whose templates got one, marked so that
        `compose` drops them and renames them to the copies' gradients."""
        graded = {e[2] for e in marks.events if e[0] == "grad"}
        marks.mark(("stand_ins",))
        for p, q in self.param_template.items():
            if q in graded and self.params[p].grad is None:   # a loop that zero-fills keeps its gradients
                param = self.params[p]
                param.grad = torch.zeros_like(param)
                marks.mark(("stand_in", marks.number(param.grad), p))
        marks.mark(("stand_ins_end",))


@dataclass
class _LongHeadCut(_Cut):
    """The cut of a step whose events did not compose with the short head: LONG_HEAD_PERIODS kept."""

    head_periods: int = LONG_HEAD_PERIODS


class _Marks:
    """The tracker handed to the step: when backward ends, the cut blocks' stand-in gradients.
    With the events of an optimizer phase known (`_OptimizerPhase`), the step stops as that phase
    begins (`_OptimizerPhaseKnown`), and `spliced` holds the step's events, that phase's put in."""

    def __init__(self, tracker, cut: _Cut, optimizer_phase: Optional[_OptimizerPhase] = None):
        self.tracker, self.cut, self.phase_now = tracker, cut, "forward"
        self.optimizer_phase, self.spliced = optimizer_phase, None

    def __getattr__(self, name: str):
        return getattr(self.tracker, name)

    def phase(self, name: str) -> None:
        if self.phase_now == "backward" and name != "backward":
            self.cut.stand_in_gradients(self.tracker)
        self.phase_now = name
        self.tracker.phase(name)
        if name == "optimizer" and self.optimizer_phase is not None:
            events = list(self.tracker.events)
            self.spliced = self.optimizer_phase.spliced_into(events, self.tracker.live_bytes_by_number())
            if self.spliced is not None:
                raise _OptimizerPhaseKnown


class _OptimizerPhaseKnown(Exception):
    """Raised as a step's optimizer phase begins when its events are known: the step stops there."""


@dataclass
class _OptimizerPhase:
    """A step's optimizer phase (clipping, the optimizer step, zero_grad, the loss released), as a
    first step of a prepared model traced it. It allocates and frees the same in every step of
    that model, whatever the batch's shape (the parameters, their gradients and the optimizer
    state do not change), so a later step stops where it begins and takes these events, with the
    storages they refer to from before the phase renamed to the later step's (`_alive_names`).
    A later step whose storages alive at the phase's start do not line up with the first's runs
    its optimizer phase (`spliced_into` says None)."""

    events: list[tuple]              # from the phase's start to the step's end
    names: dict                      # a storage alive at the phase's start that it refers to -> its name
    first_new: int                   # the first number the phase itself allocated

    @classmethod
    def recorded(cls, events: list[tuple]) -> Optional[_OptimizerPhase]:
        if ("phase", "optimizer") not in events:
            return None
        before = events[:events.index(("phase", "optimizer")) + 1]
        live = {key: entry.nbytes for key, entry in count_events(before).live.items()}
        phase = events[len(before):]
        referred = {e[1] for e in phase if e[0] in ("free", "relabel", "grad")}
        names = {key: name for key, name in _alive_names(before, live).items() if key in referred}
        return cls(phase, names, _next_number(before))

    def spliced_into(self, events: list[tuple], live: dict[int, int]) -> Optional[list[tuple]]:
        """`events` (a later step's, to its optimizer phase's start; `live` its storages alive
        then, number -> bytes) with this phase's events after them; None if they do not line up."""
        theirs = {name: key for key, name in _alive_names(events, live).items()}
        keys = {}
        for key, name in self.names.items():
            keys[key] = theirs.get(name)
            if keys[key] is None:
                return None
        out, next_number = list(events), _next_number(events)
        for e in self.events:
            kind = e[0]
            if kind == "alloc":
                keys[e[1]] = next_number + e[1] - self.first_new
                out.append(("alloc", keys[e[1]], *e[2:]))
            elif kind in ("free", "relabel", "grad"):
                key = keys[e[1]]
                if kind == "free" and key in live:   # the later step's bytes: a loss of another shape, say
                    out.append(("free", key, live[key]))
                else:
                    out.append((kind, key, *e[2:]))
            else:
                out.append(e)
        return out


def _alive_names(events: list[tuple], live: dict[int, int]) -> dict:
    """The storages alive after a step's `events` (`live`: number -> bytes), named alike in every
    step of a prepared model: the start's model state (parameters, gradients a loop keeps,
    optimizer state: counted from the front) by its place; the start's inputs (the batch, a held
    output, a grad scaler's state, whose count and bytes follow the batch's shape) by their place
    from the end, with their bytes; a gradient by its parameter; any other storage the step
    allocated (the loss) by its place among them."""
    start = [e for e in events[:events.index(("start",))] if e[0] == "alloc"]
    state = [e[1] for e in start if e[3] != "activations"]
    inputs = [e[1] for e in start if e[3] == "activations"]
    names = {key: ("state", i) for i, key in enumerate(state)}
    names.update({key: ("input", len(inputs) - i, live.get(key)) for i, key in enumerate(inputs)})
    last_grad = {}
    for e in events:
        if e[0] == "grad":
            last_grad[e[2]] = e[1]
    names.update({key: ("grad", param) for param, key in last_grad.items() if key in live and key not in names})
    others = sorted(key for key in live if key not in names)
    names.update({key: ("other", i) for i, key in enumerate(others)})
    return {key: name for key, name in names.items() if key in live}


def _next_number(events: list[tuple]) -> int:
    return max((e[1] for e in events if e[0] == "alloc"), default=0) + 1


def _skipping_class(cls: type, kept: list) -> type:
    """`cls` whose instances iterate over `kept` only: the model's loop runs the kept blocks,
    while its parameters (`_modules`) stay whole. A model that indexes its blocks, takes a part of
    them (`blocks[:6]`, a skip around the rest) or asks how many there are (to size a buffer, or
    to tell the last one) would see the cut: NotComposable. A slice of them all (`blocks[:]`) is
    the kept blocks."""

    def refuse(self, index):
        if isinstance(index, slice) and index.indices(cls.__len__(self)) == (0, cls.__len__(self), 1):
            return list(kept)
        shown = f"{index.start or ''}:{index.stop or ''}" + (f":{index.step}" if index.step else "") if isinstance(
            index, slice) else index
        what = "takes a part of" if isinstance(index, slice) else "indexes"
        raise NotComposable(f"the model {what} its blocks ({type(self).__name__}[{shown}]), so they cannot be cut")

    def uncounted(self):
        raise NotComposable(f"the model counts its blocks (len of its {type(self).__name__}), so they cannot be cut")

    return type(cls.__name__, (cls,), {"__iter__": lambda self: iter(kept), "__getitem__": refuse,
                                       "__len__": uncounted})


def _plan_stack(blocks: list, modes: list[str], first: int, head_periods: int) -> _Stack:
    """Which of a stack's blocks are cut (module docstring), `head_periods` of its run kept before the cut."""
    stack = _Stack(first, len(blocks), head_periods=head_periods)
    settings = [_settings(b) for b in blocks]
    indices = _index_settings(settings)
    kinds = [_kind(b, m, {k: v for k, v in s.items() if k not in indices}) for b, m, s in zip(blocks, modes, settings)]
    middle = kinds[1:-1]
    period = next((p for p in range(1, LONGEST_PERIOD + 1)
                   if all(middle[i] == middle[i + p] for i in range(len(middle) - p))), None)
    run, unchecked = range(first + 1, first + len(blocks) - 1), 0
    if period is None:   # the longest run of one kind in the middle; its last block borders another kind
        period, start, length, unchecked = 1, 0, 0, 1
        for i in range(len(middle)):
            if i == 0 or middle[i] != middle[i - 1]:
                here = i
            if i + 1 - here > length:
                start, length = here, i + 1 - here
        run = range(first + 1 + start, first + 1 + start + length)
    # Kept: the run's first head_periods periods, then from the first block after a whole number of
    # periods that leaves one block of the run to check (and its last one where it borders
    # another kind); and every block outside the run.
    cut = (len(run) - 1 - unchecked - head_periods * period) // period * period
    if cut <= 0:
        if not unchecked:   # kinds that repeat with a period, in too few blocks
            stack.repeats, stack.blocks_needed = period, (head_periods + 1) * period + 3
        return stack
    stack.period, stack.run = period, run
    head = run.start + head_periods * period
    stack.cut = range(head, head + cut)
    stack.alike = range(stack.cut.stop, run.stop - unchecked)
    return stack


def _kind(block: nn.Module, mode: str, settings: dict) -> tuple:
    """What makes two blocks trace alike: type, parameters and buffers (shapes, dtypes,
    trainable), checkpoint mode, and of the block and each module in it, its hooks (a forward
    hook on one block only) and its `settings` (`_settings`, less those that only number the
    blocks: `_index_settings`). What a block's position changes other than through them is not
    seen here (module docstring)."""
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in block.named_parameters())
    tensors += tuple((name, tuple(t.shape), t.dtype) for name, t in block.named_buffers())
    modules = tuple((name, type(m), tuple(len(hooks) for hooks in _hooks(m))) for name, m in block.named_modules())
    return type(block), mode, tensors, modules, tuple(sorted(settings.items(), key=repr))


def _settings(block: nn.Module) -> dict:
    """(module name, attribute, ...) -> the value of each setting of the block and each module in
    it: its public attributes that are numbers, strings, None, enums, dtypes, devices, functions
    (by their code) or classes (an activation), and those inside its tuples, lists and dicts (keyed
    by place or key).
    Other objects (a config every block shares, a tensor) are left out."""
    found: dict = {}
    for name, module in block.named_modules():
        for key, value in vars(module).items():
            if not key.startswith("_"):
                _add_setting(found, (name, key), value)
    return found


def _add_setting(found: dict, where: tuple, value) -> None:
    if value is None or isinstance(value, (bool, int, float, complex, str, enum.Enum, torch.dtype, torch.device,
                                           types.BuiltinFunctionType, type)):
        found[where] = (type(value), value)   # the type too: 1, 1.0 and True compare equal
    elif isinstance(value, types.FunctionType):   # by its code: a wrapper made per block is one function
        found[where] = (types.FunctionType, value.__code__)
    elif isinstance(value, types.MethodType):
        _add_setting(found, where, value.__func__)
    elif isinstance(value, functools.partial):
        _add_setting(found, (*where, "func"), value.func)
        _add_setting(found, (*where, "args"), value.args)
        _add_setting(found, (*where, "keywords"), value.keywords)
    elif isinstance(value, (tuple, list)):
        found[where] = (type(value), len(value))
        for i, item in enumerate(value):
            _add_setting(found, (*where, i), item)
    elif isinstance(value, dict):
        found[where] = (dict, len(value))
        for key, item in value.items():
            if isinstance(key, (str, int, enum.Enum)):
                _add_setting(found, (*where, key), item)


def _index_settings(settings: list[dict]) -> set:
    """The settings that name or number a stack's blocks, left out of their kinds: a whole number
    that every block has and that is the block's position plus the same number in each
    (transformers' `layer_idx`), and a string that every block has and no two blocks share (peft's
    `target_name`, "model.layers.3.self_attn.q_proj")."""
    def value(found: dict, key, kind: type):
        entry = found.get(key)
        return entry[1] if isinstance(entry, tuple) and entry[0] is kind else None

    if len(settings) < 3:
        return set()
    indices = set()
    for key in settings[0]:
        numbers = [value(s, key, int) for s in settings]
        names = [value(s, key, str) for s in settings]
        if None not in numbers and len({n - j for j, n in enumerate(numbers)}) == 1:
            indices.add(key)
        elif None not in names and len(set(names)) == len(names):
            indices.add(key)
    return indices


def _hooks(module: nn.Module) -> tuple:
    return (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)


# --------------------------------------------------------------------------- composing the events

def compose(events: list[tuple], cut: _Cut) -> list[tuple]:
    """The whole step's events from a shortened step's (module docstring), with storages numbered
    1, 2, ... in the order they are allocated."""
    phases = [e[1] for e in events if e[0] == "phase"]
    passes = len(phases) // 2
    if passes < 1 or phases != ["forward", "backward"] * passes + ["optimizer"]:
        raise NotComposable(f"the step's phases are {', '.join(phases)}, not forward and backward passes, then "
                            "an optimizer step")
    units = _Units(events, cut)
    stand_ins = units.stand_in_names()
    before, after = units.each_block_references(set(stand_ins.values()))
    out = []
    dropping = False
    for i, event in enumerate(events):
        if event[0] == "reads":
            continue
        role, blocks = units.backward_inserts.get(i, (None, ()))
        for j in blocks:
            out += units.copy((role, cut.stack_of[j].template(j)), j, stand_ins)
        if event[0] == "stand_ins":
            dropping = True
        if not dropping:
            out += before.get(i, [])
            out.append(units.rename(i, units.unit_of[i], None, stand_ins))
            out += after.get(i, [])
        if event[0] == "stand_ins_end":
            dropping = False
        role, blocks = units.forward_inserts.get(i, (None, ()))
        for j in blocks:
            out += units.copy((role, cut.stack_of[j].template(j)), j, stand_ins)
    return _numbered(out, units)


class _Units:
    """A shortened step's events split into the kept blocks' units (module docstring)."""

    def __init__(self, events: list[tuple], cut: _Cut):
        self.events, self.cut = events, cut
        self.kept = {s.first: [j for j in range(s.first, s.first + s.length) if j not in s.cut] for s in cut.stacks}
        self.order = {j: k for kept in self.kept.values() for k, j in enumerate(kept)}   # place in the kept order
        self.unit_of: list[Optional[tuple]] = [None] * len(events)
        self.members: dict[tuple, list[int]] = defaultdict(list)   # unit -> its events' indices
        self.allocs: dict[tuple, list] = defaultdict(list)         # unit -> the storages it allocates
        self.owner: dict[object, tuple] = {}                        # storage -> (unit, place among its allocations)
        self.forward_inserts: dict[int, tuple[str, list[int]]] = {}    # event index -> (role, cut blocks)
        self.backward_inserts: dict[int, tuple[str, list[int]]] = {}
        self.roles: list[str] = []   # of the units, pass by pass (`_role`)
        self._split()

    def _next_kept(self, block: int) -> Optional[int]:
        kept = self.kept[self.cut.stack_of[block].first]
        k = self.order[block]
        return kept[k + 1] if k + 1 < len(kept) else None

    def _split(self) -> None:
        phase, unit, depth, entered, passes = "setup", None, 0, defaultdict(int), 0
        fwd, bwd = _role("fwd", 1), _role("bwd", 1)
        forward_exit, backward_marks = {}, defaultdict(list)   # by (pass, block)
        for i, event in enumerate(self.events):
            kind = event[0]
            if kind == "reads":
                if unit is None:
                    self._check_read_outside(event[1])
                continue
            if kind == "phase":
                phase, unit = event[1], None
                if phase == "forward":
                    passes += 1
                    self.roles += [_role("fwd", passes), _role("bwd", passes)]
                fwd, bwd = _role("fwd", passes), _role("bwd", passes)
            elif phase == "forward" and kind == "enter":
                if depth == 0 and unit is None and self._is_first(event[1]):
                    unit = (fwd, event[1])
                if depth == 0 and unit != (fwd, event[1]):
                    raise NotComposable(f"block {event[1]} ran out of its stack's order (the model runs its blocks "
                                        "otherwise than in order through their container: its children(), a "
                                        "list of its own)")
                depth += 1
                entered[event[1]] += 1
            elif phase == "backward" and kind == "backward_block":
                unit = None if event[1] is None else (bwd, event[1])
                backward_marks[(passes, event[1])].append(i)
            self.unit_of[i] = unit
            if unit is not None:
                self.members[unit].append(i)
                if kind == "alloc":
                    self.owner[event[1]] = (unit, len(self.allocs[unit]))
                    self.allocs[unit].append(event[1])
            if phase == "forward" and kind == "exit":
                depth -= 1
                if depth == 0:
                    forward_exit[(passes, event[1])] = i
                    following = self._next_kept(event[1])
                    unit = (fwd, following) if following is not None else None
        for s in self.cut.stacks:
            if not s.cut:
                continue
            for j in self.kept[s.first]:
                if entered[j] != passes:
                    raise NotComposable(f"block {j} ran {entered[j]} times in the forward of {passes} pass(es)")
            for p in range(1, passes + 1):
                bwd = _role("bwd", p)
                self.forward_inserts[forward_exit[(p, s.head_last)]] = (_role("fwd", p), list(s.cut))
                if (bwd, s.template(s.cut.start)) in self.members:
                    if len(backward_marks[(p, s.head_last)]) != 1:
                        raise NotComposable(f"block {s.head_last}'s backward cannot be placed")
                    self.backward_inserts[backward_marks[(p, s.head_last)][0]] = (bwd, list(reversed(s.cut)))
                elif any((bwd, j) in self.members for j in self.kept[s.first] if j != s.first):
                    raise NotComposable("the blocks' backward units differ from their templates'")
        self._find_fixed_references()
        self._check_alike()
        self._check_references_across_runs()

    def _check_read_outside(self, numbers: frozenset) -> None:
        """An op outside the blocks' units that reads the storages of several middle blocks
        (neither the first nor the last of their stack) would read as many as the whole step
        has: NotComposable."""
        blocks = set()
        for number in numbers:
            owner = self.owner.get(number)
            if owner is None:
                continue
            block = owner[0][1]
            stack = self.cut.stack_of[block]
            if block not in (stack.first, stack.first + stack.length - 1):
                blocks.add(block)
        if len(blocks) > 1:
            raise NotComposable(f"an op outside the blocks reads the tensors of blocks {', '.join(map(str, sorted(blocks)))}")

    def _check_references_across_runs(self) -> None:
        """Where a stack is cut inside a run, the blocks after the run follow a block of another
        kind, whose unit cannot show whether their reference to a block before the cut is to a
        storage every block reads (fixed) or to the block at that distance: NotComposable."""
        for s in self.cut.stacks:
            if not s.cut or s.run == range(s.first + 1, s.first + s.length - 1):
                continue
            head_last = self.order[s.head_last]
            for j in range(s.run.stop, s.first + s.length):
                for role in self.roles:
                    for i in self.members.get((role, j), ()):
                        event = self.events[i]
                        if event[0] not in ("free", "relabel", "grad") or i in self.fixed:
                            continue
                        (_, block), _ = self.owner.get(event[1], ((None, None), None))
                        if block is not None and self.cut.stack_of.get(block) is s and self.order[block] <= head_last:
                            raise NotComposable(f"block {j} refers to block {block} across the cut of a run")

    def _check_alike(self) -> None:
        """Each kept middle block after the cut traces as its template: same events, referring
        to storages at the same places of the same neighbours. Else the template is not what the
        cut blocks are (the first blocks' influence reaches it): NotComposable."""
        for s in self.cut.stacks:
            for block in s.alike:
                template = s.template(block)
                for role in self.roles:
                    ours, theirs = self._signature((role, block)), self._signature((role, template))
                    if len(ours) != len(theirs) or not all(map(_alike_runs, _runs(ours), _runs(theirs))):
                        raise NotComposable(f"block {block}'s {_role_words(role)} allocates and frees otherwise than block "
                                            f"{template}'s, whose copies would stand for the blocks cut between them "
                                            "(blocks that differ by their position, not by their modules: a "
                                            "per-block setting the model reads from a list of its own)")

    def _signature(self, unit: tuple) -> list:
        """A unit's events, with the storages they refer to named by owner, relative to the block."""
        here = unit[1]
        signature = []
        for i in self.members.get(unit, ()):
            event = self.events[i]
            if event[0] in ("free", "relabel", "grad"):
                owner = self.owner.get(event[1])
                detail = event[2:] if event[0] != "grad" else ()   # a gradient's parameter is the block's own
                if i in self.fixed:
                    signature.append((event[0], "fixed", event[1], *detail))
                    continue
                if owner is None:   # outside the blocks: a parameter's own gradient a loop keeps, say
                    signature.append((event[0], "outside", *detail))
                    continue
                (role, block), place = owner
                stack = self.cut.stack_of[block]
                if block in (stack.first, stack.first + stack.length - 1):   # an end block: its own layout
                    signature.append((event[0], role, "end", *detail))
                else:
                    signature.append((event[0], role, self.order[block] - self.order[here], place, *detail))
            elif event[0] in ("enter", "exit", "backward_block"):
                signature.append((event[0], None if event[1] is None else self.order.get(event[1], 0) - self.order[here]))
            else:
                signature.append(event[2:] if event[0] == "alloc" else event)
        return signature

    def _find_fixed_references(self) -> None:
        """The references a block's unit makes to the very storage that the same place of the unit
        one period before refers to: a storage all blocks read (a table made once), named as is
        in every copy. The others refer to a storage relative to the block (its input)."""
        self.fixed: set[int] = set()
        for (role, block), members in list(self.members.items()):
            stack = self.cut.stack_of[block]
            kept = self.kept[stack.first]
            k = self.order[block] - stack.period
            before = self.members.get((role, kept[k])) if k >= 0 else None
            if before is None or len(before) != len(members):
                continue
            for i, i_before in zip(members, before):
                event, theirs = self.events[i], self.events[i_before]
                if event[0] in ("free", "relabel", "grad") and theirs[:2] == event[:2]:
                    self.fixed.add(i)

    def _is_first(self, block: int) -> bool:
        return self.cut.stack_of[block].first == block

    def _block_as(self, block: Optional[int], unit: Optional[tuple], as_block: Optional[int]) -> Optional[int]:
        """The block that `block`, seen from `unit` running as `as_block`, stands for."""
        if block is None or unit is None:
            return block
        here = unit[1]
        stack = self.cut.stack_of[here]
        if self.cut.stack_of.get(block) is not stack:
            return block
        target = (here if as_block is None else as_block) + self.order[block] - self.order[here]
        if not stack.first <= target < stack.first + stack.length:
            raise NotComposable(f"block {here} refers to a block beyond its stack")
        return target

    def _storage_as(self, key, unit: Optional[tuple], as_block: Optional[int], fixed: bool = False):
        """The storage that `key`, seen from `unit` running as `as_block`, stands for."""
        owner = self.owner.get(key)
        if owner is None or unit is None or fixed:
            return key
        (role, block), place = owner
        target = self._block_as(block, unit, as_block)
        return self._storage_at((role, target), place)

    def _storage_at(self, unit: tuple, place: int):
        if unit[1] in self.order:   # a kept block: its own storage
            allocs = self.allocs.get(unit, [])
            if place >= len(allocs):
                raise NotComposable(f"block {unit[1]}'s {_role_words(unit[0])} allocates otherwise than the block "
                                    "its copies stand for")
            return allocs[place]
        return ("copy", unit, place)

    def stand_in_names(self) -> dict:
        """Each stand-in gradient's storage -> the copy's gradient it stands for."""
        last_grad = {}
        for e in self.events:
            if e[0] == "grad":
                last_grad[e[2]] = e[1]
            if e[0] == "stand_ins":
                break
        names = {}
        for e in self.events:
            if e[0] != "stand_in":
                continue
            _, key, param = e
            block = self.cut.param_block[param]
            template = self.cut.stack_of[block].template(block)
            theirs = last_grad[self.cut.param_template[param]]
            owner = self.owner.get(theirs)
            if owner is None:
                raise NotComposable(f"block {template}'s gradients are allocated outside its units")
            (role, at), place = owner
            if self.cut.stack_of.get(at) is not self.cut.stack_of[block]:
                raise NotComposable(f"block {template}'s gradients are allocated outside its stack")
            names[key] = self._storage_at((role, self._block_as(at, (role, template), block)), place)
        return names

    def each_block_references(self, named: set) -> tuple[dict, dict]:
        """The events outside the blocks that refer to one storage of every block, in block order
        (autocast's cache of weight casts, released when autocast exits), made for the cut blocks
        too: {event index: the cut blocks' events to put before it}, and after it. Found where a
        block of the head's last period has one and so does the tail's block of its kind (where
        the tail is shorter than a period, the head's block a period before), at least one pair
        with the tail, and the cut blocks' storages are not `named` already (gradients, whose
        stand-ins name them). A cut
        block's events are its template's, block after block, or where the head's and the tail's
        interleave (CPU autocast's cache is a hash map), storage after storage: each of the
        template's storages, then that storage of each cut block it stands for."""
        before, after = defaultdict(list), defaultdict(list)
        for s in self.cut.stacks:
            if not s.cut:
                continue
            # Each block of the head's last period is paired with the tail's block of its kind, or
            # where the tail is shorter than a period, with the head's block a period before.
            end_of = {}   # block -> ("head", "tail" or "before", its place in the period)
            for k in range(s.period):
                head = s.head_last - s.period + 1 + k
                end_of[head] = ("head", k)
                if s.cut.stop + k in s.alike:
                    end_of[s.cut.stop + k] = ("tail", k)
                else:
                    end_of[head - s.period] = ("before", k)
            series: dict[tuple, dict[str, int]] = defaultdict(dict)   # (place in period, role, place) -> {end: event index}
            for i, event in enumerate(self.events):
                if self.unit_of[i] is None and event[0] in ("free", "relabel") and event[1] in self.owner:
                    (role, block), place = self.owner[event[1]]
                    if block in end_of:
                        end, k = end_of[block]
                        series[(k, role, place)][end] = i
            series = {key: at for key, at in series.items()
                      if len(at) == 2 and ("copy", (key[1], s.cut.start + key[0]), key[2]) not in named}
            for number in sorted({_pass_of(key[1]) for key in series}):   # each accumulation pass's own
                self._insert_series(s, {key: at for key, at in series.items() if _pass_of(key[1]) == number},
                                    before, after)
        return before, after

    def _insert_series(self, s: _Stack, series: dict, before: dict, after: dict) -> None:
        """`each_block_references`' insertions for one stack and pass: `series` maps (place in the
        period, role, place) to the event indices of the head's and the tail's (or the block's a
        period before) reference to that storage."""
        tails = sorted(at["tail"] for at in series.values() if "tail" in at)
        if not tails:
            return
        heads = sorted((at["head"], key) for key, at in series.items())
        ascending = tails[0] > heads[0][0]
        blocks = list(s.cut if ascending else reversed(s.cut))

        def copies(i: int, key: tuple, js) -> list[tuple]:
            event, (_, role, place) = self.events[i], key
            return [(event[0], ("copy", (role, j), place), *event[2:]) for j in js]

        def block_by_block() -> list[tuple]:
            return [e for j in blocks for i, key in heads if key[0] == (j - s.cut.start) % s.period
                    for e in copies(i, key, [j])]

        if ascending and heads[-1][0] < tails[0]:       # after the head's last block
            after[heads[-1][0]] += block_by_block()
        elif not ascending and heads[0][0] > tails[-1]:
            before[heads[0][0]] += block_by_block()
        else:                                            # storage by storage
            for i, key in heads:
                (after if ascending else before)[i] += copies(
                    i, key, [j for j in blocks if (j - s.cut.start) % s.period == key[0]])

    def rename(self, i: int, unit: Optional[tuple], as_block: Optional[int], stand_ins: dict) -> tuple:
        """Event `i`, of `unit`, as block `as_block`'s (None: as its own)."""
        event = self.events[i]
        kind = event[0]
        if kind == "alloc":
            if as_block is None:
                return event
            return ("alloc", ("copy", (unit[0], as_block), self.owner[event[1]][1]), *event[2:])
        if kind in ("free", "relabel", "grad"):
            key = stand_ins.get(event[1]) or self._storage_as(event[1], unit, as_block, i in self.fixed)
            return (kind, key, *event[2:])
        if kind in ("enter", "exit", "backward_block"):
            return (kind, self._block_as(event[1], unit, as_block))
        return event

    def copy(self, unit: tuple, as_block: int, stand_ins: dict) -> list[tuple]:
        """The events of `unit` (a template's) as block `as_block`'s."""
        return [self.rename(i, unit, as_block, stand_ins) for i in self.members.get(unit, ())]


def _role(unit: str, number: int) -> str:
    """The role of a block's forward ("fwd") or backward ("bwd") unit in accumulation pass
    `number` (1, 2, ...): "fwd", "bwd" in the first, "fwd2", "bwd2" in the second."""
    return unit if number == 1 else f"{unit}{number}"


def _role_words(role: str) -> str:
    """A unit's `_role` in words: "forward", "backward of pass 2"."""
    words = "forward" if role.startswith("fwd") else "backward"
    return words if _pass_of(role) == 1 else f"{words} of pass {_pass_of(role)}"


def _pass_of(role: str) -> int:
    """The accumulation pass (1, 2, ...) of a unit's `_role`."""
    return int(role[3:] or 1)


def _runs(signature: list) -> list[list]:
    """A unit's signature in runs: each run of frees one run, each other event its own. CPU
    autocast's cache of casts is a hash map keyed by address: clearing it (as a recompute's
    autocast exits) frees the casts in an order that differs from block to block. Frees in a row
    leave the same live bytes in any order and set no peak, and the CUDA allocator's free blocks
    merge to the same layout in any order."""
    runs: list[list] = []
    for event in signature:
        if event[0] == "free" and runs and runs[-1][0][0] == "free":
            runs[-1].append(event)
        else:
            runs.append([event])
    return runs


def _alike_runs(ours: list, theirs: list) -> bool:
    """Two runs of `_runs` alike: event for event in some order."""
    if len(ours) != len(theirs):
        return False
    left = list(theirs)
    for event in ours:
        match = next((k for k, other in enumerate(left) if _alike(event, other)), None)
        if match is None:
            return False
        del left[match]
    return True


def _alike(ours: tuple, theirs: tuple) -> bool:
    """Two events of `_Units._signature` alike: equal, or referring to the same role's storage
    where one of them is an end block's (whose layout is its own)."""
    if ours == theirs:
        return True
    return "end" in (ours[2:3] + theirs[2:3]) and ours[:2] == theirs[:2] and ours[-1:] == theirs[-1:]


def _numbered(events: list[tuple], units: _Units) -> list[tuple]:
    """`events` with their storages numbered 1, 2, ... in the order allocated. A copy's storage
    lives to the end exactly when its template's does, or something outside the blocks refers
    to the cut blocks' storages (all blocks' outputs kept, say): NotComposable."""
    number: dict = {}
    live: set = set()
    out = []
    for e in events:
        if e[0] == "alloc":
            if e[1] in live:
                raise NotComposable("the cut blocks' copies of their template's units allocate a storage twice: the "
                                    "template does not stand for them")
            number[e[1]] = len(number) + 1
            live.add(e[1])
            out.append(("alloc", number[e[1]], *e[2:]))
        elif e[0] in ("free", "relabel", "grad"):
            if e[1] not in live:
                raise NotComposable("the cut blocks' copies of their template's units refer to a storage that is not "
                                    "alive then: the template does not stand for them")
            if e[0] == "free":
                live.remove(e[1])
            out.append((e[0], number[e[1]], *e[2:]))
        else:
            out.append(e)
    for key in live:
        if isinstance(key, tuple):
            (role, block), place = key[1], key[2]
            template = units.cut.stack_of[block].template(block)
            if units.allocs[(role, template)][place] not in live:
                raise NotComposable(f"a storage of block {block}'s {role} unit outlives the step: something "
                                    "outside the blocks refers to every block's tensors")
    return out


def _host_peak(events: list[tuple]) -> int:
    """Pinned host bytes held at the end, from the offload's marks (+ bytes of a copy, - bytes of
    its release), as `HostOffload.peak_bytes` counts them: per block size, the most blocks of it
    in use at once."""
    live: dict[int, int] = defaultdict(int)
    held: dict[int, int] = defaultdict(int)
    for e in events:
        if e[0] == "host":
            size = host_block_bytes(abs(e[1]))
            live[size] += 1 if e[1] > 0 else -1
            held[size] = max(held[size], live[size])
    return sum(size * count for size, count in held.items())


class _MarkedHostOffload(HostOffload):
    """`HostOffload` that marks each copy to the host and its release in the tracked events, so
    that the composed step counts the cut blocks' copies too."""

    tracker = None

    def _pack(self, tensor: torch.Tensor):
        device, host = super()._pack(tensor)
        nbytes = host.numel() * host.element_size()
        if self.tracker is not None and nbytes:   # an empty copy takes no pinned block (`HostOffload`)
            self.tracker.mark(("host", nbytes))
        return device, host

    def _freed(self, nbytes: int) -> None:
        super()._freed(nbytes)
        if self.tracker is not None:
            self.tracker.mark(("host", -nbytes))


__all__ = ["NotComposable", "compose", "composed_memory", "composed_step", "fast_memory"]
