"""Predicting a training step's memory without allocating it.

`predict()` runs the *same* training step that `measure()` runs — same model code, same
checkpoint wrappers, same optimizer, same live-tensor tracker (`track_memory`) — but under
`torch._subclasses.fake_tensor.FakeTensorMode`: every tensor is a fake CPU tensor that has shape,
dtype, strides and a (meta) storage of the right size, and no data. The tracker keys tensors by
storage and learns of frees from weak references exactly as in a real run, so the predicted peak
is what a real CPU run would measure, for shapes far beyond this machine (a Llama-7B-shaped GPT at
batch 8, seq 4096 takes a few seconds and a few hundred MiB).

What a fake run cannot know: kernels' choices made from data rather than metadata (none in the
built-in workloads), allocator rounding/fragmentation and workspace (CUDA's `max_memory_reserved`),
and what happens inside `torch.compile`d graphs — `compile` policies are measured, not predicted.
Fake tensors are CPU tensors, so the kernels chosen are CPU kernels: on CPU, scaled-dot-product
attention with dropout > 0 uses the math path that materialises the (s x s) attention matrix;
with dropout 0 it uses the fused flash kernel, as a GPU would.

`closed_form()` is the pencil-and-paper model after Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models": per layer s*b*h*(34 + 5*a*s/h) bytes in 16-bit without
recomputation, 2*s*b*h with full recomputation), re-derived for ckptlab's GPT op by op (see
`gpt_block_bytes`); it is reported beside measurement with its error.

`predict_fits()` answers "the largest batch / sequence per policy on a 24/40/80/141 GiB card" from
predictions.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Optional, Sequence

import pandas as pd

from ..core.policy import Policy, parse_policy
from ..core.units import CARD_LIMITS, GiB, parse_bytes
from ..core.validate import choice, integer
from ..workloads.base import Workload
from ..workloads.models import GPTConfig
from ..workloads.registry import get_workload
from .fake_step import Prediction, fake_memory, fake_training_step
from .plan import plan_budget
from .step import DTYPES, OPTIMIZERS

CAPACITIES_GIB = tuple(limit // GiB for limit in CARD_LIMITS.values())


# --------------------------------------------------------------------------- fake training step


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

    A `budget=` policy is first resolved to a per-block plan by `ckptlab.probe.plan.plan_budget`.
    `compile` policies cannot be predicted (the compiler's partitioner decides inside the graph):
    ValueError. Offload is predicted as its base policy (CPU: a no-op), and says so in `note`.
    """
    workload = get_workload(workload) if isinstance(workload, str) else workload
    policy = parse_policy(policy)
    integer("batch_size", batch_size, 1)
    integer("seq_len", seq_len, 1)
    integer("accum_steps", accum_steps, 1)
    if workload.max_seq_len is not None and seq_len > workload.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is invalid for model={workload.label!r}: allowed is 1..{workload.max_seq_len}")
    choice("dtype", dtype, list(DTYPES))
    choice("optimizer", optimizer, OPTIMIZERS)
    if policy.kind == "compile":
        raise ValueError(f"policy={policy} cannot be predicted: torch.compile's partitioner decides "
                         "what to save inside the compiled graph; measure it instead")
    t0 = time.perf_counter()
    plan_text = None
    applied = policy
    if policy.kind == "budget":
        plan = plan_budget(workload, batch_size, seq_len, policy, dtype=dtype, optimizer=optimizer)
        applied = Policy("plan", plan.letters, offload=policy.offload)
        plan_text = plan.letters
    note = "offload predicted as its base policy (no-op on CPU)" if policy.offload else ""
    report, handle = fake_memory(workload, batch_size, seq_len, applied, dtype, optimizer, accum_steps)
    return Prediction(
        model=workload.label, batch_size=batch_size, seq_len=seq_len, policy=str(policy), dtype=dtype,
        optimizer=optimizer, n_blocks=handle.n_blocks, effective_density=handle.effective_density,
        peak_bytes=report.peak_bytes, peak_by_category=dict(report.peak_by_category),
        peak_phase=report.peak_phase, saved_activation_bytes=report.saved_activation_bytes or 0,
        predict_s=time.perf_counter() - t0, plan=plan_text, note=note,
    )


# --------------------------------------------------------------------------- closed form

def _elem_bytes(dtype: str) -> tuple[int, int]:
    """(E, R): bytes of a matmul-region activation and of the fp32 residual stream/norm input."""
    return (2, 4) if dtype == "bf16" else (4, 4)


