"""Checkpointing must never change what training computes: compare a checkpointed (or compiled)
model's loss and parameter gradients with the un-checkpointed eager model's, same weights, same
batch, same RNG.

    >>> cmp = compare_gradients(get_workload("gpt-tiny"), "density=0.5")
    >>> cmp.verdict
    'exact'

Eager checkpointing replays the same operations, so its gradients are exact. A compiled model
runs other kernels, which add and multiply in another order: in fp32 its gradients differ from
eager ones by float rounding only, far below `RELATIVE_TOLERANCE`. A difference above it is a
wrong gradient: torch 2.13's partitioner under activation_memory_budget < 1 redraws dropout's
random numbers in backward (docs/measurements.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..checkpoint.compiled import apply_policy, eager_random, fresh_compiler_cache
from ..core.policy import Policy, as_policy
from ..workloads.base import Workload
from ..workloads.registry import as_workload

# The largest difference, relative to the parameter's largest reference gradient, that float
# rounding explains: measured at <= 1.4e-6 for compiled fp32 models; wrong gradients measured at
# >= 0.36. The low-precision bounds are chosen from the mantissa (bf16 rounds to 8 bits, 3.9e-3
# per operation; fp16 to 11, 4.9e-4), not measured.
RELATIVE_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2, "bf16-weights": 3e-2, "fp16-weights": 1e-2}
EXACT, WITHIN_TOLERANCE, WRONG = "exact", "within tolerance", "wrong"


@dataclass
class GradientComparison:
    policy: str
    loss_reference: float
    loss: float
    max_abs_diff: float             # over the loss and every parameter gradient
    worst_parameter: str | None     # where max_abs_diff was found (None: the loss, or no diff)
    missing_gradients: list[str]    # parameters with a reference gradient but none here
    max_rel_diff: float = 0.0       # per parameter: largest difference / largest reference gradient
    tolerance: float = RELATIVE_TOLERANCE["fp32"]

    @property
    def exact(self) -> bool:
        return self.max_abs_diff == 0.0 and not self.missing_gradients

    def within(self, atol: float) -> bool:
        return self.max_abs_diff <= atol and not self.missing_gradients

    @property
    def verdict(self) -> str:
        """exact, within tolerance (float rounding: `max_rel_diff` <= `tolerance`) or wrong."""
        if self.exact:
            return EXACT
        return WITHIN_TOLERANCE if not self.missing_gradients and self.max_rel_diff <= self.tolerance else WRONG


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
    same RNG seed; returns the largest absolute and relative differences and a verdict. A policy
    that compiles is compiled here, with inductor drawing random numbers as eager does.
    `apply_options` go to `apply_checkpointing` (e.g. use_reentrant=True). `workload` is a
    Workload or any spec `get_workload` takes."""
    workload = as_workload(workload)
    policy = as_policy(policy)
    batch = workload.batch(batch_size, seq_len, device)
    reference = step_gradients(workload.build(device).train(), workload, batch, seed)
    model = workload.build(device).train()
    runner, handle, _ = apply_policy(model, policy, **apply_options)
    with like_eager(policy.compiles):
        got = step_gradients(model, workload, batch, seed, runner=runner)
    handle.remove()
    return GradientComparison(str(policy), reference[0].item(), got[0].item(), *gradient_difference(*reference, *got))


@contextlib.contextmanager
def like_eager(compiles: bool = True):
    """For a model that compiles (on its first call, inside): a fresh dynamo cache before and
    after (no graph of another model reused, none kept), inductor's random numbers drawn as eager
    draws them."""
    with fresh_compiler_cache(compiles), eager_random() if compiles else contextlib.nullcontext():
        yield


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
    found or None, parameters with a reference gradient but none here, largest relative
    difference: per parameter, its largest difference over its largest reference gradient)."""
    max_diff, worst = (loss - loss_ref).abs().item(), None
    max_rel = max_diff / max(abs(loss_ref.item()), torch.finfo(torch.float32).tiny)
    missing = []
    for name, g_ref in grads_ref.items():
        g = grads.get(name)
        if g_ref is None:
            continue
        if g is None:
            missing.append(name)
            continue
        diff = (g.float() - g_ref.float()).abs().max().item()
        scale = g_ref.float().abs().max().item()
        max_rel = max(max_rel, diff / scale if scale else (0.0 if diff == 0 else float("inf")))
        if diff > max_diff:
            max_diff, worst = diff, name
    return max_diff, worst, missing, max_rel
