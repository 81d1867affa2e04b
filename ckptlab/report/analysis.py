"""Analysis of a sweep's records (a DataFrame from `sweep()` or `load_run()`); every function
returns a new DataFrame and leaves its input alone.

    overhead(df)        step time and memory against the no-checkpointing baseline (density 0)
    pareto(df)          which configurations are on the (peak memory, step time) frontier
    fits_from_run(df)   the largest batch (or seq) per policy that fits a memory limit, from the
                        run's records: measured for the run's limit, extrapolated for the RTX 4090,
                        A100-40, H100-80 and H200 from a linear fit (`ckptlab.predict_fits` answers
                        by prediction)
    summary(df)         the best configuration per memory limit: measured for the run's limit,
                        from fits_from_run's extrapolation for the card sizes
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from ..core.cards import card_budgets
from ..core.loop import loop_of_record
from ..core.policy import Policy, policy_label, policy_of_label
from ..core.units import format_bytes
from ..estimate.closed_form import closed_form
from ..estimate.predict import prediction_error
from ..plan.budget import predict
from ..probe.timing import (
    NO_DIFFERENCE,
    bootstrap_median,
    time_verdict,
    unpaired_median_ratio,
    versus_fastest_at_no_more_memory,
)
from ..workloads.models import GPTConfig
from ..workloads.registry import get_workload
from .tables import format_table

SHAPE = ["model", "batch_size", "seq_len", "dtype", "accum_steps"]   # what a baseline must share


def ok(df: pd.DataFrame) -> pd.DataFrame:
    """Only the cells that were measured successfully."""
    return df[df["status"] == "ok"].copy() if len(df) else df.copy()


def require_records(df: pd.DataFrame) -> pd.DataFrame:
    """`df` when it holds records; ValueError for an empty run (no cell finished yet)."""
    if not len(df) or "status" not in df:
        run = (df.attrs.get("run") or {}).get("run")
        raise ValueError(f"df is invalid: the run{f' {run!r}' if run else ''} holds no records yet; allowed is "
                         "a DataFrame from sweep() or load_run() of a run with at least one finished cell")
    return df


def overhead(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows with baseline columns added, per (model, batch, seq, dtype, accum):

    overhead            step time / baseline's - 1 (baseline: effective_density == 0): the paired
                        median time ratio - 1 where timed together, else step_ms / baseline step_ms - 1
    overhead_low/high   its 95% interval: from the paired time ratio where the row was timed
                        together with that baseline (`time_ratio_low/high`, timing_baseline), else
                        from the two step-time intervals, unpaired (low / high, high / low: wider)
    memory_saved_bytes  baseline peak - peak;  memory_saved_frac: that / baseline peak
    Rows without a measured baseline get NaN.
    """
    rows = ok(df)
    for column in ("step_ms_low", "step_ms_high", "time_ratio", "time_ratio_low", "time_ratio_high",
                   "timing_baseline"):
        if column not in rows:
            rows[column] = np.nan
    base_rows = rows[rows["effective_density"] == 0]
    base = base_rows.groupby(SHAPE, as_index=False).agg(
        baseline_step_ms=("step_ms", "median"), baseline_peak_bytes=("peak_bytes", "median"),
        baseline_tokens_per_s=("tokens_per_s", "median"), baseline_step_ms_low=("step_ms_low", "median"),
        baseline_step_ms_high=("step_ms_high", "median"), baseline_policy=("policy", "first"))
    rows = rows.merge(base, on=SHAPE, how="left")
    paired = rows["timing_baseline"].notna() & (rows["timing_baseline"] == rows["baseline_policy"])
    rows["overhead"] = np.where(paired, rows["time_ratio"], rows["step_ms"] / rows["baseline_step_ms"]).astype(float) - 1
    rows["overhead_low"] = np.where(paired, rows["time_ratio_low"],
                                    rows["step_ms_low"] / rows["baseline_step_ms_high"]).astype(float) - 1
    rows["overhead_high"] = np.where(paired, rows["time_ratio_high"],
                                     rows["step_ms_high"] / rows["baseline_step_ms_low"]).astype(float) - 1
    rows["memory_saved_bytes"] = rows["baseline_peak_bytes"] - rows["peak_bytes"]
    rows["memory_saved_frac"] = rows["memory_saved_bytes"] / rows["baseline_peak_bytes"]
    return rows


