"""Predicting a training step's memory without allocating it.

`predict()` runs the same training step that `measure()` runs (model code, checkpoint wrappers,
optimizer, live-tensor tracker) under fake tensors (`fake_step`), so the predicted peak is what a
real CPU run would measure, for shapes far beyond this machine. What it cannot know is in
docs/design.md, note "What a fake step cannot know". `predict_fits()` answers "the largest batch /
sequence per policy on an RTX 4090 / A100-40 / H100-80 / H200 (or any card or size)" from predictions.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Optional, Sequence

from ..core.cards import DEFAULT_CARDS, Card, fits, margin_left, parse_capacity
from ..core.policy import Policy, parse_policy
from ..core.validate import choice, integer
from ..probe.step import DTYPES, OPTIMIZERS
from ..workloads.base import Workload
from ..workloads.registry import as_workload, get_workload
from .fake_step import Prediction, fake_memory


def predict(
    workload: Workload | str,
    batch_size: int,
    seq_len: int,
    policy: str | Policy = "none",
    dtype: str = "fp32",
    optimizer: str = "adamw",
    accum_steps: int = 1,
) -> Prediction:
    """Predict `measure(workload, batch_size, seq_len, policy, dtype=dtype)`'s memory columns
    without allocating: peak bytes (total, by category, phase) and saved-activation bytes.

    The policy is concrete: `ckptlab.predict` resolves a `budget=` to its plan first.
    Policies that compile cannot be predicted (the compiler's partitioner decides inside the graph):
    ValueError. Offload is predicted as its base policy (CPU: a no-op), and says so in `note`.
    """
    workload, policy = check_prediction(workload, batch_size, seq_len, policy, dtype, optimizer, accum_steps)
    if policy.kind == "budget":
        raise ValueError(f"policy={policy} is invalid here: this predicts a concrete policy; ckptlab.predict "
                         "resolves a budget to its plan first")
    t0 = time.perf_counter()
    note = "offload predicted as its base policy (no-op on CPU)" if policy.offload else ""
    report, handle = fake_memory(workload, batch_size, seq_len, policy, dtype, optimizer, accum_steps)
    return Prediction(
        model=workload.label, batch_size=batch_size, seq_len=seq_len, policy=str(policy), dtype=dtype,
        optimizer=optimizer, n_blocks=handle.n_blocks, effective_density=handle.effective_density,
        peak_bytes=report.peak_bytes, peak_by_category=dict(report.peak_by_category),
        peak_phase=report.peak_phase, saved_activation_bytes=report.saved_activation_bytes or 0,
        predict_s=time.perf_counter() - t0, note=note,
        peak_in_blocks_by_category=dict(report.peak_in_blocks_by_category), peak_block=report.peak_block,
        recompute_count=handle.recompute_count, block_calls_in_backward=report.block_calls_in_backward,
        **report.param_bytes,
    )


def check_prediction(workload: Workload | str, batch_size: int, seq_len: int, policy, dtype: str = "fp32",
                     optimizer: str = "adamw", accum_steps: int = 1) -> tuple[Workload, Policy]:
    """Check every input of `predict` (ValueError naming the first bad one): (workload, policy)."""
    workload = as_workload(workload)
    policy = parse_policy(policy)
    workload.check_shape(batch_size, seq_len)
    integer("accum_steps", accum_steps, 1)
    choice("dtype", dtype, list(DTYPES))
    choice("optimizer", optimizer, OPTIMIZERS)
    if policy.compiles:
        raise ValueError(f"policy={policy} cannot be predicted: torch.compile's partitioner decides "
                         "what to save inside the compiled graph; measure it instead")
    return workload, policy


def llama7b_shape(**overrides) -> Workload:
    """A GPT with Llama-7B's shape (32 blocks, width 4096, 32 heads, vocab 32000, 4096 positions,
    no dropout): 6.7B parameters. A GELU MLP of 4h stands in for SwiGLU's 3 matrices of 11008.
    The preset `llama7b-shape`, so predictions and records name it as such."""
    return get_workload("llama7b-shape", **overrides)


def predict_fits(
    workload: Workload | str,
    policies: Sequence[str],
    capacities: Iterable[str | int | Card] = DEFAULT_CARDS,
    seq_len: int = 2048,
    batch_size: int = 1,
    dtype: str = "bf16",
    optimizer: str = "adamw",
    max_batch: int = 1024,
    seq_lens: Optional[Sequence[int]] = None,
) -> list[dict]:
    """For each policy and capacity, by prediction: the largest batch size at `seq_len`, and the
    largest sequence length (of `seq_lens`, default powers of two up to the model's limit) at
    `batch_size`. A capacity is a card (`rtx4090`, see `ckptlab.cards()`) or a size (24GiB); a
    configuration fits a card when its device bytes plus the card's margin are at most its usable
    bytes, and a size when its peak is at most the size. `batch_margin_bytes` / `seq_margin_bytes`
    are the usable bytes left at the largest batch / sequence (None where nothing fits).
    The peak grows monotonically with batch and sequence, so the batch is found by doubling then
    bisection; each step is one `predict`. 0 means not even the smallest fits.
    (`analysis.fits_from_run` answers the same question from a sweep's measured records.)"""
    workload = as_workload(workload)
    caps = [parse_capacity(c, "capacities") for c in capacities]
    limit = workload.max_seq_len or 1 << 20
    seq_lens = list(seq_lens) if seq_lens else [2**k for k in range(7, 21) if 2**k <= limit]
    rows = []
    for pol in policies:
        cache: dict[tuple[int, int], int] = {}

        def peak(b: int, s: int) -> int:
            if (b, s) not in cache:
                cache[(b, s)] = predict(workload, b, s, pol, dtype=dtype, optimizer=optimizer).peak_bytes
            return cache[(b, s)]

        for cap in caps:
            def device(b: int, s: int, cap=cap) -> int:
                return device_bytes_for(peak(b, s), cap)

            best_batch = _largest(lambda b: fits(cap, device(b, seq_len)), max_batch)
            best_seq = max((s for s in seq_lens if fits(cap, device(batch_size, s))), default=0)
            rows.append({"model": workload.label, "policy": pol, "capacity": cap.name, "capacity_bytes": cap.usable_bytes,
                         "dtype": dtype, "seq_len": seq_len, "max_batch_size": best_batch, "batch_size": batch_size,
                         "max_seq_len": best_seq,
                         "batch_margin_bytes": margin_left(cap, device(best_batch, seq_len)) if best_batch else None,
                         "seq_margin_bytes": margin_left(cap, device(batch_size, best_seq)) if best_seq else None})
    return rows


def device_bytes_for(peak_bytes: int, capacity: Card) -> int:
    """What a step of that peak holds on the device, for `fits` and `margin_left`: the peak plus the
    card's context (none for a plain size)."""
    return peak_bytes + capacity.context_bytes


def _largest(fits, upper: int) -> int:
    """Largest x in 1..upper with fits(x), for a monotone predicate (0 if none)."""
    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= upper and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, upper + 1)  # fits(lo), not fits(hi) (or hi beyond the range)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def prediction_error(predicted: int, measured: int) -> float:
    """Relative error of a prediction: predicted / measured - 1."""
    return predicted / measured - 1 if measured else math.nan


__all__ = ["check_prediction", "device_bytes_for", "llama7b_shape", "predict", "predict_fits", "prediction_error"]
