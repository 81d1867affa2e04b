"""The training step `measure` runs, under FakeTensorMode: shapes, dtypes and storage sizes with
no data, so a step's memory can be tracked for shapes far beyond this machine.

Where a library decides from tensor data what to allocate, a fake step cannot read the data and
the library takes its cautious branch, which the real step does not. Two such decisions are
known here. A grad scaler reads whether the gradients hold an inf before it steps the optimizer:
a prediction is of a healthy step, which steps (`assume_finite_gradients`). And transformers
reads `position_ids` to detect several sequences packed into one row, and a padding mask (one a
model makes of ones where it is given none, as BART's decoder does) to decide whether SDPA may
apply causality itself; unable to read fake ones it assumes packing or padding and builds a
(batch, 1, seq, seq) attention mask that the real step never builds (and on CUDA, with a mask,
another attention kernel than flash). A prediction therefore takes the answers the real checks
give for ckptlab's batches: one sequence per row, no padding (`sequences_unpacked`).

For `device="cuda"` the step runs under CUDA's semantics (`cuda_semantics`: the kernels CUDA
would pick and what they save and allocate; `cuda_autocast`: CUDA autocast's op lists; the
optimizer implementation torch picks on CUDA), the tracker keeps every allocation in order, and
`cuda_device` adds the cuBLAS workspaces and replays the trace through the caching allocator.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import sys
import types
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeCopyMode,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_flatten

from ..checkpoint.blocks import CheckpointHandle
from ..checkpoint.wrap import apply_checkpointing
from ..core.cards import Card
from ..core.cards import card as find_card
from ..core.loop import Loop, as_loop
from ..core.policy import Policy, step_policy
from ..core.records import CATEGORIES
from ..core.units import format_bytes
from ..probe.memory import MemoryReport, count_events, module_tensors, track_memory
from ..probe.step import make_optimizer, training_step, with_dtype
from ..workloads.base import Workload
from ..workloads.specs import one_line
from . import micro_steps
from .cuda_autocast import cuda_autocast
from .cuda_device import DEFAULT_ARCH, BlasUse, DeviceMemory, HostOffload, LoopOrder, device_memory, parse_alloc_conf
from .cuda_semantics import KERNEL_FUNCTIONS, SM_COUNTS, cuda_semantics
from .fake_mode import new_fake_mode
from .kernel_outputs import kernel_outputs
from .torch_versions import torch_rules


@dataclass
class Prediction:
    """A predicted training step. Bytes are storage bytes, as `measure` reports them."""

    model: str
    batch_size: int
    seq_len: int
    policy: str
    dtype: str
    loop: Loop                           # the training loop (`core.loop`)
    n_blocks: int
    effective_density: float
    peak_bytes: int
    peak_by_category: dict
    peak_phase: str
    saved_activation_bytes: int
    predict_s: float                     # wall time of the prediction
    plan: Optional[str] = None           # the per-block plan a budget policy resolved to
    note: str = ""
    peak_in_blocks_by_category: dict = field(default_factory=dict)  # of the peak: allocated by blocks' forwards
    peak_block: Optional[int] = None     # the block whose backward held the peak (None: not in one)
    recompute_count: int = 0             # block forwards the policy's checkpoints ran again in backward
    block_calls_in_backward: int = 0     # blocks called in backward: the model recomputes them itself
    trainable_param_bytes: int = 0       # as measure's columns of the same names
    frozen_param_bytes: int = 0
    # The device the step is predicted for. On "cpu" the peak is exact to the byte and the CUDA
    # fields are None. On "cuda", peak_bytes is max_memory_allocated's peak (the allocator's
    # rounding and the cuBLAS workspaces included), peak_by_category adds workspaces, rounding
    # and fragmentation (reserved - allocated), and with a card: device_bytes = reserved + the
    # card's context, margin_bytes = core.cards.margin_left (usable - required margin - device
    # bytes). The CUDA peaks are each the worse of a loop's first two steps (`worse_step`: the one
    # that reached the reserved peak, 1 or 2),
    # and `fit` is core.cards.fit_answer ("yes", "with cache flushes", "no"), with the flushes
    # per step when the reserved peak exceeds the card (`cache_flushes`). `alloc_conf` is the
    # PYTORCH_CUDA_ALLOC_CONF the allocator is replayed with (`cuda_device.parse_alloc_conf`).
    device: str = "cpu"
    card: Optional[str] = None
    attention: Optional[str] = None          # the SDPA backend asked for (None: PyTorch's choice)
    attention_backend: Optional[str] = None  # the one chosen
    reserved_bytes: Optional[int] = None
    device_bytes: Optional[int] = None
    margin_bytes: Optional[int] = None
    host_bytes: Optional[int] = None         # offload on CUDA: pinned host memory at its peak
    torch_version: Optional[str] = None      # on "cuda": the torch release whose rules it follows
    fit: Optional[str] = None                # on a card: "yes", "with cache flushes" or "no"
    cache_flushes: Optional[int] = None      # on a card that the reserved peak passes, where it runs: per step
    worse_step: Optional[int] = None         # on "cuda": the loop's step (1, 2) that reached the reserved peak
    alloc_conf: Optional[str] = None         # on "cuda": PYTORCH_CUDA_ALLOC_CONF as replayed (None: default)
    trace: str = "full"                      # which trace answered: "composed", or "full" (why, if fast was asked)
    answered_from_cache: bool = False        # taken from the predictions kept on disk (`estimate.answers`)

    @property
    def held_bytes(self) -> int:
        """What the prediction holds of the device it is for: on a card its device bytes, else the peak."""
        return self.device_bytes if self.card is not None else self.peak_bytes

    def record(self) -> dict:
        """A flat row, columns named like `measure`'s with a `predicted_` prefix."""
        row = {k: v for k, v in asdict(self).items()
               if k not in ("loop", "peak_by_category", "peak_in_blocks_by_category")}
        row.update(self.loop.record())
        for key in ("peak_bytes", "saved_activation_bytes", "reserved_bytes", "device_bytes"):
            row[f"predicted_{key}"] = row.pop(key)
        for c in CATEGORIES:
            row[f"predicted_peak_{c}_bytes"] = self.peak_by_category.get(c, 0)
        for c in DEVICE_CATEGORIES:
            row[f"predicted_peak_{c}_bytes"] = self.peak_by_category.get(c)
        row["predicted_peak_activations_in_blocks_bytes"] = self.peak_in_blocks_by_category.get("activations", 0)
        return row

    def __str__(self) -> str:
        text = (f"{self.model} b={self.batch_size} s={self.seq_len} {self.policy} ({self.dtype}, loop {self.loop}): "
                f"peak {format_bytes(self.peak_bytes)} in {self.peak_phase}, saved activations "
                f"{format_bytes(self.saved_activation_bytes)}")
        if self.device == "cuda":
            text += (f"; reserved {format_bytes(self.reserved_bytes)}, attention {self.attention_backend}"
                     f" (torch {self.torch_version})")
        if self.card is not None:
            text += (f"; device {format_bytes(self.device_bytes)}, margin {format_bytes(self.margin_bytes)}: "
                     f"predicted for {self.card}; {self.fit_reason}")
        return text + f" [{self.predict_s:.1f} s]"

    @property
    def fit_reason(self) -> str:
        """On a card, the answer `fit` with the numbers that give it ("" elsewhere)."""
        if self.card is None:
            return ""
        context = self.device_bytes - self.reserved_bytes
        step = "first" if self.worse_step == 1 else "second"
        reserved = (f"reserved {format_bytes(self.reserved_bytes)} (reached in the loop's {step} step) + context "
                    f"{format_bytes(context)} = device {format_bytes(self.device_bytes)}")
        if self.fit == "yes":
            return f"fits: {reserved}, {format_bytes(self.margin_bytes)} left beyond the card's margin"
        over = format_bytes(-self.margin_bytes)
        if self.fit == "with cache flushes":
            return (f"fits with cache flushes: {reserved} exceeds the card less its margin by {over}, but allocated "
                    f"{format_bytes(self.peak_bytes)} does not; releasing its cached segments and retrying, the "
                    f"allocator runs the step ({self.cache_flushes} cache flush(es) per step, each a synchronizing "
                    "cudaFree)")
        return (f"does not fit: {reserved} exceeds the card less its margin by {over}, and with its cached segments "
                f"released the allocator still runs out of memory (allocated {format_bytes(self.peak_bytes)})")


