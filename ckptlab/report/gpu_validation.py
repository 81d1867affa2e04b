"""The GPU validation's verdicts (`python3 -m ckptlab.apps.gpu_check`), computed from its records alone.

`apps/gpu_check.py` measures on the GPU; everything it concludes from the measurements is here,
plain functions of records with CPU tests on synthetic records whose answers are known, so the
first GPU run is not the first run of this code. One `Claim` per claim of the validation:

    memory, measured    the tracker's peak against `torch.cuda.max_memory_allocated`, the
                        difference explained term by term (`allocator_gap`)
    memory, predicted   `predict(device="cuda")` on CPU fake tensors against the CUDA step:
                        the allocated peak (±2%) and the reserved peak (±5%), and the attention
                        backend CUDA ran (`prediction_errors`)
    time and frontier   `compare --anchors --verify`: intervals and gradient verdicts
                        (`frontier_rows`)
    overhead            ckptlab's wrapper against a hand-written checkpoint loop
    the seed's claim    transformers' Trainer with gradient checkpointing, "~20% slower"

The memory claims read records as lists of dicts and need nothing but the standard library (the
check runs where only torch is installed); the frontier's and the Trainer's read DataFrames.
Every interval is read by `probe.timing.time_verdict`, the one verdict function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from ..core.units import format_bytes
from ..probe.timing import NO_DIFFERENCE, time_verdict
from .tables import format_table

if TYPE_CHECKING:
    import pandas as pd

UNEXPLAINED_LIMIT = 0.01   # of the tracker's peak: the allocator's difference left unexplained
ALLOCATED_TARGET = 0.02    # predicted peak_bytes against torch.cuda.max_memory_allocated
RESERVED_TARGET = 0.05     # predicted reserved_bytes against torch.cuda.max_memory_reserved
OVERHEAD_TARGET = 1.01     # ckptlab full / hand-written full: the whole interval at most +1%
# A gradient difference counts as noise up to this many times the un-checkpointed model's own
# rerun difference: the largest of millions of nondeterministic differences varies between draws.
NOISE_FACTOR = 2.0

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
MEMORY_MEASURED_CLAIM = "memory, measured"
ALLOCATED_CLAIM = f"memory, predicted: max allocated (±{ALLOCATED_TARGET:.0%})"
RESERVED_CLAIM = f"memory, predicted: max reserved (±{RESERVED_TARGET:.0%})"
OVERHEAD_CLAIM, TRAINER_CLAIM, FRONTIER_CLAIM = "overhead", "the seed's claim (Trainer ~20% slower)", "time and the frontier"

# The autograd node scaled_dot_product_attention leaves, by the backend that ran it (PyTorch's
# derivatives.yaml); the math backend leaves the matmuls and softmax it is made of, and no node of its own.
ATTENTION_NODES = {"ScaledDotProductFlashAttention": "flash", "ScaledDotProductEfficientAttention": "efficient",
                   "ScaledDotProductCudnnAttention": "cudnn"}


@dataclass
class Claim:
    """One claim's outcome: `status` pass | fail | skipped, a one-line `summary`, a markdown
    `details` table, and whether it decides the check's exit status (`counts`: the seed's
    claim is about transformers, not ckptlab, and is reported only)."""

    name: str
    status: str
    summary: str
    details: str = ""
    counts: bool = True


def skipped(name: str, reason: str, counts: bool = True) -> Claim:
    return Claim(name, SKIPPED, f"not tested: {reason}", counts=counts)


# ----------------------------------------------------------------------------- memory, measured

def allocator_gap(records: Sequence[dict], workspace_bytes: int, rng_state_bytes: int,
                  limit: float = UNEXPLAINED_LIMIT) -> list[dict]:
    """Per ok cell measured on CUDA: the allocator's peak minus the tracker's, and its parts.

        gap        = cuda_max_allocated_bytes - peak_bytes
        rounding   = cuda_max_allocated_bytes - cuda_max_requested_bytes: the allocator's own
                     count of what it added to the sizes asked for (512-byte blocks, and the
                     remainder of a cached block too small to split off)
        workspace  = `workspace_bytes`: what cuBLAS/cuBLASLt (and cuDNN) keep in the caching
                     allocator for themselves, measured once on the same device
        rng_state  = `rng_state_bytes` (device bytes of one saved CUDA RNG state) x the regions
                     recomputed (`recompute_count`): what checkpoint keeps per region
        rest       = gap - rounding - workspace - rng_state; `explained` when |rest| <= limit x
                     the tracker's peak

    A cell without the allocator's requested bytes has an unknown rounding: its rest is NaN
    and it is not explained."""
    out = []
    for r in records:
        if r.get("status") != "ok" or not _known(r.get("cuda_max_allocated_bytes")):
            continue
        tracker, allocated = float(r["peak_bytes"]), float(r["cuda_max_allocated_bytes"])
        requested = r.get("cuda_max_requested_bytes")
        rounding = allocated - float(requested) if _known(requested) else math.nan
        regions = int(r["recompute_count"]) if _known(r.get("recompute_count")) else 0
        rng = float(rng_state_bytes * regions)
        gap = allocated - tracker
        rest = gap - rounding - workspace_bytes - rng
        out.append({
            "cell": cell_label(r), "peak_bytes": tracker, "cuda_max_allocated_bytes": allocated,
            "gap_bytes": gap, "rounding_bytes": rounding, "workspace_bytes": float(workspace_bytes),
            "rng_state_bytes": rng, "explained_bytes": gap - rest, "rest_bytes": rest,
            "rest_frac": rest / tracker if tracker else math.nan,
            "explained": bool(abs(rest) <= limit * tracker) if not math.isnan(rest) else False,
        })
    return out


def memory_measured_claim(gaps: Sequence[dict], limit: float = UNEXPLAINED_LIMIT) -> Claim:
    """Pass when every cell's unexplained rest is within `limit` of its peak."""
    name = MEMORY_MEASURED_CLAIM
    if not gaps:
        return Claim(name, FAIL, "no cell was measured on CUDA")
    worst = max(gaps, key=lambda g: math.inf if math.isnan(g["rest_frac"]) else abs(g["rest_frac"]))
    bad = sum(not g["explained"] for g in gaps)
    summary = (f"{len(gaps)} cells; the largest unexplained rest is {_pct(worst['rest_frac'])} of the peak "
               f"({worst['cell']}); limit ±{limit:.0%}")
    if bad:
        summary += f"; {bad} cells beyond it"
    details = format_table(list(gaps), [
        ("cell", "cell", str), ("tracker peak", "peak_bytes", _bytes), ("max allocated", "cuda_max_allocated_bytes", _bytes),
        ("difference", "gap_bytes", _bytes), ("rounding", "rounding_bytes", _bytes),
        ("workspaces", "workspace_bytes", _bytes), ("RNG states", "rng_state_bytes", _bytes),
        ("rest", "rest_bytes", _bytes), ("rest / peak", "rest_frac", _pct), ("explained", "explained", str)])
    return Claim(name, FAIL if bad else PASS, summary, details)


