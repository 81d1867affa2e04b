"""The GPU validation on CPU: its refusal without a GPU, its time budget, and every verdict it
draws from records, on synthetic records whose answers are known."""

import csv
import math
import os
import platform
import re
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pandas as pd
import pytest
import torch

from ckptlab.apps import gpu_check
from ckptlab.core.records import new_record
from ckptlab.probe.memory import saved_bytes_by_node
from ckptlab.report import gpu_validation as gv
from ckptlab.report.analysis import trainer_summary

from .conftest import requires_cuda

ROOT = Path(__file__).resolve().parents[1]


def block(n: int) -> int:
    """What the CUDA caching allocator hands out for n bytes: whole 512-byte blocks."""
    return max(512, -(-n // 512) * 512)


def cell(policy="none", tracker=0, allocated=None, requested=None, recomputes=None, status="ok", **values):
    return new_record("gpt2-small", 8, 1024, policy=policy, dtype="bf16", status=status, peak_bytes=tracker,
                      cuda_max_allocated_bytes=allocated, cuda_max_requested_bytes=requested,
                      recompute_count=recomputes, **values)


def torch_only_site(folder: Path) -> Path:
    """A folder of links to torch and its required distributions (as its metadata names them,
    recursively), and nothing else: what a GPU image without the lock's packages offers."""
    from packaging.requirements import Requirement

    folder.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        dist = metadata.distribution(name)
        todo += [r.name for r in map(Requirement, dist.requires or []) if not r.marker or r.marker.evaluate({"extra": ""})]
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(str(dist.locate_file(top)))
            if not top.endswith((".dist-info", ".pth")) and top not in ("__pycache__", "..", "bin") and source.exists() \
                    and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return folder


def recording_pip(folder: Path) -> Path:
    """A bin folder whose pip, pip3 and python3 -m pip record that they were called (in `called`)."""
    folder.mkdir()
    for name in ("pip", "pip3"):
        script = folder / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {folder / "called"}\nexit 1\n')
        script.chmod(0o755)
    return folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_with_only_torch_importable_it_starts_exits_2_with_one_line_and_never_calls_pip(tmp_path):
    site, bin_dir, work = torch_only_site(tmp_path / "site"), recording_pip(tmp_path / "bin"), tmp_path / "work"
    work.mkdir()
    # -S: no site-packages, so no pandas, numpy, matplotlib, yaml, transformers; torch alone warns that
    # it runs without numpy (its own warning, ignored here: the check's line is the one asserted).
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin",
           "HOME": str(tmp_path), "PYTHONWARNINGS": "ignore:Failed to initialize NumPy"}
    # `python3 -m ckptlab.apps.gpu_check`, and on the way out the optional packages it imported
    run_and_list = ("import atexit, runpy, sys; atexit.register(lambda: print(sorted({m.split('.')[0] for m in "
                    "sys.modules} & {'numpy', 'pandas', 'yaml', 'matplotlib', 'transformers', 'tqdm', 'papermill', "
                    "'nbformat'}))); runpy.run_module('ckptlab.apps.gpu_check', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-S", "-c", run_and_list], capture_output=True, text=True, cwd=work, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "[]\n"
    assert len(proc.stderr.strip().splitlines()) == 1 and "gpu-check: no CUDA device is available" in proc.stderr
    assert list(work.iterdir()) == [] and not (bin_dir / "called").exists()


def test_the_check_installs_and_downloads_nothing():
    """No module the check runs spawns pip or reaches the network: read in their sources."""
    # pip as a command's word, ensurepip, `-m pip`; the network's clients. ("pip install ..." in a
    # message tells a user what to run and is allowed.)
    forbidden = re.compile(r"""ensurepip|["']pip3?["']|-m pip|urllib\.request|import requests|requests\.(?:get|post)|"""
                           r"""from_pretrained|snapshot_download|hf_hub_download""")
    modules = [m for name, m in sys.modules.items() if name.startswith("ckptlab.") and getattr(m, "__file__", None)]
    sources = [Path(m.__file__) for m in modules] + [ROOT / "benchmarks" / "overhead.py"]
    assert Path(gpu_check.__file__) in sources and len(sources) > 20
    found = {str(p.relative_to(ROOT)): forbidden.findall(p.read_text()) for p in sources}
    assert {k: v for k, v in found.items() if v} == {}


def test_make_gpu_check_needs_no_venv():
    dry = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "VENV=/nonexistent"], capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0 and dry.stdout.strip() == "python3 -m ckptlab.apps.gpu_check"