# What a CUDA prediction's peak_by_category adds to the tensors' categories: the sum of all but
# fragmentation is peak_bytes (allocated), the sum of all is reserved_bytes.
DEVICE_CATEGORIES = ("workspaces", "rounding", "fragmentation")
DEVICES = ("cpu", "cuda")


def fake_model(workload: Workload, fake_mode: FakeTensorMode) -> nn.Module:
    """The workload's model with fake tensors in `fake_mode`, seeded as `Workload.build` seeds it.

    Built under the fake mode (nothing allocated); casts (`.to(dtype)`, `.half()`) and wrappers
    that move weights (peft's `get_peft_model`) work as on real tensors (`castable`). A model
    whose construction reads tensor data (`.item()` on a schedule, a data-dependent shape) cannot
    be built so: it is then built for real on the CPU (its parameters' host memory, once) and
    converted to fake tensors, with a warning saying so. Any other failure is a ValueError
    naming it: such a model can be measured, not predicted."""
    try:
        with fake_mode, castable(fake_mode):
            torch.manual_seed(workload.seed)
            return workload.new_model()
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        warnings.warn(f"model={workload.label!r} reads tensor data while it is built ({type(exc).__name__}: "
                      f"{exc}), so it cannot be built under fake tensors: building it for real on the CPU and "
                      "converting it to fake tensors (uses its parameters' host memory once)",
                      RuntimeWarning, stacklevel=3)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"model={workload.label!r} cannot be predicted: building it on fake tensors failed with "
                         f"{type(exc).__name__}: {one_line(exc)}; measure it instead (ckptlab measure)") from exc
    torch.manual_seed(workload.seed)
    try:
        real = workload.new_model()
    except Exception as exc:
        raise ValueError(f"model={workload.label!r} cannot be predicted: it cannot be built under fake tensors, "
                         f"and building it for real failed with {type(exc).__name__}: {exc}") from exc
    with FakeCopyMode(fake_mode):
        return copy.deepcopy(real)


