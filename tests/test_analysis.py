"""Analysis on hand-made records whose answers are known."""

import numpy as np
import pandas as pd
import pytest

from ckptlab.core.units import GiB
from ckptlab.report.analysis import (
    config_label,
    format_summary,
    largest_fitting,
    overhead,
    pareto,
    plans_vs_uniform,
    summary,
    timing_note,
    what_fits,
)


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


def test_what_fits_measured_and_extrapolated():
    limit = 5 * GiB
    # peak = 1 GiB + batch * 1 GiB exactly: 24 GiB fits batch 23; under 5 GiB, batch 4 fits, 8 does not.
    df = pd.DataFrame([rec("none", 0.0, b, (1 + b) * GiB, 1.0, limit=limit) for b in (1, 2, 4)]
                      + [rec("none", 0.0, 8, 9 * GiB, None, status="oom", limit=limit)])
    fits = what_fits(df).set_index(["kind", "limit"])
    assert fits.loc[("measured", "5.0 GiB"), "max_batch_size"] == 4
    assert fits.loc[("extrapolated", "24 GiB"), "max_batch_size"] == 23
    assert fits.loc[("extrapolated", "141 GiB"), "max_batch_size"] == 140
    assert fits.loc[("extrapolated", "24 GiB"), "fit_rms_residual_bytes"] == pytest.approx(0, abs=1e-3)
    assert fits.loc[("extrapolated", "24 GiB"), "fit_points"] == 3
    by_seq = what_fits(df, axis="seq_len")
    assert (by_seq["kind"] == "measured").all()  # one seq: nothing to fit
    with pytest.raises(ValueError, match="axis='dtype'"):
        what_fits(df, axis="dtype")


def test_summary_best_config_per_limit():
    df = pd.DataFrame([rec("none", 0.0, 8, 30 * GiB, 10.0), rec("full", 1.0, 8, 20 * GiB, 12.0),
                       rec("full", 1.0, 2, 5 * GiB, 4.0), rec("none", 0.0, 16, None, None, status="oom")])
    s = summary(df).set_index("limit")
    assert s.loc["no limit", "policy"] == "none" and s.loc["no limit", "batch_size"] == 8
    assert s.loc["24 GiB", "policy"] == "full" and s.loc["24 GiB", "batch_size"] == 8
    text = format_summary(df)
    assert "4 cells: 3 ok, 1 oom (0 inferred), 0 error" in text and "24 GiB" in text


def test_config_label_names_dtype_and_accumulation_only_when_not_default():
    df = pd.DataFrame([rec("full", 1.0, 8, 1, 1.0), rec("full", 1.0, 8, 1, 1.0, dtype="bf16"),
                       rec("none", 0.0, 2, 1, 1.0, accum=4)])
    assert list(config_label(df)) == ["full", "full bf16", "none accum=4"]


def test_plans_against_the_fastest_uniform_policy_at_no_more_memory():
    df = pd.DataFrame([rec("none", 0.0, 4, 100, 10.0), rec("full", 1.0, 4, 50, 14.0),
                       rec("every=2", 0.5, 4, 75, 12.0),
                       rec("budget=0.8", 0.25, 4, 80, 11.0, plan="fkkk"),
                       rec("budget=0.4", 1.0, 4, 40, 15.0, plan="ffff")])
    out = plans_vs_uniform(df).set_index("policy")
    assert out.loc["budget=0.8", "best_uniform"] == "every=2"
    assert out.loc["budget=0.8", "vs_best_uniform"] == pytest.approx(11 / 12 - 1)
    assert pd.isna(out.loc["budget=0.4", "best_uniform"])  # nothing uniform reaches 40


def test_timing_note_warns_on_a_busy_machine():
    quiet = pd.DataFrame([dict(step_ms_min=10.0, step_ms_max=11.0)])
    busy = pd.DataFrame([dict(step_ms_min=10.0, step_ms_max=40.0)])
    assert timing_note(quiet) == "Largest max/min step-time spread in one cell: 1.10x."
    assert timing_note(busy).endswith("4.00x — a busy machine: rerun before trusting the times.")


@pytest.mark.parametrize("seed", range(5))
def test_what_fits_counts_a_batch_that_fits_exactly(seed):
    """Adversarial values: peaks exactly linear in whole bytes with awkward intercepts and slopes,
    and a limit equal to one of the peaks; least squares lands a hair off, the answer must not."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        intercept, slope = int(rng.integers(1, 10**9)), int(rng.integers(1, 10**8))
        batches = sorted(set(int(b) for b in rng.integers(1, 64, size=4)))
        if len(batches) < 2:
            continue
        target = int(rng.integers(1, 10**4))
        limit = round(intercept + slope * target)
        df = pd.DataFrame([rec("none", 0.0, b, round(intercept + slope * b), 1.0) for b in batches])
        fits = what_fits(df, limits={"card": limit}).set_index("kind")
        assert fits.loc["extrapolated", "max_batch_size"] == target
        assert largest_fitting(intercept, slope, limit - 1) == target - 1 or target == 1


def test_largest_fitting_edges():
    assert largest_fitting(10.0, 0.0, 100) is None       # flat line: no answer, not infinity
    assert largest_fitting(200.0, 1.0, 100) is None      # intercept alone over the limit
    assert largest_fitting(0.0, 3.0, 2) is None          # not even x=1 fits
    assert largest_fitting(0.0, 3.0, 3) == 1
    assert largest_fitting(1 - 1e-7, 1.0, 24) == 23      # 24 + 1 - 1e-7 rounds over 24 -> 23