def test_a_stage_whose_package_is_missing_is_skipped_saying_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "NEEDS", dict(gpu_check.NEEDS, overhead=("numpy", "no_such_package_here")))
    monkeypatch.setattr(gpu_check, "memory_stage", lambda *a: [])
    monkeypatch.setattr(gpu_check, "trainer_stage", lambda *a: gv.Claim(gv.TRAINER_CLAIM, gv.PASS, "", counts=False))
    monkeypatch.setattr(gpu_check, "frontier_stage", lambda *a: gv.Claim(gv.FRONTIER_CLAIM, gv.PASS, ""))
    monkeypatch.setattr(gpu_check, "snapshot_stage", lambda *a: "")
    claims, _ = gpu_check.run_check(tmp_path, torch.device("cpu"), gpu_check.TimeBudget(600))
    assert [(c.name, c.status, c.summary) for c in claims] == [
        (gv.OVERHEAD_CLAIM, gv.SKIPPED, "not tested: needs no_such_package_here, not installed here"),
        (gv.TRAINER_CLAIM, gv.PASS, ""), (gv.FRONTIER_CLAIM, gv.PASS, "")]
    assert gv.exit_status(claims) == 3
    assert gpu_check.missing(["torch", "no_such_package_here"]) == ["no_such_package_here"]


# ----------------------------------------------------------------------------- memory, measured

def test_the_allocator_difference_is_explained_term_by_term():
    # Tensors of these sizes live at the peak; the allocator rounds each to 512-byte blocks.
    sizes = [3_000_000, 1_000_001, 513, 7]
    tracker, requested_tensors = sum(sizes), sum(sizes)
    rounding = sum(block(n) for n in sizes) - tracker
    assert rounding == (3_000_320 - 3_000_000) + (1_000_448 - 1_000_001) + (1024 - 513) + (512 - 7) == 1783
    workspace, rng_state, regions = 8 * 2**20, 16, 12
    requested = requested_tensors + workspace + rng_state * regions
    allocated = requested + rounding
    explained = cell("full", tracker, allocated, requested, regions)
    # The same tensors, and 2% of the peak the allocator holds that nothing explains.
    extra = int(0.02 * tracker)
    unexplained = cell("none", tracker, allocated + extra, requested + extra, 0)
    no_requested = cell("selective", tracker, allocated, None, 12)
    oom = cell("density=0.5", None, None, None, status="oom")
    gaps = gv.allocator_gap([explained, unexplained, no_requested, oom], workspace, rng_state)

    assert len(gaps) == 3
    a, b, c = gaps
    assert a["rounding_bytes"] == rounding and a["workspace_bytes"] == workspace
    assert a["rng_state_bytes"] == rng_state * regions
    assert a["gap_bytes"] == allocated - tracker and a["rest_bytes"] == 0 and a["explained"]
    assert b["rng_state_bytes"] == 0 and b["rest_bytes"] == extra + rng_state * regions  # no region of its own
    assert b["rest_frac"] == (extra + rng_state * regions) / tracker and not b["explained"]
    assert math.isnan(c["rest_bytes"]) and not c["explained"]

    claim = gv.memory_measured_claim(gaps)
    assert claim.status == gv.FAIL and "2 cells beyond it" in claim.summary
    assert gv.memory_measured_claim(gaps[:1]).status == gv.PASS
    assert "rounding" in claim.details and "gpt2-small b=8 s=1024 full bf16" in claim.details
    assert gv.memory_measured_claim(gv.allocator_gap([], 0, 0)).status == gv.FAIL


def test_a_rest_just_inside_the_limit_is_explained_and_a_negative_rest_counts_too():
    tracker = 10_000_000
    inside = cell("none", tracker, tracker + 100_000, tracker + 100_000, 0)      # rest 1.0% exactly
    below = cell("full", tracker, tracker - 150_000, tracker - 150_000, 0)       # the allocator saw less: -1.5%
    gaps = gv.allocator_gap([inside, below], workspace_bytes=0, rng_state_bytes=0)
    assert [g["explained"] for g in gaps] == [True, False]
    assert [g["rest_frac"] for g in gaps] == pytest.approx([0.01, -0.015])


# ----------------------------------------------------------------------------- memory, predicted

def predicted_cell(policy, allocated, reserved, predicted, predicted_reserved, dropout=0.1, backend="flash",
                   predicted_backend="flash", **values):
    return cell(policy, allocated, allocated, allocated, dropout=dropout, cuda_max_reserved_bytes=reserved,
                predicted_peak_bytes=predicted, predicted_reserved_bytes=predicted_reserved,
                measured_backend=backend, predicted_backend=predicted_backend, **values)


