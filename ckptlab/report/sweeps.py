"""A sweep and its report in one call, as notebooks want it: the grid is run by
`ckptlab.run.sweep.run_sweep`, then its figures are drawn and its summary printed."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from ..run.config import SweepConfig
from ..run.sweep import run_sweep
from .analysis import config_label, format_summary
from .plots import redraw_all


def sweep(config: Optional[SweepConfig] = None, *, plots: bool = True, **options) -> pd.DataFrame:
    """Run a sweep — `config`, or a `SweepConfig` made of `options` (its fields: the grid, the
    timing, the run folder, the runner; each documented there) — then with `plots` redraw its
    figures into `<out>/figures`, and with `progress` print its summary table. Returns the
    run's records as a DataFrame."""
    if config is None:
        config = SweepConfig.from_dict(options, source="sweep")
    elif options:
        raise ValueError(f"{next(iter(options))}=... is invalid together with config=: allowed is one of them "
                         "(set the field in the SweepConfig)")
    df = run_sweep(config)
    if plots:
        redraw_all(df.attrs["run_dir"])
    if config.progress:
        print(format_summary(df))
    return df


def equal_batch_sweep(out: str | Path, batch_size: int, policies: Sequence[str] = ("none", "full"),
                      accum_steps: Sequence[int] = (), dtypes: Sequence[str] = (), **options):
    """Checkpointing against its alternatives at one effective batch: `policies` at `batch_size`;
    for each k in `accum_steps`, no checkpointing at micro-batch batch_size // k accumulated k
    times; for each dtype in `dtypes`, none and full in that dtype. Each part is a sweep in its
    own subfolder of `out` (policies/, accum<k>/, dtypes/); returns them as one DataFrame with a
    `config` label per row. `options` go to every `sweep` (model, seq_lens, device, steps, ...)."""
    out = Path(out)
    for k in accum_steps:
        if batch_size // int(k) < 1:
            raise ValueError(f"accum_steps={k} is invalid for batch_size={batch_size}: allowed is 1..{batch_size}")
    parts = [sweep(batch_sizes=[batch_size], policies=policies, out=out / "policies", **options)]
    for k in accum_steps:
        parts.append(sweep(batch_sizes=[batch_size // k], accum_steps=[k], policies=["none"],
                           out=out / f"accum{k}", **options))
    if dtypes:
        parts.append(sweep(batch_sizes=[batch_size], dtypes=dtypes, policies=["none", "full"],
                           out=out / "dtypes", **options))
    df = pd.concat(parts, ignore_index=True)
    df["config"] = config_label(df)
    return df



__all__ = ["equal_batch_sweep", "sweep"]
