"""Full fine-tuning against LoRA: where the memory goes, and what fits on a card (notebook 10).

`lora_vs_full` measures a transformers model trained whole and as its LoRA fine-tune
(`<spec>+lora=R`), per policy and sequence length, memory by category: frozen weights, trainable
weights, their gradients and optimizer state, activations. `lora_fits` predicts (fake tensors,
nothing allocated) a LoRA fine-tune's peak per policy and sequence length, and which of them
fit each capacity (a card such as rtx4090, or a size).
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from ..core.cards import fits, margin_left, parse_capacity
from ..core.records import CATEGORIES
from ..core.validate import integer
from ..core.workers import shared
from ..plan.budget import measure, predict
from ..probe.measure import older_objects_frozen
from ..probe.step import resolve_device
from ..workloads.registry import get_workload


def lora_vs_full(model: str, rank: int, seq_lens: Sequence[int], batch_size: int,
                 policies: Sequence[str] = ("none", "full"), dtype: str = "fp32", device: str = "cpu",
                 steps: int = 1, warmup: int = 0, max_seconds: float = 1.0) -> pd.DataFrame:
    """One measured record per (fine-tune, sequence length, policy), with `finetune` ("full" or
    "LoRA r=R") and `config` (a label for figures) added. `model` is a transformers spec."""
    integer("rank", rank, 1)
    lora = f"{model}+lora={rank}"
    get_workload(lora)   # every input checked before the first measurement
    rows = []
    with older_objects_frozen(resolve_device(device)):   # each measurement's collection walks what they made
        for finetune, spec in (("full", model), (f"LoRA r={rank}", lora)):
            for seq_len in seq_lens:
                for policy in policies:
                    record = measure(spec, batch_size, seq_len, policy, dtype=dtype, device=device, steps=steps,
                                     warmup=warmup, max_seconds=max_seconds)
                    rows.append({**record, "finetune": finetune, "config": f"{finetune} · {policy} · s={seq_len}"})
    return pd.DataFrame(rows)


def lora_fits(model: str, rank: int, seq_lens: Sequence[int], capacities: Sequence[str] = ("rtx4090",),
              policies: Sequence[str] = ("none", "full"), batch_size: int = 1,
              dtype: str = "bf16-weights", workers: int = 1) -> pd.DataFrame:
    """Predicted peak of `model`'s LoRA fine-tune per (policy, sequence length), by category (the
    CPU prediction, exact against `measure` on a CPU), and per capacity `fits_<capacity>` and
    `margin_<capacity>_bytes` (the usable bytes left; negative: short by that much): on a card, of
    the step predicted for that card (`predict(device="cuda", card=...)`: its device bytes, also
    in `device_<card>_bytes`) against its usable bytes less its margin (`core.cards.fits`), and
    `fit_<card>` its answer ("yes", "with cache flushes", "no": `predict`'s `fit`); on a size, of
    the CPU peak. `workers` > 1 predicts in that many processes, this one and `workers` - 1
    spawned (`core.workers.shared`; the same rows: each prediction is the same whichever process
    makes it)."""
    integer("rank", rank, 1)
    integer("workers", workers, 1)
    spec = f"{model}+lora={rank}"
    get_workload(spec)   # a bad model or rank is reported here, not from a worker process
    caps = [parse_capacity(c, "capacities") for c in capacities]
    # a task per policy and sequence: this process takes them from the last, a spawned worker from
    # the first, each preparing mostly one policy's step
    tasks = [(spec, policy, [seq_len], caps, batch_size, dtype) for policy in policies for seq_len in seq_lens]
    done = shared(tasks, workers, _policy_rows, _policy_rows)
    return pd.DataFrame([row for rows in done for row in rows])


def _policy_rows(task: tuple) -> list[dict]:
    """lora_fits' rows of one policy, one per sequence length of the task (in a worker process or here)."""
    spec, policy, seq_lens, caps, batch_size, dtype = task
    rows = []
    for seq_len in seq_lens:
        p = predict(spec, batch_size, seq_len, policy, dtype=dtype)
        row = {"model": spec, "policy": policy, "seq_len": seq_len, "batch_size": batch_size, "dtype": dtype,
               "predicted_peak_bytes": p.peak_bytes,
               **{f"predicted_peak_{c}_bytes": p.peak_by_category.get(c, 0) for c in CATEGORIES}}
        for cap in caps:
            held = p.peak_bytes
            if cap.arch:
                on_card = predict(spec, batch_size, seq_len, policy, dtype=dtype, device="cuda", card=cap)
                held = on_card.device_bytes
                row.update({f"device_{cap.name}_bytes": held, f"fit_{cap.name}": on_card.fit})
            row.update({f"fits_{cap.name}": fits(cap, held), f"margin_{cap.name}_bytes": margin_left(cap, held)})
        rows.append(row)
    return rows


def longest_fitting(fits: pd.DataFrame) -> pd.DataFrame:
    """From `lora_fits`: per policy and capacity, the longest sequence that fits (0: none) and the
    margin left there (None where none fits); on a card also the longest that runs at all, with
    cache flushes (`longest_seq_len_with_flushes`; None on a size)."""
    rows = []
    for column in [c for c in fits.columns if c.startswith("fits_")]:
        capacity = column[len("fits_"):]
        for policy, g in fits.groupby("policy", sort=False):
            best = g[g[column]].sort_values("seq_len").tail(1)
            answer = f"fit_{capacity}"
            runs = g[g[answer] != "no"] if answer in g else None
            rows.append({"policy": policy, "capacity": capacity,
                         "longest_seq_len": int(best["seq_len"].iloc[0]) if len(best) else 0,
                         "margin_bytes": int(best[f"margin_{capacity}_bytes"].iloc[0]) if len(best) else None,
                         "longest_seq_len_with_flushes": None if runs is None else int(runs["seq_len"].max())
                         if len(runs) else 0})
    return pd.DataFrame(rows)


__all__ = ["longest_fitting", "lora_fits", "lora_vs_full"]