def pareto(df: pd.DataFrame, x: str = "peak_bytes", y: str = "step_ms",
           group: Sequence[str] = ("model", "seq_len", "effective_batch_size")) -> pd.DataFrame:
    """The ok rows with `pareto_optimal` (True on the frontier, False = dominated).

    Points compete within a group of equal work per optimizer step (same seq and effective
    batch), so checkpointing, accumulation and bf16 are compared fairly. A point is dominated
    only when another in its group holds no more memory (x) and is faster beyond the intervals:
    its time interval (`<y>_low`/`<y>_high`, the 95% interval of the median step time) lies
    entirely below this point's. Two points whose intervals overlap cannot be told apart in time,
    and both stay on the frontier. Records without interval columns compare the values alone.
    """
    rows = ok(df)
    rows["pareto_optimal"] = False
    low_col, high_col = (f"{y}_low", f"{y}_high")
    for _, g in rows.groupby(list(group)):
        ys = g[y].to_numpy(float)
        lows = g[low_col].to_numpy(float) if low_col in g else ys
        highs = g[high_col].to_numpy(float) if high_col in g else ys
        lows, highs = np.where(np.isnan(lows), ys, lows), np.where(np.isnan(highs), ys, highs)
        rows.loc[g.index, "pareto_optimal"] = on_frontier(g[x].to_numpy(float), lows, highs)
    return rows


def on_frontier(memory, time_low, time_high) -> list[bool]:
    """Per point, whether no other point dominates it: one dominates when it holds no more
    memory and is faster beyond the intervals (its time interval lies entirely below this
    point's), or holds less memory with intervals that only touch. The one rule of dominance."""
    xs, lows, highs = (np.asarray(v, dtype=float) for v in (memory, time_low, time_high))
    out = []
    for k in range(len(xs)):
        faster_beyond_interval = (xs <= xs[k]) & (highs < lows[k])
        same_time_less_memory = (xs < xs[k]) & (highs <= lows[k])
        out.append(not np.any(faster_beyond_interval | same_time_less_memory))
    return out


OFF_PASS_PHASES = ("setup", "optimizer")   # a peak there is not the activations': no point of a line