def gpt_block_bytes(cfg: GPTConfig, batch_size: int, seq_len: int, dtype: str = "fp32",
                    fused_attention: Optional[bool] = None) -> dict[str, int]:
    """Bytes one ckptlab GPT block keeps for backward, by option, counted op by op.

    With T = b*s tokens, h = width, a = heads, E = activation element bytes (4 fp32, 2 bf16
    autocast), R = 4 (residual stream, LayerNorm inputs stay fp32), p = dropout:

      keep   R*T*h (ln_1 input = block input)  + E*T*h (qkv input) + 3E*T*h (qkv output = q,k,v)
             + attention: fused  E*T*h (output) + 4*b*a*s (logsumexp)
                          math   E*T*h (scaled q) + E*T*h (output) + 3E*b*a*s^2 (softmax output,
                                 dropout mask, dropped probabilities; Korthikanti's 5as/h term)
             + E*T*h (proj input) + R*T*h (ln_2 input) + E*T*h (fc input) + 4E*T*h (gelu input)
             + 4E*T*h (mlp proj input) + 2*T*h if p > 0 (two bool dropout masks)
             + 16*T (two LayerNorms' mean and rstd)
             fp32 fused: 70*T*h (Korthikanti's 34*s*b*h in 16-bit; ours is 36*T*h in 16-bit)
      full   R*T*h: only the block input (Korthikanti's 2*s*b*h)
      selective (mm): R*T*h + the outputs of the matmuls and attention: 3E+E(attn)+E+4E+E
                      (+ on the math path the two bmm outputs instead of the attention output).
    `fused_attention` defaults to what PyTorch picks on CPU: fused when dropout is 0.
    """
    E, R = _elem_bytes(dtype)
    T, h, a, s, b = batch_size * seq_len, cfg.n_embd, cfg.n_head, seq_len, batch_size
    fused = cfg.dropout == 0 if fused_attention is None else fused_attention
    masks = 2 * E * T * h if cfg.dropout > 0 else 0     # CPU dropout multiplies by a same-dtype mask
    casts = 2 * 12 * h * h if dtype == "bf16" else 0     # autocast's bf16 weight copies, saved by the matmuls
    if fused:
        attn_keep = attn_sel = E * T * h + 4 * b * a * s
    else:  # the math path runs in fp32 under autocast (q, k, v become fp32 copies)
        qkv_copies = 3 * R * T * h if dtype == "bf16" else R * T * h  # fp32: only the scaled q is new
        attn_keep = qkv_copies + R * T * h + 3 * R * b * a * s * s
        attn_sel = R * T * h + R * b * a * s * s       # q@k^T scores and probs@v output
    keep = (R + E + 3 * E) * T * h + attn_keep + (E + R + E + 4 * E + 4 * E) * T * h + masks + 16 * T + casts
    full = R * T * h
    selective = R * T * h + (3 * E + E + 4 * E + E) * T * h + attn_sel
    # torchtitan-style: attention + every other matmul (math path: the bmm's count as matmuls)
    alt = R * T * h + (E + E) * T * h + (4 * b * a * s if fused else R * b * a * s * s)
    attn = R * T * h + (E * T * h + 4 * b * a * s if fused else 0)
    return {"keep": keep, "full": full, "selective": selective, "selective=alt": alt, "selective=attn": attn}


def closed_form(workload: Workload | str, batch_size: int, seq_len: int, policy: str | Policy = "none",
                dtype: str = "fp32", optimizer: str = "adamw") -> dict[str, int]:
    """Closed-form saved-activation and peak bytes for the GPT workloads (per-block policies).

    saved = sum over blocks of their option's bytes (`gpt_block_bytes`) + the head: the last
    block's output (ln_f input, R*T*h), lm_head input (E*T*h), log-softmax output (4*T*V) and
    the embedding dropout mask (T*h if p > 0).
    peak  = parameters + optimizer state (AdamW: 2x fp32 parameters) + saved + the loss
            backward's two fp32 (T x V) buffers + the largest recompute (keep - kept bytes of one
            recomputed block, materialised again during its backward).
    """
    workload = get_workload(workload) if isinstance(workload, str) else workload
    policy = parse_policy(policy)
    cfg = workload.config
    if not isinstance(cfg, GPTConfig):
        raise ValueError(f"model={workload.name!r} is invalid for closed_form: allowed are the GPT workloads")
    n = cfg.n_layer
    per = gpt_block_bytes(cfg, batch_size, seq_len, dtype)
    E, R = _elem_bytes(dtype)
    T, h, V = batch_size * seq_len, cfg.n_embd, cfg.vocab_size
    if policy.kind in ("budget", "compile"):
        raise ValueError(f"policy={policy} is invalid for closed_form: resolve a budget to a plan first")
    if policy.kind == "segments":  # a segment keeps only its input and recomputes all its blocks
        kept = [per["keep"]] * n
        recompute = 0
        for start, stop in policy.regions(n):
            kept[start:stop] = [per["full"]] + [0] * (stop - start - 1)
            recompute = max(recompute, (stop - start) * per["keep"] - per["full"])
    else:
        modes = policy.modes(n)
        kept = [per[m] for m in modes]
        recompute = max((per["keep"] - k for m, k in zip(modes, kept) if m != "keep"), default=0)
    head = R * T * h + E * T * h + 4 * T * V + (T * h if cfg.dropout > 0 else 0)
    saved = sum(kept) + head
    n_params = workload.n_params
    static = 4 * n_params * (1 + (2 if optimizer == "adamw" else 0))
    peak = static + saved + 2 * 4 * T * V + recompute
    return {"closed_form_saved_activation_bytes": saved, "closed_form_peak_bytes": peak,
            "closed_form_block_keep_bytes": per["keep"], "closed_form_block_full_bytes": per["full"],
            "closed_form_block_selective_bytes": per["selective"]}