# ----------------------------------------------------------------------------- memory, predicted

def attention_backend_of(nodes: Sequence[str]) -> Optional[str]:
    """The backend scaled_dot_product_attention ran, read from the autograd nodes one forward left
    (`probe.memory.saved_bytes_by_node`'s keys): flash, efficient or cudnn by their nodes, math
    when a softmax is there and none of theirs, None when neither (no attention seen)."""
    for prefix, backend in ATTENTION_NODES.items():
        if any(n.startswith(prefix) for n in nodes):
            return backend
    return "math" if any(n.startswith(("SoftmaxBackward", "SafeSoftmaxBackward")) for n in nodes) else None


def prediction_errors(cells: Sequence[dict], allocated_target: float = ALLOCATED_TARGET,
                      reserved_target: float = RESERVED_TARGET) -> list[dict]:
    """Per cell (a record measured on CUDA, with `predicted_peak_bytes`, `predicted_reserved_bytes`
    and `predicted_backend` from `predict(device="cuda")`, `measured_backend` from the CUDA step's
    autograd nodes, `prediction_message` when the prediction failed): the relative errors against
    `cuda_max_allocated_bytes` and `cuda_max_reserved_bytes`, each `within` its target, whether
    the backends agree, and `problem`: why the cell cannot be judged (not measured ok, not
    predicted), else empty."""
    out = []
    for r in cells:
        row = {"cell": cell_label(r), "status": r.get("status"),
               **{k: r.get(k) for k in ("cuda_max_allocated_bytes", "predicted_peak_bytes", "cuda_max_reserved_bytes",
                                        "predicted_reserved_bytes", "measured_backend", "predicted_backend")}}
        row["allocated_error"] = _relative(r.get("predicted_peak_bytes"), r.get("cuda_max_allocated_bytes"))
        row["reserved_error"] = _relative(r.get("predicted_reserved_bytes"), r.get("cuda_max_reserved_bytes"))
        row["allocated_within"] = abs(row["allocated_error"]) <= allocated_target
        row["reserved_within"] = abs(row["reserved_error"]) <= reserved_target
        row["backend_agrees"] = r.get("measured_backend") is None or r.get("predicted_backend") == r.get("measured_backend")
        row["problem"] = (f"{r.get('status')}: {r.get('message')}" if r.get("status") != "ok"
                          else f"not predicted: {r['prediction_message']}" if r.get("prediction_message")
                          else "no allocator counters" if math.isnan(row["allocated_error"]) else "")
        out.append(row)
    return out


