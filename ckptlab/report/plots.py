"""Figures of a sweep. Each function takes the run's DataFrame (from `sweep()` or `load_run()`),
returns the matplotlib Figure, and, given `path` (without extension), saves PNG and SVG there.

    memory_time_vs_density(df)   peak memory, step time and overhead % vs density, side by side
    heatmaps(df)                 peak memory and tokens/s over batch x seq, one column per policy
    pareto_plot(df)              peak memory vs step time, frontier joined, dominated hollow
    what_fits_plot(df)           largest batch per policy for 24/40/80/141 GiB (+ the run's limit)
    redraw_all(run_dir)          every figure above into run_dir/figures/, from the folder alone
    compare_plot(df)             a `ckptlab.compare` table: peak vs time ratio with 95% intervals
    waterfall_plot(steps)        an explanation's levers one after another, towards a capacity
    prediction_breakdown(preds)  predictions for a CUDA card by category, up to its device bytes
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import to_hex, to_rgb
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import Bbox

from ..core.policy import Policy, policy_label, policy_of_label
from ..core.records import CATEGORIES, PHASES
from ..core.units import format_bytes
from ..estimate.fake_step import DEVICE_CATEGORIES, Prediction
from ..run.store import load_run
from ..run.sweep import config_label
from . import analysis

MiB = 2**20
GiB = 2**30

# One colour and one marker per policy kind, in every figure.
KIND_STYLES = {
    "none": ("#404040", "o"), "full": ("#d62728", "s"), "density": ("#1f77b4", "^"),
    "every": ("#17becf", "v"), "layers": ("#9467bd", "D"), "segments": ("#8c564b", "P"),
    "selective": ("#2ca02c", "X"), "plan": ("#ff7f0e", "*"), "budget": ("#e377c2", "h"),
    "compile": ("#bcbd22", "p"), "hf": ("#7f7f7f", "d"),
}
OTHER_STYLE = ("#7f7f7f", ".")


def policy_style(policy: str | Policy) -> dict:
    """How a policy is drawn in every figure: `color` and `marker` from its kind, the colour
    shaded by the policy's value (density=0.25 lighter than density=0.75, every=4 lighter than
    every=2), `linestyle` dashed for +offload, dotted for +compile. A function of the policy text alone, so the same
    policy looks the same in every figure whatever else is drawn beside it."""
    parsed = policy_of_label(policy)
    if parsed is None:  # a label this version cannot parse still gets a stable style
        return {"color": OTHER_STYLE[0], "marker": OTHER_STYLE[1], "linestyle": "-"}
    kind = "hf" if parsed.mechanism == "transformers" else parsed.kind
    color, marker = KIND_STYLES.get(kind, OTHER_STYLE)
    strength = _strength(parsed)
    # Mix towards white: strength 1 is the kind's own colour, 0 is 60% white.
    rgb = np.array(to_rgb(color))
    shaded = rgb + (1 - rgb) * 0.6 * (1 - strength)
    return {"color": to_hex(shaded), "marker": marker, "linestyle": "--" if parsed.offload else ":" if parsed.compiled else "-"}


def _strength(policy) -> float:
    """How much a policy recomputes, in [0, 1], for its shade (1 where the kind has no value)."""
    value = policy.value
    if value is None:
        return 1.0
    if policy.kind in ("density", "compile") or (policy.kind == "budget" and isinstance(value, float)):
        return float(value)
    if policy.kind in ("every", "hf:every_n_layers"):
        return 1.0 / value
    if policy.kind == "plan":
        return sum(c in "sf" or c.isdigit() and c != "9" for c in value) / len(value)
    if policy.kind == "selective":
        return {"mm": 1.0, "alt": 0.66, "attn": 0.33}[value]
    # layers, segments, budget sizes: no natural order, a stable shade from the text
    return 0.35 + 0.65 * (zlib.crc32(str(policy).encode()) % 1000) / 999


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


SHAPE_LINESTYLES = ("-", "--", "-.", ":")


def memory_time_vs_density(df: pd.DataFrame, path=None, dtype: Optional[str] = None,
                           accum_steps: Optional[int] = None):
    """Peak memory, step time and overhead against density 0, each on its own panel, against
    effective density. One grey line per (batch, seq); each point in its policy's style."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), layout="constrained")
    ax_mem, ax_time, ax_over = axes
    rows = analysis.overhead(df)
    rows, dtype, accum_steps = _slice(rows, dtype, accum_steps) if len(rows) else (rows, dtype, accum_steps)
    if not len(rows):
        return _save(_empty(fig, ax_mem), path)
    handles, shapes = {}, {}
    for k, ((b, s), g) in enumerate(rows.groupby(["batch_size", "seq_len"])):
        g = g.sort_values("effective_density")
        by_density = g.groupby("effective_density", as_index=False).median(numeric_only=True)
        line_style = dict(color="0.55", ls=SHAPE_LINESTYLES[k % len(SHAPE_LINESTYLES)], lw=1.2, zorder=1)
        for ax, column, scale in ((ax_mem, "peak_bytes", 1 / MiB), (ax_time, "step_ms", 1), (ax_over, "overhead", 100)):
            ax.plot(by_density["effective_density"], by_density[column] * scale, **line_style, label=f"b={b} s={s}")
            for policy, p in g.groupby("policy", sort=False):
                style = policy_style(policy)
                ax.scatter(p["effective_density"], p[column] * scale, color=style["color"], marker=style["marker"],
                           s=40, zorder=3, label=policy_label(policy))
                bars = _interval(p, column)  # 95% intervals where the run timed them
                if bars is not None and column != "peak_bytes":
                    ax.errorbar(p["effective_density"], p[column] * scale, yerr=bars * scale, fmt="none",
                                ecolor=style["color"], capsize=3, zorder=2)
        shapes[f"b={b} s={s}"] = Line2D([], [], **line_style)
        for policy in g["policy"].unique():
            style = policy_style(policy)
            handles.setdefault(policy_label(policy), Line2D([], [], ls="", color=style["color"], marker=style["marker"]))
    ax_over.axhline(0, color="k", lw=0.6)
    xlabel = "density (fraction of blocks recomputed)"
    ax_mem.set(xlabel=xlabel, ylabel="peak memory (MiB)", title=f"peak memory ({dtype}, accum {accum_steps})")
    ax_time.set(xlabel=xlabel, ylabel="step time (ms, median)", title="step time (bars: 95% intervals)")
    ax_over.set(xlabel=xlabel, ylabel="overhead vs density 0 (%)", title="overhead (step time / density 0's − 1)")
    for ax in axes:
        ax.grid(alpha=0.3)
    handles.update(shapes)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8)
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
            ax.set(xlabel="batch (log2 spaced)", ylabel="seq")
            ax.set_title(f"{policy_label(policy)}: {label}", color=policy_style(policy)["color"], fontweight="bold")
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"{dtype}, accum {accum_steps}")
    fig.tight_layout()
    return _save(fig, path)