def fits_from_run(df: pd.DataFrame, limits: Optional[dict] = None, axis: str = "batch_size") -> pd.DataFrame:
    """Largest `axis` value ("batch_size" or "seq_len") that fits, per policy and the other axes.

    kind="measured": the largest measured value with status ok and fits, for the run's own
    memory limit (one row per group; only if the run had a limit).
    kind="extrapolated": for each of `limits` ({label: bytes}; default `card_budgets()`: per card of
    `DEFAULT_CARDS`, its usable bytes less context and margin), from a least-squares
    line peak_bytes = intercept + slope * axis through the ok cells whose peak came in the forward
    or backward pass (`peak_phase`; records without one count too), where activations set it
    (needs 2+ distinct values): a peak in the optimizer step is parameters, gradients and optimizer
    state, which the axis does not scale, and at larger values the peak moves to the passes.
    `fit_points` says how many cells the line went through; `fit_rms_residual_bytes` and
    `fit_max_rel_residual` say how straight it was, and are measured only from 3 points on (a
    line through 2 points has no residual): with 2 they are NaN. It assumes the rest of the
    card behaves like the device measured (same dtype, same kernels).
    kind="no fit": one row per group with fewer than 2 such values, so that a policy missing from
    the card sizes is explained, not silently dropped; `fit_reason` says why ("too few ok" or
    "optimizer peak": the ok values peaked in the optimizer step, all or all but one).
    Every extrapolated and no-fit row has `fit_note`, the words a figure or table shows for it.
    """
    if axis not in ("batch_size", "seq_len"):
        raise ValueError(f"axis={axis!r} is invalid: allowed are batch_size, seq_len")
    other = "seq_len" if axis == "batch_size" else "batch_size"
    keys = ["model", "policy", other, "dtype", "accum_steps"]
    limits = card_budgets() if limits is None else limits
    out = []
    measured = df[df["status"].isin(["ok", "oom"])]
    for key, g in measured.groupby(keys, dropna=False):
        base = dict(zip(keys, key))
        run_limit = g["memory_limit_bytes"].dropna()
        if len(run_limit):
            fit_rows = g[(g["status"] == "ok") & (g["fits"] == True)]  # noqa: E712 - column of bools/None
            best = int(fit_rows[axis].max()) if len(fit_rows) else None
            out.append({**base, "limit": format_bytes(run_limit.iloc[0]), "limit_bytes": int(run_limit.iloc[0]),
                        "kind": "measured", f"max_{axis}": best})
        good = g[g["status"] == "ok"]
        in_passes = good[~good["peak_phase"].isin(OFF_PASS_PHASES)] if "peak_phase" in good else good
        xs, ys = in_passes[axis].to_numpy(float), in_passes["peak_bytes"].to_numpy(float)
        n_values = len(np.unique(xs))
        if n_values < 2:
            off_pass = sorted(set(good[axis]) - set(in_passes[axis]))
            note = (_optimizer_peak_note(off_pass, axis) if off_pass else
                    _no_fit_note(n_values, int((g["status"] == "oom").sum()), axis))
            out.append({**base, "limit": None, "limit_bytes": None, "kind": "no fit", f"max_{axis}": None,
                        "fit_points": len(xs), "fit_note": note,
                        "fit_reason": "optimizer peak" if off_pass else "too few ok"})
            continue
        slope, intercept = line_fit(xs, ys)
        resid = ys - (float(intercept) + float(slope) * xs)
        residual_measured = len(xs) > 2
        fit = dict(fit_intercept_bytes=float(intercept), fit_slope_bytes=float(slope),
                   fit_rms_residual_bytes=float(np.sqrt(np.mean(resid ** 2))) if residual_measured else np.nan,
                   fit_max_rel_residual=float(np.max(np.abs(resid) / ys)) if residual_measured else np.nan,
                   fit_points=len(xs))
        fit["fit_note"] = fit_note(fit)
        for label, limit in limits.items():
            out.append({**base, "limit": label, "limit_bytes": int(limit), "kind": "extrapolated",
                        f"max_{axis}": largest_fitting(intercept, slope, limit), **fit})
    return pd.DataFrame(out)


def line_fit(xs, ys) -> tuple[Fraction, Fraction]:
    """Least-squares (slope, intercept) in exact rational arithmetic: a float fit through
    exactly linear peaks lands a hair off, and extrapolating a hundredfold past the measured
    batches turns that hair into a whole batch."""
    xs = [Fraction(float(x)) for x in xs]
    ys = [Fraction(float(y)) for y in ys]
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return slope, (sy - slope * sx) / n


def fit_note(fit: dict) -> str:
    """A fit in words: its number of points, and its residual only where one was measured."""
    n = fit["fit_points"]
    if n <= 2 or not fit["fit_max_rel_residual"] == fit["fit_max_rel_residual"]:
        return f"line through {n} points"
    percent = 100 * fit["fit_max_rel_residual"]
    return f"fit of {n} points, residual " + (f"≤{percent:.1f}%" if percent >= 0.1 else "<0.1%")


def _optimizer_peak_note(values: list, axis: str) -> str:
    name = "batch size" if axis == "batch_size" else "sequence length"
    return (f"no fit: the peak came in the optimizer step at {name} {', '.join(str(int(v)) for v in values)} "
            f"(parameters, gradients and optimizer state, which the {name} does not scale); measure larger ones")


def _no_fit_note(n_ok_values: int, n_oom: int, axis: str) -> str:
    name = "batch size" if axis == "batch_size" else "sequence length"
    ok_part = f"one {name} ran" if n_ok_values == 1 else f"no {name} ran"
    return f"no fit: {ok_part} ok" + (f", {n_oom} out of memory" if n_oom else "")