def built_model(workload: Workload) -> tuple[FakeTensorMode, nn.Module]:
    """A fake mode and the workload's model in it (`fake_model`), built once and copied for each
    later call (the last BUILT_KEPT workloads): the policies and loops of one model each step
    their own copy, and a copy costs a fraction of a build (a 7B LoRA model: 0.1 s, not 0.5 s).
    The copies share the build's fake mode, as tensors of different fake modes cannot meet. A
    model whose functions refer to itself (`refers_to_itself`) is built anew for each call: a
    copy's hooks would act on the build."""
    mode, model, copies_refer_to_it = _build(workload)
    if copies_refer_to_it:
        return mode, fake_model(workload, mode)
    with FakeCopyMode(mode), castable(mode):
        return mode, copy.deepcopy(model)


def refers_to_itself(model: nn.Module) -> bool:
    """Whether a function the model keeps (a hook of a module or tensor, a function attribute)
    refers to one of the model's modules, tensors or the lists, dicts and sets they hold, through
    its closure or defaults: `copy.deepcopy` keeps a function as it is, so a copy's hook (a lambda
    that appends a statistic to `self.stats`, say) would act on the original. Bound methods and
    `functools.partial` are copied with their objects."""
    own = set()
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        own.add(id(module))
        own.update(id(v) for v in vars(module).values() if isinstance(v, (list, dict, set, torch.Tensor)))
    own.update(id(t) for t in tensors)
    functions = [v for module in model.modules() for v in vars(module).values() if isinstance(v, types.FunctionType)]
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                      module._backward_hooks):
            functions += hooks.values()
    for t in tensors:
        for hooks in (getattr(t, "_backward_hooks", None), getattr(t, "_post_accumulate_grad_hooks", None)):
            functions += (hooks or {}).values()
    for fn in functions:
        if not isinstance(fn, types.FunctionType):
            continue
        held = [c.cell_contents for c in fn.__closure__ or () if c.cell_contents is not None]
        held += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        if any(id(v) in own for v in held):
            return True
    return False


def parameter_count(workload: Workload) -> int:
    """The workload's parameters, counted on the model a prediction built under fake tensors where
    one is kept (`built_model`), else on a build on the meta device (`Workload.n_params`: a 7B
    LoRA model's build there costs a third of a second)."""
    built = _BUILT.get(workload_key(workload))
    model = built[2] if built is not None else None
    return sum(p.numel() for p in model.parameters()) if model is not None else workload.n_params


def model_as_built(workload: Workload) -> nn.Module:
    """The workload's model as `built_model` built it, not a copy: to read (its blocks, say), never to change."""
    return _build(workload)[1]


def _build(workload: Workload) -> tuple[FakeTensorMode, nn.Module, bool]:
    """The workload's fake mode, its model as built, and whether that model refers to itself."""
    key = workload_key(workload)
    if key not in _BUILT:
        mode = new_fake_mode()
        model = fake_model(workload, mode)
        _BUILT[key] = (workload, mode, model, refers_to_itself(model))   # the workload kept alive: an object's key is its id
        while len(_BUILT) > BUILT_KEPT:
            _BUILT.popitem(last=False)
    _BUILT.move_to_end(key)
    return _BUILT[key][1:]


# Models built under fake tensors, by workload, the most recently used last (`built_model`).
_BUILT: OrderedDict = OrderedDict()
BUILT_KEPT = 2


@contextlib.contextmanager
def castable(fake_mode: FakeTensorMode):
    """While inside, a module built in `fake_mode` can be cast and moved (`.to(torch.bfloat16)`,
    `.half()`, peft moving its adapters with `.to()`). `Module._apply` replaces a fake parameter
    by swapping it with its cast (`torch.utils.swap_tensors`), which refuses a tensor that a weak
    reference points to, and the fake mode's converter keeps one to every tensor it makes. Inside,
    its memo holds them strongly instead (fake tensors own no memory); the weak memo is put back
    on the way out."""
    converter = fake_mode.fake_tensor_converter.meta_converter
    weak = converter.tensor_memo
    converter.tensor_memo = dict(weak)
    try:
        yield
    finally:
        converter.tensor_memo = weak


