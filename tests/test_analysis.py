"""Analysis on hand-made records whose answers are known."""

import numpy as np
import pandas as pd
import pytest

from ckptlab import add_predictions, get_workload, predict
from ckptlab.core.cards import card
from ckptlab.core.units import GiB
from ckptlab.probe.timing import time_verdict
from ckptlab.report.analysis import (
    compare_note,
    fits_from_run,
    format_summary,
    guide_verdict,
    largest_fitting,
    on_frontier,
    overhead,
    pareto,
    plans_vs_uniform,
    readable,
    summary,
    timing_note,
)
from ckptlab.run.sweep import config_label


def rec(policy, density, batch, peak, ms, status="ok", seq=64, accum=1, dtype="fp32", limit=None, **kw):
    fits = None if limit is None else peak is not None and peak <= limit
    return dict(model="m", policy=policy, effective_density=density, batch_size=batch, seq_len=seq,
                accum_steps=accum, effective_batch_size=batch * accum, dtype=dtype, peak_bytes=peak,
                step_ms=ms, tokens_per_s=None if ms is None else batch * seq * accum / ms * 1e3,
                status=status, memory_limit_bytes=limit, fits=fits, inferred=False, cell_id=f"{policy}{batch}", **kw)


def test_overhead_against_density_zero():
    df = pd.DataFrame([rec("none", 0.0, 4, 100, 10.0), rec("full", 1.0, 4, 60, 13.0), rec("full", 1.0, 8, 90, 20.0)])
    out = overhead(df).set_index(["policy", "batch_size"])
    assert out.loc[("full", 4), "overhead"] == pytest.approx(0.3)
    assert out.loc[("full", 4), "memory_saved_bytes"] == 40
    assert out.loc[("full", 4), "memory_saved_frac"] == pytest.approx(0.4)
    assert out.loc[("none", 4), "overhead"] == 0
    assert np.isnan(out.loc[("full", 8), "overhead"])  # no baseline at batch 8


def test_pareto_marks_dominated_points_within_equal_work():
    df = pd.DataFrame([
        rec("none", 0.0, 4, 100, 10.0), rec("density=0.5", 0.5, 4, 80, 12.0),
        rec("every=2", 0.5, 4, 90, 13.0),                     # dominated by density=0.5
        rec("full", 1.0, 4, 60, 15.0),
        rec("none", 0.0, 2, 70, 5.0, accum=2),                # same effective batch: competes
        rec("full", 1.0, 8, 10, 1.0),                         # other group: does not dominate
    ])
    out = pareto(df).set_index(["policy", "batch_size", "accum_steps"])["pareto_optimal"]
    assert not out[("every=2", 4, 1)]
    assert not out[("density=0.5", 4, 1)]  # dominated by accumulation (70 B, 5 ms)
    assert not out[("none", 4, 1)] and out[("full", 4, 1)]
    assert out[("none", 2, 2)] and out[("full", 8, 1)]


def test_pareto_needs_a_time_difference_beyond_the_intervals():
    df = pd.DataFrame([
        rec("none", 0.0, 4, 100, 10.0, step_ms_low=9.0, step_ms_high=11.0),
        rec("every=2", 0.5, 4, 80, 10.5, step_ms_low=10.0, step_ms_high=12.0),
        rec("density=0.5", 0.5, 4, 80, 9.8, step_ms_low=9.5, step_ms_high=10.2),   # overlaps every=2: both stay
        rec("full", 1.0, 4, 60, 20.0, step_ms_low=19.0, step_ms_high=21.0),
        rec("layers=0", 0.25, 4, 90, 14.0, step_ms_low=13.0, step_ms_high=15.0),   # density=0.5: less memory, faster
    ])
    out = pareto(df).set_index("policy")["pareto_optimal"]
    assert out["none"] and out["every=2"] and out["density=0.5"] and out["full"]
    assert not out["layers=0"]


def test_on_frontier_is_the_one_dominance_rule():
    # (memory, time interval) of a..f: a is faster than c beyond the intervals and holds less memory;
    # a and b overlap in time; d holds the least memory; e is faster than every other but holds
    # the most; a holds less memory than f, their intervals touching
    memory = [80, 90, 100, 70, 120, 110]
    low, high = [9.5, 10.0, 11.0, 11.0, 9.4, 10.5], [10.5, 11.0, 12.0, 12.0, 9.45, 11.5]
    assert on_frontier(memory, low, high) == [True, True, False, True, True, False]


