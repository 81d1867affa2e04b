"""Every figure drawn from a small hand-made run (no model runs): the labels, legends and colours
a reader relies on, checked on the artists."""

import itertools

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_hex

matplotlib.use("agg")

import matplotlib.pyplot as plt  # noqa: E402

from ckptlab.core.policy import policy_label  # noqa: E402
from ckptlab.probe.memory import CATEGORIES  # noqa: E402
from ckptlab.report import plots  # noqa: E402
from ckptlab.report.analysis import fits_from_run  # noqa: E402
from ckptlab.report.plots import policy_style  # noqa: E402

MiB = 2**20
LIMIT = 20 * MiB
BASE = 8 * MiB
BUDGET = "budget=44777048B"  # as a notebook writes a budget between two predicted peaks
# bytes per token and relative step time of each policy in the fixture
POLICIES = {"none": (120_000, 1.0, 0.0), "density=0.5": (60_000, 1.15, 0.5), "full": (15_000, 1.3, 1.0),
            BUDGET: (30_000, 1.2, 0.75)}


def record(policy, batch, seq):
    per_token, slowdown, density = POLICIES[policy]
    # a slight curvature, so a fit of 3+ points has a residual to report
    peak = BASE + per_token * batch * seq + 1000 * batch * batch
    ok = peak <= LIMIT
    ms = 10.0 * batch * seq / 64 * slowdown if ok else None
    row = dict(model="gpt-tiny", policy=policy, effective_density=density, batch_size=batch, seq_len=seq,
               accum_steps=1, effective_batch_size=batch, dtype="fp32", status="ok" if ok else "oom",
               peak_bytes=peak if ok else None, step_ms=ms, tokens_per_s=batch * seq / ms * 1e3 if ok else None,
               memory_limit_bytes=LIMIT, fits=ok, inferred=False, cell_id=f"{policy}-{batch}-{seq}",
               recompute_count=round(4 * density), peak_phase="backward" if density else "forward")
    parts = np.array([0.2, 0.0, 0.0, 0.2, 0.4, 0.15, 0.05]) * (peak or 0)   # no frozen parameters, no buffers
    row.update({f"peak_{c}_bytes": int(v) for c, v in zip(CATEGORIES, parts)})
    return row


@pytest.fixture(scope="module")
def run():
    return pd.DataFrame([record(p, b, s) for p in POLICIES for b in (1, 2, 4) for s in (32, 64)])


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def legend_texts(legend):
    return [t.get_text() for t in legend.get_texts()]


def legend_colors(legend):
    """label -> colour of its handle (marker face, line or patch)."""
    out = {}
    for handle, text in zip(legend.legend_handles, legend.get_texts()):
        if hasattr(handle, "get_markerfacecolor") and handle.get_marker() not in (None, "None", ""):
            out[text.get_text()] = to_hex(handle.get_markerfacecolor())
        elif hasattr(handle, "get_facecolor"):
            out[text.get_text()] = to_hex(handle.get_facecolor())
        else:
            out[text.get_text()] = to_hex(handle.get_color())
    return out


def test_policy_style_is_one_colour_and_marker_per_policy_kind_stable_across_calls():
    kinds = ["none", "full", "density=1", "every=1", "layers=0", "segments=2", "selective", "plan=ff",
             "budget=0.5", "compile"]
    styles = [policy_style(k) for k in kinds]
    assert len({s["color"] for s in styles}) == len(kinds)
    assert len({s["marker"] for s in styles}) == len(kinds)
    # same kind: same marker, a shade of one colour that grows with what is recomputed
    light, dark = policy_style("density=0.25"), policy_style("density=0.75")
    assert light["marker"] == dark["marker"] == policy_style("density=1")["marker"]
    assert light["color"] != dark["color"]
    assert sum(matplotlib.colors.to_rgb(light["color"])) > sum(matplotlib.colors.to_rgb(dark["color"]))
    assert policy_style("full+offload")["linestyle"] == "--" and policy_style("full")["linestyle"] == "-"
    assert policy_style("density=0.5") == policy_style("density=0.50")  # the policy, not its spelling


def test_every_figure_colours_a_policy_the_same_way(run):
    timelines = {p: [("forward", 1), ("backward", 2), ("optimizer", 1)] for p in POLICIES}
    legends = {
        "density": plots.memory_time_vs_density(run).legends[0],
        "pareto": plots.pareto_plot(run).axes[0].get_legend(),
        "what_fits": plots.what_fits_plot(run).axes[0].get_legend(),
        "timeline": plots.memory_timeline(timelines).axes[0].get_legend(),
    }
    expected = {policy_label(p): policy_style(p)["color"] for p in POLICIES}
    for name, legend in legends.items():
        colors = {label.split(" (")[0]: c for label, c in legend_colors(legend).items()}
        for label, color in expected.items():
            assert colors[label] == color, (name, label)
    heat = plots.heatmaps(run)
    titles = {ax.get_title().split(":")[0]: to_hex(ax.title.get_color()) for ax in heat.axes if ":" in ax.get_title()}
    assert titles == expected
    breakdown = plots.peak_breakdown(pd.DataFrame([record(p, 1, 32) for p in POLICIES]))
    ticks = {t.get_text(): to_hex(t.get_color()) for t in breakdown.axes[0].get_xticklabels()}
    assert ticks == expected