def largest_fitting(intercept: float, slope: float, limit: float) -> Optional[int]:
    """Largest integer x >= 1 whose fitted peak, rounded to the byte, is <= limit (None if none).

    A least-squares line through exactly linear peaks lands a hair off the integers, so
    `floor((limit - intercept) / slope)` alone can drop the value that fits exactly; comparing
    whole bytes around that estimate cannot."""
    if not slope > 0:
        return None
    x = max(0, math.floor((limit - intercept) / slope))
    while round(intercept + slope * (x + 1)) <= limit:
        x += 1
    while x >= 1 and round(intercept + slope * x) > limit:
        x -= 1
    return x if x >= 1 else None


BUSY_SPREAD = 1.5  # max/min step time within one cell above which timings are not to be trusted


def timing_note(df: pd.DataFrame) -> str:
    """How noisy the run's timings were: the largest max/min step-time spread within one cell,
    and a warning to rerun above BUSY_SPREAD; plus, where recorded, the widest 95% interval of a
    step time and how many cells ran while the load average exceeded the cores."""
    spread = (df["step_ms_max"] / df["step_ms_min"]).max()
    text = (f"Largest max/min step-time spread in one cell: {spread:.2f}x"
            + (" — a busy machine: rerun before trusting the times." if spread > BUSY_SPREAD else "."))
    if {"step_ms_low", "step_ms_high"} <= set(df.columns) and df["step_ms_low"].notna().any():
        width = ((df["step_ms_high"] - df["step_ms_low"]) / 2 / df["step_ms"]).max()
        text += f" Widest 95% interval of a median step time: ±{width:.1%}."
    if "busy" in df.columns and df["busy"].fillna(False).astype(bool).any():
        text += (f" {int(df['busy'].fillna(False).astype(bool).sum())} of {len(df)} cells ran while the load "
                 "average exceeded the CPU cores (other work competed).")
    return text


def compare_note(df: pd.DataFrame) -> str:
    """One paragraph on a `ckptlab.compare` table: which configurations differ in time from the
    baseline (interval excludes 1), which cannot be told apart, and whether the machine was busy."""
    timed = df[(df["status"] == "ok") & df["time_ratio"].notna()]
    if not len(timed):
        return "Nothing was timed."
    base, rest = timed.iloc[0], timed.iloc[1:]
    differ = [f"{r.policy} {r.time_ratio:.2f}x [{r.time_ratio_low:.2f}, {r.time_ratio_high:.2f}]"
              for r in rest.itertuples() if r.significant]
    same = [r.policy for r in rest.itertuples() if not r.significant]
    text = (f"{int(base['rounds'])} interleaved rounds, {int(base['threads'])} threads. "
            f"Differ from {base['policy']}: {', '.join(differ) or 'none'}. "
            f"Not distinguishable from {base['policy']} at 95%: {', '.join(same) or 'none'}.")
    if bool(base["busy"]):
        text += (f" The machine was busy (load {base['load_before']:.1f} -> {base['load_after']:.1f}, more than "
                 "its CPU cores): the intervals are wider than on an idle machine.")
    return text


TIMING_GROUP = ["batch_size", "seq_len", "dtype", "accum_steps"]   # the cells of a sweep timed together


def plans_vs_uniform(df: pd.DataFrame) -> pd.DataFrame:
    """Each budget plan against the fastest uniform policy at no more memory, timed in the same
    rounds: the plan's time over that policy's, minus one (negative: the plan is faster), with the
    95% interval of the paired per-round ratios and its `verdict` (faster, slower, no
    difference). Missing where no uniform policy reaches the plan's peak."""
    rows = ok(df)
    out = []
    for _, group in rows.groupby([c for c in TIMING_GROUP if c in rows], sort=False):
        is_plan = group["policy"].str.startswith("budget")
        uniform = [r for _, r in group[~is_plan].iterrows()]
        for _, r in group[is_plan].iterrows():
            best, (ratio, low, high) = versus_fastest_at_no_more_memory(r, uniform)
            out.append({"policy": r["policy"], "plan": r.get("plan"), "peak_bytes": r["peak_bytes"],
                        "step_ms": r["step_ms"], "best_uniform": None if best is None else best["policy"],
                        "best_uniform_step_ms": None if best is None else best["step_ms"],
                        "vs_best_uniform": ratio - 1, "vs_best_uniform_low": low - 1, "vs_best_uniform_high": high - 1,
                        "verdict": None if best is None else time_verdict(low, high)})
    return pd.DataFrame(out)


