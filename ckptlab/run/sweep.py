"""Sweeps: a grid of `measure()` cells, OOM-safe, resumable, optionally one process per cell.

    df = ckptlab.sweep(model="gpt-tiny", batch_sizes=[1, 2, 4], seq_lens=[64, 128],
                       policies=["none", "density=0.5", "full"], out="results/my-sweep")

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

import datetime as dt
import json
from pathlib import Path
from typing import Optional, Sequence

from ..core.policy import parse_policy
from ..core.units import parse_bytes
from ..core.validate import choice, integer, integer_list, no_credential, non_empty, output_folder
from ..probe.measure import check_policy_applies
from ..probe.step import DTYPES, OPTIMIZERS, resolve_device
from ..probe.timing import check_timing_options
from ..workloads.registry import get_workload
from .cells import FIXED, FIXED_DEFAULTS, Grid, now, run_cells
from .cluster import job_options, run_as_jobs
from .provenance import run_metadata
from .store import RunWriter, load_run, read_meta, read_records

# Run-level settings that must match when resuming into an existing folder: mixing cells measured
# under different settings in one table would make every comparison in it wrong.


def make_grid(model: str = "gpt-tiny", batch_sizes: Sequence[int] = (1, 2, 4),
              seq_lens: Sequence[int] = (64,), policies: Sequence[str] = ("none", "density=0.5", "full"),
              dtypes: Sequence[str] = ("fp32",), accum_steps: Sequence[int] = (1,), device: str = "cpu",
              memory_limit=None, steps: int = 3, warmup: int = 1, seed: int = 0,
              optimizer: str = "adamw", model_overrides: Optional[dict] = None, nproc: int = 1,
              target_ci: float = 0.02, max_seconds: float = 5.0) -> Grid:
    """Validate every grid value; raise ValueError naming the parameter, the value and what is
    allowed. Nothing is built on a real device and nothing is written."""
    overrides = dict(model_overrides or {})
    no_credential("model_overrides", overrides)
    workload = get_workload(model, seed=integer("seed", seed, 0), **overrides)
    batch_sizes = sorted(set(integer_list("batch_sizes", batch_sizes, 1)))
    seq_lens = sorted(set(integer_list("seq_lens", seq_lens, 1)))
    accum_steps = sorted(set(integer_list("accum_steps", accum_steps, 1)))
    limit = workload.max_seq_len
    for s in seq_lens:
        if limit is not None and s > limit:
            raise ValueError(f"seq_lens: seq_len={s} is invalid for model={model!r}: allowed is 1..{limit}")
    parsed = []
    for p in non_empty("policies", policies):
        policy = parse_policy(p)
        check_policy_applies(workload, policy)
        if str(policy) not in parsed:
            parsed.append(str(policy))
    dtypes = [choice("dtypes", d, list(DTYPES)) for d in dict.fromkeys(non_empty("dtypes", dtypes))]
    choice("optimizer", optimizer, OPTIMIZERS)
    dev = resolve_device(device)
    check_timing_options(target_ci, max_seconds)
    return Grid(model=model, batch_sizes=batch_sizes, seq_lens=seq_lens, policies=parsed, dtypes=dtypes,
                accum_steps=accum_steps, device=str(dev), memory_limit_bytes=parse_bytes(memory_limit),
                steps=integer("steps", steps, 1), warmup=integer("warmup", warmup, 0), seed=seed,
                optimizer=optimizer, model_overrides=overrides, nproc=integer("nproc", nproc, 1),
                model_hash=workload.spec_hash, target_ci=float(target_ci), max_seconds=float(max_seconds))


def run_sweep(model: str = "gpt-tiny", batch_sizes: Sequence[int] = (1, 2, 4), seq_lens: Sequence[int] = (64,),
          policies: Sequence[str] = ("none", "density=0.5", "full"), dtypes: Sequence[str] = ("fp32",),
          accum_steps: Sequence[int] = (1,), device: str = "cpu", memory_limit=None, steps: int = 3,
          warmup: int = 1, seed: int = 0, optimizer: str = "adamw", model_overrides: Optional[dict] = None,
          out: Optional[str | Path] = None, isolate: Optional[bool] = None, resume: bool = True,
          progress: bool = True, infer_oom: bool = True,
          cell_timeout_s: Optional[float] = None, nproc: int = 1, executor: str = "local",
          cluster: Optional[str] = None, slurm_partition: Optional[str] = None,
          slurm_gpus_per_job: Optional[int] = None, slurm_time_min: int = 60,
          slurm_account: Optional[str] = None, cells_per_job: int = 1, submitit_folder=None,
          target_ci: float = 0.02, max_seconds: float = 5.0):
    """Measure every cell of the grid; return all of the run's records as a pandas DataFrame.

    Grid axes: `batch_sizes` (micro-batch), `seq_lens`, `policies` (strings such as "none",
    "density=0.5", "full"; densities are policies), `dtypes` ("fp32", "bf16" autocast),
    `accum_steps` (gradient accumulation: effective batch = batch x accum). Run-level: `model`
    (preset) + `model_overrides`, `device`, `memory_limit` (e.g. "2GiB"; emulated on CPU),
    `steps`/`warmup` timing, `seed`, `optimizer`.

    Timing: in-process cells (not isolated, one rank) of one (batch, seq, dtype, accum) are
    timed together with the interleaved protocol (`ckptlab.probe.timing`): their records carry
    the paired `time_ratio` to the group's first policy with its 95% interval; every cell's
    `step_ms` carries its interval (`step_ms_low/high`). Rounds continue (at least `steps`)
    until the interval is within ±`target_ci` or `max_seconds` of timing per group.

    out      run folder (default results/sweep-<timestamp>); records.jsonl, run.json, figures/.
    isolate  one subprocess per cell (default: True on CUDA, False on CPU).
    resume   True: skip cells already in `out`. False: refuse a folder that holds records.
    progress tqdm progress bar.
    infer_oom  record larger batches of an out-of-memory group as oom (inferred) without running.
    cell_timeout_s  stop an isolated cell after this many seconds (default CELL_TIMEOUT_S) and
             record it as an error.
    nproc    ranks per cell: > 1 measures each cell sharded with FSDP2 over that many processes
             (gloo on CPU, NCCL on CUDA; see `ckptlab.probe.distributed`); records gain world_size,
             peak_bytes_per_rank, and peak_bytes is the max over ranks.
    executor "local" (cells in this process or one subprocess each) or "submitit": each chunk of
             `cells_per_job` cells is a job (`ckptlab.run.cluster`): on SLURM with `slurm_partition`,
             `slurm_gpus_per_job` (default: nproc on CUDA, 0 on CPU), `slurm_time_min` per job,
             `slurm_account`; `cluster` "slurm" | "local" (jobs as local processes) | None (SLURM if
             there, else local);
             job files under `submitit_folder` (default <out>/submitit). Same records, same resume.

    Raises ValueError on any bad grid value (nothing written) and `store.RunLockedError` when
    another sweep is writing to `out`.
    """
    grid = make_grid(model, batch_sizes, seq_lens, policies, dtypes, accum_steps, device, memory_limit,
                     steps, warmup, seed, optimizer, model_overrides, nproc, target_ci, max_seconds)
    isolate = grid.device.startswith("cuda") if isolate is None else bool(isolate)
    out = output_folder("out", Path("results") / dt.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
                        if out is None else out)
    if executor not in ("local", "submitit"):
        raise ValueError(f"executor={executor!r} is invalid: allowed are local, submitit")
    if executor == "submitit":
        jobs = job_options(out, submitit_folder, cluster, slurm_partition, slurm_gpus_per_job, slurm_time_min,
                           slurm_account, cells_per_job, grid.device, grid.nproc)
    existing_meta = read_meta(out)
    if existing_meta:
        _check_resumable(out, existing_meta, grid, resume)

    with RunWriter(out) as writer:
        done = read_records(out)
        if done and not resume:
            raise ValueError(f"out={out.name!r} already holds {len(done)} records: pass resume=True "
                             f"(CLI --resume) to add the missing cells, or choose another folder")
        meta = run_metadata(grid, out, isolate, existing_meta)
        writer.write_meta(meta)
        if executor == "submitit":
            records = run_as_jobs(grid, writer, done, jobs, progress, infer_oom, cell_timeout_s)
        else:
            records = run_cells(grid, writer, done, isolate, progress, infer_oom, cell_timeout_s)
        meta["finished_at"] = now()
        meta["status_counts"] = _counts(records)
        meta["history"][-1].update(finished_at=meta["finished_at"])
        writer.write_meta(meta)

    df = load_run(out)
    df.attrs["run_dir"] = str(out)
    return df


def _check_resumable(out: Path, meta: dict, grid: Grid, resume: bool) -> None:
    old = {k: meta.get("grid", {}).get(k, FIXED_DEFAULTS.get(k)) for k in FIXED}
    new = json.loads(json.dumps(grid.fixed()))
    diff = [k for k in FIXED if old[k] != new[k]]
    if diff and resume:
        k = diff[0]
        if k == "model_hash":
            raise ValueError(f"model={grid.model!r} is invalid for resuming run {out.name!r}: its file changed "
                             f"(content hash {new[k]}, the run was measured with {old[k]}); measure the changed "
                             "model into another out= folder")
        raise ValueError(f"{k}={new[k]!r} is invalid for resuming run {out.name!r}, which was measured "
                         f"with {k}={old[k]!r}; use the same settings or another out= folder")


def _counts(records: list[dict]) -> dict:
    counts = {"ok": 0, "oom": 0, "error": 0}
    for r in records:
        counts[r.get("status", "error")] = counts.get(r.get("status", "error"), 0) + 1
    return counts
