"""Memory probes. The ground truth is `track_memory()`, a live-tensor tracker that works on any
device, CPU included, and reports the peak by category (parameters, frozen_parameters, gradients,
optimizer_state, activations, temporaries); how it counts, and what each category holds: docs/design.md, note
"The live-tensor tracker". Beside it: the CUDA allocator's view (`cuda_allocator_stats`,
`cuda_memory_snapshot`) and an allocator-level count from the profiler (`allocator_peak`,
`profiler_peak_bytes`), which also sees inside compiled graphs.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.records import CATEGORIES, PHASES

_DEVICE_OF = torch.ops.prim.device.default


def fake_device(func, args: tuple):
    """A fake tensor's device where `func` asks for it (prim.device), else None. Autograd's engine
    asks it of the tensors every backward node takes and gives (most of a fake backward's
    dispatches); a dispatch mode above the fake mode answers as the fake mode would (the tensor's
    `device`), without passing the question down the stack of modes."""
    if func is _DEVICE_OF and type(args[0]) is FakeTensor:
        return args[0].device
    return None


@dataclass
class MemoryReport:
    """What one tracked region held. Bytes are storage bytes (a view is not counted twice)."""

    peak_bytes: int                           # high-water mark of live storage bytes
    peak_by_category: dict[str, int]          # breakdown at that moment
    peak_phase: str                           # phase in which the peak happened
    start_bytes: int                          # live bytes when tracking began
    saved_activation_bytes: int | None        # bytes allocated in forward, alive when it ended
    timeline: list[tuple[str, int]] = field(repr=False, default_factory=list)  # (phase, live bytes)
    peak_in_blocks_by_category: dict[str, int] = field(default_factory=dict)  # of which allocated in a block's forward
    peak_block: int | None = None             # the block whose backward held the peak (None: not in one)
    block_calls_in_backward: int = 0          # block calls (module __call__) that ran during backward
    param_bytes: dict[str, int] = field(default_factory=dict)  # `parameter_bytes` of the model tracked
    # With `trace=True`: every storage allocated and freed, in order, as (action, number, bytes),
    # action "alloc" or "free", number the storage's own (`_Storage.allocation`). What existed
    # before the region (parameters, gradients, optimizer state, inputs) comes first, as allocations.
    trace: list[tuple[str, int, int]] | None = field(repr=False, default=None)


@dataclass
class _Entry:
    """One live storage as the counts see it."""

    nbytes: int
    category: str
    phase: str                 # the phase it was allocated in
    order: int                 # its number among the storages allocated, in order
    in_block: bool             # allocated by a block's forward


class LiveCounts:
    """The tracker's counts, kept from its events (`_Tracker.events`), one at a time: a tracked
    step's report is these counts after its events, and a stream of events composed elsewhere
    (`estimate.compose`) is counted by the same rules. Events are tuples:

    ("alloc", key, nbytes, category, in_block), ("free", key, nbytes), ("relabel", key, category),
    ("phase", name), ("start",) (the state before the step is complete), ("enter", block) and
    ("exit", block) (a block's __call__), ("backward_block", block or None). Others are marks for
    whoever reads the events, and are not counted."""

    def __init__(self):
        self.live: dict[object, _Entry] = {}
        self.allocations = 0                  # storages allocated so far
        self.peak_allocation = 0              # the order of the storage that set the peak
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_category = dict(self.by_category)
        self.in_blocks = dict.fromkeys(CATEGORIES, 0)   # by_category's share allocated in blocks
        self.peak_in_blocks = dict(self.in_blocks)
        self.backward_block: int | None = None  # the block whose backward is running
        self.peak_block: int | None = None
        self.block_calls_in_backward = 0
        self.peak_phase = "setup"
        self.phase = "setup"
        self.start_bytes = 0
        self.saved_activation_bytes: int | None = None
        self.timeline: list[tuple[str, int]] = []
        self._apply = {"alloc": self.alloc, "free": self.free, "relabel": self.relabel, "phase": self.set_phase,
                       "start": self.start, "enter": self.enter, "backward_block": self.enter_backward}

    def apply(self, event: tuple) -> None:
        handler = self._apply.get(event[0])
        if handler is not None:
            handler(*event[1:])

    def alloc(self, key, nbytes: int, category: str, in_block: bool) -> None:
        self.allocations += 1
        self.live[key] = _Entry(nbytes, category, self.phase, self.allocations, in_block)
        self.by_category[category] += nbytes
        if in_block:
            self.in_blocks[category] += nbytes
        self.total += nbytes
        if self.phase != "setup":  # what existed before the step is the timeline's starting level
            self.timeline.append((self.phase, self.total))
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_category = dict(self.by_category)
            self.peak_in_blocks = dict(self.in_blocks)
            self.peak_phase = self.phase
            self.peak_allocation = self.allocations
            self.peak_block = self.backward_block if self.phase == "backward" else None

    def relabel(self, key, category: str) -> None:
        """Give a live storage a category that ranks before its own (a temporary that autograd
        saves becomes an activation), in the breakdown at the peak too when it was alive then:
        allocated no later than the storage that set the peak, and not freed since (it is live)."""
        entry = self.live[key]
        if CATEGORIES.index(category) >= CATEGORIES.index(entry.category):
            return
        alive_at_peak = entry.order <= self.peak_allocation
        for counts, applies in ((self.by_category, True), (self.peak_by_category, alive_at_peak),
                                (self.in_blocks, entry.in_block), (self.peak_in_blocks, alive_at_peak and entry.in_block)):
            if applies:
                counts[entry.category] -= entry.nbytes
                counts[category] += entry.nbytes
        entry.category = category

    def free(self, key, nbytes: int) -> None:
        entry = self.live.pop(key)
        self.by_category[entry.category] -= entry.nbytes
        if entry.in_block:
            self.in_blocks[entry.category] -= entry.nbytes
        self.total -= entry.nbytes
        self.timeline.append((self.phase, self.total))

    def set_phase(self, phase: str) -> None:
        if self.phase == "setup":
            self.timeline.append((phase, self.total))
        if self.phase == "forward" and phase != "forward":
            # Whatever forward allocated and is still alive is held for backward.
            held = 0
            for key, entry in self.live.items():
                if entry.phase == "forward":
                    held += entry.nbytes
                    self.relabel(key, "activations")
            self.saved_activation_bytes = held
        self.phase = phase

    def start(self) -> None:
        self.start_bytes = self.total

    def enter(self, block: int) -> None:
        if self.phase == "backward":   # a recompute through the block's __call__, not ckptlab's wrapper
            self.block_calls_in_backward += 1

    def enter_backward(self, block: int | None) -> None:
        self.backward_block = block

    def report(self, events: list[tuple] | None = None) -> MemoryReport:
        """The report of what was counted; with `events` (those counted), its allocator `trace`."""
        return MemoryReport(
            peak_bytes=self.peak,
            peak_by_category=dict(self.peak_by_category),
            peak_phase=self.peak_phase,
            start_bytes=self.start_bytes,
            saved_activation_bytes=self.saved_activation_bytes,
            peak_in_blocks_by_category=dict(self.peak_in_blocks),
            peak_block=self.peak_block,
            block_calls_in_backward=self.block_calls_in_backward,
            timeline=list(self.timeline),
            trace=None if events is None else allocator_trace(events),
        )


def count_events(events: Iterable[tuple]) -> LiveCounts:
    """The counts after `events`, counted from nothing."""
    counts = LiveCounts()
    for event in events:
        counts.apply(event)
    return counts


def allocator_trace(events: Iterable[tuple]) -> list[tuple[str, int, int]]:
    """The allocations and frees among `events`, as `MemoryReport.trace` holds them."""
    return [(e[0], e[1], e[2]) for e in events if e[0] == "alloc" or e[0] == "free"]


@dataclass
class _Storage:
    """One live storage as the tracker sees it."""

    number: int                # its number among the storages seen, in order (its events' key)
    nbytes: int
    ref: weakref.ref           # tells the tracker when it dies


class _Tracker(TorchDispatchMode):
    def __init__(self, device: torch.device | None, detect_backward: bool = False, trace: bool = False):
        super().__init__()
        self.device = device
        self.detect_backward = detect_backward
        self.keep_trace = trace
        self.events: list[tuple] = []          # everything counted, in order (`LiveCounts`)
        self.counts = LiveCounts()
        self.live: dict[int, _Storage] = {}   # by storage key
        self.allocations = 0                  # storages seen so far, numbered in order
        self.block_depth = 0                  # > 0 while a block's forward runs
        self.active = True
        self.reads_outside_blocks = False     # mark what ops outside the blocks read (`MemoryTracker.mark_reads`)

    def emit(self, event: tuple) -> None:
        self.events.append(event)
        self.counts.apply(event)

    @property
    def phase(self) -> str:
        return self.counts.phase

    # -- bookkeeping --------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: str) -> None:
        if not isinstance(tensor, torch.Tensor) or (self.device is not None and tensor.device != self.device):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested tensors have no storage
            return
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None:
            self._relabel(entry, category)
            return
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self.allocations += 1
        self.live[key] = _Storage(self.allocations, nbytes, ref)
        self.emit(("alloc", self.allocations, nbytes, category, self.block_depth > 0))

    def number(self, tensor: torch.Tensor) -> int | None:
        """The number of the live storage that `tensor` views (None: not tracked)."""
        try:
            entry = self.live.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None
        return None if entry is None else entry.number

    def claim(self, tensor: torch.Tensor, category: str) -> None:
        """Label a tensor that may already be counted (as a temporary, say) as `category`, in the
        breakdown at the peak too when its storage was alive then: optimizer state that the
        first `optimizer.step()` creates is optimizer state, not a temporary, at that step's peak."""
        if not isinstance(tensor, torch.Tensor) or (self.device is not None and tensor.device != self.device):
            return
        try:
            entry = self.live.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return
        if entry is None:
            self.track(tensor, category)
            return
        self._relabel(entry, category)

    def _relabel(self, entry: _Storage, category: str) -> None:
        if CATEGORIES.index(category) < CATEGORIES.index(self.counts.live[entry.number].category):
            self.emit(("relabel", entry.number, category))

    def _free(self, key: int) -> None:
        if not self.active:
            return
        entry = self.live.pop(key, None)
        if entry is None:
            return
        self.emit(("free", entry.number, entry.nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = fake_device(func, args)
        if device is not None:
            return device
        # Autograd's engine runs every backward op inside a graph task: a loop ckptlab does not
        # drive (transformers' Trainer) needs no explicit phase("backward") call.
        if self.detect_backward and self.phase == "forward" and torch._C._current_graph_task_id() != -1:
            self.set_phase("backward")
        out = func(*args, **(kwargs or {}))
        if self.active:
            for t in tree_flatten(out)[0]:
                self.track(t, "temporaries")
            if self.reads_outside_blocks and not self.block_depth and self.phase == "forward":
                read = {self.number(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
                read.discard(None)
                if len(read) > 1:
                    self.emit(("reads", frozenset(read)))
        return out

    # -- phases -------------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} is invalid: allowed are {', '.join(PHASES)}")
        self.emit(("phase", phase))

    def report(self) -> MemoryReport:
        return self.counts.report(self.events if self.keep_trace else None)

    # -- blocks -------------------------------------------------------------------------------
    def watch_blocks(self, blocks: Sequence[nn.Module]) -> list:
        """Hooks that tell which storages a block's forward allocates and which block's backward
        is running: a gradient hook on each block's output marks where its backward begins, one
        on the first block's input where the blocks' backward ends. Returns the hook handles."""
        handles = []
        for j, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(functools.partial(self._block_called, j)))
            handles.append(block.register_forward_hook(functools.partial(self._block_returned, j)))
        return handles

    def _block_called(self, j: int, module, args) -> None:
        self.block_depth += 1
        self.emit(("enter", j))
        x = args[0] if args else None
        if j == 0 and self.phase == "forward" and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda grad: self._enter_backward(None))

    def _block_returned(self, j: int, module, args, out) -> None:
        self.block_depth -= 1
        self.emit(("exit", j))
        h = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) and out else None
        if self.phase == "forward" and isinstance(h, torch.Tensor) and h.requires_grad:
            h.register_hook(lambda grad: self._enter_backward(j))

    def _enter_backward(self, j: int | None) -> None:
        self.emit(("backward_block", j))


class MemoryTracker:
    """Handle yielded by `track_memory`: call `phase("backward")` etc. between the parts of a step;
    `report()` after the `with` block."""

    def __init__(self, tracker: _Tracker):
        self._tracker = tracker
        self._report: MemoryReport | None = None

    def phase(self, name: str) -> None:
        self._tracker.set_phase(name)

    def add_inputs(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before the region as activations, as `inputs=` does: a batch that a
        training loop fetched before the step began."""
        for t in tensors:
            self._tracker.track(t, "activations")

    def report(self) -> MemoryReport:
        return self._report if self._report is not None else self._tracker.report()

    def live_bytes_by_number(self) -> dict[int, int]:
        """The storages alive now, by their number in the events: number -> bytes."""
        return {entry.number: entry.nbytes for entry in self._tracker.live.values()}

    def live_bytes(self) -> dict[int, int]:
        """The storages alive now: storage key -> bytes (a key stays the same while it lives)."""
        return {key: entry.nbytes for key, entry in self._tracker.live.items()}

    @property
    def timeline(self) -> list[tuple[str, int]]:
        """(phase, live bytes) after each allocation and free so far, in order."""
        return self._tracker.counts.timeline

    @property
    def events(self) -> list[tuple]:
        """Everything counted so far, in order (`LiveCounts` says what each event is)."""
        return self._tracker.events

    def mark(self, event: tuple) -> None:
        """Add a mark to the events (a tuple whose first item names it; not counted)."""
        self._tracker.emit(event)

    def number(self, tensor: torch.Tensor) -> int | None:
        """The key of the tracked storage `tensor` views in the events (None: not tracked)."""
        return self._tracker.number(tensor)

    def mark_reads(self) -> None:
        """From now on, mark each op of the forward outside the watched blocks (`blocks=`) that
        reads two or more tracked storages: ("reads", their numbers), a mark, not counted."""
        self._tracker.reads_outside_blocks = True


def module_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a model's modules hold besides their parameters: buffers (a causal mask, a
    norm's running statistics, rotary frequencies) and tensors kept as attributes, also inside a
    dict, list or tuple so kept (a cache a forward made, tables by sequence length). They sit on
    the device beside the weights."""
    return [t for module in model.modules()
            for t in (*module._buffers.values(),
                      *(t for name, value in vars(module).items() if not name.startswith("_")
                        for _, t in _tensors_inside(value, (), set())))
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)]


def module_tensors(model: nn.Module) -> dict:
    """Each tensor the model's modules hold, as a parameter, a buffer or an attribute (inside a
    dict, list or tuple too): (module's place, name, place in the container...) -> the tensor."""
    held = {}
    for i, module in enumerate(model.modules()):
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            if isinstance(t, torch.Tensor):
                held[(i, name)] = t
        for name, value in vars(module).items():
            if name not in _MODULE_INTERNALS:
                held.update(_tensors_inside(value, (i, name), set()))
    return held


# What `nn.Module.__init__` sets on every module: its parameters, buffers, children and hooks.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _tensors_inside(value, place: tuple, seen: set):
    """(place, tensor) for `value` if it is a tensor, and for each tensor inside it where it is a
    dict, list or tuple (nested; each container once)."""
    if isinstance(value, torch.Tensor):
        yield place, value
    elif isinstance(value, (dict, list, tuple)) and id(value) not in seen:
        seen.add(id(value))
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from _tensors_inside(item, place + (key,), seen)


@contextlib.contextmanager
def track_memory(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    inputs: Iterable[torch.Tensor] = (),
    device: str | torch.device | None = None,
    detect_backward: bool = False,
    blocks: Sequence[nn.Module] = (),
    trace: bool = False,
):
    """Track live tensor memory over a region (typically one training step).

    Tensors that exist before the region starts (parameters, gradients, the model's buffers and
    tensor attributes (`module_state`), optimizer state, the batch) are counted only if passed
    here; everything created inside is seen. `device` limits
    the count to one device (default: the model's parameters' device). The region starts in phase
    "forward"; call `tracker.phase("backward")` and `tracker.phase("optimizer")` as the step
    proceeds. With `detect_backward=True` the switch from forward to backward happens by itself
    when autograd's engine starts running backward ops (for training loops that cannot call
    `phase`). `blocks` (a model's repeated blocks) adds to the report what of the peak its
    blocks' forwards allocated and which block's backward held the peak. Optimizer state is
    labelled as such at the end, also in the peak's breakdown when the step created it.
    `trace=True` also keeps every allocation and free in order (`MemoryReport.trace`), for an
    allocator to replay; off, the report has none.
    """
    if device is None and model is not None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else None
    tracker = _Tracker(torch.device(device) if device is not None else None, detect_backward, trace)
    params = list(model.parameters()) if model is not None else []
    for p in params:
        tracker.track(p, "parameters" if p.requires_grad else "frozen_parameters")
        if p.grad is not None:
            tracker.track(p.grad, "gradients")
    if optimizer is not None:
        for state in optimizer.state.values():
            for t in tree_flatten(state)[0]:
                tracker.track(t, "optimizer_state")
    for t in module_state(model) if model is not None else ():
        tracker.track(t, "buffers")
    for t in inputs:
        tracker.track(t, "activations")
    # Inputs that the step itself releases (a held output, `probe.step.HeldOutput`) must not be
    # kept alive by this frame.
    inputs = t = None
    tracker.emit(("start",))

    def gradient_ready(index: int, p: torch.Tensor) -> None:
        if p.grad is None:   # autograd gave this parameter an undefined gradient: nothing accumulated
            return
        tracker.track(p.grad, "gradients")
        tracker.emit(("grad", tracker.number(p.grad), index))   # a mark: whose gradient it is

    hooks = [p.register_post_accumulate_grad_hook(functools.partial(gradient_ready, i))
             for i, p in enumerate(params) if p.requires_grad]
    hooks += tracker.watch_blocks(blocks)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if tracker.active:
            tracker.track(t, "activations")
        return t

    handle = MemoryTracker(tracker)
    tracker.set_phase("forward")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
            yield handle
        if optimizer is not None:  # state created during this step is optimizer state
            for state in optimizer.state.values():
                for t in tree_flatten(state)[0]:
                    tracker.claim(t, "optimizer_state")
    finally:
        tracker.active = False
        for h in hooks:
            h.remove()
        handle._report = tracker.report()
        if model is not None:
            handle._report.param_bytes = parameter_bytes(model)
        tracker.live.clear()


def saved_bytes_by_node(loss: torch.Tensor) -> dict[str, int]:
    """What the autograd graph behind `loss` holds for backward, by node: {"AddmmBackward0":
    bytes, ...}, each storage once, under the first node that holds it walking back from the loss.
    Call it after forward, before backward frees what it holds. Real and fake tensors alike, so a
    CUDA step and its CPU prediction can be held side by side op by op: where the kernels differ,
    the node names differ (a CPU attention node against a CUDA one)."""
    by_node: dict[str, int] = {}
    seen, done = set(), set()
    todo = collections.deque([loss.grad_fn])
    while todo:
        node = todo.popleft()
        if node is None or node in done:
            continue
        done.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
                    seen.add(t.untyped_storage()._cdata)
                    by_node[node.name()] = by_node.get(node.name(), 0) + t.untyped_storage().nbytes()
        todo.extend(f for f, _ in node.next_functions)
    return by_node


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """{"trainable_param_bytes": ..., "frozen_param_bytes": ...}: storage bytes of the model's
    parameters that train and that do not (a storage shared by both counts as trainable)."""
    storages: dict[int, tuple[int, bool]] = {}
    for p in model.parameters():
        key = p.untyped_storage()._cdata
        nbytes, trains = storages.get(key, (p.untyped_storage().nbytes(), False))
        storages[key] = (nbytes, trains or p.requires_grad)
    trainable = sum(n for n, trains in storages.values() if trains)
    frozen = sum(n for n, trains in storages.values() if not trains)
    return {"trainable_param_bytes": trainable, "frozen_param_bytes": frozen}


# --------------------------------------------------------------------------- independent counts

def allocator_peak(run: Callable[[object], object], device: torch.device | str = "cpu",
                   start_bytes: int = 0) -> tuple[MemoryReport, object]:
    """One call of `run(marks)` measured by the allocator rather than by tensors: CUDA's peak
    counters, or on CPU the profiler's raw `[memory]` events (each allocation and free, with its
    size and time) — which also see allocations inside compiled graphs that a dispatch-mode tracker
    cannot. `run` may call `marks.phase("backward")` where backward starts (a training step's
    tracker protocol). Returns (MemoryReport, what run returned): peak = `start_bytes` (what was
    held when it began) + the high-water mark above it; `saved_activation_bytes` = bytes allocated
    and still held when backward began."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        marks = _CudaMarks(dev, torch.cuda.memory_allocated(dev))
        torch.cuda.reset_peak_memory_stats(dev)
        result = run(marks)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - marks.base
        return MemoryReport(start_bytes + peak, {}, "unknown", start_bytes, marks.at_backward), result
    with _cpu_profiler() as prof:
        result = run(_ProfilerMarks())
    # The raw allocator records (signed bytes, timestamps): the aggregated FunctionEvents net
    # out allocations freed inside one op, which would hide transient peaks.
    events = list(prof.profiler.kineto_results.events())
    allocs = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    backward_at = next((e.start_ns() for e in events if e.name() == "ckptlab::backward"), None)
    current = peak = 0
    at_backward, peak_phase, timeline = None, "forward", []
    for t, nbytes in allocs:
        if at_backward is None and backward_at is not None and t >= backward_at:
            at_backward = current
        current += nbytes
        phase = "forward" if at_backward is None else "backward"
        timeline.append((phase, start_bytes + current))
        if current > peak:
            peak, peak_phase = current, phase
    return MemoryReport(start_bytes + peak, {}, peak_phase, start_bytes, at_backward, timeline), result


# What the profiler's C++ side (Kineto) writes to the process's stderr at every start and stop,
# whatever KINETO_LOG_LEVEL says: `USDT: ... profiler_start` and `USDT: ... profiler_stop`.
KINETO_LOG_PREFIXES = ("USDT:",)


@contextlib.contextmanager
def _cpu_profiler():
    """The CPU profiler with allocator events, started and stopped without Kineto's log lines
    reaching the terminal: the step itself runs with stderr untouched."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_log_dropped():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _native_log_dropped():
            prof.__exit__(None, None, None)


@contextlib.contextmanager
def _native_log_dropped():
    """While inside, what native code writes to file descriptor 2 goes to a temporary file;
    afterwards every line but Kineto's log lines is written on to stderr, so no error is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(KINETO_LOG_PREFIXES)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def profiler_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU bytes allocated by `fn` above what was allocated when it started, from the
    profiler's allocator events: an independent count to hold the live-tensor tracker against."""
    return allocator_peak(lambda marks: fn(), "cpu")[0].peak_bytes


class _ProfilerMarks:
    def phase(self, name):
        with record_function(f"ckptlab::{name}"):
            pass


class _CudaMarks:
    def __init__(self, dev, base):
        self.dev, self.base, self.at_backward = dev, base, None

    def phase(self, name):
        if name == "backward" and self.at_backward is None:
            self.at_backward = torch.cuda.memory_allocated(self.dev) - self.base


# --------------------------------------------------------------------------- CUDA allocator

def cuda_allocator_stats(device: torch.device | str) -> dict[str, int]:
    """The caching allocator's view since the last `torch.cuda.reset_peak_memory_stats`."""
    stats = torch.cuda.memory_stats(device)
    return {
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "cuda_max_requested_bytes": stats.get("requested_bytes.all.peak"),
        "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "cuda_alloc_retries": stats.get("num_alloc_retries", 0),
        "cuda_ooms": stats.get("num_ooms", 0),
    }


@contextlib.contextmanager
def cuda_memory_snapshot(path: str, max_entries: int = 100_000):
    """Record allocator history inside the block and write a snapshot pickle to `path`, for
    https://pytorch.org/memory_viz."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_memory_snapshot needs a CUDA device; none is available")
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield path
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)