def add_predictions(df, closed_form_too: bool = True):
    """Measured records (a sweep's DataFrame) -> the same rows with the prediction beside them:
    `predicted_peak_bytes`, `predicted_saved_activation_bytes`, `peak_error` and
    `saved_error` (predicted / measured - 1), and for GPT workloads the closed form's
    `closed_form_peak_bytes` and `closed_form_peak_error`. A budget policy is predicted from the
    plan it resolved to in that run (its `plan` column), so both sides describe the same model.
    A row measured on CUDA (`device` cuda or cuda:N) is predicted with CUDA's semantics (`predict`'s
    device="cuda", its default card): its allocated peak against the measured `max_memory_allocated`.
    Rows that did not measure ok, compile policies and anchors (no ckptlab policy) get no prediction."""
    rows = []
    for r in df.to_dict("records"):
        policy = policy_of_label(r["policy"])
        if r.get("status") != "ok" or policy is None or policy.compiles:
            rows.append(r)
            continue
        if isinstance(r.get("plan"), str):  # (a DataFrame turns a missing plan into NaN)
            policy = Policy("plan", r["plan"], offload=policy.offload)
        overrides = r.get("model_overrides")
        workload = get_workload(r["model"], **(overrides if isinstance(overrides, dict) else {}))
        pred = predict(workload, r["batch_size"], r["seq_len"], policy, dtype=r["dtype"], loop=loop_of_record(r),
                       device="cuda" if str(r.get("device") or "cpu").startswith("cuda") else "cpu")
        r.update(predicted_peak_bytes=pred.peak_bytes, predicted_saved_activation_bytes=pred.saved_activation_bytes,
                 peak_error=prediction_error(pred.peak_bytes, r["peak_bytes"]),
                 saved_error=prediction_error(pred.saved_activation_bytes, r["saved_activation_bytes"]))
        if closed_form_too and isinstance(workload.config, GPTConfig) and policy.kind in ("none", "full", "density", "every", "layers"):
            cf = closed_form(workload, r["batch_size"], r["seq_len"], policy, r["dtype"])
            r.update(closed_form_peak_bytes=cf["closed_form_peak_bytes"],
                     closed_form_peak_error=prediction_error(cf["closed_form_peak_bytes"], r["peak_bytes"]))
        rows.append(r)
    return pd.DataFrame(rows)


SUMMARY_COLUMNS = ("policy", "batch_size", "seq_len", "dtype", "accum_steps", "peak_bytes", "step_ms", "step_ms_low",
                   "step_ms_high", "tokens_per_s")


FAR = 10   # an extrapolated batch more than this many times the largest measured says so


def summary(df: pd.DataFrame, limits: Optional[dict] = None) -> pd.DataFrame:
    """The best configuration per memory limit, one row each, with `basis` saying how it was found.

    The run's own limit (or "no limit"): basis "measured", the highest tokens/s among ok cells
    whose measured peak fits.
    Each card (default `card_budgets()`: rtx4090, a100-40, h100-80, h200): from `fits_from_run`'s
    extrapolation, the same lines its figure draws — the configuration that fits the largest effective batch (batch x
    accumulation) at the longest sequence with a fit; ties go to the higher measured tokens/s.
    `batch_size` is then the extrapolated batch and `peak_bytes` the line's value there; its step
    time and tokens/s were not measured and are left empty. Where no policy has a fit, the row
    says so in `basis` ("cannot answer: ...") instead of recommending a cell measured far below
    the card. Status counts are in `df.status`.
    """
    rows = ok(require_records(df))
    run_limit = df["memory_limit_bytes"].dropna() if "memory_limit_bytes" in df else pd.Series(dtype=float)
    label = ("run limit " + format_bytes(run_limit.iloc[0])) if len(run_limit) else "no limit"
    fit = rows[rows["peak_bytes"] <= (run_limit.iloc[0] if len(run_limit) else np.inf)]
    if len(fit):
        best = fit.loc[fit["tokens_per_s"].idxmax()]
        out = [{"limit": label, "basis": "measured", **{k: best.get(k) for k in SUMMARY_COLUMNS}}]
    else:
        out = [{"limit": label, "basis": "measured: nothing fits", "policy": None}]
    cards = card_budgets() if limits is None else limits
    fits = fits_from_run(df, cards) if len(rows) else pd.DataFrame()
    lines = fits[fits["kind"] == "extrapolated"] if len(fits) else fits
    off_pass = len(fits) and "fit_reason" in fits and (fits["fit_reason"] == "optimizer peak").any()
    for card in cards:
        out.append(_best_on_card(card, lines[lines["limit"] == card] if len(lines) else lines, rows, bool(off_pass)))
    return pd.DataFrame(out)


