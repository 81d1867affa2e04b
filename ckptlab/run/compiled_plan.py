"""A plan for a compiled model, measured: `plan_compiled` is `compare(..., ["none", "budget=B+compile"])`
read back as one result.

The choice rests on measurements only (`ckptlab.plan.compiled`): each option's uniform plan
`plan=oooo+compile` is built, its peak measured, its gradients checked against the eager
un-checkpointed model (an option whose gradients are wrong is dropped) and its time measured in
interleaved rounds; the mix with the least predicted time whose predicted peak fits is then
built, its peak measured, its gradients checked, and timed together with `none` and every
uniform plan. Measured: every peak, time and gradient verdict of a row. Predicted: only the
chosen plan's `predicted_peak_bytes` and `predicted_step_ms` (sums of the uniform plans' shares).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from ..core.policy import Policy, budget_value
from ..core.units import format_bytes
from ..plan.compiled import COMPILED_DESCRIPTION, check_options, describe_blocks
from ..probe.timing import paired_ratio, time_verdict, versus_fastest_at_no_more_memory
from ..probe.verify import WRONG
from ..workloads.base import Workload
from ..workloads.registry import as_workload
from .compare import compare


@dataclass
class CompiledPlan:
    """What `plan_compiled` chose, what it predicted, and what measuring it found."""

    letters: str
    budget_bytes: int
    predicted_peak_bytes: int       # predicted: all-keep's measured peak minus the chosen options' measured savings
    predicted_step_ms: float        # predicted: all-keep's measured time plus the chosen options' measured additions
    peak_bytes: Optional[int]       # measured
    step_ms: Optional[float]        # measured
    gradients: Optional[str]        # measured verdict
    options: str                    # the options whose gradients were right
    best_uniform: Optional[str]     # the fastest uniform plan at or below the chosen plan's measured peak
    vs_best_uniform: Optional[tuple[float, float, float]]  # (median, low, high) paired time ratio
    vs_none: Optional[tuple[float, float, float]]          # (median, low, high) paired time ratio to eager none
    comparison: pd.DataFrame        # every row measured: none, the uniform plans, the chosen plan

    @property
    def policy(self) -> str:
        return f"plan={self.letters}+compile"

    @property
    def fits(self) -> bool:
        return self.peak_bytes is not None and self.peak_bytes <= self.budget_bytes

    def __str__(self) -> str:
        lines = [f"plan {self.letters}+compile for budget {format_bytes(self.budget_bytes)} "
                 f"(options with right gradients: {', '.join(self.options)}):",
                 *("  " + line for line in describe_blocks(self.letters)),
                 f"  peak: measured {format_bytes(self.peak_bytes or 0)} "
                 f"({'fits' if self.fits else 'does NOT fit'}); predicted {format_bytes(self.predicted_peak_bytes)}",
                 f"  step: measured {self.step_ms:.1f} ms; predicted {self.predicted_step_ms:.1f} ms"
                 if self.step_ms is not None else "  step: not measured",
                 f"  gradients (measured, against the eager model without checkpointing): {self.gradients}"]
        for name, versus in (("none (eager)", self.vs_none), (self.best_uniform, self.vs_best_uniform)):
            if versus is not None and not math.isnan(versus[0]):
                ratio, low, high = versus
                lines.append(f"  time / {name}: {ratio:.3f} [{low:.3f}, {high:.3f}] (measured, paired, 95% interval: "
                             f"{time_verdict(low, high)})")
        lines.append(f"  {COMPILED_DESCRIPTION}")
        return "\n".join(lines)


def plan_compiled(workload: Workload | str, batch_size: int, seq_len: int, budget, *, options: str = "ksf05",
                  dtype: str = "fp32", max_seconds: float = 30, target_ci: float = 0.02,
                  progress: bool = True) -> CompiledPlan:
    """The least-time plan of per-block compiled options whose peak fits `budget` (a size such
    as 512MiB, bytes, or a fraction in (0, 1] of the compiled all-keep plan's measured peak),
    chosen from measurements and then measured (module docstring). `options` are plan letters
    k, s, f and budget digits. Raises ValueError for bad input before any work, and when no plan fits."""
    workload = as_workload(workload)
    check_options(options)
    policy = Policy("budget", budget_value(budget), compiled=True)
    label = str(policy)
    df = compare(workload, batch_size, seq_len, [Policy("none"), policy], dtype=dtype,
                 max_seconds=max_seconds, target_ci=target_ci, compiled_options=options, progress=progress)
    rows = df.set_index("policy", drop=False)
    chosen = df[df["plan_cost_basis"].notna()] if "plan_cost_basis" in df else df.iloc[:0]
    if not len(chosen):
        failed = df[df["policy"] == label]
        reason = failed["message"].iloc[0] if len(failed) else "no compiled plan was chosen"
        raise ValueError(reason) if "infeasible" in str(reason) else RuntimeError(reason)
    plan = chosen.iloc[0]
    ok = plan["status"] == "ok"
    uniform = df[df["policy"].str.fullmatch(r"plan=(.)\1*\+compile") & (df["status"] == "ok")
                 & (df["gradients"] != WRONG) & (df["policy"] != f"plan={plan['plan']}+compile")]
    best, versus = versus_fastest_at_no_more_memory(plan, [r for _, r in uniform.iterrows()]) if ok else (None, None)
    best_uniform = None if best is None else best["policy"]
    return CompiledPlan(
        letters=plan["plan"], budget_bytes=int(plan["plan_budget_bytes"]),
        predicted_peak_bytes=int(plan["plan_predicted_peak_bytes"]),
        predicted_step_ms=float(plan["plan_predicted_step_ms"]),
        peak_bytes=int(plan["peak_bytes"]) if ok else None, step_ms=float(plan["step_ms"]) if ok else None,
        gradients=plan["gradients"], options=plan["plan_options"], best_uniform=best_uniform,
        vs_best_uniform=None if best is None else versus,
        vs_none=paired_ratio(plan, rows.loc["none"]) if ok else None, comparison=df)


__all__ = ["CompiledPlan", "plan_compiled"]