def test_the_cuda_prediction_is_judged_against_max_allocated_and_max_reserved():
    gib = 2**30
    cells = [
        predicted_cell("none", 20 * gib, 22 * gib, 20.3 * gib, 21.0 * gib, dropout=0.0),   # +1.5%, -4.5%
        predicted_cell("full", 10 * gib, 12 * gib, 9.81 * gib, 12.5 * gib),                # -1.9%, +4.2%
        predicted_cell("selective", 14 * gib, 16 * gib, 14 * gib, 16 * gib, backend=None),  # backend not seen: not judged
    ]
    errors = gv.prediction_errors(cells)
    assert [e["allocated_error"] for e in errors] == pytest.approx([0.015, -0.019, 0.0])
    assert [e["reserved_error"] for e in errors] == pytest.approx([-1 / 22, 0.5 / 12, 0.0])
    assert all(e["allocated_within"] and e["reserved_within"] and e["backend_agrees"] and not e["problem"]
               for e in errors)
    for quantity, name in (("allocated", gv.ALLOCATED_CLAIM), ("reserved", gv.RESERVED_CLAIM)):
        claim = gv.memory_predicted_claim(errors, quantity)
        assert claim.name == name and claim.status == gv.PASS, claim.summary
    allocated = gv.memory_predicted_claim(errors, "allocated")
    assert allocated.summary.startswith("3 cells, errors -1.90% .. +1.50% (target ±2%)")
    assert "attention backend predicted as CUDA ran it in 3 of 3 cells" in allocated.summary
    assert "gpt2-small b=8 s=1024 full bf16 dropout=0.1" in allocated.details and "flash" in allocated.details
    assert gv.ALLOCATED_CLAIM == "memory, predicted: max allocated (±2%)"
    assert gv.RESERVED_CLAIM == "memory, predicted: max reserved (±5%)"


@pytest.mark.parametrize("change, allocated_status, reserved_status, words", [
    (dict(predicted_peak_bytes=1.021), gv.FAIL, gv.PASS, "1 beyond it"),            # +2.1% allocated
    (dict(predicted_reserved_bytes=1.06), gv.PASS, gv.FAIL, "1 beyond it"),         # +6% reserved
    (dict(predicted_backend="math"), gv.FAIL, gv.PASS, "in 1 of 2 cells"),          # the wrong kernel chosen
    (dict(predicted_peak_bytes=None, predicted_reserved_bytes=None, prediction_message="TypeError: device"),
     gv.FAIL, gv.FAIL, "not predicted: TypeError: device"),
    (dict(status="oom", message="CUDA out of memory"), gv.FAIL, gv.FAIL, "oom: CUDA out of memory"),
])
def test_a_cell_beyond_its_target_or_not_judged_fails_the_claim(change, allocated_status, reserved_status, words):
    gib = 2**30
    good = predicted_cell("none", 10 * gib, 12 * gib, 10 * gib, 12 * gib)
    bad = predicted_cell("full", 10 * gib, 12 * gib, 10 * gib, 12 * gib)
    for key, value in change.items():
        bad[key] = value * bad[key] if isinstance(value, float) else value
    errors = gv.prediction_errors([good, bad])
    allocated, reserved = (gv.memory_predicted_claim(errors, q) for q in ("allocated", "reserved"))
    assert (allocated.status, reserved.status) == (allocated_status, reserved_status)
    assert words in (allocated.summary if allocated.status == gv.FAIL else reserved.summary)


def test_cells_left_out_for_time_make_the_claim_skipped_not_passed():
    gib = 2**30
    errors = gv.prediction_errors([predicted_cell("none", 10 * gib, 12 * gib, 10 * gib, 12 * gib)])
    not_run = ["8 cells from hf-llama-1b none dropout=0 on (needs about 12 s, 3 s of the 450 s budget left)"]
    claim = gv.memory_predicted_claim(errors, "allocated", not_run)
    assert claim.status == gv.SKIPPED and "not run: 8 cells from hf-llama-1b" in claim.summary
    assert gv.memory_predicted_claim([], "reserved", not_run).status == gv.SKIPPED
    assert gv.memory_predicted_claim([], "reserved").status == gv.FAIL


