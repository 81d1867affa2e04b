"""GPU validation (`make gpu-check`): one prepared command, a few minutes on one GPU.

1. A CUDA sweep with isolated cells at a real shape: gpt2-small, seq 1024, batch 1..16,
   densities 0 / 0.25 / 0.5 / 1, fp32 and bf16, into results/gpu-check-<device>/.
2. The live-tensor tracker's peak against `torch.cuda.max_memory_allocated`, per cell: the
   ratio is printed and saved (allocator_ratio.csv); a ratio far from 1 fails the check.
3. A CUDA memory snapshot of one cell (snapshot.pickle, for https://pytorch.org/memory_viz).

Without a CUDA device it exits with status 2 and says so; it never pretends to pass.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import torch

from ..plan.budget import measure
from ..probe.memory import cuda_memory_snapshot
from ..report.analysis import format_summary
from ..report.plots import redraw_all
from ..run.sweep import sweep

GRID = dict(model="gpt2-small", batch_sizes=[1, 2, 4, 8, 16], seq_lens=[1024],
            policies=["none", "density=0.25", "density=0.5", "full"], dtypes=["fp32", "bf16"],
            steps=3, warmup=1, isolate=True, cell_timeout_s=120)
# The tracker counts tensor storage bytes; the allocator adds rounding (512 B blocks) and
# library workspaces, and misses nothing the tracker sees. Outside this band something is wrong.
RATIO_BAND = (0.5, 1.1)


def allocator_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Per measured cell: tracker peak / CUDA max_memory_allocated, and whether it is in band."""
    rows = df[(df["status"] == "ok") & df["cuda_max_allocated_bytes"].notna()].copy()
    rows["tracker_vs_allocator"] = rows["peak_bytes"] / rows["cuda_max_allocated_bytes"]
    rows["in_band"] = rows["tracker_vs_allocator"].between(*RATIO_BAND)
    return rows[["cell_id", "peak_bytes", "cuda_max_allocated_bytes", "cuda_max_reserved_bytes",
                 "tracker_vs_allocator", "in_band"]].reset_index(drop=True)


def run_dir_name(device_name: str) -> str:
    return "gpu-check-" + (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "cuda")


def main(argv: list[str] | None = None, results: str = "results") -> int:

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is available on this machine (torch.cuda.is_available() is "
              "False); this check needs one NVIDIA GPU. Run `make gpu-check` on a GPU machine.", file=sys.stderr)
        return 2

    out = Path(results) / run_dir_name(torch.cuda.get_device_name(0))
    df = sweep(device="cuda", out=out, resume=True, progress=True, **GRID)
    redraw_all(out)
    print(format_summary(df))
    ratios = allocator_ratios(df)
    ratios.to_csv(out / "allocator_ratio.csv", index=False)
    print("\ntracker peak / torch.cuda.max_memory_allocated per cell:")
    print(ratios.to_string(index=False, float_format=lambda v: f"{v:.3f}"))

    # One cell under the allocator's history recorder, in this process (the sweep's cells ran
    # in their own processes, so this process's allocator is fresh).
    with cuda_memory_snapshot(str(out / "snapshot.pickle")):
        snap = measure("gpt2-small", 4, 1024, "density=0.5", device="cuda", steps=1, warmup=0)
    print(f"\nsnapshot of gpt2-small b=4 s=1024 density=0.5 ({snap['status']}): {out / 'snapshot.pickle'}")

    failures = []
    if (df["status"] == "error").any():
        failures.append(f"{int((df['status'] == 'error').sum())} cells ended in error")
    if not len(ratios):
        failures.append("no cell measured ok")
    elif not ratios["in_band"].all():
        failures.append(f"{int((~ratios['in_band']).sum())} cells have tracker/allocator outside {RATIO_BAND}")
    print("\n" + format_summary(df))
    if failures:
        print("gpu-check FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    print(f"gpu-check passed: run folder {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