@contextlib.contextmanager
def sequences_unpacked():
    """While inside, transformers' checks that read a batch's masks answer as they do for ckptlab's
    batches: one sequence per row, no padding (see the module docstring). Its packed-sequence
    detection answers None without reading `position_ids`; its checks whether SDPA may skip a
    causal or bidirectional mask, or a recurrent layer its mask, take a fake padding mask (one a
    model makes of ones where it is given none: BART's decoder) as no padding, which a real one
    of ones is, instead of building the mask the real step never builds. Nothing is imported:
    without transformers loaded there is nothing to answer for."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return

    def unpadded(check: Callable) -> Callable:
        def answer(mask, *args, **kwargs):
            return check(None if is_fake(mask) else mask, *args, **kwargs)
        return answer

    patched = {"find_packed_sequence_indices": lambda position_ids: None}
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "create_recurrent_attention_mask"):
        if hasattr(masking, name):
            patched[name] = unpadded(getattr(masking, name))
    originals = {name: getattr(masking, name) for name in patched}
    for name, value in patched.items():
        setattr(masking, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(masking, name, value)


@contextlib.contextmanager
def fake_training_step(workload: Workload, batch_size: int, seq_len: int, policy: Policy,
                       dtype: str = "fp32", loop: Loop | str | None = None, device: str = "cpu",
                       card: Optional[str | Card] = None, attention: Optional[str] = None, *,
                       torch_version: Optional[str] = None):
    """Build the model, batch and optimizer under FakeTensorMode and yield (model, handle, batch,
    optimizer, step) after one untracked warm-up step — the state `measure` tracks from. With
    device="cuda" the step runs as on `card`'s architecture (default sm80) under the rules of
    `torch_version` (default: the installed torch's), `attention` forcing the SDPA backend;
    `loop` as `probe.step.training_step`'s."""
    prepared = PreparedStep(workload, policy, dtype, as_loop(loop), device)
    with prepared.at(batch_size, seq_len, card, attention, torch_version=torch_version) as (model, handle, batch, opt, step, _):
        yield model, handle, batch, opt, step


class PreparedStep:
    """A prediction's model, built once under fake tensors with its policy applied, and its
    optimizer, to be stepped at any batch size and sequence length, and on "cuda" for any card,
    attention backend and torch version (`at`): what a prediction costs beyond the step itself is
    paid once per model, policy and loop, not once per shape or card.

    With `host`, offload moves saved tensors to it as on CUDA. `cut`, if given, shortens the
    model once the policy is applied (`compose`: `cut.shorten(model, handle)` may change which
    blocks run, and returns what the warm-up's trained parameters become). A cut that refuses the
    model raises its `Refusal` before it changes anything: the step then runs whole (`cut` None),
    and `refusal` keeps why.

    The first `at` warms the model up (`warm_up`: the state a first training step leaves). That
    state does not depend on the batch's shape nor on the kernels the step runs (parameters, the
    optimizer state, a grad scaler's scalars, gradients a loop zero-fills), except a held output:
    a later `at` swaps the batch, and for a loop that holds its output runs the forward at the
    new shape, whose output replaces the held one as in a warm-up. Its optimizer state and kept
    gradients do not depend on the policy either: given `warm` (the `WarmState` of another
    policy's step of the same model, dtype, loop, device and path), the warm-up makes that state
    instead of stepping the optimizer. A model whose forward leaves
    tensors on its modules (a table sized by the sequence, made on the first call: `state_made`)
    is in the state of the shape it was warmed up at, so `prepared_step` prepares it again for
    another shape. tests/test_fast_path.py checks that a reused step predicts what a fresh one
    does, to the byte."""

    def __init__(self, workload: Workload, policy: Policy, dtype: str, loop: Loop, device: str,
                 host: Optional[HostOffload] = None, *, cut=None, warm: Optional["WarmState"] = None):
        self.device, self.dtype, self.loop, self.host, self.cut = device, dtype, loop, host, cut
        self.refusal: Optional[Exception] = None
        self.warmed_at: Optional[tuple[int, int]] = None   # the (batch, seq) the warm-up ran at
        self.state_made = False                             # its forward left tensors on the model's modules
        self.warm, self.warm_state = warm, None             # taken, and left (`WarmState.of`), by the first `at`
        self.workload = with_dtype(workload, dtype)
        self.fake_mode, self.model = built_model(self.workload)  # as Workload.build, minus the device move
        self.built_params = list(self.model.parameters())   # in the build's order, before the policy wraps blocks
        self.step = None
        with self.fake_mode, sequences_unpacked():
            self.model.train()
            self.handle = apply_checkpointing(self.model, policy, offload_hooks=host.hooks if host else None)
            self.trained = None
            if cut is not None:
                try:
                    self.trained = cut.shorten(self.model, self.handle)
                except cut.Refusal as why:
                    self.cut, self.refusal = None, why
            self.opt = make_optimizer(loop, self.model, device)

    @contextlib.contextmanager
    def at(self, batch_size: int, seq_len: int, card: Optional[str | Card] = None, attention: Optional[str] = None, *,
           torch_version: Optional[str] = None):
        """Inside the fake mode (and on "cuda" CUDA's semantics for `card`'s architecture, default
        sm80, `attention` and `torch_version`, as `fake_training_step`'s), the state a tracked step
        starts from at this shape: yields (model, handle, batch, optimizer, step, kernels), kernels
        the CUDA semantics (None on "cpu")."""
        semantics = None
        if self.device == "cuda":
            arch, sm_count = kernels_of(as_card(card))
            semantics = cuda_semantics(arch, attention, sm_count, torch_version=torch_version)
        with self.fake_mode, kernel_outputs(self.fake_mode, cuda=self.device == "cuda"), sequences_unpacked(), \
                semantics or contextlib.nullcontext() as kernels:
            gen = torch.Generator().manual_seed(self.workload.seed + 1)
            batch = self.workload.new_batch(batch_size, seq_len, gen)
            if self.step is None:
                self.step = training_step(self.model, self.workload, batch, self.opt, self.dtype, self.loop,
                                          cuda_autocast if self.device == "cuda" else None)
                if self.step.scaler is not None:
                    assume_finite_gradients(self.step.scaler)
                torch.manual_seed(self.workload.seed)
                before = module_tensors(self.model)
                taken = warm_up(self.step, self.model, self.opt, self.trained,
                                functools.partial(self.warm.give, self.built_params, self.opt)
                                if self.warm is not None and self.step.scaler is None else None)
                self.state_made = _changed(before, module_tensors(self.model))
                before = None   # this frame lives while the step runs: it must not hold the model's tensors
                if self.step.scaler is None:
                    self.warm_state = self.warm if taken else WarmState.of(self.built_params, self.opt)
                self.warm = None
                self.warmed_at = (batch_size, seq_len)
                if self.cut is not None and self.state_made:
                    self.refusal = self.cut.Refusal("the model's forward leaves tensors on its modules (a cache made "
                                                    "on its first call), which the cut blocks never make")
                    raise self.refusal
            else:
                self.step.batch = batch
                if self.loop.holds_output:
                    self.step.forward_loss()   # its output is held, the last one released
            self.handle.reset_counts()
            yield self.model, self.handle, batch, self.opt, self.step, kernels


def _changed(before: dict, after: dict) -> bool:
    """Whether the tensors a model holds (`module_tensors`) changed from `before` to `after`."""
    return after.keys() != before.keys() or any(after[k] is not t for k, t in before.items())


@dataclass
class WarmState:
    """What a warm-up left, by the place of each parameter in the model's build: the optimizer's
    state and the gradients a loop keeps (zero_grad="zeros"), each tensor as (shape, stride,
    dtype, device). Another policy's step of the same model, dtype, loop, device and path (the
    fast path's cut or the full trace) starts from the same state (the policy wraps blocks; it
    does not change which parameters train), so its warm-up makes this one (`give`) instead of
    stepping the optimizer; it still runs its forward, as what a model keeps on its modules can
    depend on the policy. tests/test_fast_path.py checks that such a step predicts what a
    warmed-up one does, to the byte."""

    state: list[tuple[int, dict]]        # (parameter's place, its optimizer state), in the optimizer's order
    grads: list[tuple[int, "_Layout"]]   # (parameter's place, its gradient's layout)

    @staticmethod
    def of(params: list[torch.Tensor], opt) -> Optional["WarmState"]:
        """The state now held; None where a tensor in it is not a whole storage of its own, or sits
        inside another value (it could not be made alike from its layout)."""
        place = {id(p): i for i, p in enumerate(params)}
        state = []
        for p in (p for group in (opt.param_groups if opt is not None else ()) for p in group["params"]):
            if p not in opt.state:
                continue
            entries = _state_layouts(opt.state[p])
            if entries is None:
                return None
            state.append((place[id(p)], entries))
        grads = [(i, _layout(p.grad)) for i, p in enumerate(params) if p.grad is not None]
        if any(layout is None for _, layout in grads):
            return None
        return WarmState(state, grads)

    def give(self, params: list[torch.Tensor], opt) -> None:
        """Make this state on `params` (the same build's, in its order) and `opt`, inside the fake
        mode; in `opt`'s order of its parameters, as its first step would."""
        state = dict(self.state)
        by_place = {id(p): i for i, p in enumerate(params)}
        for p in (p for group in (opt.param_groups if opt is not None else ()) for p in group["params"]):
            entries = state.get(by_place[id(p)])
            if entries is not None:
                opt.state[p] = _made(entries)
        for i, layout in self.grads:
            params[i].grad = layout.make()


def _state_layouts(entries: dict) -> Optional[dict]:
    """A parameter's optimizer state with each tensor as its layout, each other value copied;
    None where a tensor cannot be made alike from its layout (`_layout`) or sits inside another value."""
    out = {}
    for key, value in entries.items():
        if isinstance(value, torch.Tensor):
            out[key] = _layout(value)
            if out[key] is None:
                return None
        elif any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0]):
            return None
        else:
            out[key] = copy.deepcopy(value)
    return out