def test_the_attention_backend_is_read_from_the_autograd_nodes():
    assert gv.attention_backend_of(["AddmmBackward0", "ScaledDotProductFlashAttentionBackward0"]) == "flash"
    assert gv.attention_backend_of(["ScaledDotProductEfficientAttentionBackward0", "SoftmaxBackward0"]) == "efficient"
    assert gv.attention_backend_of(["ScaledDotProductCudnnAttentionBackward0"]) == "cudnn"
    assert gv.attention_backend_of(["BmmBackward0", "SoftmaxBackward0", "NativeDropoutBackward0"]) == "math"
    assert gv.attention_backend_of(["SafeSoftmaxBackward0", "LogSoftmaxBackward0"]) == "math"
    assert gv.attention_backend_of(["LogSoftmaxBackward0"]) is None      # the loss's, not attention's
    assert gv.attention_backend_of(["AddmmBackward0"]) is None
    # a real forward on CPU (bf16 without dropout takes the flash kernel for CPU, whose node names it)
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    nodes = saved_bytes_by_node(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum())
    assert gv.attention_backend_of(list(nodes)) in ("flash", "math")


# ----------------------------------------------------------------------------- time and the frontier

def compare_row(policy, source="ckptlab", peak=0, step=100.0, ratio=(1.0, 1.0, 1.0), diff=0.0, status="ok", group="g"):
    return dict(group=group, policy=policy, source=source, peak_bytes=peak, step_ms=step, step_ms_low=step - 1,
                step_ms_high=step + 1, time_ratio=ratio[0], time_ratio_low=ratio[1], time_ratio_high=ratio[2],
                max_grad_diff=diff, status=status, timing_stopped="target", model="m", seq_len=2048, batch_size=4,
                dtype="bf16",
                effective_batch_size=4)


def test_frontier_rows_read_intervals_gradients_and_the_frontier():
    rows = gv.frontier_rows(pd.DataFrame([
        compare_row("none", peak=40, step=100, diff=1e-6),
        compare_row("full", peak=20, step=130, ratio=(1.3, 1.28, 1.32), diff=1.5e-6),
        compare_row("selective", peak=30, step=101, ratio=(1.01, 0.99, 1.03), diff=5e-6),
        compare_row("density=0.5", peak=35, step=140, ratio=(1.4, 1.38, 1.42), diff=0.0),
        compare_row("compile", peak=30, step=90, ratio=(0.9, 0.88, 0.92), diff=1e-3),
        compare_row("transformers every_n_layers=2", source="transformers", status="error", diff=math.nan),
        compare_row("plan=5f+compile", source="ckptlab plan", peak=25, step=95, ratio=(0.95, 0.93, 0.97), diff=1e-3),
    ]))
    r = rows.set_index("policy")
    assert r.loc["full", "time_verdict"] == "slower" and r.loc["selective", "time_verdict"] == "no difference"
    assert r.loc["compile", "time_verdict"] == "faster"
    assert r.loc["full", "grad_verdict"] == "equal"             # within twice the floor of 1e-6
    assert r.loc["selective", "grad_verdict"] == "differs"      # five times it
    assert r.loc["compile", "grad_verdict"] == r.loc["plan=5f+compile", "grad_verdict"] == "compiled: reported"
    assert r.loc["transformers every_n_layers=2", "grad_verdict"] == "not run"
    # density=0.5 holds more than full and is slower beyond the intervals than it: dominated
    assert not r.loc["density=0.5", "pareto_optimal"] and r.loc["full", "pareto_optimal"]
    assert r.loc["compile", "pareto_optimal"] and not r.loc["none", "pareto_optimal"]

    claim = gv.frontier_claim(rows)
    assert claim.summary.startswith("m b=4 s=2048 bf16: 7 rows in 1 comparisons")
    assert claim.status == gv.FAIL and "1 rows whose gradients differ" in claim.summary
    assert "1.300 [1.280, 1.320]" in claim.details


def test_the_frontier_claim_passes_holds_anchors_harmless_and_is_skipped_when_groups_did_not_run():
    good = gv.frontier_rows(pd.DataFrame([
        compare_row("none", peak=40, diff=0.0),
        compare_row("full", peak=20, step=130, ratio=(1.3, 1.28, 1.32), diff=0.0),
        compare_row("torch.compile", source="torch.compile", status="error", diff=math.nan),
        compare_row("none", peak=40, diff=0.0, group="h"),
        compare_row("plan=kfkf", source="ckptlab plan", peak=30, step=110, ratio=(1.1, 1.08, 1.12), group="h"),
    ]))
    assert gv.frontier_claim(good).status == gv.PASS
    unverified = gv.frontier_rows(pd.concat([good, pd.DataFrame([   # a compiled group compared without verify
        compare_row("none", peak=40, diff=math.nan, group="compiled"),
        compare_row("compile", peak=30, step=90, ratio=(0.9, 0.88, 0.92), diff=math.nan, group="compiled")])],
        ignore_index=True))
    assert unverified["grad_verdict"].tolist()[-2:] == ["not verified", "not verified"]
    claim = gv.frontier_claim(unverified)
    assert claim.status == gv.PASS and "gradients not verified in: compiled" in claim.summary
    assert gv.frontier_claim(good, ["compiled (needs about 300 s, 20 s of the 480 s budget left)"]).status == gv.SKIPPED
    zero_floor = gv.frontier_rows(pd.DataFrame([compare_row("none", diff=0.0), compare_row("full", diff=1e-9)]))
    assert zero_floor["grad_verdict"].tolist() == ["equal", "differs"]
    no_interval = gv.frontier_rows(pd.DataFrame([compare_row("none"), compare_row("full", ratio=(1.3, None, None))]))
    assert gv.frontier_claim(no_interval).status == gv.FAIL
    broken = good.copy()
    broken.loc[4, "status"] = "oom"
    assert "1 ckptlab rows did not run" in gv.frontier_claim(broken).summary
    assert gv.frontier_claim(pd.DataFrame()).status == gv.FAIL


