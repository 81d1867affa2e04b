"""Sweeps dispatched as cluster jobs with submitit: SLURM on a cluster, local processes elsewhere.

    ckptlab.sweep(model="gpt2-small", batch_sizes=[1, 2, 4, 8], seq_lens=[512, 1024],
                  device="cuda", out="results/big", executor="submitit",
                  slurm_partition="gpu", slurm_gpus_per_job=1, slurm_time_min=30)

Each chunk of `cells_per_job` cells is one job of a job array; the sweep process gathers their
records into the run folder through its one `RunWriter`. How a dead, killed or timed-out job
loses no record and resume finds them: docs/design.md, note "Cluster jobs lose nothing". Job time
limit: `slurm_time_min`, or `cell_timeout_s * cells_per_job` seconds when a cell timeout is set
(rounded up to minutes on SLURM). Requires the optional extra `ckptlab[cluster]` (submitit).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from .cells import OomInference, cell_id, failed_record, measure_cells, run_cell
from .config import JobOptions, SweepConfig
from .progress import progress_bar
from .provenance import now


def make_executor(options: JobOptions, timeout_s: Optional[float] = None):
    """A configured `submitit.AutoExecutor`."""
    import submitit  # noqa: PLC0415 - submitit is the cluster extra

    try:
        executor = submitit.AutoExecutor(folder=options.folder / "jobs" / "%j", cluster=options.cluster)
    except RuntimeError as exc:   # cluster="slurm" without srun on PATH: not a SLURM machine
        raise ValueError(f"cluster={options.cluster!r} is invalid here: no SLURM found ({exc}); pass cluster='local' "
                         f"to run the jobs as local processes") from None
    params = dict(name="ckptlab-sweep", tasks_per_node=1, nodes=1)
    if executor.cluster == "slurm":
        if options.max_jobs:
            params["slurm_array_parallelism"] = options.max_jobs
        params["timeout_min"] = math.ceil(timeout_s / 60) if timeout_s else options.slurm_time_min
        if options.slurm_gpus_per_job:
            params["gpus_per_node"] = options.slurm_gpus_per_job
        if options.slurm_partition:
            params["slurm_partition"] = options.slurm_partition
        if options.slurm_account:
            params["slurm_account"] = options.slurm_account
    elif executor.cluster == "local":
        # LocalExecutor takes fractional minutes: a limit in seconds works
        params["local_timeout_min"] = timeout_s / 60 if timeout_s else float(options.slurm_time_min)
    executor.update_parameters(**params)
    return executor


# ----------------------------------------------------------------------------- inside a job

def run_job(config: dict, cells: list[dict], partial: str, measure=None) -> list[dict]:
    """A job's body: measure `cells` in this process, in order; each record goes to `partial`
    (one JSON line, durable) as soon as it exists. Returns the records."""
    config = SweepConfig.from_dict(config)
    measure = measure or run_cell
    try:
        import submitit  # noqa: PLC0415 - submitit is the cluster extra
        job_id = submitit.JobEnvironment().job_id
    except (ImportError, RuntimeError):
        job_id = None
    records = []
    Path(partial).parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "a", encoding="utf-8") as f:
        def keep(record: dict, cell: dict) -> None:   # durable before the next cell starts
            record.update(_cell=cell, job_id=job_id)
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
            records.append(record)

        measure_cells(config, cells, measure, keep, OomInference(config))
    return records


JOB_FUNCTION = run_job   # what each job runs (tests swap in a job that hangs)


# ----------------------------------------------------------------------------- the dispatcher

def run_as_jobs(config: SweepConfig, writer, done: list[dict]) -> list[dict]:
    """Measure every cell of `config` without a record in `done` as submitit jobs; append each
    record through `writer` as its job ends. Returns all of the run's records."""
    records = list(done)
    finished = {r.get("cell_id") for r in done}
    options = config.job_options()
    oom = OomInference(config, done)
    cells = config.cells()
    bar = progress_bar(len(cells), f"sweep {config.model} (submitit)", "cell", config.progress)
    bar.update(len(finished & {cell_id(c) for c in cells}))

    def keep(record: dict, cell: dict, job_id=None, isolated=False) -> None:
        record.pop("_cell", None)
        record.update(cell_id=cell_id(cell), seed=config.seed, isolated=isolated and not record.get("inferred"),
                      inferred=bool(record.get("inferred")), executor="submitit",
                      job_id=record.get("job_id") or job_id,
                      finished_at=now())
        record.setdefault("cell_wall_s", None)
        writer.append(record)
        records.append(record)
        finished.add(record["cell_id"])
        oom.note(record)
        bar.update(1)

    try:
        # Records that jobs of an interrupted earlier sweep finished after it stopped listening.
        in_grid = {cell_id(c) for c in cells}
        for record in _leftovers(options.folder):
            cell = record.get("_cell")
            if cell and cell_id(cell) in in_grid - finished and record.get("status") in ("ok", "oom"):
                keep(record, cell, record.get("job_id"), isolated=options.cells_per_job == 1)
        pending = []
        for cell in cells:
            if cell_id(cell) in finished:
                continue
            inferred = oom.infer(cell)
            if inferred is not None:
                keep(inferred, cell)
            else:
                pending.append(cell)
        timeout_s = config.cell_timeout_s * options.cells_per_job if config.cell_timeout_s else None
        executor = make_executor(options, timeout_s) if pending else None
        while pending:
            pending = _wave(config, executor, pending, options, keep)
    finally:
        bar.close()
    return records


