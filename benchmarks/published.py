"""Published GPU training-memory figures, reproduced: ckptlab's prediction of each figure's
quantity beside the estimators a user would try, on the same rows (benchmarks/published_rows.py).

    python benchmarks/published.py [--rows ID,ID] [--out results/published] [--docs docs/published.md]

For each row: ckptlab.predict on fake tensors for the row's card and loop, and
  - pytorch-memtracker: torch.distributed._tools.mem_tracker.MemTracker around the same fake step
    (CUDA's 512-byte rounding applied): its peak, for an allocated quantity (null for reserved and
    nvidia-smi, which it does not model, and where it fails: it hooks every parameter's gradient,
    which a frozen parameter refuses); on the PyTorch row, that row's own figure is its estimate;
  - 16-bytes-per-parameter: 16 B per trainable parameter (weights, gradients, two AdamW moments in
    fp32) plus the frozen parameters' weights: the model states only;
  - accelerate-estimate-memory: `accelerate estimate-memory`'s "Training using Adam" for the
    row's dtype (float32, or bfloat16 for bf16 rows), from the fp32 model's size.
Nothing is fitted: a row that stays off is reported with what ckptlab leaves out and what the
source leaves unknown. Prints the median and worst |error| per estimator; writes report.json and
predicted_vs_published.png to --out and, when every row ran, the page docs/published.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published_rows as rows_module  # noqa: E402 - beside this file
from published_rows import MODELS, NOT_RUN, QUANTITIES, ROWS, Row, card_for, package_missing, source_table  # noqa: E402

import ckptlab  # noqa: E402
from ckptlab.core.loop import Loop  # noqa: E402
from ckptlab.core.policy import parse_policy  # noqa: E402
from ckptlab.estimate import answers  # noqa: E402
from ckptlab.estimate.fake_step import fake_training_step  # noqa: E402

ESTIMATORS = ("pytorch-memtracker", "16-bytes-per-parameter", "accelerate-estimate-memory")
BAND = 0.05   # the figure's band, and "within" on the page
MIB = 2**20


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line and exit 2, nothing written
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None, help="comma-separated row ids (default: all); a subset writes no page")
    parser.add_argument("--out", default="results/published", help="folder for report.json and the figure")
    parser.add_argument("--docs", default="docs/published.md", help="the page written when every row ran")
    args = parser.parse_args(argv)
    known = [r.id for r in ROWS]
    if args.rows is not None:
        chosen = [r.strip() for r in args.rows.split(",")]
        unknown = [r for r in chosen if r not in known]
        if not chosen or unknown or "" in chosen:
            parser.error(f"--rows={args.rows!r} is invalid: allowed are row ids among {', '.join(known)}")
        args.rows = chosen
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out={args.out!r} is invalid: it is a file; allowed is a folder (made if missing)")
    docs = Path(args.docs)
    if docs.exists() and docs.is_dir() or docs.suffix != ".md":
        parser.error(f"--docs={args.docs!r} is invalid: allowed is a .md file path")
    return args


# ---------------------------------------------------------------------------------------------- estimators

def memtracker_peak(row: Row, workload: ckptlab.Workload) -> int:
    """MemTracker's peak around the fake step ckptlab tracks (after the same warm-up), the model
    and optimizer registered with `track_external`; CPU fake tensors stand for CUDA ones, so
    MemTracker's CUDA rounding (512 B) is applied to them, as tests/reference_models.py does.
    MemTracker refuses a second forward in one iteration, so an accumulating loop is run as its
    last micro-step: the gradients the earlier ones left are there before it starts, and it then
    accumulates into them and steps (each micro-step after the first holds the same)."""
    from torch.distributed._tools import mem_tracker  # noqa: PLC0415 - loads torch.distributed only here

    info = mem_tracker._WeakRefInfo
    unrounded = info._calculate_mem_consumed
    info._calculate_mem_consumed = lambda self: math.ceil(self.size * self.element_size / 512) * 512
    loop = dataclasses.replace(predicted_loop(row), accum_steps=1)
    kept = row.loop["accum_steps"] > 1 or row.loop["zero_grad"] == "zeros"   # gradients alive when it starts
    try:
        with fake_training_step(workload, row.batch_size, row.seq_len, parse_policy(row.policy), row.dtype, loop,
                                device="cuda", card=card_for(row), torch_version=row.torch_version) as (
                                    model, _, _, opt, step):
            if kept:
                for param in model.parameters():
                    if param.requires_grad and param.grad is None:
                        param.grad = torch.zeros_like(param)
            tracker = mem_tracker.MemTracker()
            tracker.track_external(model, *([opt] if opt is not None else []))
            with tracker:
                step()
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        info._calculate_mem_consumed = unrounded
    return int(sum(snap["Total"] for snap in peak.values()))


def parameter_counts(workload: ckptlab.Workload) -> tuple[int, int]:
    """(trainable, frozen) parameters of the model built on the meta device."""
    model = workload.build("meta")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen


def sixteen_bytes_rule(row: Row, workload: ckptlab.Workload) -> int:
    trainable, frozen = parameter_counts(workload)
    frozen_bytes = 2 if row.dtype in ("bf16-weights", "fp16-weights") else 4
    return 16 * trainable + frozen_bytes * frozen


def accelerate_estimate(row: Row, workload: ckptlab.Workload) -> int:
    """`accelerate estimate-memory`'s training figure: the largest of its model, gradients,
    optimizer and step sizes for the dtype, from the fp32 model's total size (its own functions)."""
    from accelerate.commands.estimate import estimate_training_usage  # noqa: PLC0415 - the `hf` extra
    from accelerate.utils import calculate_maximum_sizes  # noqa: PLC0415

    total, _ = calculate_maximum_sizes(workload.build("meta"))
    dtype = "float32" if row.dtype == "fp32" else "bfloat16"
    return int(max(estimate_training_usage(total, dtype).values()))