# ----------------------------------------------------------------------------- overhead and Trainer

@pytest.mark.parametrize("interval, status, words", [
    ((1.002, 0.996, 1.008), gv.PASS, "within +1%"),
    ((1.002, 0.990, 1.012), gv.FAIL, "not shown"),
    ((1.030, 1.020, 1.040), gv.FAIL, "beyond +1%"),
])
def test_the_overhead_claim_follows_the_whole_interval(interval, status, words):
    claim = gv.overhead_claim(*interval)
    assert claim.status == status and words in claim.summary


def trainer_frame(none_ms, checkpointed_ms):
    rows = []
    for run, times in (("none", none_ms), ("gradient_checkpointing", checkpointed_ms)):
        for step, ms in enumerate(times):
            rows.append(dict(run=run, step=step, policy=None, mechanism=run, effective_density=0.0,
                             memory_tracked=step == 0, peak_bytes=100.0 if step == 0 else None,
                             peak_activations_bytes=50.0, saved_activation_bytes=40.0, step_ms=ms, loss=1.0))
    return pd.DataFrame(rows)


def test_the_trainer_claim_reads_the_guides_twenty_percent_from_the_interval():
    steady = [999.0] + [100.0, 101.0, 99.0, 100.0, 100.5, 99.5] * 3
    holds = gv.trainer_claim(trainer_summary(trainer_frame(steady, [999.0] + [x * 1.2 for x in steady[1:]])))
    assert holds.status == gv.PASS and not holds.counts and "consistent with the guide's ~20%" in holds.summary
    more = gv.trainer_claim(trainer_summary(trainer_frame(steady, [999.0] + [x * 1.5 for x in steady[1:]])))
    assert more.status == gv.FAIL and "more than the guide's ~20%" in more.summary
    alone = gv.trainer_claim(trainer_summary(trainer_frame(steady, [999.0, 120.0])))
    assert alone.status == gv.FAIL and "too few timed steps" in alone.summary


# ----------------------------------------------------------------------------- report and budget

def test_the_report_says_pass_or_fail_per_claim_and_the_exit_status_follows():
    claims = [gv.Claim(gv.MEMORY_MEASURED_CLAIM, gv.PASS, "16 cells", "a table"),
              gv.Claim(gv.TRAINER_CLAIM, gv.FAIL, "+50%", counts=False),
              gv.skipped(gv.FRONTIER_CLAIM, "needs about 300 s, 20 s of the 480 s budget left")]
    assert gv.exit_status(claims) == 3
    assert gv.exit_status(claims[:2]) == 0                     # a reported-only claim does not count
    assert gv.exit_status(claims + [gv.Claim(gv.OVERHEAD_CLAIM, gv.FAIL, "")]) == 1
    text = gv.report_markdown(claims, "NVIDIA H200", 480, 401, ["a note"],
                              {"Python": "3.12.3", "torch": "2.11.0 (CUDA 12.8)", "pandas": "2.2.3", "papermill": None})
    assert text.startswith("# GPU validation on NVIDIA H200: INCOMPLETE")
    assert "Ran on: Python 3.12.3, torch 2.11.0 (CUDA 12.8), pandas 2.2.3; not installed: papermill." in text
    assert "| memory, measured | pass | 16 cells |" in text
    assert "| the seed's claim (Trainer ~20% slower) | fail (reported only) | +50% |" in text
    assert "| time and the frontier | skipped | not tested: needs about 300 s" in text
    assert "Ran 401 s of a 480 s budget" in text and "## memory, measured" in text and "a note" in text