def test_overhead_interval_paired_where_timed_together_else_from_both_intervals():
    df = pd.DataFrame([
        rec("none", 0.0, 4, 100, 10.0, step_ms_low=9.0, step_ms_high=11.0, time_ratio=1.0, time_ratio_low=1.0,
            time_ratio_high=1.0, timing_baseline="none"),
        rec("full", 1.0, 4, 60, 13.0, step_ms_low=12.0, step_ms_high=14.0, time_ratio=1.31, time_ratio_low=1.28,
            time_ratio_high=1.33, timing_baseline="none"),
        rec("full", 1.0, 8, 90, 26.0, step_ms_low=24.0, step_ms_high=28.0),
        rec("none", 0.0, 8, 140, 20.0, step_ms_low=19.0, step_ms_high=22.0),
    ])
    out = overhead(df).set_index(["policy", "batch_size"])
    assert out.loc[("full", 4), ["overhead", "overhead_low", "overhead_high"]].tolist() == pytest.approx(
        [0.31, 0.28, 0.33])
    assert out.loc[("full", 8), "overhead"] == pytest.approx(0.3)
    assert out.loc[("full", 8), "overhead_low"] == pytest.approx(24 / 22 - 1)
    assert out.loc[("full", 8), "overhead_high"] == pytest.approx(28 / 19 - 1)


def test_fits_from_run_measured_and_extrapolated():
    limit = 5 * GiB
    # peak = 1 GiB + batch * 1 GiB exactly: 24 GiB fits batch 23; under 5 GiB, batch 4 fits, 8 does not.
    df = pd.DataFrame([rec("none", 0.0, b, (1 + b) * GiB, 1.0, limit=limit) for b in (1, 2, 4)]
                      + [rec("none", 0.0, 8, 9 * GiB, None, status="oom", limit=limit)])
    fits = fits_from_run(df, {"24 GiB": 24 * GiB}).set_index(["kind", "limit"])
    assert fits.loc[("measured", "5.0 GiB"), "max_batch_size"] == 4
    assert fits.loc[("extrapolated", "24 GiB"), "max_batch_size"] == 23
    assert fits.loc[("extrapolated", "24 GiB"), "fit_rms_residual_bytes"] == pytest.approx(0, abs=1e-3)
    assert fits.loc[("extrapolated", "24 GiB"), "fit_points"] == 3
    assert fits.loc[("extrapolated", "24 GiB"), "fit_note"] == "fit of 3 points, residual <0.1%"
    # by default, the cards: each one's budget (usable less context and margin) in whole GiB, less one
    cards = fits_from_run(df).set_index(["kind", "limit"])
    for name in ("rtx4090", "a100-40", "h100-80", "h200"):
        assert cards.loc[("extrapolated", name), "max_batch_size"] == card(name).budget_bytes // GiB - 1
    by_seq = fits_from_run(df, axis="seq_len")
    assert set(by_seq["kind"]) == {"measured", "no fit"}  # one seq: nothing to fit, and it says so
    notes = by_seq[by_seq.kind == "no fit"].set_index("batch_size")["fit_note"]
    assert notes[4] == "no fit: one sequence length ran ok" and notes[8] == "no fit: no sequence length ran ok, 1 out of memory"
    with pytest.raises(ValueError, match="axis='dtype'"):
        fits_from_run(df, axis="dtype")


def test_summary_best_config_per_limit():
    df = pd.DataFrame([rec("none", 0.0, 8, 30 * GiB, 10.0), rec("full", 1.0, 8, 20 * GiB, 12.0),
                       rec("full", 1.0, 2, 5 * GiB, 4.0), rec("none", 0.0, 16, None, None, status="oom")])
    s = summary(df).set_index("limit")
    assert s.loc["no limit", "policy"] == "none" and s.loc["no limit", "batch_size"] == 8
    assert s.loc["no limit", "basis"] == "measured"
    # full: peak = 2.5 GiB per sequence through (2, 5 GiB) and (8, 20 GiB), so batch 9 (22.5 GiB)
    # fits an RTX 4090's budget (22.7 GiB); none has one ok batch size, no line: the card rows may
    # not rest on it.
    assert 22.5 * GiB <= card("rtx4090").budget_bytes < 25 * GiB
    assert s.loc["rtx4090", "policy"] == "full" and s.loc["rtx4090", "batch_size"] == 9
    assert s.loc["rtx4090", "basis"] == "extrapolated (line through 2 points)"
    assert s.loc["rtx4090", "peak_bytes"] == round(22.5 * GiB) and pd.isna(s.loc["rtx4090", "tokens_per_s"])
    text = format_summary(df)
    assert "4 cells: 3 ok, 1 oom (0 inferred), 0 error" in text and "rtx4090" in text
    timed = df.assign(step_ms_low=df["step_ms"] - 1, step_ms_high=df["step_ms"] + 2)
    assert "10.0 [9.0, 12.0]" in format_summary(timed)  # the measured row: none at batch 8