# ---------------------------------------------------------------------------------------------- rows

def predicted_loop(row: Row) -> Loop:
    """The row's loop as it is predicted: an accumulation of k >= 2 micro-batches as 2. From the
    second micro-step on, each starts with the gradients the earlier ones left and ends the same,
    so the peak is the same for every k >= 2; the fake step runs each micro-step, and 128 of them
    (litgpt's LoRA recipe at micro-batch 1) would cost minutes for nothing."""
    return Loop(**{**row.loop, "accum_steps": min(row.loop["accum_steps"], 2)})


def predicted_quantity(row: Row, prediction) -> int:
    """ckptlab's number for the row's quantity."""
    if row.quantity == "nvidia-smi":
        return prediction.device_bytes
    if row.quantity == "reserved":
        return prediction.reserved_bytes
    return prediction.peak_bytes    # allocated, and the estimator's peak PyTorch's test asserts


def run_row(row: Row, model_factory=None) -> dict:
    """One row of the report: ckptlab's prediction, each estimator's, their ratios to the figure."""
    record = {"id": row.id, "source": dataclasses.asdict(row.source), "card": row.card, "quantity": row.quantity,
              "quantity_means": QUANTITIES[row.quantity], "published_bytes": row.published_bytes,
              "published_text": row.published_text, "model": row.model, "batch_size": row.batch_size,
              "seq_len": row.seq_len, "policy": row.policy, "dtype": row.dtype, "loop": str(Loop(**row.loop)),
              "predicted_loop": str(predicted_loop(row)), "torch_version": row.torch_version,
              "conditions": list(row.conditions), "unknowns": [list(u) for u in row.unknowns],
              "not_modelled": list(row.not_modelled), "predicted_for": getattr(card_for(row), "label", row.predict_card),
              "predicted_bytes": None, "ratio": None, "estimators": dict.fromkeys(ESTIMATORS),
              "estimator_ratios": dict.fromkeys(ESTIMATORS), "estimator_notes": {}, "status": "ok", "reason": ""}
    reason = None if model_factory is not None else package_missing(row)
    if reason:
        return {**record, "status": "not run", "reason": reason}
    workload = (model_factory or MODELS[row.model])()
    start = time.perf_counter()
    prediction = ckptlab.predict(workload, row.batch_size, row.seq_len, row.policy, row.dtype, predicted_loop(row),
                                 device="cuda", card=card_for(row), torch_version=row.torch_version)
    record.update(predict_s=round(time.perf_counter() - start, 1), peak_phase=prediction.peak_phase,
                  torch_version=prediction.torch_version,
                  attention_backend=prediction.attention_backend, peak_by_category=dict(prediction.peak_by_category),
                  allocated_bytes=prediction.peak_bytes, reserved_bytes=prediction.reserved_bytes,
                  device_bytes=prediction.device_bytes)
    record["predicted_bytes"] = predicted_quantity(row, prediction)
    record["residual"] = row.residual
    if row.source_context_bytes is not None and row.quantity == "nvidia-smi":
        # the account of the residual, not the prediction: the context the source measured in place of ckptlab's
        record["source_context_bytes"] = row.source_context_bytes
        record["ratio_with_source_context"] = (prediction.reserved_bytes + row.source_context_bytes) / row.published_bytes
    estimates, notes = {}, {}
    for name, estimate in (("pytorch-memtracker", memtracker_peak), ("16-bytes-per-parameter", sixteen_bytes_rule),
                           ("accelerate-estimate-memory", accelerate_estimate)):
        if name == "pytorch-memtracker" and row.quantity not in ("allocated", "pytorch-estimate"):
            estimates[name], notes[name] = None, f"no answer for a {row.quantity} figure (it counts tensors)"
            continue
        try:
            estimates[name] = estimate(row, workload)
        except Exception as exc:  # noqa: BLE001 - an estimator that fails on a row has no answer there, said why
            estimates[name], notes[name] = None, f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    record["estimators"], record["estimator_notes"] = estimates, notes
    record["ratio"] = record["predicted_bytes"] / row.published_bytes
    record["estimator_ratios"] = {k: (v / row.published_bytes if v is not None else None) for k, v in estimates.items()}
    return record