def _wave(config: SweepConfig, executor, cells: list[dict], options: JobOptions, keep) -> list[dict]:
    """Submit `cells` in chunks, gather every job; return the cells to submit again (those a dead
    job never reached). On SLURM all chunks go in as one job array; local jobs are started as
    earlier ones end, at most `max_jobs` at a time (default: one per CPU core)."""
    size = options.cells_per_job
    chunks = [cells[i:i + size] for i in range(0, len(cells), size)]
    config_dict = config.to_dict()
    queue = [(chunk, options.folder / "records" / f"{uuid.uuid4().hex}.jsonl") for chunk in chunks]
    limit = options.max_jobs or (len(queue) if executor.cluster == "slurm" else (os.cpu_count() or 1))

    def submit(batch):
        with executor.batch():
            jobs = [executor.submit(JOB_FUNCTION, config_dict, chunk, str(path)) for chunk, path in batch]
        return [(job, chunk, path, time.monotonic()) for job, (chunk, path) in zip(jobs, batch)]

    again: list[dict] = []

    def finish(job, chunk, path, started):
        again.extend(_gather(config, job, chunk, path, time.monotonic() - started, keep, size == 1))

    poll_jobs(queue, submit, finish, limit, options.poll_s)
    return again


def poll_jobs(queue: list, submit: Callable[[list], list[tuple]], finish: Callable[..., None], limit: int,
              poll_s: float) -> None:
    """The one job-polling loop: at most `limit` jobs in flight, submitted from `queue` as earlier
    ones end (`submit(items)` -> one tuple per job, the job first); `finish(*entry)` for each job
    that ended; jobs still running when this is interrupted (Ctrl-C) are cancelled, never left
    running unattended."""
    waiting = submit(queue[:limit])
    queue = queue[limit:]
    try:
        while waiting:
            still = []
            for entry in waiting:
                if job_done(entry[0]):
                    finish(*entry)
                else:
                    still.append(entry)
            free = limit - len(still)
            if free > 0 and queue:
                still += submit(queue[:free])
                queue = queue[free:]
            waiting = still
            if waiting:
                time.sleep(poll_s)
    finally:
        for job, *_ in waiting:
            job.cancel(check=False)


def _gather(config: SweepConfig, job, chunk: list[dict], path: Path, elapsed_s: float, keep, isolated: bool) -> list[dict]:
    reason = ""
    wait_for_local_results(job)
    try:
        by_cell = {json.dumps(r["_cell"], sort_keys=True): r for r in job.result()}
    except Exception as exc:  # noqa: BLE001 - the job died: keep what it wrote, say why
        by_cell = {json.dumps(r["_cell"], sort_keys=True): r for r in _read_partial(path)}
        lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
        state = job_state(job)
        reason = (f"job {job.job_id} ended without finishing this cell (state {state}, {elapsed_s:.0f} s "
                  f"after submission): {lines[0][:300] if lines else type(exc).__name__}")
    again, blamed = [], False
    for cell in chunk:
        record = by_cell.get(json.dumps(cell, sort_keys=True))
        if record is not None:
            keep(record, cell, job.job_id, isolated)
        elif not blamed:   # the cell in flight when the job died
            keep(failed_record(config, cell, reason), cell, job.job_id, isolated)
            blamed = True
        else:
            again.append(cell)
    return again


def wait_for_local_results(job) -> None:
    """submitit waits 15 s for a dead job's result file to appear (NFS caching on clusters); a
    local job writes to a local disk, so 1 s is plenty."""
    import submitit  # noqa: PLC0415 - submitit is the cluster extra

    if isinstance(job, submitit.LocalJob):
        job._results_timeout_s = 1


def job_done(job) -> bool:
    try:
        return job.done()
    except Exception:  # noqa: BLE001 - DebugExecutor runs the job inside done(): a failure is an end
        return True


def job_state(job) -> str:
    try:
        return str(job.state)
    except Exception:  # noqa: BLE001
        return "UNKNOWN"


def _read_partial(path: Path):
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:   # a torn last line from a killed job
            continue
    return out


def _leftovers(folder: Path):
    for path in sorted((Path(folder) / "records").glob("*.jsonl")):
        for record in _read_partial(path):
            yield record


__all__ = ["job_done", "job_state", "make_executor", "poll_jobs", "run_as_jobs", "run_job",
           "wait_for_local_results"]


