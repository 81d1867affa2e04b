"""Figures of a sweep. Each function takes the run's DataFrame (from `sweep()` or `load_run()`),
returns the matplotlib Figure, and, given `path` (without extension), saves PNG and SVG there.

    memory_time_vs_density(df)   peak memory and step time vs density, overhead % on a 2nd axis
    heatmaps(df)                 peak memory and tokens/s over batch x seq, one column per policy
    pareto_plot(df)              peak memory vs step time, frontier joined, dominated hollow
    what_fits_plot(df)           largest batch per policy for 24/40/80/141 GiB (+ the run's limit)
    redraw_all(run_dir)          every figure above into run_dir/figures/, from the folder alone
    compare_plot(df)             a `ckptlab.compare` table: peak vs time ratio with 95% intervals
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..core.records import CATEGORIES
from ..run.store import load_run
from . import analysis

MiB = 2**20


def _save(fig, path: Optional[str | Path]):
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # No date in the files: the same data redraws to the same bytes.
        fig.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight", metadata={"Software": None})
        fig.savefig(path.with_suffix(".svg"), bbox_inches="tight", metadata={"Date": None})
    return fig


def _slice(df: pd.DataFrame, dtype: Optional[str], accum_steps: Optional[int]) -> tuple[pd.DataFrame, str, int]:
    """One dtype and one accumulation setting (default: the first dtype, the smallest accum)."""
    dtype = dtype or df["dtype"].iloc[0]
    accum_steps = accum_steps or int(df["accum_steps"].min())
    return df[(df["dtype"] == dtype) & (df["accum_steps"] == accum_steps)], dtype, accum_steps


def _interval(df: pd.DataFrame, column: str):
    """Error-bar lengths (below, above) from `<column>_low/_high`; none where they are missing."""
    low, high = f"{column}_low", f"{column}_high"
    if low not in df or high not in df:
        return None
    return np.vstack([(df[column] - df[low]).clip(lower=0).fillna(0).to_numpy(float),
                      (df[high] - df[column]).clip(lower=0).fillna(0).to_numpy(float)])


def _empty(fig, ax, text="no ok cells to plot"):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    return fig


def memory_time_vs_density(df: pd.DataFrame, path=None, dtype: Optional[str] = None,
                           accum_steps: Optional[int] = None):
    """Left: peak memory vs effective density; right: step time vs density, with overhead
    against density 0 on a second y axis. One line per (batch, seq)."""
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = analysis.overhead(df)
    rows, dtype, accum_steps = _slice(rows, dtype, accum_steps) if len(rows) else (rows, dtype, accum_steps)
    if not len(rows):
        return _save(_empty(fig, ax_mem), path)
    ax_over = ax_time.twinx()
    for (b, s), g in rows.groupby(["batch_size", "seq_len"]):
        g = g.groupby("effective_density", as_index=False).median(numeric_only=True).sort_values("effective_density")
        label = f"b={b} s={s}"
        line, = ax_mem.plot(g["effective_density"], g["peak_bytes"] / MiB, "o-", label=label)
        ax_time.errorbar(g["effective_density"], g["step_ms"], yerr=_interval(g, "step_ms"), fmt="o-",
                         color=line.get_color(), label=label, capsize=3)
        over = g.assign(overhead_pct=100 * g["overhead"], overhead_pct_low=100 * g["overhead_low"],
                        overhead_pct_high=100 * g["overhead_high"])
        ax_over.errorbar(over["effective_density"], over["overhead_pct"], yerr=_interval(over, "overhead_pct"),
                         fmt="x:", color=line.get_color(), alpha=0.7, capsize=2)
    ax_mem.set(xlabel="density (fraction of blocks recomputed)", ylabel="peak memory (MiB)",
               title=f"peak memory ({dtype}, accum {accum_steps})")
    ax_time.set(xlabel="density (fraction of blocks recomputed)", ylabel="step time (ms, median) — solid",
                title="step time and overhead (bars: 95% intervals)")
    ax_over.set_ylabel("overhead vs density 0 (%) — dotted")
    ax_mem.legend(fontsize=8)
    ax_mem.grid(alpha=0.3)
    ax_time.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def heatmaps(df: pd.DataFrame, path=None, dtype: Optional[str] = None, accum_steps: Optional[int] = None):
    """Peak memory (top) and tokens/s (bottom) over batch x seq, one column per policy.
    Out-of-memory cells are marked OOM; batches are powers of two on a log2-spaced axis."""
    rows, dtype, accum_steps = _slice(df, dtype, accum_steps) if len(df) else (df, dtype, accum_steps)
    policies = list(dict.fromkeys(rows["policy"])) if len(rows) else []
    fig, axes = plt.subplots(2, max(1, len(policies)), figsize=(3.6 * max(1, len(policies)), 6.4), squeeze=False)
    if not policies:
        return _save(_empty(fig, axes[0, 0]), path)
    batches, seqs = sorted(rows["batch_size"].unique()), sorted(rows["seq_len"].unique())
    rows = rows.assign(peak_mib=rows["peak_bytes"] / MiB)
    ok_rows = rows[rows["status"] == "ok"]
    # One colour scale per row across policies, so equal colours mean equal values.
    scales = {v: (ok_rows[v].min(), ok_rows[v].max()) if len(ok_rows) else (None, None)
              for v in ("peak_mib", "tokens_per_s")}
    for col, policy in enumerate(policies):
        g = rows[rows["policy"] == policy]
        for row, (value, label, fmt) in enumerate([("peak_mib", "peak MiB", lambda v: f"{v:.0f}"),
                                                   ("tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}")]):
            ax = axes[row, col]
            grid = np.full((len(seqs), len(batches)), np.nan)
            status = {}
            for _, r in g.iterrows():
                i, j = seqs.index(r["seq_len"]), batches.index(r["batch_size"])
                status[i, j] = r["status"]
                if r["status"] == "ok":
                    grid[i, j] = r[value]
            vmin, vmax = scales[value]
            im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis" if row else "magma",
                           vmin=vmin, vmax=vmax)
            for (i, j), st in status.items():
                text = fmt(grid[i, j]) if st == "ok" else st.upper()
                light = st == "ok" and im.norm(grid[i, j]) > 0.6  # the top of both colour maps is pale
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="r" if st != "ok" else ("k" if light else "w"))
            # The batches are (usually) powers of two, so equal spacing is a log2 axis.
            ax.set_xticks(range(len(batches)), [str(b) for b in batches])
            ax.set_yticks(range(len(seqs)), [str(s) for s in seqs])
            ax.set(xlabel="batch (log2 spaced)", ylabel="seq", title=f"{policy}: {label}")
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"{dtype}, accum {accum_steps}")
    fig.tight_layout()
    return _save(fig, path)


def pareto_plot(df: pd.DataFrame, path=None):
    """Peak memory vs step time; one colour per (seq, effective batch) group, the frontier of
    each group joined by a line, dominated points hollow with grey labels."""
    fig, ax = plt.subplots(figsize=(7, 5))
    rows = analysis.pareto(df)
    if not len(rows):
        return _save(_empty(fig, ax), path)
    for (_, s, eb), g in rows.groupby(["model", "seq_len", "effective_batch_size"]):
        front = g[g["pareto_optimal"]].sort_values("peak_bytes")
        line, = ax.plot(front["peak_bytes"] / MiB, front["step_ms"], "o-", label=f"s={s} eff. batch={eb}")
        dom = g[~g["pareto_optimal"]]
        ax.scatter(dom["peak_bytes"] / MiB, dom["step_ms"], facecolors="none", edgecolors=line.get_color())
        ax.errorbar(g["peak_bytes"] / MiB, g["step_ms"], yerr=_interval(g, "step_ms"), fmt="none",
                    ecolor=line.get_color(), alpha=0.6, capsize=2)
        for (_, r), tag in zip(g.iterrows(), analysis.config_label(g)):
            ax.annotate(tag, (r["peak_bytes"] / MiB, r["step_ms"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points", color="k" if r["pareto_optimal"] else "0.45")
    ax.set(xlabel="peak memory (MiB)", ylabel="step time (ms, median, 95% interval)",
           title="Pareto frontier (filled, joined); dominated hollow")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def what_fits_plot(df: pd.DataFrame, path=None, seq_len: Optional[int] = None, dtype: Optional[str] = None,
                   accum_steps: Optional[int] = None):
    """Largest batch per policy for each memory limit at one seq (default: the longest measured).
    Extrapolated bars are hatched and labelled; the fit residual is in the legend."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    fits = analysis.what_fits(df)
    if not len(fits):
        return _save(_empty(fig, ax, "need 2+ ok batch sizes per policy to extrapolate"), path)
    fits, dtype, accum_steps = _slice(fits, dtype, accum_steps)
    seq_len = seq_len or int(fits["seq_len"].max())
    fits = fits[fits["seq_len"] == seq_len]
    limits = list(dict.fromkeys(fits["limit"]))
    policies = list(dict.fromkeys(fits["policy"]))
    width = 0.8 / max(1, len(policies))
    for k, policy in enumerate(policies):
        g = fits[fits["policy"] == policy].set_index("limit")
        xs = np.arange(len(limits)) + k * width
        vals = [g.loc[lim, "max_batch_size"] if lim in g.index else np.nan for lim in limits]
        vals = [np.nan if v is None else float(v) for v in vals]
        kinds = [g.loc[lim, "kind"] if lim in g.index else "" for lim in limits]
        resid = g["fit_max_rel_residual"].dropna() if "fit_max_rel_residual" in g else pd.Series(dtype=float)
        label = policy + (f" (fit residual ≤{100 * resid.iloc[0]:.1f}%)" if len(resid) else "")
        bars = ax.bar(xs, vals, width, label=label)
        for bar, kind in zip(bars, kinds):
            if kind == "extrapolated":
                bar.set_hatch("//")
    ax.set_yscale("log", base=2)
    ax.set_xticks(np.arange(len(limits)) + width * (len(policies) - 1) / 2,
                  [f"{lim}\n({'extrapolated' if lim in analysis.CARD_LIMITS else 'measured'})"
                   for lim in limits])
    ax.set(ylabel="largest batch that fits (log2)", title=f"what fits: seq {seq_len}, {dtype}, accum {accum_steps}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, path)


FIGURES = {
    "memory_time_vs_density": memory_time_vs_density,
    "heatmaps": heatmaps,
    "pareto": pareto_plot,
    "what_fits": what_fits_plot,
}


def redraw_all(run_dir: str | Path) -> list[Path]:
    """Redraw every figure of a run from its folder alone into run_dir/figures/ (PNG + SVG);
    return the paths written."""
    run_dir = Path(run_dir)
    df = load_run(run_dir)
    if not len(df):
        raise ValueError(f"run_dir={str(run_dir)!r} is invalid: it holds no records ({run_dir.name}/records.jsonl "
                         "is missing or empty); allowed is a run folder with at least one finished cell")
    written = []
    for name, draw in FIGURES.items():
        fig = draw(df, run_dir / "figures" / name)
        plt.close(fig)
        written += [run_dir / "figures" / f"{name}.png", run_dir / "figures" / f"{name}.svg"]
    return written


# ----------------------------------------------------------------------------- single-step figures

CATEGORY_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
                   "activations": "#c44e52", "temporaries": "#8172b3"}