def _made(entries: dict) -> dict:
    """A parameter's optimizer state made from `_state_layouts`' (inside the fake mode)."""
    return {key: value.make() if isinstance(value, _Layout) else copy.deepcopy(value) for key, value in entries.items()}


@dataclass(frozen=True)
class _Layout:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    value: Optional[float | int] = None   # a fake scalar's known value (an optimizer's step count, read by `.item()`)

    def make(self) -> torch.Tensor:
        if self.value is not None:
            return torch.tensor(self.value, dtype=self.dtype, device=self.device)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


def _layout(tensor: torch.Tensor) -> Optional[_Layout]:
    """A tensor's layout, where it is the whole of its storage (else None)."""
    constant = getattr(tensor, "constant", None)
    if constant is not None:
        with unset_fake_temporarily():
            constant = constant.item() if constant.numel() == 1 else None
        if constant is None:
            return None
    layout = _Layout(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, constant)
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != _dense_nbytes(layout):
        return None
    return layout


def _dense_nbytes(layout: _Layout) -> int:
    if any(n == 0 for n in layout.shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(layout.shape, layout.stride))) * layout.dtype.itemsize


# Prepared steps kept for reuse, the most recently used last: a table of predictions (a search
# over batch sizes, a widget's changes) steps one model at many shapes. Eight hold `explain`'s:
# its levers prepare up to nine (policies, loops, dtypes), then its floor plan's profile asks
# for three of the first again. A prepared 7B LoRA model with a traced step held 7 MiB (RSS).
_PREPARED: OrderedDict = OrderedDict()
PREPARED_KEPT = 8


