"""Sweeps as submitit jobs (LocalExecutor: real subprocess jobs on this machine, no SLURM)."""

import json
import os
import signal
import sys

import pytest

submitit = pytest.importorskip("submitit")

from ckptlab import sweep  # noqa: E402
from ckptlab.apps.cli import main as cli_main  # noqa: E402
from ckptlab.apps.notebook_jobs import run_notebooks_as_jobs  # noqa: E402
from ckptlab.run import cluster  # noqa: E402
from ckptlab.run.config import job_options  # noqa: E402
from ckptlab.run.store import read_records  # noqa: E402

TINY = dict(model="gpt-tiny", model_overrides=dict(n_layer=4, n_embd=32, n_head=2, vocab_size=64),
            batch_sizes=[2], seq_lens=[16], steps=1, warmup=0, max_seconds=0.2, progress=False)
POLICIES = ["none", "density=0.5", "full"]
# Columns that do not depend on timing or on which process measured them.
DETERMINISTIC = ["peak_bytes", "saved_activation_bytes", "effective_density", "status", "recompute_count",
                 "peak_activations_bytes", "checkpointed_blocks"]


def _by_cell(run_dir):
    return {r["cell_id"]: r for r in read_records(run_dir)}


def test_jobs_give_the_same_records_as_a_local_run(tmp_path):
    sweep(policies=POLICIES, out=tmp_path / "local", **TINY)
    sweep(policies=POLICIES, out=tmp_path / "jobs", executor="submitit", cluster="local", cells_per_job=2, **TINY)
    local, jobs = _by_cell(tmp_path / "local"), _by_cell(tmp_path / "jobs")
    assert sorted(local) == sorted(jobs) and len(jobs) == 3
    for cell, record in local.items():
        assert record["status"] == "ok"
        assert {k: jobs[cell][k] for k in DETERMINISTIC} == {k: record[k] for k in DETERMINISTIC}, cell
        assert jobs[cell]["executor"] == "submitit" and jobs[cell]["job_id"]
    # the density axis really was measured in the jobs (not a constant column)
    peaks = [jobs[c]["saved_activation_bytes"] for c in sorted(jobs, key=lambda c: jobs[c]["effective_density"])]
    assert peaks[0] > peaks[1] > peaks[2]
    meta = json.loads((tmp_path / "jobs" / "run.json").read_text())
    assert meta["status_counts"] == {"ok": 3, "oom": 0, "error": 0}


def test_killed_or_timed_out_job_is_an_error_the_rest_of_its_chunk_runs_resume_adds_only_new_cells(tmp_path, monkeypatch):
    def killing_job(config, cells, partial):
        # defined inside the test, so cloudpickle ships it by value to the job process
        from ckptlab.run.cells import run_cell
        from ckptlab.run.cluster import run_job

        def measure(config, cell):
            if cell["policy"] == "density=0.5":
                os.kill(os.getpid(), signal.SIGKILL)   # the job dies mid-way through its chunk
            return run_cell(config, cell)

        return run_job(config, cells, partial, measure=measure)

    out = tmp_path / "run"
    monkeypatch.setattr(cluster, "JOB_FUNCTION", killing_job)
    sweep(policies=POLICIES, out=out, executor="submitit", cluster="local", cells_per_job=3, **TINY)
    records = read_records(out)
    by_policy = {r["policy"]: r for r in records}
    assert len(records) == 3 and set(by_policy) == set(POLICIES)    # no silent gap, no duplicate
    assert by_policy["none"]["status"] == "ok"                          # finished before the kill
    assert by_policy["full"]["status"] == "ok"                          # never reached: resubmitted
    assert by_policy["full"]["job_id"] != by_policy["none"]["job_id"]
    dead = by_policy["density=0.5"]
    assert dead["status"] == "error" and f"job {dead['job_id']} ended without finishing" in dead["message"]

    # Resume with one more policy: only the new cell is submitted. Its job hangs past the job's
    # time limit (cell_timeout_s x cells_per_job): killed by the executor, reported as an error.
    def hanging_job(config, cells, partial):
        import time
        time.sleep(600)

    monkeypatch.setattr(cluster, "JOB_FUNCTION", hanging_job)
    sweep(policies=POLICIES + ["every=2"], out=out, executor="submitit", cluster="local", cell_timeout_s=2, **TINY)
    again = read_records(out)
    assert [r["cell_id"] for r in again[:3]] == [r["cell_id"] for r in records]
    assert len(again) == 4 and again[3]["policy"] == "every=2"
    assert again[3]["status"] == "error" and "ended without finishing this cell" in again[3]["message"]