def test_tables_for_reading_show_sizes_and_budgets_by_label():
    budget = f"budget={44777048}B"
    df = pd.DataFrame([rec("none", 0.0, 4, 81570008, 10.0, saved_activation_bytes=None),
                       rec(budget, 0.5, 4, 44777048, 12.0, saved_activation_bytes=2 * GiB, limit=48 * 2**20)])
    shown = readable(df)
    assert list(shown.policy) == ["none", "budget=42.7MiB"]
    assert list(shown.peak) == ["77.8 MiB", "42.7 MiB"] and list(shown.saved_activation) == ["-", "2.0 GiB"]
    assert list(shown.memory_limit) == ["-", "48.0 MiB"] and "peak_bytes" not in shown
    assert df.peak_bytes.tolist() == [81570008, 44777048] and df.policy[1] == budget   # input untouched
    assert list(readable(df.set_index("policy")).index) == ["none", "budget=42.7MiB"]
    # a name already taken keeps its _bytes column, so no two columns share a name
    assert list(readable(pd.DataFrame({"limit": ["24 GiB"], "limit_bytes": [24 * GiB]})).columns) == ["limit", "limit_bytes"]
    assert "budget=42.7MiB" in format_summary(df) and "44777048" not in format_summary(df)


def test_summary_cards_agree_with_fits_from_run_far_beyond_the_run_limit():
    # A tiny emulated limit where full fits the largest measured batch, but none, the faster
    # one, extrapolates to a much larger batch on a card: the card rows follow fits_from_run.
    limit = 20 * 2**20
    df = pd.DataFrame([rec("none", 0.0, b, (8 + 4 * b) * 2**20, 1.0 + b, limit=limit) for b in (1, 2)]
                      + [rec("none", 0.0, 4, None, None, status="oom", limit=limit)]
                      + [rec("full", 1.0, b, (8 + 2 * b) * 2**20, 1.0 + 1.5 * b, limit=limit) for b in (1, 2, 4)])
    s = summary(df).set_index("limit")
    assert s.loc["run limit 20.0 MiB", "policy"] == "none" and s.loc["run limit 20.0 MiB", "batch_size"] == 2
    fits = fits_from_run(df)
    on_card = fits[(fits.kind == "extrapolated") & (fits.limit == "rtx4090")].set_index("policy")["max_batch_size"]
    assert s.loc["rtx4090", "batch_size"] == on_card.max() == (card("rtx4090").budget_bytes - 8 * 2**20) // (2 * 2**20)
    assert s.loc["rtx4090", "policy"] == "full"
    # that line is carried thousands of times past batch 4: the row says how far
    batch = int(s.loc["rtx4090", "batch_size"])
    assert s.loc["rtx4090", "basis"] == f"extrapolated (fit of 3 points, residual <0.1%; {batch / 4:,.0f}x the largest batch measured, 4)"


def test_summary_says_plainly_when_it_cannot_answer_for_a_card():
    df = pd.DataFrame([rec("none", 0.0, 4, 100, 10.0), rec("full", 1.0, 4, 60, 13.0)])
    s = summary(df).set_index("limit")
    assert pd.isna(s.loc["h100-80", "policy"])
    assert s.loc["h100-80", "basis"] == "cannot answer: no policy has 2+ ok batch sizes to extrapolate from"
    assert "cannot answer" in format_summary(df)


def test_config_label_names_dtype_and_accumulation_only_when_not_default():
    df = pd.DataFrame([rec("full", 1.0, 8, 1, 1.0), rec("full", 1.0, 8, 1, 1.0, dtype="bf16"),
                       rec("none", 0.0, 2, 1, 1.0, accum=4)])
    assert list(config_label(df)) == ["full", "full bf16", "none accum=4"]