def memory_predicted_claim(errors: Sequence[dict], quantity: str, not_run: Sequence[str] = ()) -> Claim:
    """The claim for `quantity` "allocated" (±ALLOCATED_TARGET, and the attention backend the
    prediction chose is the one CUDA ran) or "reserved" (±RESERVED_TARGET): pass when every cell
    was measured, predicted and is within; fail when one was not; skipped when none failed but
    cells were left out (`not_run`, with why: not tested is not passed)."""
    name, target = {"allocated": (ALLOCATED_CLAIM, ALLOCATED_TARGET), "reserved": (RESERVED_CLAIM, RESERVED_TARGET)}[quantity]
    left_out = f"; not run: {', '.join(not_run)}" if not_run else ""
    if not errors:
        return Claim(name, SKIPPED if not_run else FAIL, "no cell was measured" + left_out)
    judged = [e for e in errors if not e["problem"]]
    bad = [e for e in judged if not e[f"{quantity}_within"] or (quantity == "allocated" and not e["backend_agrees"])]
    problems = [e for e in errors if e["problem"]]
    if judged:
        errs = [e[f"{quantity}_error"] for e in judged]
        summary = (f"{len(judged)} cells, errors {_pct(min(errs))} .. {_pct(max(errs))} (target ±{target:.0%})"
                   + (f", {len(bad)} beyond it" if bad else ""))
    else:
        summary = "no cell could be judged"
    if quantity == "allocated":
        wrong = [e for e in judged if not e["backend_agrees"]]
        summary += (f"; attention backend predicted as CUDA ran it in {len(judged) - len(wrong)} of {len(judged)} cells"
                    if judged else "")
    if problems:
        summary += f"; {len(problems)} cells not judged ({problems[0]['cell']}: {problems[0]['problem']})"
    status = FAIL if bad or problems or not judged else SKIPPED if not_run else PASS
    measured, predicted = ("cuda_max_allocated_bytes", "predicted_peak_bytes") if quantity == "allocated" else \
        ("cuda_max_reserved_bytes", "predicted_reserved_bytes")
    details = format_table(list(errors), [
        ("cell", "cell", str), (f"measured max {quantity}", measured, _bytes), ("predicted", predicted, _bytes),
        ("error", f"{quantity}_error", _pct), ("within", f"{quantity}_within", str),
        ("backend CUDA ran", "measured_backend", str), ("predicted backend", "predicted_backend", str),
        ("not judged", "problem", str)])
    return Claim(name, status, summary + left_out, details)