def summary(records: list[dict]) -> dict:
    """Per estimator (ckptlab first): rows answered, median and worst |ratio - 1|, the worst row."""
    out = {}
    for name in ("ckptlab", *ESTIMATORS):
        errors = [(abs((r["ratio"] if name == "ckptlab" else r["estimator_ratios"][name]) - 1), r["id"])
                  for r in records if r["status"] == "ok"
                  and (r["ratio"] if name == "ckptlab" else r["estimator_ratios"][name]) is not None]
        if not errors:
            out[name] = {"rows": 0, "median_abs_error": None, "worst_abs_error": None, "worst_row": None}
            continue
        worst = max(errors)
        out[name] = {"rows": len(errors), "median_abs_error": statistics.median(e for e, _ in errors),
                     "worst_abs_error": worst[0], "worst_row": worst[1]}
    return out


def closest(record: dict) -> str:
    """The estimator (ckptlab included) whose ratio is nearest 1 on this row."""
    ratios = {"ckptlab": record["ratio"], **record["estimator_ratios"]}
    return min((abs(v - 1), k) for k, v in ratios.items() if v is not None)[1]


def build_report(records: list[dict]) -> dict:
    for r in records:
        if r["status"] == "ok":
            r["closest"] = closest(r)
    not_run = [{"id": n.id, "source": dataclasses.asdict(n.source), "card": n.card, "quantity": n.quantity,
                "published_bytes": n.published_bytes, "published_text": n.published_text, "status": "not run",
                "reason": n.reason} for n in NOT_RUN]
    return {"rows": records, "not_reproducible": not_run, "summary": summary(records), "sources": source_table(),
            "independent_sources": sorted({r["source"]["project"] for r in records if r["status"] == "ok"}),
            "band": BAND, "estimators": list(ESTIMATORS),
            "environment": {"torch": torch.__version__, "ckptlab": ckptlab.__version__, **package_versions()}}


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - only the report needs it

    versions = {}
    for name in ("litgpt", "llms-from-scratch", "transformers", "accelerate"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


# ---------------------------------------------------------------------------------------------- figure and page

def draw(report: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the figure needs it
    matplotlib.use("agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in report["rows"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    markers = {"ckptlab": "o", "pytorch-memtracker": "s", "16-bytes-per-parameter": "^", "accelerate-estimate-memory": "v"}
    values = [r["published_bytes"] / 1e9 for r in rows]
    for name, marker in markers.items():
        points = [(r["published_bytes"] / 1e9, (r["predicted_bytes"] if name == "ckptlab" else r["estimators"][name]) / 1e9)
                  for r in rows if (r["predicted_bytes"] if name == "ckptlab" else r["estimators"][name]) is not None]
        if points:
            ax.scatter(*zip(*points), marker=marker, label=name, alpha=0.8, s=36 if name == "ckptlab" else 24)
            values += [p for _, p in points]
    low, high = min(values) * 0.7, max(values) * 1.4
    line = [low, high]
    ax.plot(line, line, color="black", linewidth=0.8)
    ax.fill_between(line, [v * (1 - BAND) for v in line], [v * (1 + BAND) for v in line], color="grey", alpha=0.25,
                    label=f"±{BAND:.0%}")
    ax.set(xscale="log", yscale="log", xlim=line, ylim=line, xlabel="published (GB)", ylabel="predicted (GB)",
           title="Published GPU training memory: predicted against published")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def gb(n) -> str:
    return "—" if n is None else f"{n / 1e9:.2f}"


def ratio_text(v) -> str:
    return "—" if v is None else f"{v:.3f}"


def pct(v) -> str:
    return "—" if v is None else f"{v:.1%}"


def render_page(report: dict) -> str:
    """docs/published.md from report.json, every number read from it (tests check the page against the report)."""
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    s = report["summary"]
    lines = [
        "# Published GPU measurements, reproduced",
        "",
        "No GPU has run ckptlab's CUDA model in this benchmark: its ground truth is what other projects measured on",
        "real cards and published with their code. `benchmarks/published.py` rebuilds each model from the",
        "framework's own code on fake tensors (no weights downloaded), runs the source's training loop as",
        "ckptlab's options describe it, and predicts the quantity the source published for the source's card.",
        "The same rows go to the estimators a user would try instead. Nothing is fitted: no constant was",
        "chosen to make a row match, and a row that stays off is reported so, with what ckptlab leaves out and",
        "what the source leaves unknown. This page is generated from `results/published/report.json`",
        "(`python benchmarks/published.py`; the benchmark-only packages are the `published` extra).",
        "",
        f"Rows reproduced: {len(rows)}, from {len(report['independent_sources'])} independent projects "
        f"({', '.join(report['independent_sources'])}); {len(report['not_reproducible'])} more published figures "
        "are listed below as not reproducible, with the reason.",
        "",
        "## Errors",
        "",
        "| estimator | rows | median \\|error\\| | worst \\|error\\| | worst row |",
        "|---|---|---|---|---|",
    ]
    for name, v in s.items():
        lines.append(f"| {name} | {v['rows']} | {pct(v['median_abs_error'])} | {pct(v['worst_abs_error'])} | "
                     f"{v['worst_row'] or '—'} |")
    lines += ["", "![predicted against published](results/published/predicted_vs_published.png)", "",
              "## Rows", "",
              "Ratios are predicted / published. GB = 10^9 bytes.", "",
              "| row | card | quantity | published | ckptlab | ratio | " + " | ".join(ESTIMATORS) + " | closest |",
              "|---|---|---|---|---|---|" + "---|" * len(ESTIMATORS) + "---|"]
    for r in rows:
        est = " | ".join(f"{gb(r['estimators'][e])} ({ratio_text(r['estimator_ratios'][e])})" for e in ESTIMATORS)
        lines.append(f"| {r['id']} | {r['card']} | {r['quantity']} | {r['published_text']} | "
                     f"{gb(r['predicted_bytes'])} | {ratio_text(r['ratio'])} | {est} | {r['closest']} |")
    lines += ["", "## Each row: its loop, what is unknown, and the residual", ""]
    for r in report["rows"]:
        src = r["source"]
        lines += [f"### {r['id']}", "",
                  f"- Source: {src['project']}, `{src['repo']}` `{src['file']}` at `{src['commit']}`: "
                  f"`{src['quote']}`",
                  f"- Card: {r['card']} (predicted for: {r['predicted_for'] or 'sm80, no context'}). Quantity: "
                  f"{r['quantity']}, {r['quantity_means']}. Published: {r['published_text']} "
                  f"= {r['published_bytes']:,} B.",
                  f"- Shape and policy: batch {r['batch_size']}, seq {r['seq_len']}, policy `{r['policy']}`, dtype "
                  f"`{r['dtype']}`; loop `{r['loop']}`, predicted as `{r['predicted_loop']}` (every micro-step after the "
                  f"first holds the same), under torch {r['torch_version'] or 'installed'}'s CUDA rules.",
                  "- Conditions of the loop, as the source sets them:"]
        lines += [f"    - {c}" for c in r["conditions"]]
        if r["unknowns"]:
            lines.append("- Left unknown by the source, and the assumption made:")
            lines += [f"    - {what}: {assumed}" for what, assumed in r["unknowns"]]
        if r["status"] != "ok":
            lines += [f"- Not run: {r['reason']}", ""]
            continue
        verdict = (f"within ±{BAND:.0%}" if abs(r["ratio"] - 1) <= BAND else
                   f"{'above' if r['ratio'] > 1 else 'below'} the figure by {abs(r['ratio'] - 1):.1%}")
        cats = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in r["peak_by_category"].items() if v)
        lines += [f"- ckptlab: {gb(r['predicted_bytes'])} GB, ratio {ratio_text(r['ratio'])}, {verdict}. Allocated "
                  f"{gb(r['allocated_bytes'])}, reserved {gb(r['reserved_bytes'])}, device "
                  f"{gb(r['device_bytes'])} GB; peak in {r['peak_phase']}, attention "
                  f"{r['attention_backend'] or 'none (no SDPA)'}; by category (GB): {cats}. "
                  f"Predicted in {r['predict_s']} s.",
                  *[f"- {name} has no answer here: {note}" for name, note in r["estimator_notes"].items()],
                  "- What ckptlab does not model here, the residual's candidates:"]
        lines += [f"    - {n}" for n in r["not_modelled"]]
        if r.get("ratio_with_source_context") is not None:
            lines.append(f"- With the CUDA context the source measured on its card ({r['source_context_bytes'] / MIB:.0f} "
                         f"MiB) in place of ckptlab's ({(r['device_bytes'] - r['reserved_bytes']) / MIB:.0f} MiB), the "
                         f"ratio would be {ratio_text(r['ratio_with_source_context'])} (an account, not the prediction).")
        if r["estimators"]["pytorch-memtracker"] is not None:
            lines.append(f"- pytorch-memtracker over ckptlab's allocated peak, on the same fake step: "
                         f"{ratio_text(r['estimators']['pytorch-memtracker'] / r['allocated_bytes'])}.")
        if r["residual"]:
            lines.append(f"- The residual: {r['residual']}")
        if r["closest"] == "pytorch-memtracker":
            lines.append("- Closest on this row: pytorch-memtracker, not ckptlab. It tracks the same fake step and "
                         "differs from ckptlab by what each counts (it leaves out what exists before it starts, "
                         "such as the batch, and the cuBLAS workspaces); where the figure is PyTorch's own "
                         "estimate, PyTorch's tracker is the nearer by construction.")
        elif r["closest"] != "ckptlab":
            lines.append(f"- Closest on this row: {r['closest']}, not ckptlab. A model-states-only estimate "
                         "leaves out activations and temporaries; when it lands nearer, it is because its "
                         "omissions and its over-counts (fp32 copies a bf16 run does not hold, the whole model as "
                         "trainable under LoRA) happen to cancel, not because it models the step.")
        lines.append("")
    lines += ["## Published figures not reproducible", "",
              "| figure | source | card | quantity | published | why not |", "|---|---|---|---|---|---|"]
    for n in report["not_reproducible"]:
        lines.append(f"| {n['id']} | {n['source']['repo']} `{n['source']['file']}` | {n['card']} | {n['quantity']} | "
                     f"{n['published_text']} | {n['reason']} |")
    lines += ["", "## Sources", "", "| project | repository | file | commit | rows |", "|---|---|---|---|---|"]
    for src in report["sources"]:
        lines.append(f"| {src['project']} | `{src['repo']}` | `{src['file']}` | `{src['commit']}` | "
                     f"{', '.join(src['rows'])} |")
    lines += ["", CONSIDERED, "", "## The estimators", "", ESTIMATOR_NOTES, "",
              f"Environment of this run: {json.dumps(report['environment'])}.", ""]
    return "\n".join(lines)


CONSIDERED = """Considered and not used: torchtune's README table (Llama 3.1 8B on an RTX 4090, 18.9 GiB:
torch.compile, 8-bit paged AdamW and the optimizer in backward, none of which ckptlab predicts);
peft's README (T0_3B, 47.14 GB / 14.4 GB on an A100-80: the script, batch and lengths are not
given); peft's method_comparison results (Llama-3.2-3B on an L40S: the figure is the reserved peak
of the whole run, evaluation included, and the longest training batch is filtered by characters,
not tokens, so it is unknown)."""

ESTIMATOR_NOTES = """- **pytorch-memtracker**: `torch.distributed._tools.mem_tracker.MemTracker` around the same
  fake step ckptlab tracks (same model, batch, loop and CUDA rules), with the model and optimizer
  registered. It refuses a second forward in one iteration, so an accumulating loop is tracked as
  its last micro-step, the gradients the earlier ones left already there. It registers a gradient
  hook on every parameter, which a frozen one refuses: on LoRA rows it has no answer. It counts tensor bytes, rounded to 512 B as CUDA's allocator does, so it answers
  allocated quantities; for reserved and nvidia-smi figures it has no answer (null).
- **16-bytes-per-parameter**: 16 B per trainable parameter (fp32 weights, gradients and two AdamW
  moments) plus the frozen parameters' weights in the row's weight dtype: model states only.
- **accelerate-estimate-memory**: `accelerate estimate-memory`'s "Training using Adam" figure (its
  `estimate_training_usage` on `calculate_maximum_sizes` of the fp32 model) for float32 rows, and
  for bfloat16 rows its bfloat16 figure; it knows nothing of the batch, LoRA or checkpointing."""


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = [r for r in ROWS if args.rows is None or r.id in args.rows]
    out = Path(args.out)
    records = []
    for row in chosen:
        record = run_row(row)
        records.append(record)
        print(f"{row.id:<40} published {gb(row.published_bytes):>7} GB  ckptlab {gb(record['predicted_bytes']):>7} "
              f"({ratio_text(record['ratio'])})  " + ("" if record["status"] == "ok" else record["reason"]), flush=True)
    report = build_report(records)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    if any(r["status"] == "ok" for r in records):
        draw(report, out / "predicted_vs_published.png")
    for name, v in report["summary"].items():
        print(f"{name:<28} rows {v['rows']:>2}  median |error| {pct(v['median_abs_error']):>6}  "
              f"worst |error| {pct(v['worst_abs_error']):>6}  ({v['worst_row'] or '-'})")
    if args.rows is None:
        Path(args.docs).write_text(render_page(report))
    return 0


__all__ = ["ESTIMATORS", "build_report", "main", "parse_args", "render_page", "rows_module", "run_row", "summary"]

if __name__ == "__main__":
    with answers.off():   # every timed prediction is made, none taken from the answers kept on disk
        sys.exit(main())