def _best_on_card(card: str, lines: pd.DataFrame, rows: pd.DataFrame, optimizer_peaks: bool = False) -> dict:
    if not len(lines):
        why = ("the peaks measured came in the optimizer step (parameters, gradients and optimizer state, which "
               "the batch does not scale): measure larger batches" if optimizer_peaks else
               "no policy has 2+ ok batch sizes to extrapolate from")
        return {"limit": card, "basis": f"cannot answer: {why}", "policy": None}
    lines = lines[lines["seq_len"] == lines["seq_len"].max()]
    lines = lines[lines["max_batch_size"].notna()]
    if not len(lines):
        return {"limit": card, "basis": "extrapolated: not even batch 1 fits", "policy": None}
    line = ["model", "policy", "seq_len", "dtype", "accum_steps"]
    measured = rows.groupby(line)
    speed, largest = measured["tokens_per_s"].max(), measured["batch_size"].max()
    ranked = lines.assign(
        effective_batch=lines["max_batch_size"] * lines["accum_steps"],
        measured_speed=[speed.get(tuple(r), np.nan) for r in lines[line].itertuples(index=False)])
    best = ranked.sort_values(["effective_batch", "measured_speed"], ascending=False).iloc[0]
    batch = int(best["max_batch_size"])
    # a line carried far past what was measured says how far: kernels, limits and the allocator
    # are those of the batches measured, not of one a thousand times larger
    most = largest.get(tuple(best[line]))
    reach = f"; {batch / most:,.0f}x the largest batch measured, {most}" if most and batch > FAR * most else ""
    return {"limit": card, "basis": f"extrapolated ({best['fit_note']}{reach})", "policy": best["policy"],
            "batch_size": batch, "seq_len": best["seq_len"], "dtype": best["dtype"], "accum_steps": best["accum_steps"],
            "peak_bytes": round(best["fit_intercept_bytes"] + best["fit_slope_bytes"] * batch),
            "step_ms": None, "tokens_per_s": None}


def format_summary(df: pd.DataFrame) -> str:
    """The text printed at the end of a sweep: counts, then the best config per limit."""
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    inferred = int(df["inferred"].fillna(False).astype(bool).sum()) if "inferred" in df else 0
    head = (f"{len(df)} cells: {counts.get('ok', 0)} ok, {counts.get('oom', 0)} oom "
            f"({inferred} inferred), {counts.get('error', 0)} error")
    if not len(df):
        return head
    num = lambda f: (lambda v: "-" if v is None or v != v else format(int(v) if f == "d" else v, f))  # noqa: E731
    columns = [("limit", "limit", str), ("policy", "policy", lambda v: policy_label(v) if v else "-"),
               ("batch", "batch_size", num("d")), ("seq", "seq_len", num("d")), ("dtype", "dtype", lambda v: v or "-"),
               ("accum", "accum_steps", num("d")), ("peak", "peak_bytes", lambda v: "-" if v is None or v != v else format_bytes(v)),
               ("step ms [95% CI]", "step_text", str), ("tokens/s", "tokens_per_s", num(",.0f")), ("basis", "basis", str)]
    rows = [{k: (None if isinstance(v, float) and np.isnan(v) else _py(v)) for k, v in r.items()}
            for r in summary(df).to_dict("records")]
    for r in rows:
        r["step_text"] = "-" if r.get("step_ms") is None else format(r["step_ms"], ".1f") + (
            "" if r.get("step_ms_low") is None else f" [{r['step_ms_low']:.1f}, {r['step_ms_high']:.1f}]")
    errors = df[df["status"] == "error"]
    lines = [head, "best configuration per memory limit (run limit: highest measured tokens/s that fits; "
             "cards: largest batch that fits, extrapolated as in fits_from_run):", format_table(rows, columns)]
    for _, r in errors.head(5).iterrows():
        lines.append(f"error in {r.get('cell_id')}: {r.get('message')}")
    return "\n".join(lines)