# ----------------------------------------------------------------------------- time and frontier

def is_compiled(row: dict) -> bool:
    policy = str(row.get("policy", ""))
    return policy.startswith("compile") or policy.endswith("+compile") or row.get("source") == "torch.compile"


def frontier_rows(df: pd.DataFrame, factor: float = NOISE_FACTOR) -> pd.DataFrame:
    """`compare`'s rows (from one or more comparisons, `group` telling them apart; each group's
    first row is its time baseline) with `time_verdict` (its interval against the baseline's),
    `grad_verdict` and `pareto_optimal` (on the (peak, step time) frontier, intervals honoured).

    The gradient's noise floor is the baseline's own `max_grad_diff` (the un-checkpointed model
    run twice: what nondeterministic kernels alone change). An eager row is "equal" within
    `factor` x the floor (exactly equal when the floor is 0), else "differs"; a compiled row runs
    other kernels, whose rounding differs, and is "compiled: reported". Every row of a group
    compared without `verify` (no `max_grad_diff` at all) is "not verified"."""
    from .analysis import pareto  # noqa: PLC0415 - pandas: the frontier's claim needs it, the check's start does not

    df = df.copy()
    if "group" not in df:
        df["group"] = 0
    if "max_grad_diff" not in df:
        df["max_grad_diff"] = math.nan
    df["time_verdict"] = [
        time_verdict(r["time_ratio_low"], r["time_ratio_high"]) if _known(r.get("time_ratio_low")) else "no interval"
        for r in df.to_dict("records")]
    verdicts = {}
    for _, g in df.groupby("group", sort=False):
        floor, verified = g["max_grad_diff"].iloc[0], g["max_grad_diff"].notna().any()
        for i, r in zip(g.index, g.to_dict("records")):
            verdicts[i] = _grad_verdict(r, floor, factor) if verified else "not verified"
    df["grad_verdict"] = df.index.map(verdicts)
    front = pareto(df, group=("group",))
    df["pareto_optimal"] = front["pareto_optimal"].reindex(df.index).fillna(False).astype(bool)
    return df


def _grad_verdict(r: dict, floor, factor: float) -> str:
    if r["status"] != "ok":
        return "not run"
    if is_compiled(r):
        return "compiled: reported"
    if not _known(r["max_grad_diff"]):
        return "not checked"
    if not _known(floor):
        return "no noise floor"
    return "equal" if r["max_grad_diff"] <= factor * floor else "differs"


def frontier_claim(rows: pd.DataFrame, not_run: Sequence[str] = ()) -> Claim:
    """Pass when every ckptlab row (policies and plans) ran, every timed row has an interval,
    and no eager row's gradients differ beyond the noise floor. Anchors that cannot run here
    (an old transformers, no compiler) are reported, not held against ckptlab. `not_run` names
    the groups left out for time (with why): a claim not failed but not fully tested is skipped."""
    name = FRONTIER_CLAIM
    left_out = f"; not run: {', '.join(not_run)}" if not_run else ""
    if rows.empty:
        return Claim(name, SKIPPED if not_run else FAIL, "no comparison ran" + left_out)
    ours = rows["source"].astype(str).str.startswith("ckptlab")
    failed = rows[ours & (rows["status"] != "ok")]
    no_interval = rows[(rows["status"] == "ok") & (rows["time_verdict"] == "no interval")
                       & ~rows.index.isin(rows.groupby("group").head(1).index)]
    differs = rows[rows["grad_verdict"].isin(["differs", "not checked", "no noise floor"])]
    problems = [f"{len(frame)} {what}" for frame, what in (
        (failed, "ckptlab rows did not run"), (no_interval, "timed rows without an interval"),
        (differs, "rows whose gradients differ or were not checked")) if len(frame)]
    unverified = sorted(set(rows.loc[rows["grad_verdict"] == "not verified", "group"].astype(str)))
    stopped = ", ".join(sorted(set(rows["timing_stopped"].dropna().astype(str)))) if "timing_stopped" in rows else "-"
    shapes = ", ".join(dict.fromkeys(f"{r.get('model')} b={r.get('batch_size')} s={r.get('seq_len')} {r.get('dtype')}"
                                     for r in rows.to_dict("records")))
    summary = (f"{shapes}: {len(rows)} rows in {rows['group'].nunique()} comparisons, "
               f"{int(rows['pareto_optimal'].sum())} on the frontier; timing stopped by: {stopped}")
    if unverified:
        summary += f"; gradients not verified in: {', '.join(unverified)}"
    if problems:
        summary += "; " + "; ".join(problems)
    status = FAIL if problems else SKIPPED if not_run else PASS
    return Claim(name, status, summary + left_out, _frontier_table(rows))