def pareto_plot(df: pd.DataFrame, path=None):
    """Peak memory vs step time, each point in its policy's style and labelled with its
    configuration; the frontier of each group of equal work (seq, effective batch) joined by a
    grey line, dominated points hollow with grey labels. Labels are placed where they overlap
    neither each other nor the axes' edges."""
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    rows = analysis.pareto(df)
    if not len(rows):
        return _save(_empty(fig, ax), path)
    handles, frontiers = {}, {}
    points, texts, colors = [], [], []
    for k, ((_, s, eb), g) in enumerate(rows.groupby(["model", "seq_len", "effective_batch_size"])):
        front = g[g["pareto_optimal"]].sort_values("peak_bytes")
        line_style = dict(color="0.6", ls=SHAPE_LINESTYLES[k % len(SHAPE_LINESTYLES)], lw=1.2)
        ax.plot(front["peak_bytes"] / MiB, front["step_ms"], zorder=1, **line_style)
        frontiers[f"frontier: s={s} eff. batch={eb}"] = Line2D([], [], **line_style)
        for (_, r), tag in zip(g.iterrows(), config_label(g)):
            style = policy_style(r["policy"])
            x, y = r["peak_bytes"] / MiB, r["step_ms"]
            ax.scatter([x], [y], marker=style["marker"], s=45, zorder=3, edgecolors=style["color"],
                       facecolors=style["color"] if r["pareto_optimal"] else "none")
            bars = _interval(g.loc[[r.name]], "step_ms")  # the step time's 95% interval, where timed
            if bars is not None:
                ax.errorbar([x], [y], yerr=bars, fmt="none", ecolor=style["color"], alpha=0.6, capsize=2, zorder=2)
            handles.setdefault(policy_label(r["policy"]), Line2D([], [], ls="", marker=style["marker"], color=style["color"]))
            points.append((x, y))
            texts.append(tag)
            colors.append("k" if r["pareto_optimal"] else "0.45")
    ax.set(xlabel="peak memory (MiB)", ylabel="step time (ms, median, 95% interval)",
           title="Pareto frontier (filled, joined); dominated hollow")
    ax.grid(alpha=0.3)
    ax.margins(x=0.12, y=0.1)
    handles.update(frontiers)
    ax.legend(list(handles.values()), list(handles), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    place_labels(ax, points, texts, colors)
    return _save(fig, path)


# Offsets (points) tried in turn for a point's label: beside it, then further away.
LABEL_OFFSETS = [(dx * r, dy * r) for r in (4, 11, 18, 26) for dx, dy in ((1, 1), (1, -1), (-1, 1), (-1, -1))] + [
    (0, 34), (0, -34), (40, 0), (-40, 0)]


def place_labels(ax, points, texts, colors, fontsize: float = 7) -> list:
    """Annotate each point with its text at the first offset whose label overlaps no marker and
    no label placed before it, and stays inside the axes (else the first offset inside the
    axes). The figure's layout must be final: positions are measured in display space."""
    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    radius = 3.5 * ax.figure.dpi / 72  # a marker's half-width (points), in display units
    markers = [Bbox.from_extents(px - radius, py - radius, px + radius, py + radius)
               for px, py in ax.transData.transform(np.asarray(points, dtype=float).reshape(-1, 2))]
    placed, annotations = [], []
    for k, ((x, y), text, color) in enumerate(zip(points, texts, colors)):
        fallback = None
        others = markers[:k] + markers[k + 1:]  # a label may touch its own marker, no other
        for dx, dy in LABEL_OFFSETS:
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                              color=color, ha="left" if dx >= 0 else "right", va="bottom" if dy >= 0 else "top")
            box = ann.get_window_extent(renderer)
            within = (box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0 and box.y1 <= inside.y1)
            if within and not any(box.overlaps(other) for other in placed + others):
                break
            if within and fallback is None:
                fallback = (dx, dy)
            ann.remove()
        else:
            dx, dy = fallback or LABEL_OFFSETS[0]
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                              color=color, ha="left" if dx >= 0 else "right", va="bottom" if dy >= 0 else "top")
            box = ann.get_window_extent(renderer)
        placed.append(box)
        annotations.append(ann)
    return annotations


