"""What a CUDA device holds for a predicted step beyond the step's tensors: the cuBLAS
workspaces, the caching allocator's rounding and reserve, and the card's context.

The fake step (`fake_step`, under `cuda_semantics`) gives the tensors' allocations and frees in
order (the tracker's trace). Added to them, as CUDA adds them:

- cuBLAS workspaces. Each thread that runs a cuBLAS matmul gets its own handle, and each
  (handle, stream) its own workspace, allocated through the caching allocator (so counted in
  `max_memory_allocated`) and kept for the life of the process: 4096 KiB x 2 + 16 KiB x 8 by
  default, 32 MiB on Hopper (sm90) (`core.cards.CUBLAS_WORKSPACE_BYTES`). A matmul that goes
  through cuBLASLt (addmm with a bias vector: a Linear with bias) takes a cuBLASLt workspace as
  the torch version modelled gives it (`TorchRules.cublaslt_workspace`): 1 MiB allocated and
  freed around each call (2.4 - 2.8, CUDABlas.cpp:1213 gemm_and_bias at v2.6.0), 1 MiB kept per
  thread (2.9, 2.10, CublasHandlePool.cpp getCUDABlasLtWorkspace: no tag source), or the thread's
  cuBLAS workspace itself (2.11 on, unified_cublas_and_lt_workspaces: no tag source). Sizes and
  rules: aten/src/ATen/cuda/CublasHandlePool.cpp:116-134 (parseChosenWorkspaceSize), :170
  (getCurrentCUDABlasHandle) and CUDABlas.cpp:186-208 (_parseChosenWorkspaceSize, 1024 KiB) at
  v2.6.0, without CUBLAS_WORKSPACE_CONFIG or CUBLASLT_WORKSPACE_SIZE set. The forward runs on
  the caller's thread; autograd runs a CUDA backward on its own device thread, so a step that
  multiplies matrices in both holds two of each. They exist from the warm-up step on, so they are
  allocated before the step, after the state it starts with.
- RNG states take no device memory in an eager step: checkpoint stashes the CUDA generator's
  state on the host (`torch.cuda.get_rng_state()` returns a CPU tensor), and a kernel that keeps
  its Philox seed and offset for backward (flash attention with dropout) keeps them as a saved
  tensor, which the fake step counts.
- The allocator replay (`replay_allocations`) turns the sizes into what the caching allocator
  holds: the allocated peak with its rounding (`max_memory_allocated`) and the reserved peak
  (`max_memory_reserved`); reserved minus allocated is fragmentation.
- Offload (`P+offload`): `save_on_cpu(pin_memory=True)` copies each tensor saved inside a block
  to pinned host memory, so the device copy is freed when nothing else holds it, and backward
  copies it back into a new device tensor (torch/autograd/graph.py:350 save_on_cpu at v2.13.0).
  `HostOffload` does the same
  on fake tensors: the host copy is a meta tensor (the tracker, counting the CPU device the fake
  step stands for, does not see it) and counts as pinned host bytes, as the host caching
  allocator holds them: rounded up to a power of two, cached per rounded size.
- `device_bytes` = reserved + the card's context (driver, CUDA runtime and kernels loaded: what
  `nvidia-smi` shows beyond PyTorch's reserve).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.cards import CUBLAS_WORKSPACE_BYTES, Card, fit_answer, fits
from ..probe.memory import fake_device
from .allocator import AllocEvent, replay_steps
from .torch_versions import TorchRules, torch_rules

DEFAULT_ARCH = "sm80"     # a prediction for CUDA without a card: an A100's architecture
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024                    # CUDABlas.cpp:194 at v2.6.0, CUBLASLT_WORKSPACE_SIZE default
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.addmv.default, torch.ops.aten.mv.default,
           torch.ops.aten.addbmm.default, torch.ops.aten.dot.default}


class BlasUse(TorchDispatchMode):
    """Which threads of a CUDA step would run cuBLAS and cuBLASLt: the caller's (forward,
    optimizer) or autograd's (backward, recomputation included). Where the torch of `rules`
    allocates cuBLASLt's workspace per call, the call allocates it here too, around the matmul
    (a tracker outside this mode records it)."""

    def __init__(self, rules: TorchRules | None = None):
        super().__init__()
        self.rules = rules or torch_rules()
        self.cublas: set[str] = set()
        self.cublaslt: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = fake_device(func, args)
        if device is not None:
            return device
        if func in MATMULS:
            thread = "autograd" if torch._C._current_graph_task_id() != -1 else "caller"
            self.cublas.add(thread)
            if func is torch.ops.aten.addmm.default and args[0].dim() == 1:
                self.cublaslt.add(thread)
                if self.rules.cublaslt_workspace == "per-call":
                    workspace = torch.empty(CUBLASLT_WORKSPACE_BYTES, dtype=torch.uint8)
                    out = func(*args, **(kwargs or {}))
                    del workspace
                    return out
        return func(*args, **(kwargs or {}))

    def workspaces(self, arch: str) -> list[int]:
        """The workspaces kept for the life of the process, one per (thread, library)."""
        cublas = CUBLAS_WORKSPACE_BYTES[int(arch[2:-1])]   # by the major of compute capability "smXY"
        kept_lt = len(self.cublaslt) if self.rules.cublaslt_workspace == "persistent" else 0
        if self.rules.cublaslt_workspace == "unified":   # Lt allocates the thread's cuBLAS workspace if it has none
            return [cublas] * len(self.cublas | self.cublaslt)
        return [cublas] * len(self.cublas) + [CUBLASLT_WORKSPACE_BYTES] * kept_lt


def host_block_bytes(nbytes: int) -> int:
    """The pinned block the host caching allocator gives a request of nbytes (> 0): PowerOf2Ceil."""
    return 1 << (nbytes - 1).bit_length()


class HostOffload:
    """`save_on_cpu(pin_memory=True)` as a CUDA step runs it, on fake tensors (module docstring):
    `hooks()` for `apply_checkpointing(offload_hooks=...)`; `peak_bytes`, the pinned host memory
    the host caching allocator holds. It rounds each request up to a power of two and caches a
    freed block for a later request of that same rounded size (aten/src/ATen/core/
    CachingHostAllocator.h at v2.13.0, `CachingHostAllocatorImpl::allocate`: :302-309 `roundSize` =
    `c10::llvm::PowerOf2Ceil(size)` with the default pinned_max_round_threshold, then :312
    `get_free_block(roundSize)` from the free list of that size's index, else :341
    `allocate_host_memory(roundSize)`; :132 at v2.6.0), and
    keeps what it allocated until `empty_cache`: so per rounded size, the most blocks of it live
    at once."""

    def __init__(self):
        self.live: dict[int, int] = {}      # rounded size -> blocks of it in use
        self.held: dict[int, int] = {}      # rounded size -> blocks of it allocated (in use or cached)

    @property
    def peak_bytes(self) -> int:
        return sum(size * count for size, count in self.held.items())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset(self) -> None:
        """Count what is held from now on, starting from what is in use."""
        self.held = dict(self.live)

    def _pack(self, tensor: torch.Tensor):
        host = torch.empty(tensor.size(), dtype=tensor.dtype, device="meta")
        nbytes = host.numel() * host.element_size()
        if nbytes:
            rounded = host_block_bytes(nbytes)
            self.live[rounded] = self.live.get(rounded, 0) + 1
            self.held[rounded] = max(self.held.get(rounded, 0), self.live[rounded])
            weakref.finalize(host, self._freed, nbytes)
        return tensor.device, host

    def _freed(self, nbytes: int) -> None:
        self.live[host_block_bytes(nbytes)] -= 1

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        device, host = packed
        return torch.empty(host.size(), dtype=host.dtype, device=device)


# PYTORCH_CUDA_ALLOC_CONF values a prediction replays: the default allocator, or expandable
# segments (c10/core/AllocatorConfig.h:302 AcceleratorAllocatorConfig::parseExpandableSegments at
# v2.9.0, a header absent at v2.8.0; before, c10/cuda/CUDAAllocatorConfig.cpp:295-305 at v2.6.0,
# which takes "True" or "False" only).
ALLOC_CONFS = ("expandable_segments:True", "expandable_segments:False")


def parse_alloc_conf(value) -> bool:
    """An allocator option -> whether segments are expandable (None: the default, not). ValueError
    naming the value and what is allowed."""
    if value is None:
        return False
    if value not in ALLOC_CONFS:
        raise ValueError(f"alloc_conf={value!r} is invalid: allowed are {', '.join(ALLOC_CONFS)}, or None "
                         "(the default allocator)")
    return value == "expandable_segments:True"


@dataclass
class DeviceMemory:
    """A predicted step on a CUDA card, in the caching allocator's terms: of a loop's first two
    steps, each peak the larger of the two (`worse_step`: the step that reached the reserved peak)."""

    allocated_bytes: int        # peak, as max_memory_allocated: rounded blocks, workspaces included
    reserved_bytes: int         # peak, as max_memory_reserved
    workspace_bytes: int        # cuBLAS and cuBLASLt workspaces, held throughout
    rounding_bytes: int         # allocated_bytes - the tensors' peak - workspace_bytes
    device_bytes: int | None    # reserved + the card's context (None without a card)
    context_bytes: int | None
    host_bytes: int | None = None   # pinned host memory held by the host caching allocator, with offload
    worse_step: int = 2             # the step that reached the reserved peak: 1 (it creates the optimizer state) or 2
    fit: str | None = None          # on a card: core.cards.fit_answer
    cache_flushes: int | None = None    # on a card whose limit the reserved peak passes, and that runs the step: flushes per step
    limited_reserved_bytes: int | None = None  # ... and the reserved peak the replay under the limit reached


@dataclass(frozen=True)
class LoopOrder:
    """Where a tracked step's trace stands in a training loop: the start allocations that the
    first `optimizer.step()` creates (the optimizer state) and the trace index of the step's first
    event in its optimizer phase (None: it has none)."""
    state_keys: frozenset
    optimizer_at: int | None


def first_two_steps(trace: list[tuple[str, int, int]], split: int, order: LoopOrder):
    """A loop's first two steps as event streams, from one tracked step: (initial, first, second).

    `trace[:split]` is the state the tracked step started from, `trace[split:]` the step. The
    first step starts without the optimizer state and without what a previous step left (start
    allocations the step frees: a held output); its optimizer state is allocated where its
    optimizer phase begins, as AdamW's `_init_group` creates `exp_avg`, `exp_avg_sq` lazily at
    the first `step()` (torch/optim/adam.py:139, :162-182, which AdamW inherits, adamw.py:20, at
    v2.13.0), so into the cache that the freed
    activations left. The second step is the tracked step again on that layout: new keys, and
    its frees of the previous step's leftovers free what the first step left of the same size
    (paired in order; one without a partner is not freed)."""
    start, step = trace[:split], trace[split:]
    start_keys = {key for _, key, _ in start}
    freed = {key for action, key, _ in step if action == "free"}
    carried = start_keys & freed
    state = [e for e in start if e[1] in order.state_keys]
    initial = [e for e in start if e[1] not in order.state_keys and e[1] not in carried]
    at = len(step) if order.optimizer_at is None else order.optimizer_at - split
    first = [e for e in step[:at] if e[1] not in carried] + state + [e for e in step[at:] if e[1] not in carried]
    left = [(key, size) for action, key, size in step if action == "alloc" and key not in freed]
    offset = max((key for _, key, _ in trace), default=0) + 1
    partner: dict[int, int] = {}
    for _, key, size in (e for e in step if e[0] == "free" and e[1] in carried):
        match = next((k for k, s in left if s == size and k not in partner.values()), None)
        if match is not None:
            partner[key] = match
    second = []
    for action, key, size in step:
        if key in carried:
            if key in partner:
                second.append((action, partner[key], size))
        else:
            second.append((action, key + offset, size))
    return initial, first, second


def device_memory(trace: list[tuple[str, int, int]], start_bytes: int, tensor_peak_bytes: int,
                  workspaces: list[int], card: Card | None, expandable_segments: bool = False, *,
                  loop_order: LoopOrder | None = None) -> DeviceMemory:
    """Replay a tracked step's `trace` (the tracker's, whose first allocations, `start_bytes` in
    all, are the state the step starts with) with the workspaces allocated after that state.
    With `loop_order`, a loop's first two steps are replayed (`first_two_steps`) and each peak is
    the worse of the two; without, the step from its tracked start. On a card the answer `fit`:
    when the reserved peak passes what the allocator may reserve there (`Card.budget_bytes`),
    both steps are replayed again under that limit, with the allocator's cache flushes."""
    split, held = 0, 0
    while held < start_bytes:      # the state before the step: allocations only, start_bytes in all
        held += trace[split][2]
        split += 1
    if loop_order is None:
        initial, steps = trace[:split], [trace[split:]]
    else:
        initial, *steps = first_two_steps(trace, split, loop_order)
    first_key = max((number for _, number, _ in trace), default=0) * 2 + 2
    initial = [AllocEvent(a, k, n) for a, k, n in initial if n]
    initial += [AllocEvent("alloc", first_key + i, size) for i, size in enumerate(workspaces)]
    steps = [[AllocEvent(a, k, n) for a, k, n in step if n] for step in steps]
    replays = replay_steps(initial, steps, expandable_segments=expandable_segments)
    # Reserved only grows without a limit, so the second step's peak is never below the first's:
    # the step named is the one that reached it (the first when the second adds nothing).
    reserved = max(r.peak_reserved_bytes for r in replays)
    worse = next(i for i, r in enumerate(replays) if r.peak_reserved_bytes == reserved)
    allocated = max(r.peak_allocated_bytes for r in replays)
    memory = DeviceMemory(
        allocated_bytes=allocated, reserved_bytes=reserved, workspace_bytes=sum(workspaces),
        rounding_bytes=allocated - tensor_peak_bytes - sum(workspaces),
        device_bytes=None, context_bytes=None, worse_step=worse + 1 if loop_order is not None else 2)
    if card is not None:
        memory.context_bytes = card.context_bytes
        memory.device_bytes = reserved + card.context_bytes
        runs = fits(card, memory.device_bytes)
        if not runs:
            limited = replay_steps(initial, steps, expandable_segments=expandable_segments,
                                   limit_bytes=max(card.budget_bytes, 0))
            runs = len(limited) == len(steps) and not limited[-1].out_of_memory
            memory.cache_flushes = max(r.cache_flushes for r in limited) if runs else None  # a step that never runs has none per step
            memory.limited_reserved_bytes = max(r.peak_reserved_bytes for r in limited)
        memory.fit = fit_answer(card, memory.device_bytes, runs)
    return memory


__all__ = ["ALLOC_CONFS", "DEFAULT_ARCH", "BlasUse", "HostOffload", "host_block_bytes", "CUBLASLT_WORKSPACE_BYTES", "DeviceMemory", "LoopOrder", "device_memory",
           "first_two_steps", "parse_alloc_conf"]