def _frontier_table(rows: pd.DataFrame) -> str:
    return format_table([dict(r, ratio_text=_ratio_text(r)) for r in rows.to_dict("records")], [
        ("group", "group", str), ("policy", "policy", str), ("source", "source", str),
        ("peak", "peak_bytes", _bytes), ("step ms", "step_ms", lambda v: _num(v, ".1f")),
        ("time ratio [95% CI]", "ratio_text", str), ("verdict", "time_verdict", str),
        ("max grad diff", "max_grad_diff", lambda v: _num(v, ".2g")), ("gradients", "grad_verdict", str),
        ("frontier", "pareto_optimal", str), ("status", "status", str)])


def _ratio_text(r: dict) -> str:
    if not _known(r.get("time_ratio")):
        return "-"
    if not _known(r.get("time_ratio_low")):
        return f"{r['time_ratio']:.3f}"
    return f"{r['time_ratio']:.3f} [{r['time_ratio_low']:.3f}, {r['time_ratio_high']:.3f}]"


# ----------------------------------------------------------------------------- overhead and Trainer

def overhead_claim(ratio: float, low: float, high: float, target: float = OVERHEAD_TARGET) -> Claim:
    """ckptlab full / hand-written full, paired per round: pass when the whole 95% interval lies
    below `target`."""
    verdict = time_verdict(low, high, reference=target)
    summary = (f"ckptlab full / manual full {ratio - 1:+.2%} [95% CI {low - 1:+.2%}, {high - 1:+.2%}]: "
               + {"faster": f"within {target - 1:+.0%}",
                  "slower": f"beyond {target - 1:+.0%}",
                  NO_DIFFERENCE: f"{target - 1:+.0%} not shown (the interval reaches above it)"}[verdict])
    return Claim(OVERHEAD_CLAIM, PASS if verdict == "faster" else FAIL, summary)


def trainer_claim(summary: pd.DataFrame, run: str = "gradient_checkpointing") -> Claim:
    """transformers' own checkpointing against none, from `trainer_summary`: pass when the
    overhead's interval includes the guide's ~20% (`guide_verdict`). Reported, not counted."""
    from .analysis import GUIDE_SLOWDOWN, guide_verdict  # noqa: PLC0415 - pandas, as frontier_rows

    name = TRAINER_CLAIM
    row = summary[summary["run"] == run]
    if row.empty or "overhead" not in summary:
        return Claim(name, FAIL, f"no {run!r} run beside 'none'", counts=False)
    r = row.iloc[0]
    if not _known(r["overhead_low"]):
        return Claim(name, FAIL, f"{r['overhead']:+.0%} step time, too few timed steps for an interval",
                     counts=False)
    verdict = guide_verdict(r["overhead_low"], r["overhead_high"])
    holds = (time_verdict(r["overhead_low"], r["overhead_high"], reference=0.0) != NO_DIFFERENCE
             and time_verdict(r["overhead_low"], r["overhead_high"], reference=GUIDE_SLOWDOWN) == NO_DIFFERENCE)
    text = (f"{r['overhead']:+.1%} step time [95% CI {r['overhead_low']:+.1%}, {r['overhead_high']:+.1%}] "
            f"over {int(r['timed_steps'])} timed steps: {verdict}")
    if "same_losses_as_none" in r and not bool(r["same_losses_as_none"]):
        text += "; the logged losses differ from the run without checkpointing"
    return Claim(name, PASS if holds else FAIL, text, counts=False)