def test_the_time_budget_skips_what_no_longer_fits():
    now = [0.0]
    budget = gpu_check.TimeBudget(480, clock=lambda: now[0])
    assert budget.fits(480) and not budget.fits(481)
    now[0] = 400.0
    assert budget.left() == 80 and budget.fits(80) and not budget.fits(90)
    assert budget.reason(90) == "needs about 90 s, 80 s of the 480 s budget left"
    now[0] = 500.0
    assert budget.reason(10).endswith("0 s of the 480 s budget left")
    assert gpu_check.group_estimate(4, 0, 30, 120, timing_s=30) == 150
    assert gpu_check.group_estimate(3, 2, 30, 120, timing_s=30) == 360
    assert gpu_check.BUDGET_S <= 8 * 60


def test_every_stage_is_skipped_with_its_reason_when_no_time_is_left(tmp_path):
    budget = gpu_check.TimeBudget(0.0)
    claims, notes = gpu_check.run_check(tmp_path, torch.device("cpu"), budget)
    assert [c.name for c in claims] == [gv.MEMORY_MEASURED_CLAIM, gv.ALLOCATED_CLAIM, gv.RESERVED_CLAIM,
                                        gv.OVERHEAD_CLAIM, gv.TRAINER_CLAIM, gv.FRONTIER_CLAIM]
    assert all(c.status == gv.SKIPPED and "budget left" in c.summary for c in claims)
    assert gv.exit_status(claims) == 3 and len(notes) == 1
    # no card here: the default card's arch (sm80) and flash; nothing measured without CUDA
    assert notes[0].startswith("Attention kernel this card picks by default") and "not measured" in notes[0]
    assert "ckptlab predicts flash" in notes[0]
    assert torch.backends.cuda.cudnn_sdp_enabled()   # cuDNN attention stays on: the card's own choice is checked


@pytest.mark.parametrize("card_name, torch_version, kernel", [
    ("h200", "2.13", "cudnn"), ("h200", "2.10", "flash"), ("h100-80", "2.9", "cudnn"), ("a100-80", "2.13", "flash"),
    ("rtx4090", "2.13", "flash")])
def test_the_kernel_the_check_names_is_the_cards_default(card_name, torch_version, kernel):
    # sdp_utils.cpp check_prefer_cudnn_attention (no tag source; torch_versions.CUDNN_FIRST): sm90
    # with a runtime cuDNN > 9.15 (the wheels of
    # 2.11 on) or, in 2.9, built against cuDNN >= 9.9: cuDNN first; other cards: flash first.
    from ckptlab.core.cards import card
    assert gpu_check.predicted_attention_kernel(card(card_name), torch_version) == kernel


def test_the_configured_cells_and_groups_are_valid_before_a_gpu_sees_them():
    from ckptlab.core.policy import parse_policy
    from ckptlab.run.anchors import chosen_anchors
    from ckptlab.workloads.registry import get_workload

    memory_policies = tuple(p for p in gpu_check.MEMORY["policies"] if p != gpu_check.PLAN)
    assert set(gpu_check.MEMORY["policies"]) == {"none", "full", "selective", gpu_check.PLAN}
    for policy in memory_policies + tuple(p for _, ps, _ in gpu_check.GROUPS for p in ps):
        parse_policy(policy)
    assert all(ps[0] == "none" for _, ps, _ in gpu_check.GROUPS)   # each group's time baseline and noise floor
    assert gpu_check.MEMORY["dtype"] == "bf16" and gpu_check.MEMORY["dropouts"] == (0.0, 0.1)
    pytest.importorskip("transformers")
    for _, spec, overrides, batch_size, seq_len in gpu_check.MEMORY["models"]:
        workload = gpu_check.memory_workload(spec, overrides, 0.1)
        workload.check_shape(batch_size, seq_len)
        assert workload.config.model_type == "llama" and workload.config.attention_dropout == 0.1
    assert [m[1:] for m in gpu_check.MEMORY["models"]][-1] == ("hf-llama-1b", {}, 2, 2048)
    llama = get_workload(gpu_check.FRONTIER["model"])
    llama.check_shape(gpu_check.FRONTIER["batch_size"], gpu_check.FRONTIER["seq_len"])
    named = [a for _, _, anchors in gpu_check.GROUPS for a in anchors]
    assert len(chosen_anchors(llama, named)) == len(named) == len(set(named))
    with pytest.raises(ValueError, match="anchors='torch.checkpoint' is invalid: allowed are"):
        chosen_anchors(llama, ["torch.checkpoint"])
    assert gpu_check.run_dir_name("NVIDIA H200") == "gpu-check-nvidia-h200"