def _py(v):
    return v.item() if hasattr(v, "item") else v


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """The table for reading: every `*_bytes` column as a size ("77.8 MiB"), named without
    `_bytes` where that name is free, and policies by their label (budget=42.7MiB, not the exact
    bytes). For display: the records keep the exact numbers."""
    out = df.copy()
    if "policy" in out:
        out["policy"] = out["policy"].map(lambda p: p if pd.isna(p) else policy_label(p))
    if out.index.name == "policy":
        out.index = out.index.map(policy_label)
    sizes = [c for c in out.columns if isinstance(c, str) and c.endswith("_bytes")]
    for c in sizes:
        out[c] = out[c].map(lambda v: "-" if pd.isna(v) else format_bytes(v))
    return out.rename(columns={c: c.removesuffix("_bytes") for c in sizes if c.removesuffix("_bytes") not in out})


# ----------------------------------------------------------------------------- transformers' Trainer runs

def trainer_summary(df):
    """One row per run of `compare_trainer_runs`' frame: peak memory (the highest tracked step),
    step time over the steps timed without the tracker (the median with its 95% bootstrap
    interval, `step_ms_low/high`, and how many steps, `timed_steps`), and against the "none" run:
    the step-time `overhead` (ratio of medians - 1) with its 95% interval `overhead_low/high`,
    `significant` (that interval excludes 0), memory saved, and whether every loss (the one
    Trainer logged where the frame has it, else the callback's) is bitwise the same.

    The runs train one after another, not in interleaved rounds, so step i of one run has nothing
    to pair with step i of another: the overhead's interval comes from an unpaired bootstrap that
    resamples each run's step times on its own (`unpaired_median_ratio`). A run with fewer than
    two timed steps has no interval (NaN) and is never `significant`."""
    rows, timed_ms = [], {}
    for run, g in df.groupby("run", sort=False):
        timed = g[~g["memory_tracked"]] if (~g["memory_tracked"]).any() else g
        tracked = g[g["peak_bytes"].notna()]
        peak = tracked.loc[tracked["peak_bytes"].idxmax()] if len(tracked) else None
        timed_ms[run] = timed["step_ms"].to_numpy(dtype=float)
        step, low, high = (bootstrap_median(timed_ms[run]) if len(timed) >= 2
                           else (float(np.median(timed_ms[run])), math.nan, math.nan))
        rows.append({
            "run": run, "policy": g["policy"].iloc[0], "mechanism": g["mechanism"].iloc[0],
            "effective_density": g["effective_density"].iloc[0], "steps": len(g),
            "peak_bytes": None if peak is None else peak["peak_bytes"],
            "peak_activations_bytes": None if peak is None else peak["peak_activations_bytes"],
            "saved_activation_bytes": None if peak is None else peak["saved_activation_bytes"],
            "step_ms": step, "step_ms_low": low, "step_ms_high": high, "timed_steps": len(timed),
            "timed_with_tracker": bool(timed["memory_tracked"].any()),
            "losses": g["trainer_loss" if "trainer_loss" in g else "loss"].tolist(),
        })
    table = pd.DataFrame(rows)
    base = table[table["run"] == "none"]
    if len(base):
        b = base.iloc[0]
        overheads = [_unpaired_overhead(timed_ms[run], timed_ms["none"], run == "none") for run in table["run"]]
        table["overhead"], table["overhead_low"], table["overhead_high"] = map(list, zip(*overheads))
        table["significant"] = [time_verdict(low, high, reference=0.0) != NO_DIFFERENCE
                                for low, high in zip(table["overhead_low"], table["overhead_high"])]
        table["memory_saved_frac"] = 1 - table["peak_bytes"] / b["peak_bytes"] if b["peak_bytes"] else None
        table["same_losses_as_none"] = [losses == b["losses"] for losses in table["losses"]]
    return table.drop(columns="losses")