def prepared_step(workload: Workload, policy: Policy, dtype: str, loop: Loop, device: str, shape: tuple[int, int], *,
                  host_type: Optional[type] = None, cut_type: Optional[type] = None) -> PreparedStep:
    """The `PreparedStep` for these options, reused from an earlier prediction where one was made
    (the last PREPARED_KEPT are kept). A step is the same when its workload object is, or for a
    workload made from a spec, when its spec, its file's hash, overrides, seed, weights' dtype and
    loss (`Workload.loss_identity`) are. `host_type` (a `HostOffload`) is made for offload on "cuda", `cut_type()`'s `shorten`
    shortens the model (`compose`). An exception while preparing is raised again for the same
    options without preparing again. A step whose cut refused the model is the whole one, also
    kept for these options without a cut (the full trace's), so that its model is built once. A
    plan of one option on every block takes the step of that option's policy (`step_policy`). A
    step whose warm-up left tensors on the model (`PreparedStep.state_made`) is reused only at
    the (batch, seq) `shape` it was warmed up at, except to refuse its cut again. A new step takes the optimizer state a kept step
    of the same model, dtype, loop, device and path was warmed up to (`WarmState`), not stepping
    the optimizer in its warm-up."""
    runs_as = step_policy(policy)
    key = ((workload_key(workload), workload.loss_identity), runs_as, dtype, loop, device, host_type, cut_type)
    found = _PREPARED[key][1] if key in _PREPARED else None
    if isinstance(found, PreparedStep) and found.state_made and found.warmed_at != shape and found.refusal is None:
        found = None   # a cut step refused for the state its model made refuses at any shape, at once
    if found is not None:
        _PREPARED.move_to_end(key)
    else:
        warm = next((other.warm_state for k, (_, other) in reversed(_PREPARED.items())
                     if k[:1] + k[2:] == key[:1] + key[2:] and isinstance(other, PreparedStep)
                     and other.warm_state is not None), None)
        try:
            found = PreparedStep(workload, runs_as, dtype, loop, device, host_type() if host_type else None,
                                 cut=cut_type() if cut_type else None, warm=warm)
        except Exception as exc:
            found = exc
        _PREPARED[key] = (workload, found)   # the workload kept alive: an object's key is its id
        if isinstance(found, PreparedStep) and found.refusal is not None and host_type is None:
            _PREPARED.setdefault(key[:-1] + (None,), (workload, found))
        while len(_PREPARED) > PREPARED_KEPT:
            _PREPARED.popitem(last=False)
    if isinstance(found, Exception):
        raise found
    if runs_as is not policy:
        policy.regions(found.handle.n_blocks)   # a plan's length, checked as applying it checks it
    return found


@contextlib.contextmanager
def stepped(prepared: PreparedStep, batch_size: int, seq_len: int, *kernels, **options):
    """`prepared.at(batch_size, seq_len, ...)`; a step that raises leaves its model in a state
    that is not the warm-up's, so the prepared step is dropped from reuse (not for its cut's
    refusal, raised before the step)."""
    try:
        with prepared.at(batch_size, seq_len, *kernels, **options) as state:
            yield state
    except BaseException as exc:
        if exc is not prepared.refusal:   # a cut's refusal leaves the model warmed up: kept, to refuse at once
            for key, (_, found) in list(_PREPARED.items()):
                if found is prepared:
                    del _PREPARED[key]
        raise


def clear_prepared() -> None:
    """Forget every prepared step and built model (a test that changes what a model builds into, say)."""
    _PREPARED.clear()
    _BUILT.clear()


def workload_key(workload: Workload) -> tuple:
    """What identifies a workload's model for reuse: its spec and what shapes the model built from
    it, or the object itself for a workload made in Python (`Workload.custom`)."""
    if workload.spec is None:
        return ("object", id(workload))
    return ("spec", workload.spec, workload.spec_hash, repr(sorted(workload.overrides.items())), workload.seed,
            workload.weights_dtype, workload.block_paths, workload.seq_len_limit)


def warm_up(step, model: nn.Module, opt, trained=None, given: Optional[Callable[[], None]] = None) -> bool:
    """Leave what a first training step of the step's loop leaves, at a fraction of its cost: the
    optimizer's state, a grad scaler's scale and growth tracker, and with zero_grad="zeros" the
    zero-filled gradients. The forward shows which parameters its backward would give gradients
    (those its graph reaches), zero gradients stand in for them, the loss is scaled (which makes
    the scaler's state), and the optimizer steps once, as the step steps it (without a scaler on one
    parameter of each layout, `step_by_representatives`; clipping leaves
    nothing behind). A graph with a custom autograd Function (which may run its own backward, as reentrant
    checkpointing does) gets the whole step. `trained(reached)`, if given, says which parameters
    train from those the step reaches (a step whose blocks are cut, `compose`): a graph with a
    custom Function then runs its backward to show them. `given`, if given, makes the state
    another step's warm-up left (`WarmState.give`): where the graph holds no custom Function, it
    runs instead of the optimizer step. The forward runs
    either way: what a model keeps on its modules can depend on the policy (a table made inside
    a checkpoint, a cache in a dict). Returns whether the state was taken."""
    loss = step.forward_loss()
    reached = reached_parameters(loss)
    if given is not None and reached is not None:
        given()
        return True
    if reached is None and trained is None:
        loss = None
        step()
        return False
    if reached is None:
        loss.backward()
        reached = [p for p in model.parameters() if p.grad is not None]
    trained = trained(reached) if trained else reached
    scaler, loop = step.scaler, step.loop
    if scaler is not None:
        scaler.scale(loss)
    loss = None
    for param in trained:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    elif opt is not None:
        step_by_representatives(opt)
    model.zero_grad(set_to_none=loop.zero_grad == "set_to_none")
    return False