@pytest.fixture
def tiny_check(monkeypatch):
    """The check's stages at a tiny size on CPU, the CUDA-only probes stubbed: the data flow from
    measurements to claims runs here before it runs on a GPU."""
    monkeypatch.setattr(gpu_check, "MEMORY", dict(gpu_check.MEMORY, policies=(gpu_check.PLAN, "none", "full"), dropouts=(0.1,),
                                                  models=(("tiny", "hf-llama-tiny", {"num_hidden_layers": 2}, 2, 32),)))
    monkeypatch.setattr(gpu_check, "prediction_workers", lambda: 1)
    monkeypatch.setattr(gpu_check, "FRONTIER", dict(model="gpt-tiny", batch_size=2, seq_len=32, dtype="fp32"))
    monkeypatch.setattr(gpu_check, "GROUPS", (("tiny", ("none", "full"), ("torch.utils.checkpoint per block",)),))
    monkeypatch.setattr(gpu_check, "COMPARE_TIMING_S", 0.5)
    monkeypatch.setattr(gpu_check, "OVERHEAD_TIMING_S", 1.0)
    monkeypatch.setattr(gpu_check, "OVERHEAD_ARGS", ["--batch", "1", "--seq", "8"])
    monkeypatch.setattr(gpu_check, "TRAINER", dict(model="hf-llama-tiny", batch_size=2, seq_len=16, accum_steps=1,
                                                   max_steps=4, track_steps=1))
    for name in ("fresh_allocator", "library_workspace_bytes", "rng_state_bytes"):
        monkeypatch.setattr(gpu_check, name, lambda dev: 0)
    return gpu_check.TimeBudget(600)


def test_the_memory_and_frontier_stages_run_end_to_end_on_cpu(tiny_check, tmp_path):
    pytest.importorskip("transformers")
    cpu = torch.device("cpu")
    notes = []
    measured, allocated, reserved = gpu_check.memory_stage(tmp_path, cpu, tiny_check, notes)
    assert measured.status == gv.FAIL and "no cell was measured on CUDA" in measured.summary   # CPU has no allocator counters
    for claim in (allocated, reserved):    # predicted for CUDA, measured on a CPU: nothing to judge, and it says so
        assert claim.status == gv.FAIL and "3 cells not judged" in claim.summary and "no allocator counters" in claim.summary
    with open(tmp_path / "memory" / "cells.csv") as f:
        cells = list(csv.DictReader(f))
    assert [(c["policy"][:5], c["dropout"], c["status"]) for c in cells] == [  # the plan's cell last, its plan
        ("none", "0.1", "ok"), ("full", "0.1", "ok"), ("plan=", "0.1", "ok")]  # made meanwhile in a worker
    assert all(int(c["predicted_peak_bytes"]) > 0 and int(c["predicted_reserved_bytes"]) >= int(c["predicted_peak_bytes"])
               and c["predicted_backend"] for c in cells)
    assert {c["measured_backend"] for c in cells} == {"math"}   # CPU's kernels with dropout, read from the nodes
    assert (tmp_path / "memory" / "prediction_errors.csv").exists()
    frontier = gpu_check.frontier_stage(tmp_path, cpu, tiny_check)
    rows = pd.read_csv(tmp_path / "compare" / "frontier.csv")
    assert set(rows["group"]) == {"tiny"} and "torch.utils.checkpoint per block" in set(rows["policy"])
    assert "ckptlab plan" in set(rows["source"])   # the plan at the anchor's peak
    assert frontier.status in (gv.PASS, gv.FAIL) and "comparisons" in frontier.summary
    assert (rows[rows["status"] == "ok"]["grad_verdict"] == "equal").all(), rows[["policy", "grad_verdict"]]
    assert (tmp_path / "compare" / "tiny" / "figures" / "compare.png").exists()


