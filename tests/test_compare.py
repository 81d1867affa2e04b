"""ckptlab.compare: memory per configuration, interleaved timing with intervals, anchors, the
gradient check, the files and the CLI. Timing tests assert properties of intervals, not times."""

import contextlib
import gc
import json
import subprocess
import sys
import weakref

import pandas as pd
import pytest
import torch

from ckptlab import compare, get_workload
from ckptlab.apps.cli import main
from ckptlab.report import plots
from ckptlab.report.plots import compare_plot, policy_style
from ckptlab.run.compare import write

# A shape where recomputation is clearly measurable (full adds ~60% to a step of a few dozen ms),
# so that an interval of a few rounds is narrow enough to tell `full` from `none`.
SHAPE = dict(workload="gpt-tiny", batch_size=2, seq_len=64)


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: on a machine shared with other jobs, two OpenMP threads wait on each other
    whenever one is descheduled, which makes steps several times slower and far noisier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def busy_core(seconds: float = 30):
    """Another process spinning on one core for at most `seconds`: a noisy neighbour."""
    proc = subprocess.Popen([sys.executable, "-c",
                             f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def a_a(**kwargs):
    return compare(**SHAPE, policies=["none", "density=0"], target_ci=0.01, max_seconds=1.5, **kwargs)


def interval_contains_one(df) -> bool:
    row = df.set_index("policy").loc["density=0.0"]
    return row["time_ratio_low"] <= 1 <= row["time_ratio_high"]


@pytest.mark.parametrize("noisy_neighbour", [False, True], ids=["quiet", "one-core-busy"])
def test_a_a_interval_contains_one(noisy_neighbour):
    """`none` and `density=0` run the same computation. A correct 95% interval misses 1 in about
    one A/A run in 20, so a miss is retried twice: three misses in a row (1 in 8,000 for a correct
    interval) fail, as does a protocol biased by order or by the neighbour (the step that opens a
    round is a few percent slower here: per-round ratios put the median in one order's cluster,
    which the per-cycle ratios of `ckptlab.probe.timing` cancel). Under `make test` the other
    test worker is a neighbour whose load comes in bursts (inductor compiles), which two runs in a
    row have missed together (1.004 [1.0005, 1.014] after a first miss)."""
    with busy_core() if noisy_neighbour else contextlib.nullcontext():
        df = a_a()
        for _ in range(2):
            if interval_contains_one(df):
                break
            df = a_a()
    assert interval_contains_one(df), df[["policy", "time_ratio", "time_ratio_low", "time_ratio_high", "rounds"]]
    assert not df.set_index("policy").loc["density=0.0", "significant"]
    assert (df["peak_bytes"].iloc[0] == df["peak_bytes"]).all()


def test_full_recompute_is_significantly_slower():
    df = compare(**SHAPE, policies=["none", "full"], target_ci=0.02, max_seconds=2)
    full = df.set_index("policy").loc["full"]
    assert full["time_ratio_low"] > 1 and full["significant"], df[["policy", "time_ratio_low", "time_ratio_high"]]
    none = df.set_index("policy").loc["none"]
    assert full["peak_bytes"] < none["peak_bytes"] and full["saved_activation_bytes"] < none["saved_activation_bytes"]


def resident_optimizers_at_each_gradient_check(monkeypatch) -> list[int]:
    """How many of the optimizers the timed configurations built are alive each time the gradient
    check runs a model: each holds its model's state, which on a card must be gone by then (a 1B
    model: 13.8 GiB each), as the check builds fresh models."""
    import ckptlab.probe.measure as measure_module
    import ckptlab.run.verify_rows as verify_module

    optimizers, alive = [], []
    make_optimizer, step_gradients = measure_module.make_optimizer, verify_module.step_gradients

    def tracked(*args, **kwargs):
        optimizer = make_optimizer(*args, **kwargs)
        optimizers.append(weakref.ref(optimizer))
        return optimizer

    def counting(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in optimizers))
        return step_gradients(*args, **kwargs)

    monkeypatch.setattr(measure_module, "make_optimizer", tracked)
    monkeypatch.setattr(verify_module, "step_gradients", counting)
    return alive


def test_one_row_per_policy_with_memory_time_and_interval_columns(tmp_path, monkeypatch):
    resident = resident_optimizers_at_each_gradient_check(monkeypatch)
    df = compare("gpt-tiny", 1, 16, "none,density=0.5,full", max_seconds=0.5, verify=True, out=tmp_path)
    assert resident == [0, 0, 0, 0]   # the reference's check and each row's: no timed configuration left
    assert list(df["policy"]) == ["none", "density=0.5", "full"]
    assert list(df["effective_density"]) == [0.0, 0.5, 1.0]
    for column in ("policy", "source", "effective_density", "peak_bytes", "saved_activation_bytes", "step_ms",
                   "time_ratio", "time_ratio_low", "time_ratio_high", "significant", "rounds", "threads",
                   "load_before", "load_after", "busy", "max_grad_diff"):
        assert column in df, column
    assert (df["status"] == "ok").all() and (df["source"] == "ckptlab").all()
    assert df["peak_bytes"].is_monotonic_decreasing
    assert df.loc[0, ["time_ratio", "time_ratio_low", "time_ratio_high"]].tolist() == [1.0, 1.0, 1.0]
    assert (df["time_ratio_low"] <= df["time_ratio"]).all() and (df["time_ratio"] <= df["time_ratio_high"]).all()
    assert (df["rounds"] >= 5).all() and (df["threads"] == 1).all()
    assert (df["max_grad_diff"] == 0).all()  # checkpointing never changes gradients (dropout on)
    assert (df["gradients"] == "exact").all()
    saved = pd.read_csv(tmp_path / "compare.csv")
    assert list(saved["policy"]) == list(df["policy"])
    assert json.loads((tmp_path / "compare.json").read_text())[2]["policy"] == "full"


def test_anchors_on_a_transformers_model(monkeypatch):
    pytest.importorskip("transformers")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler for inductor here")

    monkeypatch.setattr(torch, "compile", no_compiler)
    workload = get_workload("hf-llama-tiny", num_hidden_layers=2)
    df = compare(workload, 1, 16, ["none"], anchors=True, max_seconds=0.5).set_index("policy")
    sources = dict(zip(df.index, df["source"]))
    assert sources["torch.utils.checkpoint per block"] == "torch.utils.checkpoint"
    assert df.loc["torch.utils.checkpoint per block", "effective_density"] == 1.0
    assert df.loc["transformers every_n_layers=2", "effective_density"] == 0.5   # layer 0 of 2
    assert df.loc["transformers every_n_layers=4", "effective_density"] == 0.5
    assert df.loc["transformers + torch SAC (context_fn)", "status"] == "ok"
    compiled = df.loc["torch.compile activation_memory_budget=0.5"]
    assert compiled["status"] == "error" and "no C++ compiler" in compiled["message"]
    # Per-block torch.utils.checkpoint and transformers' every-layer checkpointing hold the same.
    assert (df.loc["torch.utils.checkpoint per block", "peak_bytes"]
            == df.loc["transformers checkpointing (every layer)", "peak_bytes"])
    plans = df[df["plan_at_peak_of"].notna()]
    eager, compiled_plans = plans[~plans.index.str.contains("compile")], plans[plans.index.str.contains("compile")]
    assert len(eager) and (eager["status"] == "ok").all()
    assert "torch.utils.checkpoint per block" in "; ".join(eager["plan_at_peak_of"])
    # Beside each eager plan, the compiled plan at that peak: here it says why there is none.
    anchors_ran = df[~df["source"].isin(["ckptlab", "ckptlab plan"]) & (df["status"] == "ok")]
    assert len(compiled_plans) == len(anchors_ran) and (compiled_plans["status"] == "error").all()
    assert compiled_plans["message"].str.contains("the compiled all-keep plan plan=kk+compile did not run",
                                                  regex=False).all()
    timed = df[df["status"] == "ok"]
    assert timed["time_ratio"].notna().all() and timed["rounds"].nunique() == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(policies=[]), "policies=\\[\\] is invalid"), (dict(policies=["fulll"]), "fulll"),
    (dict(batch_size=0), "batch_size=0 is invalid"), (dict(dtype="fp8"), "dtype='fp8' is invalid"),
    (dict(target_ci=2), "target_ci=2 is invalid"), (dict(max_seconds=0), "max_seconds=0 is invalid"),
    (dict(seq_len=10_000), "seq_len=10000 is invalid"),
])
def test_bad_input_is_refused_before_any_work(kwargs, match):
    args = {**dict(workload="gpt-tiny", batch_size=1, seq_len=16, policies=["none"]), **kwargs}
    with pytest.raises(ValueError, match=match):
        compare(**args)


