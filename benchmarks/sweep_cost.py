"""Sweep cost: cells per minute for the default small grid (in-process), and the extra cost per
cell of isolated subprocess cells (same grid, isolate=True).

    .venv/bin/python benchmarks/sweep_cost.py
"""

import tempfile
import time
from pathlib import Path

from ckptlab import sweep

GRID = dict(model="gpt-tiny", batch_sizes=[1, 2, 4], seq_lens=[64], policies=["none", "density=0.5", "full"],
            steps=3, warmup=1, progress=False)   # the sweep() defaults, spelled out


def timed(isolate: bool, out: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    df = sweep(out=out, isolate=isolate, **GRID)
    return time.perf_counter() - t0, len(df)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sweep(out=Path(tmp) / "warm", **{**GRID, "batch_sizes": [1], "policies": ["none"]})  # imports, caches
        inproc_s, n = timed(False, Path(tmp) / "inproc")
        iso_s, _ = timed(True, Path(tmp) / "iso")
        t0 = time.perf_counter()
        from ckptlab.report.plots import redraw_all
        redraw_all(Path(tmp) / "inproc")
        plots_s = time.perf_counter() - t0
    print(f"grid: gpt-tiny, batch 1,2,4 x seq 64 x none,density=0.5,full = {n} cells, steps=3 warmup=1, CPU")
    print(f"in-process: {inproc_s:.1f} s, {n / inproc_s * 60:.0f} cells/minute ({inproc_s / n:.2f} s/cell)")
    print(f"isolated:   {iso_s:.1f} s, {n / iso_s * 60:.0f} cells/minute ({iso_s / n:.2f} s/cell)")
    print(f"isolation overhead: {(iso_s - inproc_s) / n:.2f} s per cell")
    print(f"redraw all figures: {plots_s:.1f} s")


if __name__ == "__main__":
    main()