def _unpaired_overhead(times, baseline, is_baseline: bool) -> tuple[float, float, float]:
    """(overhead, low, high) of `times` against `baseline`: 0 exactly for the baseline itself, NaN
    bounds where either has fewer than two steps."""
    if is_baseline:
        return 0.0, 0.0, 0.0
    if len(times) < 2 or len(baseline) < 2:
        return float(np.median(times) / np.median(baseline) - 1), math.nan, math.nan
    ratio, low, high = unpaired_median_ratio(times, baseline)
    return ratio - 1, low - 1, high - 1


GUIDE_SLOWDOWN = 0.2   # the transformers guide: "Training will be ~20% slower"


def guide_verdict(overhead_low: float, overhead_high: float) -> str:
    """An overhead's 95% interval against the transformers guide's "~20% slower": no difference
    from no checkpointing when it includes 0, else more, less, or consistent (it includes 20%)."""
    if time_verdict(overhead_low, overhead_high, reference=0.0) == NO_DIFFERENCE:
        return "no difference from no checkpointing: the interval includes 0 (inside the noise of these steps)"
    return {"slower": "more than the guide's ~20%", "faster": "less than the guide's ~20%",
            NO_DIFFERENCE: "consistent with the guide's ~20% (the interval includes it)"}[
        time_verdict(overhead_low, overhead_high, reference=GUIDE_SLOWDOWN)]


def slowdown_answer(summary) -> str:
    """The guide's "Training will be ~20% slower", answered from `trainer_summary`'s numbers: per
    run the overhead with its 95% interval. An interval that includes 0 is reported as no
    difference from no checkpointing (inside the noise of these steps); otherwise it is compared
    with the guide's ~20% (more, less, or consistent when the interval includes 20%)."""
    if "overhead" not in summary:
        raise ValueError("summary is invalid: it has no 'none' run to compare against; include 'none' in runs")
    base = summary[summary["run"] == "none"].iloc[0]
    parts = []
    for r in summary[summary["run"] != "none"].itertuples():
        if pd.isna(r.overhead_low):
            verdict = "too few timed steps for an interval: no difference is claimed"
            interval = ""
        else:
            interval = f" [95% CI {r.overhead_low:+.0%}, {r.overhead_high:+.0%}]"
            verdict = guide_verdict(r.overhead_low, r.overhead_high)
        memory = "" if pd.isna(r.memory_saved_frac) else f", {r.memory_saved_frac:.0%} less peak memory"
        parts.append(f"{r.run}: {r.overhead:+.0%} step time{interval} (median {r.step_ms:.0f} ms{_ms_interval(r)})"
                     f"{memory} — {verdict}")
    caveat = (" — every step ran under the memory tracker, whose hooks slow it: use track_steps below max_steps"
              if summary["timed_with_tracker"].any() else "")
    return (f"Against no checkpointing (median {base.step_ms:.0f} ms{_ms_interval(base)} over {base.timed_steps} "
            f"steps){caveat}. The runs ran one after another, not interleaved: intervals come from an unpaired "
            "bootstrap of each run's step times.\n" + "\n".join(parts))


def _ms_interval(r) -> str:
    return "" if pd.isna(r.step_ms_low) else f" [{r.step_ms_low:.0f}, {r.step_ms_high:.0f}]"


__all__ = ["BUSY_SPREAD", "add_predictions", "GUIDE_SLOWDOWN", "SHAPE", "TIMING_GROUP", "compare_note", "fit_note", "fits_from_run",
           "format_summary", "guide_verdict", "largest_fitting", "line_fit", "ok", "on_frontier", "overhead", "pareto",
           "plans_vs_uniform", "readable", "slowdown_answer", "summary", "timing_note", "trainer_summary"]
