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

import dataclasses
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .children import die_with_parent, exit_when_orphaned
from .measure import DTYPES, OPTIMIZERS, check_policy_applies, device_name, measure, resolve_device
from .memory import format_bytes, parse_bytes
from .models import get_workload
from .policy import parse_policy
from .store import RunWriter, read_meta, read_records
from .validate import choice, integer, integer_list, no_credential, non_empty, output_folder

RECORD_PREFIX = "CKPTLAB_RECORD "   # marks the child's result line on stdout (isolated cells)
CELL_TIMEOUT_S = 3600.0             # an isolated cell running longer is stopped and recorded as an error
AXES = ("seq_len", "dtype", "accum_steps", "policy", "batch_size")   # loop order, outermost first
# Run-level settings that must match when resuming into an existing folder: mixing cells measured
# under different settings in one table would make every comparison in it wrong.
FIXED = ("model", "model_overrides", "seed", "device", "steps", "warmup", "memory_limit_bytes", "optimizer",
         "nproc")
FIXED_DEFAULTS = {"nproc": 1}   # what a run.json written before the field existed meant


@dataclass
class Grid:
    """A validated sweep grid (build it with `make_grid`, which checks every value)."""

    model: str
    batch_sizes: list[int]
    seq_lens: list[int]
    policies: list[str]
    dtypes: list[str]
    accum_steps: list[int]
    device: str
    memory_limit_bytes: Optional[int]
    steps: int
    warmup: int
    seed: int
    optimizer: str
    model_overrides: dict = field(default_factory=dict)
    nproc: int = 1   # ranks per cell: > 1 measures under FSDP2 (ckptlab.distributed)

    def cells(self) -> list[dict]:
        """Every cell, in run order (batch innermost, ascending)."""
        out = []
        for seq in self.seq_lens:
            for dtype in self.dtypes:
                for accum in self.accum_steps:
                    for policy in self.policies:
                        for batch in self.batch_sizes:
                            out.append(dict(seq_len=seq, dtype=dtype, accum_steps=accum,
                                            policy=policy, batch_size=batch))
        return out

    def fixed(self) -> dict:
        return {k: getattr(self, k) for k in FIXED}


def cell_id(cell: dict) -> str:
    """Stable key of a cell within a run: 'b=4 s=64 p=density=0.5 dt=fp32 acc=1'."""
    return (f"b={cell['batch_size']} s={cell['seq_len']} p={cell['policy']} "
            f"dt={cell['dtype']} acc={cell['accum_steps']}")


def make_grid(model: str = "gpt-tiny", batch_sizes: Sequence[int] = (1, 2, 4),
              seq_lens: Sequence[int] = (64,), policies: Sequence[str] = ("none", "density=0.5", "full"),
              dtypes: Sequence[str] = ("fp32",), accum_steps: Sequence[int] = (1,), device: str = "cpu",
              memory_limit=None, steps: int = 3, warmup: int = 1, seed: int = 0,
              optimizer: str = "adamw", model_overrides: Optional[dict] = None, nproc: int = 1) -> Grid:
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
    return Grid(model=model, batch_sizes=batch_sizes, seq_lens=seq_lens, policies=parsed, dtypes=dtypes,
                accum_steps=accum_steps, device=str(dev), memory_limit_bytes=parse_bytes(memory_limit),
                steps=integer("steps", steps, 1), warmup=integer("warmup", warmup, 0), seed=seed,
                optimizer=optimizer, model_overrides=overrides, nproc=integer("nproc", nproc, 1))


