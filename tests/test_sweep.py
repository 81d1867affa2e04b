"""Sweep engine: records, OOM inference, validation, resume, SIGKILL, lock, isolation, secrets."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptlab import RunLockedError, load_run, measure, plots, sweep
from ckptlab.apps.cli import main as cli_main
from ckptlab.run.store import RunWriter

FAST = dict(steps=1, warmup=0, max_seconds=0.2, progress=False)
EXPECTED_COLUMNS = {
    "model", "batch_size", "seq_len", "accum_steps", "effective_batch_size", "tokens", "policy",
    "effective_density", "dtype", "device", "peak_bytes", "peak_activations_bytes", "saved_activation_bytes",
    "step_ms", "tokens_per_s", "recompute_count", "fits", "status", "message", "cell_id", "isolated",
    "inferred", "seed", "cell_wall_s", "memory_limit_bytes",
}


def test_small_sweep_every_record_and_figures(tmp_path):
    out = tmp_path / "small"
    df = sweep(model="gpt-tiny", batch_sizes=[2, 1], seq_lens=[16], policies=["none", "full"],
               dtypes=["fp32", "bf16"], accum_steps=[1, 2], out=out, steps=2, warmup=0, max_seconds=0.2, progress=False)
    assert len(df) == 16 and df["cell_id"].is_unique
    assert EXPECTED_COLUMNS <= set(df.columns)
    assert (df["status"] == "ok").all(), df["message"].tolist()
    assert not df["isolated"].any() and not df["inferred"].any()
    acc = df[df["accum_steps"] == 2]
    assert (acc["effective_batch_size"] == 2 * acc["batch_size"]).all()
    assert (acc["tokens"] == acc["batch_size"] * 16 * 2).all()
    # Checkpointing every block must hold fewer activations than none at the same shape.
    key = ["batch_size", "dtype", "accum_steps"]
    none = df[df.policy == "none"].set_index(key)["saved_activation_bytes"]
    full = df[df.policy == "full"].set_index(key)["saved_activation_bytes"]
    assert (full < none.loc[full.index]).all()
    full_rows = df[df.policy == "full"]  # gpt-tiny: 4 blocks, each recomputed once per micro-batch
    assert (full_rows["recompute_count"] == 4 * full_rows["accum_steps"]).all()
    # Batches run in ascending order per policy, whatever order they were given in; the policies
    # of one (batch, seq, dtype, accum) are timed together, paired with the first.
    for _, g in df.groupby(["policy", "dtype", "accum_steps"], sort=False):
        assert list(g["batch_size"]) == [1, 2]
    assert (df["timing_baseline"] == "none").all()
    assert (df["time_ratio_low"] <= df["time_ratio"]).all() and (df["time_ratio"] <= df["time_ratio_high"]).all()
    assert (df["step_ms_low"] <= df["step_ms"]).all() and (df["step_ms"] <= df["step_ms_high"]).all()
    plots.redraw_all(df.attrs["run_dir"])   # a sweep returns its run; figures are drawn on request
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert len(figures) == 8 and all(p.stat().st_size > 1000 for p in (out / "figures").iterdir())
    meta = json.loads((out / "run.json").read_text())
    assert meta["config"]["batch_sizes"] == [1, 2] and meta["finished_at"] and meta["status_counts"]["ok"] == 16
    assert meta["environment"]["packages"]["torch"] and meta["git_commit"]


def test_emulated_oom_marks_larger_batches_inferred(tmp_path):
    df = sweep(model="mlp-chain", batch_sizes=[1, 2, 4, 8, 16], seq_lens=[64], policies=["none", "full"],
               memory_limit="7MiB", out=tmp_path / "oom", **FAST)
    assert len(df) == 10 and set(df["status"]) <= {"ok", "oom"}
    for policy, g in df.groupby("policy"):
        g = g.sort_values("batch_size")
        status = list(g["status"])
        first_oom = status.index("oom") if "oom" in status else len(status)
        assert all(s == "ok" for s in status[:first_oom]) and all(s == "oom" for s in status[first_oom:])
        if first_oom < len(status):
            assert not g["inferred"].iloc[first_oom] and g["peak_bytes"].iloc[first_oom] > 7 * 2**20
            assert g["inferred"].iloc[first_oom + 1:].all()
            assert g["message"].iloc[first_oom + 1:].str.contains("inferred").all()
    none, full = (df[(df.policy == p) & (df.status == "ok")]["batch_size"].max() for p in ("none", "full"))
    assert df[df.policy == "none"]["inferred"].any(), "limit should stop 'none' before batch 16"
    assert full > none  # checkpointing fits a larger batch under the same limit


@pytest.mark.parametrize("bad, shown", [
    (dict(batch_sizes=[0]), "0"), (dict(seq_lens=[-1]), "-1"), (dict(policies=["density=2"]), "density=2"),
    (dict(model="gpt-huge"), "gpt-huge"), (dict(dtypes=["fp8"]), "fp8"), (dict(device="tpu"), "tpu"),
    (dict(accum_steps=[0]), "0"), (dict(memory_limit="lots"), "lots"), (dict(seq_lens=[999]), "999"),
    (dict(policies=["layers=7"]), "layers=7"), (dict(batch_sizes=[]), "batch_sizes"),
])
def test_bad_grid_value_clear_error_nothing_written(tmp_path, bad, shown):
    out = tmp_path / "bad"
    with pytest.raises(ValueError, match="invalid") as err:
        sweep(out=out, **{**FAST, **bad})
    assert shown in str(err.value)
    assert not out.exists()


def test_resume_skips_finished_cells_and_checks_settings(tmp_path):
    out = tmp_path / "resume"
    first = sweep(model="mlp-chain", batch_sizes=[1], seq_lens=[8], policies=["none", "full"], out=out, **FAST)
    second = sweep(model="mlp-chain", batch_sizes=[1, 2], seq_lens=[8], policies=["none", "full"], out=out, **FAST)
    assert len(first) == 2 and len(second) == 4 and second["cell_id"].is_unique
    kept = second.set_index("cell_id").loc[first["cell_id"], "finished_at"]
    assert list(kept) == list(first["finished_at"])  # the old cells were not re-run
    with pytest.raises(ValueError, match="steps=2"):
        sweep(model="mlp-chain", batch_sizes=[1], seq_lens=[8], out=out, **{**FAST, "steps": 2})
    with pytest.raises(ValueError, match="resume"):
        sweep(model="mlp-chain", batch_sizes=[1], seq_lens=[8], out=out, resume=False, **FAST)
    assert len(load_run(out)) == 4


def test_sigkill_mid_run_then_resume_loses_and_duplicates_nothing(tmp_path):
    out = tmp_path / "killed"
    grid = dict(model="gpt-tiny", model_overrides=dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64),
                batch_sizes=[1, 2, 3], seq_lens=[16, 32], policies=["none", "density=0.5", "full"])
    code = f"from ckptlab import sweep; sweep(out={str(out)!r}, steps=1, warmup=1, max_seconds=0.2, progress=False, **{grid!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    records = out / "records.jsonl"
    deadline = time.time() + 300   # a loaded machine is slow; the kill must still land mid-run
    while time.time() < deadline and proc.poll() is None:
        if records.exists() and records.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the sweep finished before it could be killed: " + proc.stderr.read().decode()[-500:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [json.loads(line) for line in records.read_text().splitlines()]
    assert 3 <= len(before) < 18
    with open(records, "a") as f:  # what a kill in the middle of a write leaves behind
        f.write('{"model": "gpt-tiny", "batch_si')
    with pytest.warns(RuntimeWarning, match="torn"):
        assert len(load_run(out)) == len(before)  # a torn line never breaks loading
    with pytest.warns(RuntimeWarning, match="torn"):
        df = sweep(out=out, steps=1, warmup=1, max_seconds=0.2, progress=False, **grid)
    assert len(df) == 18 and df["cell_id"].is_unique
    after = df.set_index("cell_id")
    for r in before:
        assert after.loc[r["cell_id"], "finished_at"] == r["finished_at"]
    # The file is clean again: every line parses.
    assert all(json.loads(line) for line in records.read_text().splitlines())


def test_second_sweep_on_a_folder_in_use_is_refused(tmp_path):
    out = tmp_path / "locked"
    with RunWriter(out):
        with pytest.raises(RunLockedError, match="in use"):
            sweep(model="mlp-chain", batch_sizes=[1], seq_lens=[8], out=out, **FAST)
    assert not (out / "records.jsonl").read_text()
    # Released: the same sweep now runs.
    assert len(sweep(model="mlp-chain", batch_sizes=[1], seq_lens=[8], policies=["none"], out=out, **FAST)) == 1


def test_isolated_cell_runs_in_a_subprocess_and_agrees(tmp_path):
    kw = dict(model="mlp-chain", batch_sizes=[2], seq_lens=[8], policies=["full"], **FAST)
    iso = sweep(out=tmp_path / "iso", isolate=True, **kw).iloc[0]
    inproc = sweep(out=tmp_path / "inproc", isolate=False, **kw).iloc[0]
    assert iso["status"] == "ok" and bool(iso["isolated"]) and not bool(inproc["isolated"])
    assert iso["peak_bytes"] == inproc["peak_bytes"] and iso["saved_activation_bytes"] == inproc["saved_activation_bytes"]


def test_no_secret_or_absolute_path_in_the_run_folder(tmp_path, monkeypatch):
    token = "hf_FAKEtoken_8c1d2e3f4a5b"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("WANDB_API_KEY", token)
    out = tmp_path / "secret-run"
    sweep(model="mlp-chain", batch_sizes=[1], seq_lens=[8], policies=["none"], out=out,
          isolate=True, steps=1, warmup=0, max_seconds=0.2, progress=False)  # isolated: the child sees the environment too
    plots.redraw_all(out)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) >= 10
    for p in files:
        data = p.read_bytes()
        assert token.encode() not in data, p.name
        assert str(tmp_path).encode() not in data, p.name
        assert str(Path.home()).encode() + b"/" not in data, p.name


def test_cli_sweep_then_plot(tmp_path, capsys):
    out = str(tmp_path / "cli")
    args = ["sweep", "--model", "mlp-chain", "--batch", "1,2", "--seq", "8", "--policy", "none,full",
            "--accum", "1,2", "--steps", "1", "--warmup", "0", "--max-seconds", "0.2", "--out", out, "--no-progress",
            "--no-plots"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "8 cells: 8 ok, 0 oom (0 inferred), 0 error" in text and "best configuration" in text
    assert cli_main(args) == 2  # same folder without --resume: refused, clear error
    assert "--resume" in capsys.readouterr().err
    assert cli_main(args + ["--resume"]) == 0
    assert cli_main(["plot", out]) == 0
    assert len(list((tmp_path / "cli" / "figures").glob("*.svg"))) == 4
    assert cli_main(["sweep", "--batch", "0", "--out", out + "-bad"]) == 2
    assert not Path(out + "-bad").exists()


def test_measure_gradient_accumulation_record():
    r = measure("mlp-chain", 2, 8, "none", steps=1, warmup=0, max_seconds=0.2, loop="accum=3")
    assert r["status"] == "ok"
    assert (r["accum_steps"], r["effective_batch_size"], r["tokens"]) == (3, 6, 48)
    one = measure("mlp-chain", 2, 8, "none", steps=1, warmup=0, max_seconds=0.2)
    assert one["accum_steps"] == 1 and one["tokens"] == 16
    # Micro-batch activations are what is held: about the same saved bytes as one micro-batch.
    assert r["saved_activation_bytes"] == one["saved_activation_bytes"]
    with pytest.raises(ValueError, match="accum_steps=0"):
        measure("mlp-chain", 2, 8, loop="accum=0")


def test_source_commit_names_ckptlabs_own_repository_only(tmp_path):
    from ckptlab.run.provenance import source_commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "vendored" / "ckptlab").mkdir(parents=True)
    (tmp_path / "vendored" / "ckptlab" / "__init__.py").write_text("")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    assert source_commit(tmp_path / "vendored") is None        # ckptlab inside another repository
    commit = source_commit(tmp_path)
    assert len(commit) == 40
    (tmp_path / "vendored" / "ckptlab" / "__init__.py").write_text("# edited\n")
    assert source_commit(tmp_path) == commit + "-dirty"
    assert source_commit(tmp_path.parent / "no-such-folder") is None