def test_plans_against_the_fastest_uniform_policy_at_no_more_memory():
    df = pd.DataFrame([rec("none", 0.0, 4, 100, 10.0), rec("full", 1.0, 4, 50, 14.0),
                       rec("every=2", 0.5, 4, 75, 12.0),
                       rec("budget=0.8", 0.25, 4, 80, 11.0, plan="fkkk"),
                       rec("budget=0.4", 1.0, 4, 40, 15.0, plan="ffff")])
    # Per-round times of one timing group: the plan is 11/12 of every-2 in every round but one.
    rounds = {"none": [10.0] * 6, "full": [14.0] * 6, "every=2": [12.0] * 6, "budget=0.8": [11.0] * 5 + [12.5],
              "budget=0.4": [15.0] * 6}
    df["round_ms"] = df["policy"].map(rounds)
    out = plans_vs_uniform(df).set_index("policy")
    assert out.loc["budget=0.8", "best_uniform"] == "every=2"
    assert out.loc["budget=0.8", "vs_best_uniform"] == pytest.approx(11 / 12 - 1)   # the paired median
    assert out.loc["budget=0.8", "verdict"] == "faster"
    assert pd.isna(out.loc["budget=0.4", "best_uniform"])  # nothing uniform reaches 40
    # Drift that moves both members of a round cancels in the paired ratio.
    df["round_ms"] = [[t * (1 + r) for r, t in enumerate(times)] for times in df["round_ms"]]
    assert plans_vs_uniform(df).set_index("policy").loc["budget=0.8", "verdict"] == "faster"
    # Rounds where the plan is as often faster as slower: no difference.
    df["round_ms"] = df["policy"].map({**rounds, "budget=0.8": [11.0, 13.0] * 3})
    assert plans_vs_uniform(df).set_index("policy").loc["budget=0.8", "verdict"] == "no difference"


@pytest.mark.parametrize("low, high, reference, verdict", [
    (0.9, 0.99, 1.0, "faster"), (1.01, 1.2, 1.0, "slower"), (0.95, 1.05, 1.0, "no difference"),
    (float("nan"), float("nan"), 1.0, "no difference"), (0.25, 0.4, 0.2, "slower"), (-0.1, 0.1, 0.0, "no difference")])
def test_one_verdict_from_an_interval(low, high, reference, verdict):
    assert time_verdict(low, high, reference) == verdict


def test_timing_note_warns_on_a_busy_machine():
    quiet = pd.DataFrame([dict(step_ms_min=10.0, step_ms_max=11.0)])
    busy = pd.DataFrame([dict(step_ms_min=10.0, step_ms_max=40.0)])
    assert timing_note(quiet) == "Largest max/min step-time spread in one cell: 1.10x."
    assert timing_note(busy).endswith("4.00x — a busy machine: rerun before trusting the times.")