def peak_breakdown(df: pd.DataFrame, path=None, limit_bytes: Optional[int] = None, label: str = "policy"):
    """Stacked bars: peak memory by category, one bar per row of `df` (records from `measure`),
    with step time written above each bar and an optional memory-limit line."""
    fig, ax = plt.subplots(figsize=(3.2 + 1.3 * max(len(df), 1), 4.2))
    if not len(df):
        return _save(_empty(fig, ax, "no records"), path)
    x = np.arange(len(df))
    bottom = np.zeros(len(df))
    for cat in CATEGORIES:
        values = df[f"peak_{cat}_bytes"].fillna(0).to_numpy(dtype=float) / MiB
        ax.bar(x, values, bottom=bottom, color=CATEGORY_COLORS[cat], label=cat.replace("_", " "))
        bottom += values
    lows = df["step_ms_low"] if "step_ms_low" in df else df["step_ms"]
    highs = df["step_ms_high"] if "step_ms_high" in df else df["step_ms"]
    for xi, total, ms, low, high in zip(x, bottom, df["step_ms"], lows, highs):
        text = "" if pd.isna(ms) else f"{ms:.0f} ms" + ("" if pd.isna(low) else f"\n[{low:.0f}, {high:.0f}]")
        ax.text(xi, total, text, ha="center", va="bottom", fontsize=8)
    if limit_bytes:
        ax.axhline(limit_bytes / MiB, color="k", ls="--", lw=1, label=f"limit {limit_bytes / MiB:.0f} MiB")
    ax.set_xticks(x, df[label].astype(str), rotation=20, ha="right")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory by category (step time, 95% interval, above)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never over a bar
    fig.tight_layout()
    return _save(fig, path)