def sweep(model: str = "gpt-tiny", batch_sizes: Sequence[int] = (1, 2, 4), seq_lens: Sequence[int] = (64,),
          policies: Sequence[str] = ("none", "density=0.5", "full"), dtypes: Sequence[str] = ("fp32",),
          accum_steps: Sequence[int] = (1,), device: str = "cpu", memory_limit=None, steps: int = 3,
          warmup: int = 1, seed: int = 0, optimizer: str = "adamw", model_overrides: Optional[dict] = None,
          out: Optional[str | Path] = None, isolate: Optional[bool] = None, resume: bool = True,
          progress: bool = True, infer_oom: bool = True, plots: bool = True,
          cell_timeout_s: Optional[float] = None, nproc: int = 1, executor: str = "local",
          cluster: Optional[str] = None, slurm_partition: Optional[str] = None,
          slurm_gpus_per_job: Optional[int] = None, slurm_time_min: int = 60,
          slurm_account: Optional[str] = None, cells_per_job: int = 1, submitit_folder=None):
    """Measure every cell of the grid; return all of the run's records as a pandas DataFrame.

    Grid axes: `batch_sizes` (micro-batch), `seq_lens`, `policies` (strings such as "none",
    "density=0.5", "full"; densities are policies), `dtypes` ("fp32", "bf16" autocast),
    `accum_steps` (gradient accumulation: effective batch = batch x accum). Run-level: `model`
    (preset) + `model_overrides`, `device`, `memory_limit` (e.g. "2GiB"; emulated on CPU),
    `steps`/`warmup` timing, `seed`, `optimizer`.

    out      run folder (default results/sweep-<timestamp>); records.jsonl, run.json, figures/.
    isolate  one subprocess per cell (default: True on CUDA, False on CPU).
    resume   True: skip cells already in `out`. False: refuse a folder that holds records.
    progress tqdm progress bar, and print the summary table at the end.
    infer_oom  record larger batches of an out-of-memory group as oom (inferred) without running.
    cell_timeout_s  stop an isolated cell after this many seconds (default CELL_TIMEOUT_S) and
             record it as an error.
    plots    redraw the figures into `out/figures` at the end.
    nproc    ranks per cell: > 1 measures each cell sharded with FSDP2 over that many processes
             (gloo on CPU, NCCL on CUDA; see `ckptlab.distributed`); records gain world_size,
             peak_bytes_per_rank, and peak_bytes is the max over ranks.
    executor "local" (cells in this process or one subprocess each) or "submitit": each chunk of
             `cells_per_job` cells is a job (`ckptlab.cluster`): on SLURM with `slurm_partition`,
             `slurm_gpus_per_job` (default: nproc on CUDA, 0 on CPU), `slurm_time_min` per job,
             `slurm_account`; `cluster` "slurm" | "local" (jobs as local processes) | None (SLURM if
             there, else local);
             job files under `submitit_folder` (default <out>/submitit). Same records, same resume.

    Raises ValueError on any bad grid value (nothing written) and `store.RunLockedError` when
    another sweep is writing to `out`.
    """
    grid = make_grid(model, batch_sizes, seq_lens, policies, dtypes, accum_steps, device, memory_limit,
                     steps, warmup, seed, optimizer, model_overrides, nproc)
    isolate = grid.device.startswith("cuda") if isolate is None else bool(isolate)
    out = output_folder("out", Path("results") / dt.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
                        if out is None else out)
    if executor not in ("local", "submitit"):
        raise ValueError(f"executor={executor!r} is invalid: allowed are local, submitit")
    if executor == "submitit":
        from .cluster import job_options
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
            from .cluster import run_as_jobs
            records = run_as_jobs(grid, writer, done, jobs, progress, infer_oom, cell_timeout_s)
        else:
            records = _run_cells(grid, writer, done, isolate, progress, infer_oom, cell_timeout_s)
        meta["finished_at"] = _now()
        meta["status_counts"] = _counts(records)
        meta["history"][-1].update(finished_at=meta["finished_at"])
        writer.write_meta(meta)

    from .store import load_run
    df = load_run(out)
    if plots:
        from .plots import redraw_all
        redraw_all(out)
    if progress:
        from .analysis import format_summary
        print(format_summary(df))
    return df


