"""Sweep cost: cells per minute for the default small grid (in-process), and the extra cost per
cell of isolated subprocess cells (same grid, isolate=True).

    .venv/bin/python benchmarks/sweep_cost.py [--quick]
"""

import argparse
import tempfile
import time
from pathlib import Path

from ckptlab import sweep
from ckptlab.report.plots import redraw_all

GRID = dict(model="gpt-tiny", batch_sizes=[1, 2, 4], seq_lens=[64], policies=["none", "density=0.5", "full"],
            steps=3, warmup=1, progress=False)   # the sweep() defaults, spelled out


def timed(isolate: bool, out: Path, grid: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    df = sweep(out=out, isolate=isolate, **grid)
    return time.perf_counter() - t0, len(df)


QUICK = dict(batch_sizes=[1], seq_lens=[16], policies=["full"], steps=1, warmup=0, max_seconds=0.2)   # the smallest setting


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest grid: 1 cell (a smoke run)")
    grid = {**GRID, **QUICK} if parser.parse_args(argv).quick else GRID
    with tempfile.TemporaryDirectory() as tmp:
        sweep(out=Path(tmp) / "warm", **{**grid, "batch_sizes": [1], "policies": ["none"]})  # imports, caches
        inproc_s, n = timed(False, Path(tmp) / "inproc", grid)
        iso_s, _ = timed(True, Path(tmp) / "iso", grid)
        t0 = time.perf_counter()
        redraw_all(Path(tmp) / "inproc")
        plots_s = time.perf_counter() - t0
    print(f"grid: {grid['model']}, batch {','.join(map(str, grid['batch_sizes']))} x seq "
          f"{','.join(map(str, grid['seq_lens']))} x {','.join(grid['policies'])} = {n} cells, "
          f"steps={grid['steps']} warmup={grid['warmup']}, CPU")
    print(f"in-process: {inproc_s:.1f} s, {n / inproc_s * 60:.0f} cells/minute ({inproc_s / n:.2f} s/cell)")
    print(f"isolated:   {iso_s:.1f} s, {n / iso_s * 60:.0f} cells/minute ({iso_s / n:.2f} s/cell)")
    print(f"isolation overhead: {(iso_s - inproc_s) / n:.2f} s per cell")
    print(f"redraw all figures: {plots_s:.1f} s")


if __name__ == "__main__":
    main()