def what_fits_plot(df: pd.DataFrame, path=None, seq_len: Optional[int] = None, dtype: Optional[str] = None,
                   accum_steps: Optional[int] = None):
    """Largest batch per policy for each memory limit at one seq (default: the longest measured).
    Extrapolated bars are hatched; the legend gives each policy's line (its number of points,
    and its residual where one was measured) or why it has none ("no fit: one batch size ran
    ok, 2 out of memory")."""
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    fits = analysis.fits_from_run(df)
    if not len(fits):
        return _save(_empty(fig, ax, "no ok or out-of-memory cells"), path)
    fits, dtype, accum_steps = _slice(fits, dtype, accum_steps)
    seq_len = seq_len or int(fits["seq_len"].max())
    fits = fits[fits["seq_len"] == seq_len]
    bars = fits[fits["kind"] != "no fit"]
    limits = list(dict.fromkeys(bars["limit"]))
    policies = list(dict.fromkeys(fits["policy"]))
    width = 0.8 / max(1, len(policies))
    handles, labels = [], []
    for k, policy in enumerate(policies):
        g = bars[bars["policy"] == policy].set_index("limit")
        style = policy_style(policy)
        xs = np.arange(len(limits)) + k * width
        vals = [g.loc[lim, "max_batch_size"] if lim in g.index else np.nan for lim in limits]
        vals = [np.nan if v is None else float(v) for v in vals]
        drawn = ax.bar(xs, vals, width, color=style["color"], edgecolor="k", linewidth=0.5)
        for bar, lim in zip(drawn, limits):
            if lim in g.index and g.loc[lim, "kind"] == "extrapolated":
                bar.set_hatch("//")
        notes = fits[(fits["policy"] == policy) & fits["fit_note"].notna()]["fit_note"] if "fit_note" in fits else []
        handles.append(Patch(facecolor=style["color"], edgecolor="k", linewidth=0.5))
        labels.append(policy_label(policy) + (f" ({notes.iloc[0]})" if len(notes) else ""))
    if limits:
        ax.set_yscale("log", base=2)
    else:  # one batch size per policy and no run limit: the legend says why there is nothing to draw
        _empty(fig, ax, "no limit to compare with: see the legend")
    kinds = bars.drop_duplicates("limit").set_index("limit")["kind"]
    ax.set_xticks(np.arange(len(limits)) + width * (len(policies) - 1) / 2,
                  [f"{lim}\n{kinds[lim]}" for lim in limits], fontsize=8)
    ax.set(ylabel="largest batch that fits (log2)", title=f"what fits: seq {seq_len}, {dtype}, accum {accum_steps}")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
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
    return the paths written. A comparison's folder (`compare(out=...)`: compare.json, no
    records) gets its one figure again."""
    run_dir = Path(run_dir)
    if (run_dir / "compare.json").is_file() and not (run_dir / "records.jsonl").is_file():
        fig = compare_plot(pd.read_json(run_dir / "compare.json", orient="records"), run_dir / "figures" / "compare")
        plt.close(fig)
        return [run_dir / "figures" / "compare.png", run_dir / "figures" / "compare.svg"]
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

CATEGORY_COLORS = {"parameters": "#4c72b0", "frozen_parameters": "#a6bddb", "buffers": "#da8bc3", "gradients": "#dd8452",
                   "optimizer_state": "#55a868", "activations": "#c44e52", "temporaries": "#8172b3"}


def shown_categories(df: pd.DataFrame) -> list[str]:
    """The memory categories a breakdown draws: all, but frozen parameters and buffers only where
    a record has some (most models' would carry an empty legend entry)."""
    def present(category: str) -> bool:
        column = f"peak_{category}_bytes"
        return column in df and bool(df[column].fillna(0).astype(float).any())
    return [c for c in CATEGORIES if c not in ("frozen_parameters", "buffers") or present(c)]


RECOMPUTE_NOTE = "with recompute, backward's temporaries include the recomputed blocks' activations"


def peak_breakdown(df: pd.DataFrame, path=None, limit_bytes: Optional[int] = None, label: str = "policy"):
    """Stacked bars: peak memory by category, one bar per row of `df` (records from `measure`),
    with step time written above each bar and an optional memory-limit line. Tick labels are in
    their policy's colour. Where a row recomputed blocks and peaked in backward, the legend says
    that its temporaries include the recomputed activations (the tracker counts them there:
    they are allocated in backward and held only until the block's gradient is done)."""
    notes = []
    if len(df):
        lows = df["step_ms_low"] if "step_ms_low" in df else df["step_ms"]
        highs = df["step_ms_high"] if "step_ms_high" in df else df["step_ms"]
        notes = ["" if pd.isna(ms) else f"{ms:.0f} ms" + ("" if pd.isna(low) else f"\n[{low:.0f}, {high:.0f}]")
                 for ms, low, high in zip(df["step_ms"], lows, highs)]
    limit = (limit_bytes, f"limit {format_bytes(limit_bytes)}") if limit_bytes else None
    return _breakdown(df, shown_categories(df), notes, "peak memory by category (step time, 95% interval, above)",
                      limit, label, path)


# What a prediction for a CUDA card stacks above the tensors' categories: the allocator's own
# (reserved = allocated + fragmentation) and the card's context (device bytes = reserved + context).
DEVICE_COLORS = {"workspaces": "#937860", "rounding": "#c9b79c", "fragmentation": "#dddddd", "context": "#555555"}
FIT_WORDS = {"yes": "fits", "with cache flushes": "fits with\ncache flushes", "no": "does not fit"}


def prediction_breakdown(predictions: list[Prediction], path=None):
    """Stacked bars of predictions for one CUDA card (`ckptlab.predict(..., card=...)`), one bar
    per prediction: the tensors' categories at the peak, then the allocator's workspaces, rounding
    and fragmentation (up to the reserved bytes) and the card's context (up to the device bytes);
    the fit answer above each bar and the card's usable bytes less its margin as a line (a bar
    above it does not fit as reserved). A line more than four times the tallest bar is named in
    the title instead, so that the bars stay readable."""
    rows = [{"policy": p.policy, "recompute_count": p.recompute_count, "peak_phase": p.peak_phase,
             **{f"peak_{c}_bytes": p.peak_by_category.get(c, 0) for c in (*CATEGORIES, *DEVICE_CATEGORIES)},
             "peak_context_bytes": p.device_bytes - p.reserved_bytes} for p in predictions]
    df = pd.DataFrame(rows)
    notes = [f"{format_bytes(p.device_bytes)}\n{FIT_WORDS[p.fit]}" for p in predictions]
    if not predictions:
        return _breakdown(df, [], notes, "", None, "policy", path)
    card = predictions[0].card
    allowed = predictions[0].device_bytes + predictions[0].margin_bytes   # usable bytes less the margin
    title = f"predicted peak on {card}"
    limit = (allowed, f"{card} less its margin")
    if allowed > 4 * max(p.device_bytes for p in predictions):
        title, limit = f"{title} (it allows {format_bytes(allowed)})", None
    return _breakdown(df, [*shown_categories(df), *DEVICE_COLORS], notes, title, limit, "policy", path)


def _breakdown(df: pd.DataFrame, categories: list[str], notes: list[str], title: str,
               limit: Optional[tuple[int, str]], label: str, path):
    """peak_breakdown's and prediction_breakdown's figure: `categories` stacked per row of `df`
    (columns `peak_<category>_bytes`), `notes` above the bars, `limit` (bytes, its name) a line."""
    fig, ax = plt.subplots(figsize=(3.2 + 1.3 * max(len(df), 1), 4.2))
    if not len(df):
        return _save(_empty(fig, ax, "no records"), path)
    totals = sum(df[f"peak_{cat}_bytes"].fillna(0).to_numpy(dtype=float) for cat in categories)
    scale, unit = (GiB, "GiB") if max(totals.max(), limit[0] if limit else 0) >= GiB else (MiB, "MiB")
    x = np.arange(len(df))
    bottom = np.zeros(len(df))
    recomputed = (df["recompute_count"].fillna(0) > 0) & (df["peak_phase"] == "backward") \
        if {"recompute_count", "peak_phase"} <= set(df) else pd.Series(False, index=df.index)
    for cat in categories:
        values = df[f"peak_{cat}_bytes"].fillna(0).to_numpy(dtype=float) / scale
        name = cat.replace("_", " ")
        if cat == "temporaries" and recomputed.any():
            name += "\n(" + RECOMPUTE_NOTE.replace("include ", "include\n") + ")"
        ax.bar(x, values, bottom=bottom, color=CATEGORY_COLORS.get(cat) or DEVICE_COLORS[cat], label=name)
        bottom += values
    for xi, total, note in zip(x, bottom, notes):
        ax.text(xi, total, note, ha="center", va="bottom", fontsize=8)
    if limit:
        ax.axhline(limit[0] / scale, color="k", ls="--", lw=1, label=limit[1])
    names = df[label].astype(str)
    ax.set_xticks(x, [policy_label(n) for n in names] if label == "policy" else names, rotation=20, ha="right",
                  rotation_mode="anchor")
    if label == "policy":
        for tick, policy in zip(ax.get_xticklabels(), names):
            tick.set_color(policy_style(policy)["color"])
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.1)  # room for the notes above the bars
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never over a bar
    fig.tight_layout()
    return _save(fig, path)