def equal_batch_sweep(out: str | Path, batch_size: int, policies: Sequence[str] = ("none", "full"),
                      accum_steps: Sequence[int] = (), dtypes: Sequence[str] = (), **options):
    """Checkpointing against its alternatives at one effective batch: `policies` at `batch_size`;
    for each k in `accum_steps`, no checkpointing at micro-batch batch_size // k accumulated k
    times; for each dtype in `dtypes`, none and full in that dtype. Each part is a sweep in its
    own subfolder of `out` (policies/, accum<k>/, dtypes/); returns them as one DataFrame with a
    `config` label per row. `options` go to every `sweep` (model, seq_lens, device, steps, ...)."""
    import pandas as pd

    from .analysis import config_label

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


def _run_cells(grid: Grid, writer: RunWriter, done: list[dict], isolate: bool, progress: bool,
               infer_oom: bool, cell_timeout_s) -> list[dict]:
    from tqdm.auto import tqdm

    records = list(done)
    finished = {r.get("cell_id") for r in done}
    oom_at: dict[tuple, int] = {}   # group -> smallest batch that really ran out of memory
    for r in done:
        _note_oom(oom_at, r)
    cells = grid.cells()
    todo = [c for c in cells if cell_id(c) not in finished]
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), disable=not progress,
               desc=f"sweep {grid.model}", unit="cell")
    try:
        for cell in todo:
            bar.set_postfix_str(cell_id(cell), refresh=False)
            oom_batch = oom_at.get(_group(cell))
            t0 = time.perf_counter()
            if infer_oom and oom_batch is not None and cell["batch_size"] > oom_batch:
                record = _inferred_oom(grid, cell, oom_batch)
            elif isolate:
                record = run_isolated(grid, cell, cell_timeout_s)
            else:
                record = run_cell(grid, cell)
            record.update(cell_id=cell_id(cell), seed=grid.seed, isolated=isolate and not record.get("inferred"),
                          inferred=bool(record.get("inferred")), cell_wall_s=round(time.perf_counter() - t0, 4),
                          finished_at=_now())
            writer.append(record)
            records.append(record)
            _note_oom(oom_at, record)
            bar.update(1)
    finally:
        bar.close()
    return records


def _group(cell: dict) -> tuple:
    return (cell["seq_len"], cell["dtype"], cell["accum_steps"], cell["policy"])


def _note_oom(oom_at: dict, record: dict) -> None:
    if record.get("status") == "oom" and not record.get("inferred"):
        g = _group(record)
        oom_at[g] = min(oom_at.get(g, record["batch_size"]), record["batch_size"])


def _inferred_oom(grid: Grid, cell: dict, oom_batch: int) -> dict:
    return dict(model=grid.model, **cell, effective_batch_size=cell["batch_size"] * cell["accum_steps"],
                tokens=cell["batch_size"] * cell["seq_len"] * cell["accum_steps"], device=grid.device,
                optimizer=grid.optimizer, steps=grid.steps, warmup=grid.warmup,
                memory_limit_bytes=grid.memory_limit_bytes, fits=False, status="oom", inferred=True,
                message=f"inferred, not run: batch {oom_batch} already ran out of memory")


def run_cell(grid: Grid, cell: dict) -> dict:
    """Measure one cell in this process (with nproc > 1: in nproc rank processes it starts)."""
    if grid.nproc > 1:
        from .distributed import measure_sharded
        return measure_sharded(grid.model, cell["batch_size"], cell["seq_len"], cell["policy"], nproc=grid.nproc,
                               device=grid.device, dtype=cell["dtype"], steps=grid.steps, warmup=grid.warmup,
                               memory_limit=grid.memory_limit_bytes, optimizer=grid.optimizer,
                               accum_steps=cell["accum_steps"], seed=grid.seed, model_overrides=grid.model_overrides)
    workload = get_workload(grid.model, seed=grid.seed, **grid.model_overrides)
    return measure(workload, cell["batch_size"], cell["seq_len"], cell["policy"], device=grid.device,
                   dtype=cell["dtype"], steps=grid.steps, warmup=grid.warmup,
                   memory_limit=grid.memory_limit_bytes, optimizer=grid.optimizer,
                   accum_steps=cell["accum_steps"])