def step_by_representatives(opt) -> None:
    """`opt.step()` once from no state, as to the state it leaves, at the cost of a step of a few
    parameters: torch's AdamW and SGD (`probe.step.make_optimizer`) make each parameter's state
    from that parameter and its gradient alone, so one parameter per param group and layout of
    parameter and gradient steps, and the others get the state it got, alike in layout
    (`WarmState`; none where it got none: SGD without momentum), in the optimizer's order of its
    parameters, as its step makes it: on 2 cores,
    a 7B LoRA model's (256 adapters of two layouts) in 0.09 s instead of 0.2 s, a 7B's in 0.2 s
    instead of 0.5 s. Where a state tensor's layout cannot be copied (a view, a value inside
    another), the optimizer steps every parameter."""
    def kind(p):   # a parameter whose layout or gradient's cannot be copied is a kind of its own
        if p.layout != torch.strided or p.grad.layout != torch.strided:
            return id(p)
        layouts = (_layout(p), _layout(p.grad))
        return layouts if None not in layouts else id(p)

    groups = [group["params"] for group in opt.param_groups]
    kinds = {id(p): kind(p) for params in groups for p in params if p.grad is not None}   # before the step
    classes = []   # per group: {kind of a parameter with a gradient: the first of that kind}
    for params in groups:
        by_layout = {}
        for p in params:
            if p.grad is not None:
                by_layout.setdefault(kinds[id(p)], p)
        classes.append(by_layout)
    if all(len(by_layout) == sum(p.grad is not None for p in params) for by_layout, params in zip(classes, groups)):
        opt.step()   # nothing to share
        return
    try:
        for group, by_layout in zip(opt.param_groups, classes):
            group["params"] = list(by_layout.values())
        opt.step()
    finally:
        for group, params in zip(opt.param_groups, groups):
            group["params"] = params
    # A representative without state (SGD without momentum keeps none) leaves its kind without.
    taken = {id(p): _state_layouts(opt.state[p]) for by_layout in classes for p in by_layout.values()
             if p in opt.state}
    opt.state.clear()
    if any(entries is None for entries in taken.values()):
        opt.step()
        return
    for params, by_layout in zip(groups, classes):
        for p in params:
            entries = taken.get(id(by_layout[kinds[id(p)]])) if p.grad is not None else None
            if entries is not None:
                opt.state[p] = _made(entries)


def assume_finite_gradients(scaler) -> None:
    """A grad scaler steps the optimizer only when the unscaled gradients hold no inf or NaN,
    which it reads from a tensor (torch/amp/grad_scaler.py:371 at v2.13.0, `GradScaler._maybe_opt_step`:
    `.item()` on found_inf); a fake step cannot read it. The step is predicted as a healthy step runs: the
    optimizer steps."""
    def step_optimizer(optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)
    scaler._maybe_opt_step = step_optimizer


def reached_parameters(loss: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """The leaf tensors `loss.backward()` would accumulate gradients into; None when the graph
    holds a custom autograd Function, whose backward may reach more, other than the CUDA
    attention kernels' (`cuda_semantics.KERNEL_FUNCTIONS`: their backward reaches their inputs)."""
    leaves, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction) and node._forward_cls not in KERNEL_FUNCTIONS:
            return None
        variable = getattr(node, "variable", None)   # AccumulateGrad: a leaf's gradient sink
        if variable is not None:
            leaves.append(variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def kernels_of(card: Optional[Card]) -> tuple[str, int]:
    """The architecture and SM count whose kernels a CUDA step runs on `card` (None: DEFAULT_ARCH's
    usual card; a card of no SM count: its architecture's usual one)."""
    arch = card.arch if card else DEFAULT_ARCH
    return arch, (card.sm_count if card else None) or SM_COUNTS[arch]


def as_card(card: Optional[str | Card]) -> Optional[Card]:
    """A card given by name or as itself."""
    return find_card(card) if isinstance(card, str) else card


@dataclass
class FakeMemory:
    """One tracked fake step: the tracker's report, the checkpoint handle, and on CUDA the
    attention backend chosen and the device's view (`cuda_device`)."""

    report: MemoryReport
    handle: CheckpointHandle
    attention_backend: Optional[str] = None
    device: Optional[DeviceMemory] = None
    recompute_count: int = 0            # block forwards the policy's checkpoints ran again in backward
    trace: str = "full"                 # which trace answered: "full", or "composed" (`compose`)
    passes_traced: Optional[int] = None  # of an accumulation step's passes, where fewer than all (`micro_steps`)


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off within (as it was before, after): a traced step and its replay
    make hundreds of thousands of objects, and a full collection that lands inside one walks every
    one of them (on a 7B, a prediction in which one lands takes a third longer). Storages are
    freed by their reference counts, as in a real step, so the events do not change."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def fake_memory(workload: Workload, batch_size: int, seq_len: int, policy: Policy, dtype: str = "fp32",
                loop: Loop | str | None = None, device: str = "cpu", card: Optional[str | Card] = None,
                attention: Optional[str] = None, *, torch_version: Optional[str] = None,
                alloc_conf: Optional[str] = None, extend_passes: bool = False) -> FakeMemory:
    """One tracked fake training step, for `device` ("cpu": exact; "cuda": module docstring, under
    the rules of `torch_version`, default the installed torch's, the allocator replayed with
    `alloc_conf` through the loop's first two steps). With `extend_passes`, a step of more than
    `micro_steps.TRACED` accumulation passes is traced with that many and extended to all
    (`micro_steps`; `FakeMemory.passes_traced`), where its passes allow it; not with offload on
    "cuda", whose pinned host memory is counted by its own allocator, not from the events."""
    card, loop = as_card(card), as_loop(loop)
    offloads = device == "cuda" and policy.offload
    if extend_passes and loop.accum_steps > micro_steps.TRACED and not offloads:
        try:
            return _fake_memory(workload, batch_size, seq_len, policy, dtype, loop, device, card, attention,
                                torch_version, alloc_conf, micro_steps.TRACED)
        except micro_steps.NotExtendable:
            pass
    return _fake_memory(workload, batch_size, seq_len, policy, dtype, loop, device, card, attention, torch_version,
                        alloc_conf, loop.accum_steps)


