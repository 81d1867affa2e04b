"""Sweeps: a grid of `measure()` cells, OOM-safe, resumable, optionally one process per cell.

    df = ckptlab.sweep(model="gpt-tiny", batch_sizes=[1, 2, 4], seq_lens=[64, 128],
                       policies=["none", "density=0.5", "full"], out="results/my-sweep")
    df = run_sweep(SweepConfig.from_yaml("sweep.yaml"))     # the same, from a file

The grid and every option are the fields of `SweepConfig` (`run/config.py`).
The grid is batch sizes x sequence lengths x policies x dtypes x gradient-accumulation steps,
for one workload on one device. Everything is validated before anything runs or is written.
Each finished cell is one line in `<out>/records.jsonl` (see `store.py`), so a crash loses
nothing finished, and running the same sweep again into the same folder (resume) runs only the
cells that are missing.

Cells are ordered so that, within one (seq, dtype, accum, policy) group, batch sizes grow: once
batch b runs out of memory, larger batches are recorded as `oom` with `inferred=True` without
running them (memory only grows with the batch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from ..core.policy import policy_label
from .cells import run_cells
from .cluster import run_as_jobs
from .config import RESUME_MUST_MATCH, SweepConfig
from .provenance import now, run_metadata
from .store import RunWriter, load_run, read_meta, read_records


def run_sweep(config: SweepConfig):
    """Measure every cell of `config` that its run folder has no record of; return all of the
    run's records as a pandas DataFrame (`sweep` takes the fields as keywords).

    Timing: in-process cells (not isolated, one rank) of one (batch, seq, dtype, accum) are
    timed together with the interleaved protocol (`ckptlab.probe.timing`): their records carry
    the paired `time_ratio` to the group's first policy with its 95% interval; every cell's
    `step_ms` carries its interval (`step_ms_low/high`).

    Raises ValueError on any bad value (nothing written) and `store.RunLockedError` when
    another sweep is writing to `config.out`.
    """
    out = config.out
    existing_meta = read_meta(out)
    if existing_meta:
        _check_resumable(config, existing_meta)

    with RunWriter(out) as writer:
        done = read_records(out)
        if done and not config.resume:
            raise ValueError(f"out={out.name!r} already holds {len(done)} records: pass resume=True "
                             f"(CLI --resume) to add the missing cells, or choose another folder")
        meta = run_metadata(config, existing_meta)
        writer.write_meta(meta)
        records = run_as_jobs(config, writer, done) if config.executor == "submitit" else run_cells(config, writer, done)
        meta["finished_at"] = now()
        meta["status_counts"] = _counts(records)
        meta["history"][-1].update(finished_at=meta["finished_at"])
        writer.write_meta(meta)

    df = load_run(out)
    df.attrs["run_dir"] = str(out)
    return df


def sweep(config: Optional[SweepConfig] = None, **options) -> pd.DataFrame:
    """Run a sweep: `config`, or a `SweepConfig` made of `options` (its fields: the grid, the
    timing, the run folder, the runner; each documented there). Returns the run: its records as
    a DataFrame, the folder in `df.attrs["run_dir"]`. Figures are drawn by whoever asks for them
    (`ckptlab.report.plots.redraw_all(df.attrs["run_dir"])`)."""
    if config is None:
        config = SweepConfig.from_dict(options, source="sweep")
    elif options:
        raise ValueError(f"{next(iter(options))}=... is invalid together with config=: allowed is one of them "
                         "(set the field in the SweepConfig)")
    return run_sweep(config)


def equal_batch_sweep(out: str | Path, batch_size: int, policies: Sequence[str] = ("none", "full"),
                      accum_steps: Sequence[int] = (), dtypes: Sequence[str] = (), **options) -> pd.DataFrame:
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


def config_label(df: pd.DataFrame) -> pd.Series:
    """A row's configuration in words: the policy (as `policy_label`), plus the dtype unless fp32,
    plus the accumulation unless 1 — e.g. "full bf16", "none accum=4"."""
    return (df["policy"].map(policy_label) + df["dtype"].map(lambda d: "" if d == "fp32" else f" {d}")
            + df["accum_steps"].map(lambda k: "" if k == 1 else f" accum={k}"))


# What a run.json written before a field existed, or under its earlier name, meant.
_SAVED_DEFAULTS = {"nproc": 1, "model_hash": None}
_SAVED_NAMES = {"memory_limit": "memory_limit_bytes", "loop": "optimizer"}


def _check_resumable(config: SweepConfig, meta: dict) -> None:
    saved = meta.get("config", meta.get("grid", {}))
    old = {k: saved.get(k, saved.get(_SAVED_NAMES.get(k), _SAVED_DEFAULTS.get(k))) for k in RESUME_MUST_MATCH}
    fields = config.to_dict()
    new = json.loads(json.dumps({k: fields[k] for k in RESUME_MUST_MATCH}))
    diff = [k for k in RESUME_MUST_MATCH if old[k] != new[k]]
    if diff and config.resume:
        k, name = diff[0], config.out.name
        if k == "model_hash":
            raise ValueError(f"model={config.model!r} is invalid for resuming run {name!r}: its file changed "
                             f"(content hash {new[k]}, the run was measured with {old[k]}); measure the changed "
                             "model into another out= folder")
        raise ValueError(f"{k}={new[k]!r} is invalid for resuming run {name!r}, which was measured "
                         f"with {k}={old[k]!r}; use the same settings or another out= folder")


def _counts(records: list[dict]) -> dict:
    counts = {"ok": 0, "oom": 0, "error": 0}
    for r in records:
        counts[r.get("status", "error")] = counts.get(r.get("status", "error"), 0) + 1
    return counts