# --------------------------------------------------------------------------- what fits

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
) -> list[dict]:
    """For each policy and capacity, by prediction: the largest batch size at `seq_len`, and the
    largest sequence length (of `seq_lens`, default powers of two up to the model's limit) at
    `batch_size`. The peak grows monotonically with batch and sequence, so the batch is found by
    doubling then bisection; each step is one `predict`. 0 means not even the smallest fits.
    (`analysis.fits_from_run` answers the same question from a sweep's measured records.)"""
    workload = get_workload(workload) if isinstance(workload, str) else workload
    caps = [(str(c), parse_bytes(c, "capacity")) for c in capacities]
    limit = workload.max_seq_len or 1 << 20
    seq_lens = list(seq_lens) if seq_lens else [2**k for k in range(7, 21) if 2**k <= limit]
    rows = []
    for pol in policies:
        cache: dict[tuple[int, int], int] = {}

        def peak(b: int, s: int) -> int:
            if (b, s) not in cache:
                cache[(b, s)] = predict(workload, b, s, pol, dtype=dtype, optimizer=optimizer).peak_bytes
            return cache[(b, s)]

        for cap_name, cap in caps:
            rows.append({"model": workload.label, "policy": pol, "capacity": cap_name, "capacity_bytes": cap,
                         "dtype": dtype, "seq_len": seq_len, "max_batch_size": _largest(lambda b: peak(b, seq_len) <= cap, max_batch),
                         "batch_size": batch_size,
                         "max_seq_len": max((s for s in seq_lens if peak(batch_size, s) <= cap), default=0)})
    return rows


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


def add_predictions(df, closed_form_too: bool = True):
    """Measured records (a sweep's DataFrame) -> the same rows with the prediction beside them:
    `predicted_peak_bytes`, `predicted_saved_activation_bytes`, `peak_error` and
    `saved_error` (predicted / measured - 1), and for GPT workloads the closed form's
    `closed_form_peak_bytes` and `closed_form_peak_error`. A budget policy is predicted from the
    plan it resolved to in that run (its `plan` column), so both sides describe the same model.
    Rows that did not measure ok, and compile policies, get no prediction."""

    rows = []
    for r in df.to_dict("records"):
        policy = parse_policy(r["policy"])
        if r.get("status") != "ok" or policy.kind == "compile":
            rows.append(r)
            continue
        if isinstance(r.get("plan"), str):  # (a DataFrame turns a missing plan into NaN)
            policy = Policy("plan", r["plan"], offload=policy.offload)
        overrides = r.get("model_overrides")
        workload = get_workload(r["model"], **(overrides if isinstance(overrides, dict) else {}))
        pred = predict(workload, r["batch_size"], r["seq_len"], policy, dtype=r["dtype"],
                       optimizer=r.get("optimizer", "adamw"), accum_steps=int(r.get("accum_steps") or 1))
        r.update(predicted_peak_bytes=pred.peak_bytes, predicted_saved_activation_bytes=pred.saved_activation_bytes,
                 peak_error=prediction_error(pred.peak_bytes, r["peak_bytes"]),
                 saved_error=prediction_error(pred.saved_activation_bytes, r["saved_activation_bytes"]))
        if closed_form_too and isinstance(workload.config, GPTConfig) and policy.kind in ("none", "full", "density", "every", "layers"):
            cf = closed_form(workload, r["batch_size"], r["seq_len"], policy, r["dtype"])
            r.update(closed_form_peak_bytes=cf["closed_form_peak_bytes"],
                     closed_form_peak_error=prediction_error(cf["closed_form_peak_bytes"], r["peak_bytes"]))
        rows.append(r)
    return pd.DataFrame(rows)


__all__ = ["Prediction", "add_predictions", "predict", "closed_form", "gpt_block_bytes", "predict_fits", "llama7b_shape",
           "fake_training_step", "prediction_error", "CAPACITIES_GIB"]