@pytest.mark.parametrize("seed", range(5))
def test_fits_from_run_counts_a_batch_that_fits_exactly(seed):
    """Adversarial values: peaks exactly linear in whole bytes with awkward intercepts and slopes,
    and a limit equal to one of the peaks; least squares lands a hair off, the answer must not."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        intercept, slope = int(rng.integers(1, 10**9)), int(rng.integers(1, 10**8)) + 0.5 * int(rng.integers(0, 2))
        # even batches: a half-integer slope still gives whole-byte peaks, exactly on the line
        batches = sorted(set(2 * int(b) for b in rng.integers(1, 32, size=4)))
        if len(batches) < 2:
            continue
        target = int(rng.integers(1, 10**4))
        limit = round(intercept + slope * target)
        df = pd.DataFrame([rec("none", 0.0, b, round(intercept + slope * b), 1.0) for b in batches])
        fits = fits_from_run(df, limits={"card": limit}).set_index("kind")
        assert fits.loc["extrapolated", "max_batch_size"] == target
        assert largest_fitting(intercept, slope, limit - 1) == target - 1 or target == 1


def test_largest_fitting_edges():
    assert largest_fitting(10.0, 0.0, 100) is None       # flat line: no answer, not infinity
    assert largest_fitting(200.0, 1.0, 100) is None      # intercept alone over the limit
    assert largest_fitting(0.0, 3.0, 2) is None          # not even x=1 fits
    assert largest_fitting(0.0, 3.0, 3) == 1
    assert largest_fitting(1 - 1e-7, 1.0, 24) == 23      # 24 + 1 - 1e-7 rounds over 24 -> 23


def test_compare_note_names_real_differences_and_a_busy_machine():
    common = dict(status="ok", rounds=12, threads=1, load_before=3.0, load_after=3.5, busy=True)
    df = pd.DataFrame([
        dict(policy="none", time_ratio=1.0, time_ratio_low=1.0, time_ratio_high=1.0, significant=False, **common),
        dict(policy="full", time_ratio=1.3, time_ratio_low=1.25, time_ratio_high=1.36, significant=True, **common),
        dict(policy="density=0.0", time_ratio=1.01, time_ratio_low=0.97, time_ratio_high=1.04, significant=False,
             **common),
    ])
    note = compare_note(df)
    assert "Differ from none: full 1.30x [1.25, 1.36]." in note
    assert "Not distinguishable from none at 95%: density=0.0." in note
    assert "busy (load 3.0 -> 3.5" in note
    assert "busy" not in compare_note(df.assign(busy=False))


@pytest.mark.parametrize("low, high, verdict", [
    (-0.05, 0.30, "no difference from no checkpointing"), (0.25, 0.40, "more than the guide's ~20%"),
    (0.02, 0.10, "less than the guide's ~20%"), (0.10, 0.30, "consistent with the guide's ~20%"),
])
def test_the_guides_twenty_percent_is_judged_by_the_interval(low, high, verdict):
    assert guide_verdict(low, high).startswith(verdict)


def test_add_predictions_predicts_a_cuda_row_as_cuda_runs_it_and_skips_anchors():
    workload = get_workload("gpt-tiny", n_layer=2)
    row = dict(model="gpt-tiny", model_overrides={"n_layer": 2}, batch_size=2, seq_len=16, policy="full", dtype="bf16",
               status="ok", peak_bytes=10 * 2**20, saved_activation_bytes=2**20)
    df = add_predictions(pd.DataFrame([{**row, "device": "cpu"}, {**row, "device": "cuda:0"},
                                       {**row, "policy": "torch.utils.checkpoint per block"}]), closed_form_too=False)
    on = {d: predict(workload, 2, 16, "full", dtype="bf16", device=d).peak_bytes for d in ("cpu", "cuda")}
    assert on["cpu"] != on["cuda"]
    assert df["predicted_peak_bytes"].iloc[:2].tolist() == [on["cpu"], on["cuda"]]
    assert pd.isna(df["predicted_peak_bytes"].iloc[2])


def test_peaks_in_the_optimizer_step_are_no_points_of_a_line_to_carry_to_a_card():
    # two batch sizes whose peaks came in the optimizer step (parameters, gradients and optimizer
    # state): a line through them, flat but for the batch's own bytes, would reach millions of
    # times the batches measured
    df = pd.DataFrame([rec("none", 0.0, 1, 14_800_000, 1.0, peak_phase="optimizer"),
                       rec("none", 0.0, 2, 14_800_512, 1.1, peak_phase="optimizer"),
                       rec("full", 1.0, 1, 14_700_000, 1.2, peak_phase="optimizer"),
                       rec("full", 1.0, 2, 14_700_000, 1.3, peak_phase="optimizer")])
    fits = fits_from_run(df).set_index("policy")
    assert set(fits.kind) == {"no fit"} and set(fits.fit_reason) == {"optimizer peak"}
    assert fits.loc["none", "fit_note"] == ("no fit: the peak came in the optimizer step at batch size 1, 2 (parameters, "
                                            "gradients and optimizer state, which the batch size does not scale); "
                                            "measure larger ones")
    s = summary(df).set_index("limit")
    assert pd.isna(s.loc["rtx4090", "policy"]) and s.loc["rtx4090", "basis"] == (
        "cannot answer: the peaks measured came in the optimizer step (parameters, gradients and optimizer state, "
        "which the batch does not scale): measure larger batches")
    # from the batches whose peak came in backward, a line: exact, however large the parameters
    # (a LoRA model under full checkpointing: 14 GiB and 40 MiB a sample)
    grows = pd.concat([df, pd.DataFrame([rec("none", 0.0, b, 14 * GiB + 40 * 2**20 * b, 1.5, peak_phase="backward")
                                         for b in (4, 8)])])
    line = fits_from_run(grows).set_index(["policy", "kind"]).loc[("none", "extrapolated")]
    assert (line.fit_points == 2).all() and (line.fit_slope_bytes == 40 * 2**20).all()
    assert summary(grows).set_index("limit").loc["h200", "policy"] == "none"
