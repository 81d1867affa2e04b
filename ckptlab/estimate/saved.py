"""What one block keeps for backward, op by op, against Korthikanti et al. (2022), Table 2.

The paper counts a GPT layer's activations as `sbh(34 + 5as/h)` bytes without recompute, `34sbh`
with selective recompute (of the attention core) and `2sbh` with full recompute, for 16-bit
activations (s sequence, b batch, h width, a heads). `held_by_block` measures the same thing on
fake tensors (nothing allocated, any shape): the storages a middle block allocates during the
forward pass that are still alive when the forward pass ends, with the op that made each one.
`korthikanti` sets them beside the formula.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..checkpoint.wrap import apply_checkpointing
from ..probe.step import autocast_dtype, with_dtype
from ..workloads.base import Workload
from ..workloads.registry import get_workload
from ..workloads.stacks import find_blocks
from .fake_mode import new_fake_mode
from .fake_step import fake_model, sequences_unpacked
from .kernel_outputs import kernel_outputs


class _Allocations(TorchDispatchMode):
    """Every storage an op allocates while `inside` is set: op, shape, dtype, bytes; dropped when freed."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.live: dict[int, dict] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:   # a view or an in-place op's output lives in its input's storage: not new
            inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.live.keys() | inputs:
                    storage = t.untyped_storage()
                    key = storage._cdata
                    self.live[key] = {"op": str(func.overloadpacket.__name__), "shape": tuple(t.shape),
                                      "dtype": str(t.dtype).replace("torch.", ""), "bytes": storage.nbytes()}
                    weakref.finalize(storage, self.live.pop, key, None)
        return out


def held_by_block(workload: Workload | str, batch_size: int, seq_len: int, policy: str = "none",
                  dtype: str = "fp32", block: int = 1) -> list[dict]:
    """Rows {op, shape, dtype, bytes}: the storages block `block` allocates in the forward pass of
    a training step that are alive when the forward pass ends (held for backward, or the block's
    output held by the next block), largest first. Fake tensors: no memory, any shape."""
    workload = with_dtype(get_workload(workload) if isinstance(workload, str) else workload, dtype)
    mode = new_fake_mode()
    model = fake_model(workload, mode)
    recorder = _Allocations()
    with mode, kernel_outputs(mode), sequences_unpacked():
        model.train()
        apply_checkpointing(model, policy)
        target = find_blocks(model)[block]
        target.register_forward_pre_hook(lambda *_: setattr(recorder, "inside", torch.is_grad_enabled()))
        target.register_forward_hook(lambda *_: setattr(recorder, "inside", False))
        batch = workload.new_batch(batch_size, seq_len, torch.Generator().manual_seed(workload.seed + 1))
        autocast = autocast_dtype(dtype)
        with recorder, torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = workload.loss(model, batch)
        rows = sorted(recorder.live.values(), key=lambda r: -r["bytes"])
        del loss
    return rows


def korthikanti(batch_size: int = 2, seq_len: int = 512, width: int = 1024, heads: int = 16,
                dtypes=("fp32", "bf16-weights")) -> list[dict]:
    """Per-layer activation bytes of ckptlab's GPT (dropout 0.1) measured by `held_by_block`,
    over the paper's formula, for no recompute, selective and full."""
    gpt = get_workload("gpt-tiny", n_layer=3, n_embd=width, n_head=heads, block_size=seq_len, vocab_size=512)
    s, b, h, a = seq_len, batch_size, width, heads
    formula = {"none": s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h, "full": 2 * s * b * h}
    rows = []
    for dtype in dtypes:
        for policy, paper in formula.items():
            held = sum(r["bytes"] for r in held_by_block(gpt, b, s, policy, dtype))
            rows.append({"dtype": dtype, "policy": policy, "measured_bytes": held, "formula_bytes": int(paper),
                         "ratio": held / paper})
    return rows


__all__ = ["held_by_block", "korthikanti"]