def _fake_memory(workload: Workload, batch_size: int, seq_len: int, policy: Policy, dtype: str, loop: Loop,
                 device: str, card: Optional[Card], attention: Optional[str], torch_version: Optional[str],
                 alloc_conf: Optional[str], passes: int) -> FakeMemory:
    """`fake_memory`, the step traced with `passes` of the loop's accumulation passes."""
    cuda = device == "cuda"
    blas = BlasUse(torch_rules(torch_version)) if cuda else contextlib.nullcontext()
    traced_loop = dataclasses.replace(loop, accum_steps=passes)
    prepared = prepared_step(workload, policy, dtype, traced_loop, device, (batch_size, seq_len),
                             host_type=HostOffload if cuda and policy.offload else None)
    host = prepared.host
    with stepped(prepared, batch_size, seq_len, card, attention, torch_version=torch_version) as (
            model, handle, batch, opt, step, kernels):
        if host:
            host.reset()   # the warm-up step's copies are gone
        starts: list[int] = []   # the recomputes counted as each pass after the first begins
        with track_memory(model, opt, inputs=step.inputs(), device="cpu", blocks=handle.blocks,
                          trace=cuda and passes == loop.accum_steps) as tracker, blas:
            step(_PassStarts(tracker, handle, starts) if passes < loop.accum_steps else tracker)
        report, recompute_count = tracker.report(), handle.recompute_count
        if passes < loop.accum_steps:
            events = micro_steps.extended(list(tracker.events), loop.accum_steps)
            param_bytes, report = report.param_bytes, count_events(events).report(events if cuda else None)
            report.param_bytes = param_bytes
            recompute_count += (loop.accum_steps - passes) * (handle.recompute_count - starts[-1])
        traced = passes if passes < loop.accum_steps else None
        if not cuda:
            return FakeMemory(report, handle, recompute_count=recompute_count, passes_traced=traced)
        workspaces = blas.workspaces(kernels_of(card)[0])
        # --- the loop's first two steps (cuda_device.first_two_steps) ---
        order = LoopOrder(optimizer_state_keys(report.trace, model, opt), optimizer_event(report))
        on_device = device_memory(report.trace, report.start_bytes, report.peak_bytes, workspaces, card,
                                  parse_alloc_conf(alloc_conf), loop_order=order)
        on_device.host_bytes = host.peak_bytes if host else None
        return FakeMemory(report, handle, kernels.attention_backend, on_device, recompute_count, passes_traced=traced)


class _PassStarts:
    """The tracker, handed to a step: as each accumulation pass after the first begins (its phase
    "forward"), the recomputes counted so far are noted in `starts`."""

    def __init__(self, tracker, handle, starts: list[int]):
        self._tracker, self._handle, self._starts = tracker, handle, starts

    def phase(self, name: str) -> None:
        if name == "forward":
            self._starts.append(self._handle.recompute_count)
        self._tracker.phase(name)

    def __getattr__(self, name: str):
        return getattr(self._tracker, name)


def optimizer_state_keys(trace: list[tuple[str, int, int]], model: nn.Module, opt) -> frozenset:
    """The trace keys of the optimizer state a tracked step starts with. `probe.memory.track_memory`
    numbers the start's storages in order, each once: the parameters' and the gradients a loop
    keeps (zero_grad="zeros"), then the optimizer state's, then the inputs'."""
    seen: set[int] = set()
    for p in model.parameters():
        seen.update(t.untyped_storage()._cdata for t in (p, p.grad) if t is not None)
    tensors = [t for s in (opt.state.values() if opt is not None else ()) for t in tree_flatten(s)[0]]
    state = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors
             if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen}
    entries = trace[len(seen):len(seen) + len(state)]
    if sum(size for _, _, size in entries) != sum(state.values()):
        raise RuntimeError("the tracked step's start does not list the optimizer state after the parameters")
    return frozenset(key for _, key, _ in entries)


def optimizer_event(report: MemoryReport) -> Optional[int]:
    """The trace index of the step's first event in its optimizer phase (None: none). The
    tracker's timeline has one entry as the step begins, then one per event of the step."""
    step_events = [phase for phase, _ in report.timeline[1:]]
    first = len(report.trace) - len(step_events)
    start = report.trace[:first]
    if any(action != "alloc" for action, _, _ in start) or sum(size for _, _, size in start) != report.start_bytes:
        raise RuntimeError("the tracker's timeline does not follow its trace event by event")
    return next((first + i for i, phase in enumerate(step_events) if phase == "optimizer"), None)


__all__ = ["BUILT_KEPT", "DEVICES", "DEVICE_CATEGORIES", "PREPARED_KEPT", "FakeMemory", "PreparedStep", "Prediction", "WarmState", "as_card", "built_model", "castable", "model_as_built", "parameter_count",
           "clear_prepared", "fake_memory", "fake_model", "fake_training_step", "gc_paused", "prepared_step",
           "sequences_unpacked", "step_by_representatives", "stepped", "warm_up", "workload_key"]