def memory_timeline(timelines: dict, path=None):
    """Live bytes over one training step, one line per policy in its style. The x axis is the
    step's phases (forward, backward, optimizer), each one unit wide, the allocations and frees
    of a phase spread evenly across it — so phases line up across policies whatever their
    number of events: forward rising, backward falling, recompute spikes in backward.
    `timelines` maps a policy to a MemoryReport.timeline [(phase, bytes), ...]."""
    phases = [p for p in PHASES if p != "setup"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for label, timeline in timelines.items():
        if not timeline:
            continue
        xs = np.empty(len(timeline))
        names = np.array([p for p, _ in timeline])
        for k, phase in enumerate(phases):
            at = np.flatnonzero(names == phase)
            xs[at] = k + (np.arange(len(at)) + 0.5) / max(len(at), 1)
        style = policy_style(label)
        ax.plot(xs, np.array([b for _, b in timeline]) / MiB, lw=1.2, color=style["color"],
                ls=style["linestyle"], label=policy_label(label))
    for k in range(1, len(phases)):
        ax.axvline(k, color="0.5", lw=0.8, ls=":")
    ax.set_xlim(0, len(phases))
    ax.set_xticks([k + 0.5 for k in range(len(phases))], phases)
    ax.set_xlabel("phase of the step (each phase's memory events spread evenly across it)")
    ax.set_ylabel("live tensor memory (MiB)")
    ax.set_title("memory over one training step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return _save(fig, path)


def compare_plot(df: pd.DataFrame, path=None):
    """Peak memory against time ratio (to the first row's policy) for a `ckptlab.compare` table,
    the 95% interval of each ratio as a horizontal error bar. The marker says where a row comes
    from — ckptlab's policies circles, anchors (the other frameworks' knobs) squares, plans at an
    anchor's peak diamonds — and the colour is the policy's, as in every figure. A row whose
    gradients are wrong (`compare(..., verify=True)`) is crossed out and its label says so."""
    fig, ax = plt.subplots(figsize=(9.5, 5.5))
    rows = df[(df["status"] == "ok") & df["time_ratio"].notna()] if len(df) else df
    if not len(rows):
        return _save(_empty(fig, ax, "no timed configurations to plot"), path)
    sources = {"ckptlab": ("o", "ckptlab policy"), "anchor": ("s", "anchor (framework knob)"),
               "plan": ("D", "ckptlab plan at an anchor's peak")}
    points, texts = [], []
    for kind, (marker, label) in sources.items():
        part = rows[rows["source"].map(_source_kind) == kind]
        if not len(part):
            continue
        for r in part.itertuples():
            err = [[r.time_ratio - r.time_ratio_low], [r.time_ratio_high - r.time_ratio]]
            ax.errorbar([r.time_ratio], [r.peak_bytes / MiB], xerr=err, fmt=marker, capsize=3,
                        color=policy_style(r.policy)["color"], markeredgecolor="0.2")
            points.append((r.time_ratio, r.peak_bytes / MiB))
            wrong = getattr(r, "gradients", None) == "wrong"
            if wrong:
                ax.plot([r.time_ratio], [r.peak_bytes / MiB], "x", color="red", markersize=14, mew=2)
            texts.append(f"{r.policy} (WRONG gradients)" if wrong else r.policy)
        ax.plot([], [], marker, color="0.5", markeredgecolor="0.2", label=label)   # one legend entry per source
    ax.axvline(1.0, color="0.6", lw=0.8, ls="--")
    first = rows.iloc[0]
    ax.set(xlabel=f"time ratio to {rows['timing_baseline'].iloc[0]} (median, 95% interval)",
           ylabel="peak memory (MiB)",
           title=f"{first['model']} b={first['batch_size']} s={first['seq_len']} {first['dtype']}: "
                 f"{int(first['rounds'])} interleaved rounds" + (" (busy machine)" if first["busy"] else ""))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.08)
    fig.tight_layout()
    place_labels(ax, points, texts, ["k"] * len(points))
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
        color = policy_style(g["policy"].iloc[0])["color"]  # each run in its policy's colour
        ax_loss.plot(g["step"], g["loss"], marker=markers[i % len(markers)], markersize=max(3, 9 - 1.5 * i),
                     linewidth=1.5, alpha=0.8, label=run, color=color)
        tracked, timed = g[g["memory_tracked"]], g[~g["memory_tracked"]]
        ax_time.plot(timed["step"], timed["step_ms"], "o-", color=color, label=run)
        ax_time.plot(tracked["step"], tracked["step_ms"], "o", color=color, markerfacecolor="none")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="loss per step (the runs overlap)")
    ax_loss.legend()
    peak_rows = []
    for run in runs:
        g = df[(df["run"] == run) & df["peak_bytes"].notna()]
        peak_rows.append(g.loc[g["peak_bytes"].idxmax()] if len(g) else None)
    categories = shown_categories(df)
    by_category = all(r is not None and r[[f"peak_{c}_bytes" for c in categories]].notna().all() for r in peak_rows)
    if by_category:
        bottom = [0.0] * len(runs)
        for category in categories:
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