def test_budget_is_labelled_as_a_size(run):
    assert policy_label(BUDGET) == "budget=42.7MiB"
    texts = legend_texts(plots.pareto_plot(run).axes[0].get_legend())
    assert "budget=42.7MiB" in texts and not any("44777048" in t for t in texts)


def test_what_fits_labels_say_the_points_and_why_a_policy_has_no_line(run):
    legend = legend_texts(plots.what_fits_plot(run).axes[0].get_legend())  # seq 64, the longest
    assert "none (no fit: one batch size ran ok, 2 out of memory)" in legend
    assert "density=0.5 (line through 2 points)" in legend  # no residual claimed for 2 points
    fits = fits_from_run(run).set_index(["policy", "seq_len", "kind"])
    residual = fits.loc[("full", 64, "extrapolated"), "fit_max_rel_residual"].iloc[0]
    assert 0 < residual < 0.001
    assert "full (fit of 3 points, residual <0.1%)" in legend


def test_what_fits_with_nothing_to_extrapolate_says_why(run):
    one_batch = run[(run.batch_size == 1) & (run.seq_len == 32)].assign(memory_limit_bytes=None, fits=None)
    ax = plots.what_fits_plot(one_batch).axes[0]
    assert "no fit: one batch size ran ok" in " ".join(legend_texts(ax.get_legend()))
    assert [t.get_text() for t in ax.texts] == ["no limit to compare with: see the legend"]


def test_what_fits_tick_labels_do_not_overlap(run):
    fig = plots.what_fits_plot(run)
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in fig.axes[0].get_xticklabels()]
    assert len(boxes) == 5  # the run's limit and four cards
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)


def test_pareto_labels_every_point_inside_the_axes_without_overlap(run):
    fig = plots.pareto_plot(run)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    boxes = [(a.get_text(), a.get_window_extent(renderer)) for a in ax.texts]
    assert len(boxes) == len(run[run.status == "ok"])
    assert "none" in dict(boxes)  # the largest peak, at the right edge: once clipped
    for text, box in boxes:
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, text
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), (a, b)
    markers = [ax.transData.transform(p) for c in ax.collections for p in c.get_offsets()]
    for text, box in boxes:
        assert not any(box.contains(*m) for m in markers), text  # no label over a point


def test_overhead_has_its_own_visible_panel(run):
    fig = plots.memory_time_vs_density(run[run.policy != BUDGET])
    ax_over = next(ax for ax in fig.axes if ax.get_ylabel().startswith("overhead"))
    ys = np.concatenate([c.get_offsets()[:, 1] for c in ax_over.collections
                         if isinstance(c, matplotlib.collections.PathCollection)])
    assert np.nanmax(ys) == pytest.approx(30.0)  # full is 1.3x none in the fixture
    assert all(ax_over is not ax for ax in fig.axes if ax.get_ylabel().startswith("step time"))


def test_timeline_x_axis_is_the_labelled_phases():
    timeline = [("forward", 10), ("forward", 20), ("backward", 25), ("backward", 5), ("optimizer", 6)]
    ax = plots.memory_timeline({"none": timeline, "full": timeline[:3] + timeline[4:]}).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["forward", "backward", "optimizer"]
    xs = ax.lines[0].get_xdata()
    assert (xs[:2] < 1).all() and ((1 < xs[2:4]) & (xs[2:4] < 2)).all() and xs[4] > 2
    assert "fraction" not in ax.get_xlabel()


def test_breakdown_says_temporaries_include_recomputed_activations():
    records = pd.DataFrame([record(p, 1, 32) for p in ("none", "full")])
    texts = legend_texts(plots.peak_breakdown(records).axes[0].get_legend())
    assert any("temporaries" in t and "recomputed" in t for t in texts)
    plt.close("all")
    texts = legend_texts(plots.peak_breakdown(records[records.policy == "none"]).axes[0].get_legend())
    assert "temporaries" in texts  # nothing recomputed: no note


def test_trainer_figure_draws_each_run_in_its_policys_colour():
    rows = [dict(run=policy, policy=policy, step=step, loss=2.0 - 0.1 * step, memory_tracked=step == 1,
                 step_ms=10.0 + step, peak_bytes=(1 + step) * MiB if step == 1 else None,
                 **{f"peak_{c}_bytes": (MiB if step == 1 else None) for c in CATEGORIES})
            for policy in ("none", "full") for step in (1, 2, 3)]
    loss_ax = plots.trainer_plot(pd.DataFrame(rows)).axes[0]
    colors = {line.get_label(): to_hex(line.get_color()) for line in loss_ax.lines}
    assert colors == {"none": policy_style("none")["color"], "full": policy_style("full")["color"]}
