"""Checkpointing must never change what training computes: compare a checkpointed model's loss
and parameter gradients with the un-checkpointed model's, same weights, same batch, same RNG.

    >>> cmp = compare_gradients(get_workload("gpt-tiny"), "density=0.5")
    >>> cmp.exact
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checkpoint.wrap import apply_checkpointing
from ..core.policy import Policy
from ..workloads.base import Workload
from ..workloads.registry import as_workload


@dataclass
class GradientComparison:
    policy: str
    loss_reference: float
    loss: float
    max_abs_diff: float             # over the loss and every parameter gradient
    worst_parameter: str | None     # where max_abs_diff was found (None: the loss, or no diff)
    missing_gradients: list[str]    # parameters with a reference gradient but none here

    @property
    def exact(self) -> bool:
        return self.max_abs_diff == 0.0 and not self.missing_gradients

    def within(self, atol: float) -> bool:
        return self.max_abs_diff <= atol and not self.missing_gradients


def compare_gradients(
    workload: Workload | str,
    policy: str | Policy,
    batch_size: int = 2,
    seq_len: int = 16,
    seed: int = 0,
    device: str = "cpu",
    **apply_options,
) -> GradientComparison:
    """One forward + backward with and without `policy`, in train mode (dropout on), from the
    same RNG seed; returns the largest absolute difference. `apply_options` go to
    `apply_checkpointing` (e.g. use_reentrant=True). `workload` is a Workload or any spec
    `get_workload` takes."""
    workload = as_workload(workload)
    batch = workload.batch(batch_size, seq_len, device)

    def run(checkpoint_policy):
        model = workload.build(device).train()
        handle = apply_checkpointing(model, checkpoint_policy, **apply_options) if checkpoint_policy else None
        result = step_gradients(model, workload, batch, seed)
        if handle is not None:
            handle.remove()
        return result

    loss_ref, grads_ref = run(None)
    loss, grads = run(policy)
    max_diff, worst, missing = gradient_difference(loss_ref, grads_ref, loss, grads)
    return GradientComparison(str(policy), loss_ref.item(), loss.item(), max_diff, worst, missing)


def step_gradients(model: torch.nn.Module, workload: Workload, batch: tuple, seed: int = 0,
                   runner: torch.nn.Module | None = None, autocast_dtype: torch.dtype | None = None):
    """(loss, {parameter name: gradient}) of one forward + backward of `runner` (default: the
    model itself; e.g. a compiled wrapper of it), from RNG seed `seed`; gradients are detached
    from the model (set to None there)."""
    runner = model if runner is None else runner
    torch.manual_seed(seed)
    device_type = batch[0].device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = workload.loss(runner, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def gradient_difference(loss_ref, grads_ref: dict, loss, grads: dict):
    """(largest absolute difference over the loss and every gradient, the parameter where it was
    found or None, parameters with a reference gradient but none here)."""
    max_diff, worst = (loss - loss_ref).abs().item(), None
    missing = []
    for name, g_ref in grads_ref.items():
        g = grads.get(name)
        if g_ref is None:
            continue
        if g is None:
            missing.append(name)
            continue
        diff = (g.float() - g_ref.float()).abs().max().item()
        if diff > max_diff:
            max_diff, worst = diff, name
    return max_diff, worst, missing