def waterfall_plot(steps: list, capacity_bytes: Optional[int] = None, title: str = "", path=None):
    """From today's peak towards a capacity, one bar per step: `steps` is [(name, peak bytes,
    basis)], today's first; each later bar spans from the step before it to its own peak (green
    down, red up), hatched when modelled rather than predicted; the capacity is a dashed line."""
    fig, ax = plt.subplots(figsize=(2.5 + 1.2 * max(len(steps), 1), 4.0))
    if not steps:
        return _save(_empty(fig, ax, "no steps"), path)
    scale, unit = (GiB, "GiB") if max(s[1] for s in steps) >= GiB else (MiB, "MiB")
    previous = None
    for i, (name, peak, basis) in enumerate(steps):
        level = peak / scale
        low, high = (0.0, level) if previous is None else sorted((previous, level))
        color = "#7f7f7f" if previous is None else ("#2ca02c" if level <= previous else "#d62728")
        ax.bar(i, high - low, bottom=low, color=color, hatch="//" if basis == "modelled" else None,
               edgecolor="white" if basis == "modelled" else color)
        down = previous is not None and level <= previous
        ax.text(i, level, f"{level:.1f}", ha="center", va="top" if down else "bottom", fontsize=8)
        if previous is not None:
            ax.plot([i - 1.4, i - 0.6], [previous, previous], color="#404040", lw=0.8)
        previous = level
    if capacity_bytes:
        ax.axhline(capacity_bytes / scale, color="k", ls="--", lw=1,
                   label=f"capacity {capacity_bytes / scale:.1f} {unit}")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never over a bar
    ax.set_xticks(range(len(steps)), [s[0] for s in steps], rotation=20, ha="right", rotation_mode="anchor")
    ax.set_ylabel(f"predicted peak ({unit})")
    ax.set_title(title or "peak, one lever after another", fontsize=10)
    ax.margins(y=0.12)
    fig.tight_layout()
    return _save(fig, path)


__all__ = ["CATEGORY_COLORS", "FIGURES", "KIND_STYLES", "MiB", "compare_plot", "heatmaps", "memory_time_vs_density",
           "memory_timeline", "pareto_plot", "peak_breakdown", "place_labels", "prediction_breakdown", "policy_style", "redraw_all",
           "trainer_plot", "waterfall_plot", "what_fits_plot"]