def test_cli_prints_the_table_and_draws_the_figure(tmp_path, capsys):
    assert main(["compare", "--batch", "1", "--seq", "16", "--policy", "none,full", "--max-seconds", "0.5",
                 "--verify", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "time ratio [95% CI]" in text and "interleaved rounds" in text and "full" in text
    assert "gradients" in text and "exact" in text
    assert (tmp_path / "figures" / "compare.png").stat().st_size > 0


def test_compare_plot_draws_error_bars():
    df = pd.DataFrame([
        dict(policy="none", source="ckptlab", status="ok", time_ratio=1.0, time_ratio_low=1.0, time_ratio_high=1.0,
             peak_bytes=4e6, timing_baseline="none", model="m", batch_size=1, seq_len=8, dtype="fp32", rounds=9,
             busy=False),
        dict(policy="hf", source="transformers", status="ok", time_ratio=1.3, time_ratio_low=1.2,
             time_ratio_high=1.4, peak_bytes=2e6, timing_baseline="none", model="m", batch_size=1, seq_len=8,
             dtype="fp32", rounds=9, busy=False),
    ])
    ax = compare_plot(df).axes[0]
    segments = [seg for coll in ax.collections for seg in coll.get_segments()]
    assert any(abs(seg[0][0] - 1.2) < 1e-9 and abs(seg[1][0] - 1.4) < 1e-9 for seg in segments)
    # Colour is the policy's (as in every figure), the marker the row's source.
    points = {tuple(line.get_xdata()): line for line in ax.lines if line.get_marker() in ("o", "s", "D") and len(line.get_xdata())}
    assert points[(1.3,)].get_color() == policy_style("hf")["color"] and points[(1.3,)].get_marker() == "s"
    assert points[(1.0,)].get_color() == policy_style("none")["color"] and points[(1.0,)].get_marker() == "o"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ckptlab policy", "anchor (framework knob)"]
    # A row whose gradients are wrong is crossed out and says so.
    wrong = compare_plot(df.assign(gradients=["exact", "wrong"])).axes[0]
    assert any(line.get_marker() == "x" and tuple(line.get_xdata()) == (1.3,) for line in wrong.lines)
    assert any("hf (WRONG gradients)" in t.get_text() for t in wrong.texts)


def test_a_comparisons_figure_is_redrawn_from_its_folder(tmp_path, monkeypatch):
    df = pd.DataFrame([
        dict(policy="none", source="ckptlab", status="ok", time_ratio=1.0, time_ratio_low=1.0, time_ratio_high=1.0,
             peak_bytes=4e6, timing_baseline="none", model="m", batch_size=1, seq_len=8, dtype="fp32", rounds=9,
             busy=False, gradients=None),
        dict(policy="full", source="ckptlab", status="ok", time_ratio=1.3, time_ratio_low=1.2,
             time_ratio_high=1.4, peak_bytes=2e6, timing_baseline="none", model="m", batch_size=1, seq_len=8,
             dtype="fp32", rounds=9, busy=False, gradients="exact"),
    ])
    write(df, tmp_path)
    drawn = []
    monkeypatch.setattr(plots, "compare_plot", lambda table, path: drawn.append(table) or compare_plot(table, path))
    assert plots.redraw_all(tmp_path) == [tmp_path / "figures" / "compare.png", tmp_path / "figures" / "compare.svg"]
    assert (tmp_path / "figures" / "compare.png").stat().st_size > 0
    pd.testing.assert_frame_equal(drawn[0], df, check_dtype=False)   # the table it was drawn from, read back


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_configurations_timed_together_with_events():
    df = compare("gpt-tiny", 2, 64, ["none", "full"], device="cuda", max_seconds=2).set_index("policy")
    assert (df["status"] == "ok").all() and (df["rounds"] >= 5).all()
    assert df.loc["full", "peak_bytes"] < df.loc["none", "peak_bytes"]
    # Each configuration's allocator peak excludes the other configuration's resident weights.
    assert df.loc["full", "cuda_max_allocated_bytes"] < df.loc["none", "cuda_max_allocated_bytes"]

