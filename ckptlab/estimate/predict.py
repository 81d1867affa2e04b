"""Predicting a training step's memory without allocating it.

`predict()` runs the same training step that `measure()` runs (model code, checkpoint wrappers,
optimizer, live-tensor tracker) under fake tensors (`fake_step`), so the predicted peak is what a
real CPU run would measure, for shapes far beyond this machine. With `device="cuda"` it predicts
the step as a CUDA card runs it: CUDA's kernels, autocast and optimizer, the cuBLAS workspaces and
the caching allocator (allocated, reserved), and on a card (`core.cards`) the device bytes and the
margin left (`fake_step`, `cuda_device`). What it cannot know is in docs/design.md, note "What a
fake step cannot know". `predict_fits()` answers "the largest batch / sequence per policy on a
card" from predictions.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Optional, Sequence

from ..core.cards import CARD_NAMES, DEFAULT_MARGIN_BYTES, Card
from ..core.cards import card as find_card
from ..core.optimizers import OPTIMIZERS
from ..core.policy import Policy, parse_policy
from ..core.units import CARD_LIMITS, GiB, parse_bytes
from ..core.validate import choice, integer
from ..probe.step import DTYPES
from ..workloads.base import Workload
from ..workloads.registry import as_workload, get_workload
from .cuda_semantics import ATTENTION_BACKENDS
from .fake_step import DEVICES, Prediction, as_card, fake_memory

CAPACITIES_GIB = tuple(limit // GiB for limit in CARD_LIMITS.values())


def predict(
    workload: Workload | str,
    batch_size: int,
    seq_len: int,
    policy: str | Policy = "none",
    dtype: str = "fp32",
    optimizer: str = "adamw",
    accum_steps: int = 1,
    device: str = "cpu",
    card: Optional[str | Card] = None,
    attention: Optional[str] = None,
) -> Prediction:
    """Predict `measure(workload, batch_size, seq_len, policy, dtype=dtype)`'s memory columns
    without allocating: peak bytes (total, by category, phase) and saved-activation bytes.

    `device="cpu"` (default) predicts the step on a CPU, exact to the byte. `device="cuda"`
    predicts it as a CUDA card runs it: peak_bytes is the allocator's allocated peak,
    reserved_bytes its reserved peak, and with `card` (a name of `ckptlab.cards()`, default:
    none, an sm80 card without a context) device_bytes and margin_bytes. `attention` forces
    scaled-dot-product attention's CUDA backend (flash, efficient or math; default: PyTorch's
    choice, named in `attention_backend`).

    The policy is concrete: `ckptlab.predict` resolves a `budget=` to its plan first.
    Policies that compile cannot be predicted (the compiler's partitioner decides inside the graph):
    ValueError. Offload is predicted as its base policy, and says so in `note`.
    """
    workload, policy = check_prediction(workload, batch_size, seq_len, policy, dtype, optimizer, accum_steps,
                                        device, card, attention)
    if policy.kind == "budget":
        raise ValueError(f"policy={policy} is invalid here: this predicts a concrete policy; ckptlab.predict "
                         "resolves a budget to its plan first")
    t0 = time.perf_counter()
    on_card = as_card(card)
    note = f"offload predicted as its base policy (no-op on {'CPU' if device == 'cpu' else 'fake CPU tensors'})" \
        if policy.offload else ""
    fake = fake_memory(workload, batch_size, seq_len, policy, dtype, optimizer, accum_steps, device, on_card, attention)
    report, handle = fake.report, fake.handle
    peak, by_category, cuda = report.peak_bytes, dict(report.peak_by_category), {}
    if fake.device is not None:
        dm = fake.device
        by_category.update(workspaces=dm.workspace_bytes, rounding=dm.rounding_bytes,
                           fragmentation=dm.reserved_bytes - dm.allocated_bytes)
        peak = dm.allocated_bytes
        cuda = {"reserved_bytes": dm.reserved_bytes, "device_bytes": dm.device_bytes,
                "attention_backend": fake.attention_backend}
        if on_card is not None:
            cuda.update(card=on_card.name, margin_bytes=on_card.usable_bytes - dm.device_bytes)
    return Prediction(
        model=workload.label, batch_size=batch_size, seq_len=seq_len, policy=str(policy), dtype=dtype,
        optimizer=optimizer, n_blocks=handle.n_blocks, effective_density=handle.effective_density,
        peak_bytes=peak, peak_by_category=by_category,
        peak_phase=report.peak_phase, saved_activation_bytes=report.saved_activation_bytes or 0,
        predict_s=time.perf_counter() - t0, note=note,
        peak_in_blocks_by_category=dict(report.peak_in_blocks_by_category), peak_block=report.peak_block,
        recompute_count=handle.recompute_count, block_calls_in_backward=report.block_calls_in_backward,
        device=device, attention=attention, **{**report.param_bytes, **cuda},
    )


def check_prediction(workload: Workload | str, batch_size: int, seq_len: int, policy, dtype: str = "fp32",
                     optimizer: str = "adamw", accum_steps: int = 1, device: str = "cpu",
                     card: Optional[str | Card] = None, attention: Optional[str] = None) -> tuple[Workload, Policy]:
    """Check every input of `predict` (ValueError naming the first bad one): (workload, policy)."""
    workload = as_workload(workload)
    policy = parse_policy(policy)
    workload.check_shape(batch_size, seq_len)
    integer("accum_steps", accum_steps, 1)
    choice("dtype", dtype, list(DTYPES))
    choice("optimizer", optimizer, OPTIMIZERS)
    choice("device", device, DEVICES)
    if device != "cuda" and (card is not None or attention is not None):
        given = "card" if card is not None else "attention"
        raise ValueError(f"{given}={card if card is not None else attention!r} is invalid with device={device!r}: "
                         "a card and an attention backend are CUDA's; allowed is device='cuda'")
    if isinstance(card, str):
        find_card(card)
    if attention is not None:
        choice("attention", attention, ATTENTION_BACKENDS)
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
    capacities: Iterable[str | int] = tuple(f"{c}GiB" for c in CAPACITIES_GIB),
    seq_len: int = 2048,
    batch_size: int = 1,
    dtype: str = "bf16",
    optimizer: str = "adamw",
    max_batch: int = 1024,
    seq_lens: Optional[Sequence[int]] = None,
    device: str = "cpu",
    attention: Optional[str] = None,
    margin=DEFAULT_MARGIN_BYTES,
) -> list[dict]:
    """For each policy and capacity, by prediction: the largest batch size at `seq_len`, and the
    largest sequence length (of `seq_lens`, default powers of two up to the model's limit) at
    `batch_size`. The peak grows monotonically with batch and sequence, so the batch is found by
    doubling then bisection; each step is one `predict`. 0 means not even the smallest fits.
    (`analysis.fits_from_run` answers the same question from a sweep's measured records.)

    A capacity is a size ("24GiB") or a card's name ("rtx4090", `ckptlab.cards()`). On a card
    the step is predicted for that card (device="cuda" is implied) and fits when its device bytes
    plus `margin` (a size) are at most the card's usable bytes; the row says how much is left at
    each largest shape (`margin_at_max_*_bytes`). A size fits, on "cpu", the peak; on "cuda",
    the reserved bytes plus `margin` (a bare size has no context)."""
    workload = as_workload(workload)
    caps = [capacity(c) for c in capacities]
    choice("device", device, DEVICES)
    margin_bytes = parse_bytes(margin, "margin") if margin else 0
    limit = workload.max_seq_len or 1 << 20
    seq_lens = list(seq_lens) if seq_lens else [2**k for k in range(7, 21) if 2**k <= limit]
    rows = []
    for pol in policies:
        cache: dict[tuple, Prediction] = {}

        def predicted(b: int, s: int, on: Optional[Card]) -> Prediction:
            key = (b, s, on.name if on else None)
            if key not in cache:
                cache[key] = predict(workload, b, s, pol, dtype=dtype, optimizer=optimizer,
                                     device="cuda" if on else device, card=on, attention=attention)
            return cache[key]

        for cap_name, cap, on in caps:
            def held(p: Prediction) -> int:
                if on is not None:
                    return p.device_bytes + margin_bytes
                return p.peak_bytes if device == "cpu" else p.reserved_bytes + margin_bytes

            def fits(b: int, s: int) -> bool:
                return held(predicted(b, s, on)) <= cap

            best_batch = _largest(lambda b: fits(b, seq_len), max_batch)
            best_seq = max((s for s in seq_lens if fits(batch_size, s)), default=0)
            row = {"model": workload.label, "policy": pol, "capacity": cap_name, "capacity_bytes": cap,
                   "dtype": dtype, "seq_len": seq_len, "max_batch_size": best_batch,
                   "batch_size": batch_size, "max_seq_len": best_seq,
                   "device": "cuda" if on else device, "card": on.name if on else None,
                   "margin_bytes": margin_bytes if on or device == "cuda" else None,
                   "basis": f"predicted for {on.label}" if on else f"predicted for {device}"}
            if on is not None:
                row["margin_at_max_batch_bytes"] = predicted(best_batch, seq_len, on).margin_bytes if best_batch else None
                row["margin_at_max_seq_bytes"] = predicted(batch_size, best_seq, on).margin_bytes if best_seq else None
            rows.append(row)
    return rows


def capacity_card(value) -> Optional[Card]:
    """The card a capacity names (a Card or a card's name), None for a size."""
    if isinstance(value, Card):
        return value
    return find_card(value) if isinstance(value, str) and value in CARD_NAMES else None


def capacity(value: str | int | Card) -> tuple[str, int, Optional[Card]]:
    """A capacity as (label, usable bytes, card or None): a card (or its name), or a size."""
    on = capacity_card(value)
    if on is not None:
        return on.name, on.usable_bytes, on
    return str(value), parse_bytes(value, "capacity"), None


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


__all__ = ["CAPACITIES_GIB", "capacity", "capacity_card", "check_prediction", "llama7b_shape", "predict",
           "predict_fits", "prediction_error"]