def test_leftover_records_of_an_interrupted_sweep_are_gathered_not_rerun(tmp_path, monkeypatch):
    # A job of an earlier sweep finished after that sweep's process was gone: its record file is
    # all that is left. Resuming takes the record from it and submits nothing.
    from ckptlab.run.cells import run_cell
    from ckptlab.run.config import SweepConfig

    out = tmp_path / "run"
    config = SweepConfig(**{k: TINY[k] for k in ("model", "model_overrides", "batch_sizes", "seq_lens", "steps", "warmup",
                                                 "max_seconds")},
                         policies=["none"], out=out)
    cell = config.cells()[0]
    record = run_cell(config, cell)
    record.update(_cell=cell, job_id="12345")
    (out / "submitit" / "records").mkdir(parents=True)
    (out / "submitit" / "records" / "old.jsonl").write_text(json.dumps(record) + "\n{torn")

    def no_jobs(*args, **kwargs):
        raise AssertionError("nothing should be submitted")

    monkeypatch.setattr(cluster, "make_executor", no_jobs)
    sweep(policies=["none"], out=out, executor="submitit", cluster="local", **TINY)
    [kept] = read_records(out)
    assert kept["status"] == "ok" and kept["job_id"] == "12345" and kept["peak_bytes"] == record["peak_bytes"]


@pytest.mark.parametrize("kwargs, shown", [
    (dict(executor="slurm"), "executor='slurm' is invalid"),
    (dict(executor="submitit", cluster="pbs"), "cluster='pbs' is invalid"),
    (dict(executor="submitit", cells_per_job=0), "cells_per_job=0 is invalid"),
    (dict(executor="submitit", slurm_gpus_per_job=-1), "slurm_gpus_per_job=-1 is invalid"),
])
def test_bad_executor_options_are_refused_before_anything_is_written(tmp_path, kwargs, shown):
    with pytest.raises(ValueError, match=shown.replace("(", r"\(").replace("[", r"\[")):
        sweep(policies=["none"], out=tmp_path / "x", **TINY, **kwargs)
    assert not (tmp_path / "x").exists()


def test_auto_cluster_is_slurm_where_srun_exists_else_local_processes(tmp_path):
    if __import__("shutil").which("srun"):
        pytest.skip("SLURM is available here")
    assert cluster.make_executor(job_options(tmp_path)).cluster == "local"
    with pytest.raises(ValueError, match="cluster='slurm' is invalid here: no SLURM found.*cluster='local'"):
        cluster.make_executor(job_options(tmp_path, cluster="slurm"))


def test_cli_executor_flags_reach_the_job_options(monkeypatch, tmp_path):
    seen = {}

    def fake_sweep(config):
        seen.update(config.to_dict())
        raise ValueError("stop here")

    monkeypatch.setattr(sys.modules["ckptlab.apps.cli"], "sweep", fake_sweep)   # the name the CLI calls
    code = cli_main(["sweep", "--out", str(tmp_path / "x"), "--executor", "submitit", "--slurm-partition", "gpu",
                     "--slurm-gpus", "1", "--slurm-time", "30", "--slurm-account", "lab", "--cells-per-job", "4",
                     "--cluster", "slurm", "--nproc", "2"])
    assert code == 2
    assert {k: seen[k] for k in ("executor", "slurm_partition", "slurm_gpus_per_job", "slurm_time_min",
                                 "slurm_account", "cells_per_job", "cluster", "nproc")} == dict(
        executor="submitit", slurm_partition="gpu", slurm_gpus_per_job=1, slurm_time_min=30,
        slurm_account="lab", cells_per_job=4, cluster="slurm", nproc=2)


def test_slurm_parameters_reach_the_sbatch_script(tmp_path, monkeypatch):
    # No SLURM here: a fake `srun` on PATH lets submitit build its SLURM executor; nothing is
    # submitted, the generated sbatch header is checked instead.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    options = job_options(tmp_path, cluster="slurm", slurm_partition="gpu", slurm_gpus_per_job=2,
                                  slurm_time_min=30, slurm_account="lab", device="cuda", nproc=2)
    script = cluster.make_executor(options)._executor._make_submission_file_text("cmd", "uid")
    for line in ["--partition=gpu", "--account=lab", "--gpus-per-node=2", "--time=30"]:
        assert f"#SBATCH {line}\n" in script
    assert "--time=1\n" in cluster.make_executor(options, timeout_s=20)._executor._make_submission_file_text("c", "u")
    assert job_options(tmp_path, device="cuda", nproc=4).slurm_gpus_per_job == 4   # one per rank
    assert job_options(tmp_path, device="cpu", nproc=4).slurm_gpus_per_job == 0


def test_notebook_runs_as_a_job(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("papermill")
    book = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x: int = 1  # a number\nrun_dir: str = ''")
    cell.metadata["tags"] = ["parameters"]
    book.cells = [cell, nbformat.v4.new_code_cell(
        "import json, pathlib; pathlib.Path(run_dir, 'headline.json').write_text(json.dumps({'x2': x * 2}))")]
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "99_tiny.ipynb"
    nbformat.write(book, str(path))
    [run] = run_notebooks_as_jobs([(path, {"x": 21})], tmp_path / "results", "tiny", "default", 120,
                                          cluster="local")
    assert run.status == "ok", run.error
    assert json.loads((run.run_dir / "headline.json").read_text()) == {"x2": 42}
    assert json.loads((run.run_dir / "run.json").read_text())["status"] == "ok"