def test_the_overhead_and_trainer_stages_run_end_to_end_on_cpu(tiny_check, tmp_path, monkeypatch):
    commands, run = [], subprocess.run

    def recorded(args, *rest, **kwargs):   # every child the stages start, and what PATH offers it as pip
        commands.append([str(a) for a in args])
        return run(args, *rest, **kwargs)

    bin_dir = recording_pip(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(subprocess, "run", recorded)
    cpu = torch.device("cpu")
    overhead = gpu_check.overhead_stage(tmp_path, cpu, tiny_check)
    assert overhead.name == gv.OVERHEAD_CLAIM and "ckptlab full / manual full" in overhead.summary
    assert (tmp_path / "overhead" / "overhead.txt").read_text().startswith("gpt-tiny")
    pytest.importorskip("transformers")
    trainer = gpu_check.trainer_stage(tmp_path, cpu)
    assert trainer.name == gv.TRAINER_CLAIM and not trainer.counts and "timed steps" in trainer.summary
    assert (tmp_path / "trainer" / "summary.csv").exists()
    assert commands and not any("pip" in a for c in commands for a in c) and not (bin_dir / "called").exists()


def test_arguments_are_refused_with_one_line(capsys):
    assert gpu_check.main(["--fast"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "arguments='--fast' are invalid" in err


def test_the_alarm_stops_a_stage_and_the_stages_after_it_are_skipped(tmp_path, monkeypatch):
    def endless(*args):
        while True:
            pass

    ran = []
    monkeypatch.setattr(gpu_check, "memory_stage", endless)
    monkeypatch.setattr(gpu_check, "overhead_stage", lambda *a: ran.append("overhead"))
    with gpu_check.budget_alarm(0.2):
        claims, notes = gpu_check.run_check(tmp_path, torch.device("cpu"), gpu_check.TimeBudget(600))
    assert ran == []
    assert [c.summary for c in claims[:3]] == ["not tested: stopped by the time budget while it ran"] * 3
    assert all("spent by an earlier stage" in c.summary for c in claims[3:])
    assert gv.exit_status(claims) == 3


def test_a_stage_that_crashes_fails_its_claim_and_the_others_run(tmp_path, monkeypatch):
    def crash(*args):
        raise RuntimeError("CUDA error: an illegal memory access\nmore")

    monkeypatch.setattr(gpu_check, "memory_stage", crash)
    monkeypatch.setattr(gpu_check, "overhead_stage", lambda *a: gv.overhead_claim(1.0, 0.995, 1.005))
    monkeypatch.setattr(gpu_check, "trainer_stage", crash)
    monkeypatch.setattr(gpu_check, "frontier_stage", lambda *a: gv.skipped(gv.FRONTIER_CLAIM, "test"))
    monkeypatch.setattr(gpu_check, "snapshot_stage", lambda *a: None)
    budget = gpu_check.TimeBudget(600)
    claims, notes = gpu_check.run_check(tmp_path, torch.device("cpu"), budget)
    assert [c.status for c in claims] == [gv.FAIL, gv.FAIL, gv.FAIL, gv.PASS, gv.FAIL, gv.SKIPPED]
    assert claims[0].summary == "RuntimeError: CUDA error: an illegal memory access (errors.txt)"
    assert "Traceback" in (tmp_path / "errors.txt").read_text()
    assert gpu_check.finish(tmp_path, claims, notes, "Fake GPU", budget, {"torch": "x"}) == 1
    assert (tmp_path / "report.md").read_text().startswith("# GPU validation on Fake GPU: FAIL")
    assert '"device": "Fake GPU"' in (tmp_path / "claims.json").read_text()
    assert f"Ran on: Python {platform.python_version()}, torch {torch.__version__}" in (tmp_path / "report.md").read_text()


@requires_cuda
def test_the_cuda_probes_measure_what_the_libraries_hold():
    dev = torch.device("cuda", torch.cuda.current_device())
    workspace = gpu_check.library_workspace_bytes(dev)
    assert workspace >= 0 and workspace % 512 == 0
    assert gpu_check.library_workspace_bytes(dev) == workspace      # the same on a second look
    assert gpu_check.rng_state_bytes(dev) >= 0
    gpu_check.fresh_allocator(dev)
    x = torch.empty(1000, device=dev)
    assert torch.cuda.memory_stats(dev)["requested_bytes.all.current"] <= torch.cuda.memory_allocated(dev)
    del x


def test_saved_bytes_by_node_on_a_hand_counted_model_real_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ckptlab.probe.memory import saved_bytes_by_node

    def saved():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        return saved_bytes_by_node(model(torch.randn(4, 8)).sum())

    # addmm keeps its input for the weight's gradient (4 x 8 fp32), relu its output (4 x 16 fp32)
    assert saved() == {"AddmmBackward0": 4 * 8 * 4, "ReluBackward0": 4 * 16 * 4}
    with FakeTensorMode():
        assert saved() == {"AddmmBackward0": 128, "ReluBackward0": 256}


def test_the_prediction_is_for_the_card_the_device_is(monkeypatch):
    def device(major, minor, total_memory):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda dev: types.SimpleNamespace(major=major, minor=minor, total_memory=total_memory))

    cuda = torch.device("cuda", 0)
    device(9, 0, 150_110_126_080)                     # what an H200 reports (143,158 MiB)
    assert gpu_check.card_of(cuda).name == "h200"
    device(9, 0, 85_045_477_376)
    assert gpu_check.card_of(cuda).name == "h100-80"
    device(7, 5, 16 * 2**30)                           # a T4: no card of its capability in the table
    assert gpu_check.card_of(cuda) is None and gpu_check.card_of(torch.device("cpu")) is None
