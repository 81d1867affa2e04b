"""Notebooks as submitit jobs: each (notebook, parameters) one job running the same papermill
execution as a local run (`ckptlab.apps.notebook_exec.execute`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..run.cluster import job_state, make_executor, poll_jobs, wait_for_local_results
from ..run.config import job_options
from ..run.provenance import now
from ..run.store import fresh_run_folder
from .notebook_exec import NotebookRun, execute, relative, write_json


def run_notebooks_as_jobs(plan, out: Path, run_name: str, param_set: str, timeout_s: float,
                          executor: str = "submitit", **options) -> list:
    """`notebooks.run_notebooks` with executor="submitit": each (notebook, parameters) of `plan`
    is one job running the same papermill execution; a job that dies is a failed run with the
    reason. `options`: cluster, slurm_partition, slurm_gpus_per_job, slurm_time_min,
    slurm_account, folder (default <out>/submitit)."""
    if executor != "submitit":
        raise ValueError(f"executor={executor!r} is invalid: allowed are local, submitit")
    opts = job_options(Path(out), options.pop("folder", None), **options)
    runs: dict[int, NotebookRun] = {}
    queue = []
    for i, (path, values) in enumerate(plan):
        run_dir = fresh_run_folder(Path(out) / path.stem / run_name)
        queue.append((i, path, run_dir, values))
    # papermill stops a notebook at timeout_s itself; the job limit only catches a stuck job
    executor_ = make_executor(opts, timeout_s + 120)
    limit = opts.max_jobs or (len(queue) if executor_.cluster == "slurm" else (os.cpu_count() or 1))

    def submit(items):
        entries = []
        for i, path, run_dir, values in items:
            job = executor_.submit(_notebook_job, str(path), str(run_dir), values, param_set, timeout_s)
            print(f"[{i + 1}/{len(plan)}] {path.stem} -> {relative(run_dir)} (job {job.job_id})", flush=True)
            entries.append((job, i, path, run_dir, time.monotonic()))
        return entries

    def finish(job, i, path, run_dir, started):
        wait_for_local_results(job)
        try:
            run = job.result()
        except Exception as exc:  # noqa: BLE001 - the job died: a failed run with the reason
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            error = (f"job {job.job_id} ended without a result (state {job_state(job)}): "
                     f"{lines[0][:300] if lines else type(exc).__name__}")
            run = NotebookRun(path.stem, run_dir, "failed", time.monotonic() - started, error)
            meta_path = run_dir / "run.json"
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"notebook": path.stem}
            meta.update(status="failed", error=error, finished_at=now())
            write_json(meta_path, meta)
        runs[i] = run
        print(f"[{i + 1}/{len(plan)}] {path.stem}: {run.status} in {run.seconds:.0f} s"
              + (f" — {run.error}" if run.error else ""), flush=True)

    poll_jobs(queue, submit, finish, limit, opts.poll_s)
    return [runs[i] for i in sorted(runs)]


def _notebook_job(path: str, run_dir: str, values: dict, param_set: str, timeout_s: float):
    return execute(Path(path), Path(run_dir), values, param_set, timeout_s)


__all__ = ["run_notebooks_as_jobs"]