def run_isolated(grid: Grid, cell: dict, timeout_s: Optional[float] = None) -> dict:
    """Measure one cell in a fresh Python process, so no allocator
    state, cache or leak carries from one cell to the next. A crash or timeout (default
    CELL_TIMEOUT_S) becomes an error record; it never stops the sweep. The child dies with this
    process (`ckptlab.children`), so a killed sweep leaves nothing computing behind its lock."""
    timeout_s = CELL_TIMEOUT_S if timeout_s is None else timeout_s
    spec = json.dumps({"grid": dataclasses.asdict(grid), "cell": cell, "parent_pid": os.getpid()})
    # The child must import this same ckptlab, installed or not.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_PARENT, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=spec, text=True, env=env,
                              capture_output=True, timeout=timeout_s, preexec_fn=die_with_parent())
    except subprocess.TimeoutExpired:
        return _failed(grid, cell, f"isolated cell timed out after {timeout_s} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RECORD_PREFIX):
            return json.loads(line[len(RECORD_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return _failed(grid, cell, f"isolated cell exited with code {proc.returncode}: {tail}")


def _failed(grid: Grid, cell: dict, message: str) -> dict:
    record = _inferred_oom(grid, cell, 0)
    record.update(fits=None, status="error", inferred=False, message=message)
    return record


_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
_CHILD = "import sys; from ckptlab.sweep import _child_main; sys.exit(_child_main())"


def _child_main() -> int:
    spec = json.loads(sys.stdin.read())
    exit_when_orphaned(spec["parent_pid"])
    record = run_cell(Grid(**spec["grid"]), spec["cell"])
    sys.stdout.write(RECORD_PREFIX + json.dumps(record, default=str) + "\n")
    sys.stdout.flush()
    return 0


# ----------------------------------------------------------------------------- run metadata

def run_metadata(grid: Grid, out: Path, isolate: bool, previous: Optional[dict] = None) -> dict:
    """What run.json holds: the grid and the environment. Deliberately no environment
    variables, no command line and no absolute paths (they can carry secrets or home paths)."""
    from . import __version__

    history = list((previous or {}).get("history", []))
    started = _now()
    history.append({"started_at": started, "cells": len(grid.cells())})
    return {
        "run": out.name,
        "ckptlab_version": __version__,
        "git_commit": _git_commit(),
        "grid": dataclasses.asdict(grid),
        "memory_limit": format_bytes(grid.memory_limit_bytes) if grid.memory_limit_bytes else None,
        "isolate": isolate,
        "started_at": (previous or {}).get("started_at", started),
        "finished_at": None,
        "history": history,
        "environment": environment(grid.device),
    }


def environment(device: str) -> dict:
    import torch

    from importlib import metadata
    packages = {}
    for name in ("torch", "numpy", "pandas", "matplotlib", "tqdm", "PyYAML", "submitit"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    dev = torch.device(device)
    capacity = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else _ram_bytes()
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "packages": packages,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device,
        "device_name": device_name(dev),
        "device_capacity_bytes": capacity,
        "cpu": device_name(torch.device("cpu")),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _ram_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _git_commit() -> Optional[str]:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) or None


def _check_resumable(out: Path, meta: dict, grid: Grid, resume: bool) -> None:
    old = {k: meta.get("grid", {}).get(k, FIXED_DEFAULTS.get(k)) for k in FIXED}
    new = json.loads(json.dumps(grid.fixed()))
    diff = [k for k in FIXED if old[k] != new[k]]
    if diff and resume:
        k = diff[0]
        raise ValueError(f"{k}={new[k]!r} is invalid for resuming run {out.name!r}, which was measured "
                         f"with {k}={old[k]!r}; use the same settings or another out= folder")


def _counts(records: list[dict]) -> dict:
    counts = {"ok": 0, "oom": 0, "error": 0}
    for r in records:
        counts[r.get("status", "error")] = counts.get(r.get("status", "error"), 0) + 1
    return counts


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
