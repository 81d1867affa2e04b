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
  freed around each call (2.4 - 2.8, CUDABlas.cpp gemm_and_bias), 1 MiB kept per thread (2.9,
  2.10, CublasHandlePool.cpp getCUDABlasLtWorkspace), or the thread's cuBLAS workspace itself
  (2.11 on, unified_cublas_and_lt_workspaces). Sizes and rules: aten/src/ATen/cuda/
  CublasHandlePool.cpp (`parseChosenWorkspaceSize`, `parseCUDABlasLtWorkspaceSize`,
  `getCurrentCUDABlasHandle`), without CUBLAS_WORKSPACE_CONFIG or CUBLASLT_WORKSPACE_SIZE set. The forward runs on the caller's thread; autograd runs a CUDA
  backward on its own device thread, so a step that multiplies matrices in both holds two of
  each. They exist from the warm-up step on, so they are allocated before the step, after the
  state it starts with.
- RNG states take no device memory in an eager step: checkpoint stashes the CUDA generator's
  state on the host (`torch.cuda.get_rng_state()` returns a CPU tensor), and a kernel that keeps
  its Philox seed and offset for backward (flash attention with dropout) keeps them as a saved
  tensor, which the fake step counts.
- The allocator replay (`replay_allocations`) turns the sizes into what the caching allocator
  holds: the allocated peak with its rounding (`max_memory_allocated`) and the reserved peak
  (`max_memory_reserved`); reserved minus allocated is fragmentation.
- Offload (`P+offload`): `save_on_cpu(pin_memory=True)` copies each tensor saved inside a block
  to pinned host memory, so the device copy is freed when nothing else holds it, and backward
  copies it back into a new device tensor (torch/autograd/graph.py). `HostOffload` does the same
  on fake tensors: the host copy is a meta tensor (the tracker, counting the CPU device the fake
  step stands for, does not see it) and counts as pinned host bytes.
- `device_bytes` = reserved + the card's context (driver, CUDA runtime and kernels loaded: what
  `nvidia-smi` shows beyond PyTorch's reserve).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.cards import CUBLAS_WORKSPACE_BYTES, Card
from .allocator import AllocEvent, replay_allocations
from .torch_versions import TorchRules, torch_rules

DEFAULT_ARCH = "sm80"     # a prediction for CUDA without a card: an A100's architecture
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024                    # CublasHandlePool.cpp, CUBLASLT_WORKSPACE_SIZE default
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


class HostOffload:
    """`save_on_cpu(pin_memory=True)` as a CUDA step runs it, on fake tensors (module docstring):
    `hooks()` for `apply_checkpointing(offload_hooks=...)`; `peak_bytes` of pinned host memory."""

    def __init__(self):
        self.live_bytes = 0
        self.peak_bytes = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset(self) -> None:
        self.live_bytes = self.peak_bytes = 0

    def _pack(self, tensor: torch.Tensor):
        host = torch.empty(tensor.size(), dtype=tensor.dtype, device="meta")
        nbytes = host.numel() * host.element_size()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host, self._freed, nbytes)
        return tensor.device, host

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        device, host = packed
        return torch.empty(host.size(), dtype=host.dtype, device=device)


@dataclass
class DeviceMemory:
    """A predicted step on a CUDA card, in the caching allocator's terms."""

    allocated_bytes: int        # peak, as max_memory_allocated: rounded blocks, workspaces included
    reserved_bytes: int         # peak, as max_memory_reserved
    workspace_bytes: int        # cuBLAS and cuBLASLt workspaces, held throughout
    rounding_bytes: int         # allocated_bytes - the tensors' peak - workspace_bytes
    device_bytes: int | None    # reserved + the card's context (None without a card)
    context_bytes: int | None
    host_bytes: int | None = None   # pinned host memory at its peak, with offload


def device_memory(trace: list[tuple[str, int, int]], start_bytes: int, tensor_peak_bytes: int,
                  workspaces: list[int], card: Card | None, expandable_segments: bool = False) -> DeviceMemory:
    """Replay a tracked step's `trace` (the tracker's, whose first allocations, `start_bytes` in
    all, are the state the step starts with) with the workspaces allocated after that state."""
    split, held = 0, 0
    while held < start_bytes:      # the state before the step: allocations only, start_bytes in all
        held += trace[split][2]
        split += 1
    first_key = max((number for _, number, _ in trace), default=0) + 1
    workspace_events = [AllocEvent("alloc", first_key + i, size) for i, size in enumerate(workspaces)]
    events = [AllocEvent(action, number, nbytes) for action, number, nbytes in trace[:split] if nbytes]
    events += workspace_events
    events += [AllocEvent(action, number, nbytes) for action, number, nbytes in trace[split:] if nbytes]
    replay = replay_allocations(events, expandable_segments=expandable_segments)
    context = card.context_bytes if card is not None else None
    return DeviceMemory(
        allocated_bytes=replay.peak_allocated_bytes, reserved_bytes=replay.peak_reserved_bytes,
        workspace_bytes=sum(workspaces),
        rounding_bytes=replay.peak_allocated_bytes - tensor_peak_bytes - sum(workspaces),
        device_bytes=None if context is None else replay.peak_reserved_bytes + context, context_bytes=context)


__all__ = ["DEFAULT_ARCH", "BlasUse", "HostOffload", "CUBLASLT_WORKSPACE_BYTES", "DeviceMemory", "device_memory"]