def memory_timeline(timelines: dict, path=None):
    """Live bytes over one training step, one line per policy: x is the allocation/free event
    index scaled to [0, 1] of the step, forward rising, backward falling (recompute spikes).
    `timelines` maps a label to a MemoryReport.timeline [(phase, bytes), ...]."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for label, timeline in timelines.items():
        if not timeline:
            continue
        t = np.linspace(0, 1, len(timeline))
        ax.plot(t, np.array([b for _, b in timeline]) / MiB, lw=1.2, label=label)
        first_backward = next((i for i, (p, _) in enumerate(timeline) if p == "backward"), None)
        if first_backward is not None:
            ax.axvline(t[first_backward], color=ax.lines[-1].get_color(), ls=":", lw=0.8)
    ax.set_xlabel("fraction of the step's memory events (dotted: backward starts)")
    ax.set_ylabel("live tensor memory (MiB)")
    ax.set_title("memory over one training step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def compare_plot(df: pd.DataFrame, path=None):
    """Peak memory against time ratio (to the first row's policy) for a `ckptlab.compare` table,
    the 95% interval of each ratio as a horizontal error bar; ckptlab's own rows filled, anchors
    (the other frameworks' knobs) as squares, plans at an anchor's peak as diamonds."""
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = df[(df["status"] == "ok") & df["time_ratio"].notna()] if len(df) else df
    if not len(rows):
        return _save(_empty(fig, ax, "no timed configurations to plot"), path)
    for kind, marker, colour in (("ckptlab", "o", "C0"), ("anchor", "s", "C3"), ("plan", "D", "C2")):
        part = rows[rows["source"].map(_source_kind) == kind]
        if not len(part):
            continue
        err = [part["time_ratio"] - part["time_ratio_low"], part["time_ratio_high"] - part["time_ratio"]]
        ax.errorbar(part["time_ratio"], part["peak_bytes"] / MiB, xerr=err, fmt=marker, color=colour, capsize=3,
                    label={"ckptlab": "ckptlab policy", "anchor": "anchor (framework knob)",
                           "plan": "ckptlab plan at an anchor's peak"}[kind])
        for r in part.itertuples():
            ax.annotate(r.policy, (r.time_ratio, r.peak_bytes / MiB), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
    ax.axvline(1.0, color="0.6", lw=0.8, ls="--")
    first = rows.iloc[0]
    ax.set(xlabel=f"time ratio to {rows['timing_baseline'].iloc[0]} (median, 95% interval)",
           ylabel="peak memory (MiB)",
           title=f"{first['model']} b={first['batch_size']} s={first['seq_len']} {first['dtype']}: "
                 f"{int(first['rounds'])} interleaved rounds" + (" (busy machine)" if first["busy"] else ""))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def trainer_plot(df, path=None):
    """`compare_trainer_runs`' frame in three panels: the loss of every step, one line per run
    (identical runs lie on top of each other); peak memory per run by category (the highest
    tracked step); every step's time per run, steps timed under the tracker hollow."""
    fig, (ax_loss, ax_mem, ax_time) = plt.subplots(1, 3, figsize=(15, 4.2))
    runs = list(dict.fromkeys(df["run"]))
    markers = "os^Dvx+*"
    for i, run in enumerate(runs):
        g = df[df["run"] == run]
        ax_loss.plot(g["step"], g["loss"], marker=markers[i % len(markers)], markersize=max(3, 9 - 1.5 * i),
                     linewidth=1.5, alpha=0.8, label=run)
        tracked, timed = g[g["memory_tracked"]], g[~g["memory_tracked"]]
        color = f"C{i}"
        ax_time.plot(timed["step"], timed["step_ms"], "o-", color=color, label=run)
        ax_time.plot(tracked["step"], tracked["step_ms"], "o", color=color, markerfacecolor="none")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="loss per step (the runs overlap)")
    ax_loss.legend()
    peak_rows = []
    for run in runs:
        g = df[(df["run"] == run) & df["peak_bytes"].notna()]
        peak_rows.append(g.loc[g["peak_bytes"].idxmax()] if len(g) else None)
    by_category = all(r is not None and r[[f"peak_{c}_bytes" for c in CATEGORIES]].notna().all() for r in peak_rows)
    if by_category:
        bottom = [0.0] * len(runs)
        for category in CATEGORIES:
            part = [r[f"peak_{category}_bytes"] / MiB for r in peak_rows]
            ax_mem.bar(runs, part, bottom=bottom, label=category.replace("_", " "), color=CATEGORY_COLORS[category])
            bottom = [b + p for b, p in zip(bottom, part)]
        ax_mem.legend(fontsize=8)
    else:  # the allocator's peak (CUDA) has no categories
        ax_mem.bar(runs, [0.0 if r is None else r["peak_bytes"] / MiB for r in peak_rows])
    ax_mem.set(ylabel="MiB", title="peak memory at the highest tracked step")
    plt.setp(ax_mem.get_xticklabels(), rotation=25, ha="right")
    ax_time.set(xlabel="optimizer step", ylabel="ms", title="step time (hollow: under the memory tracker)")
    ax_time.legend()
    fig.tight_layout()
    return _save(fig, path)


def _source_kind(source: str) -> str:
    if source == "ckptlab":
        return "ckptlab"
    return "plan" if source == "ckptlab plan" else "anchor"


__all__ = ["CATEGORY_COLORS", "FIGURES", "MiB", "compare_plot", "heatmaps", "memory_time_vs_density",
           "memory_timeline", "pareto_plot", "peak_breakdown", "redraw_all", "trainer_plot", "what_fits_plot"]