# ----------------------------------------------------------------------------- the report

def exit_status(claims: list[Claim]) -> int:
    """1 when a counted claim failed, 3 when none failed but one was skipped (not tested is not
    passed), 0 when every counted claim passed."""
    counted = [c for c in claims if c.counts]
    if any(c.status == FAIL for c in counted):
        return 1
    return 3 if any(c.status == SKIPPED for c in counted) else 0


def report_markdown(claims: list[Claim], device: str, budget_s: float, elapsed_s: float,
                    notes: Optional[list[str]] = None, versions: Optional[dict[str, Optional[str]]] = None) -> str:
    """report.md: the verdict per claim first, then what it ran on (`versions`: package -> version,
    None when not installed), then each claim's table."""
    verdict = {0: "PASS", 1: "FAIL", 3: "INCOMPLETE (claims skipped)"}[exit_status(claims)]
    lines = [f"# GPU validation on {device}: {verdict}", "",
             f"Ran {elapsed_s:.0f} s of a {budget_s:.0f} s budget (`python3 -m ckptlab.apps.gpu_check`).", ""]
    if versions:
        present = ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None)
        absent = ", ".join(k for k, v in versions.items() if v is None)
        lines += [f"Ran on: {present}" + (f"; not installed: {absent}" if absent else "") + ".", ""]
    lines += ["| claim | result | |", "|---|---|---|"]
    for c in claims:
        lines.append(f"| {c.name} | {c.status}{'' if c.counts else ' (reported only)'} | {c.summary} |")
    for note in notes or []:
        lines += ["", note]
    for c in claims:
        if c.details:
            lines += ["", f"## {c.name}", "", "```", c.details, "```"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- helpers

def cell_label(r: dict) -> str:
    parts = [str(r.get("model")), f"b={r.get('batch_size')}", f"s={r.get('seq_len')}", str(r.get("policy")),
             str(r.get("dtype"))]
    if _known(r.get("dropout")):
        parts.append(f"dropout={r['dropout']:g}")
    return " ".join(parts)


def _relative(predicted, measured) -> float:
    """predicted / measured - 1; NaN when either is unknown or measured is 0."""
    return predicted / measured - 1 if _known(predicted) and _known(measured) and measured else math.nan


def _known(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _bytes(v) -> str:
    if not _known(v):
        return "-"
    return ("-" if v < 0 else "") + format_bytes(abs(v))


def _pct(v) -> str:
    return "-" if not _known(v) else f"{v:+.2%}"


def _num(v, fmt: str) -> str:
    return "-" if not _known(v) else format(v, fmt)


__all__ = ["ALLOCATED_CLAIM", "ALLOCATED_TARGET", "ATTENTION_NODES", "Claim", "FAIL", "FRONTIER_CLAIM",
           "MEMORY_MEASURED_CLAIM", "NOISE_FACTOR", "OVERHEAD_CLAIM", "OVERHEAD_TARGET", "PASS", "RESERVED_CLAIM",
           "RESERVED_TARGET", "SKIPPED", "TRAINER_CLAIM", "UNEXPLAINED_LIMIT", "allocator_gap", "attention_backend_of",
           "cell_label", "exit_status", "frontier_claim", "frontier_rows", "is_compiled", "memory_measured_claim",
           "memory_predicted_claim", "overhead_claim", "prediction_errors", "report_markdown", "skipped", "trainer_claim"]
