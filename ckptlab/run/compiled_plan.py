"""A plan for a compiled model: one option per block, each block compiled on its own.

The eager planner (`ckptlab.plan`) predicts peaks with fake tensors, which do not follow
inductor: what a compiled block keeps is the partitioner's choice. So here every number the
choice rests on is measured, and the only prediction is the sum at the end:

1. measure: for each option o (k keep, s selective, f full, a digit d: compile budget d/10),
   the uniform plan `plan=oooo+compile`, all timed together (`compare`), each with its
   gradient verdict against the eager un-checkpointed model;
2. cost: an option whose gradients are wrong is dropped; each remaining option's per-block
   effect is its uniform run's difference to all-keep, divided by the number of blocks (peak
   saved, step time added);
3. choose (predicted): the mix of options with the least predicted step time whose predicted
   peak (all-keep's peak minus the blocks' savings) fits the budget; blocks are identical, so
   only how many blocks take each option matters;
4. verify (measured): the chosen plan timed together with all-keep and with every uniform plan
   whose measured peak is at or below the chosen plan's, with gradients checked; the result
   says whether it fits, and its time against the best such uniform plan, paired, with its 95%
   interval.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from ..core.policy import COMPILE_DIGITS, PLAN_LETTERS, Policy
from ..core.units import format_bytes
from ..plan.budget import resolve_budget
from ..probe.timing import versus_fastest_at_no_more_memory
from ..probe.verify import WRONG
from ..workloads.base import Workload
from ..workloads.registry import as_workload
from ..workloads.stacks import find_blocks
from .compare import compare


@dataclass
class CompiledPlan:
    """What `plan_compiled` chose, what it predicted, and what measuring it found."""

    letters: str
    budget_bytes: int
    predicted_peak_bytes: int       # all-keep's measured peak minus the chosen options' measured savings
    predicted_step_ms: float
    peak_bytes: Optional[int]       # measured
    gradients: Optional[str]        # measured verdict
    best_uniform: Optional[str]     # the fastest uniform plan at or below the chosen plan's measured peak
    vs_best_uniform: Optional[tuple[float, float, float]]  # (median, low, high) paired time ratio
    options: str                    # the options whose gradients were right
    costing: pd.DataFrame           # step 1's rows
    verification: pd.DataFrame      # step 4's rows

    @property
    def policy(self) -> str:
        return f"plan={self.letters}+compile"

    @property
    def fits(self) -> bool:
        return self.peak_bytes is not None and self.peak_bytes <= self.budget_bytes

    def __str__(self) -> str:
        lines = [f"plan {self.letters}+compile for budget {format_bytes(self.budget_bytes)}: predicted peak "
                 f"{format_bytes(self.predicted_peak_bytes)}, measured {format_bytes(self.peak_bytes or 0)} "
                 f"({'fits' if self.fits else 'does NOT fit'}), gradients {self.gradients}"]
        if self.vs_best_uniform is not None:
            ratio, low, high = self.vs_best_uniform
            lines.append(f"  time / {self.best_uniform}: {ratio:.3f} [{low:.3f}, {high:.3f}] (95% interval)")
        return "\n".join(lines)


def plan_compiled(workload: Workload | str, batch_size: int, seq_len: int, budget, *, options: str = "ksf05",
                  dtype: str = "fp32", max_seconds: float = 30, target_ci: float = 0.02) -> CompiledPlan:
    """The least-time plan of per-block compiled options whose peak fits `budget` (a size such
    as 512MiB, bytes, or a fraction in (0, 1] of the compiled all-keep peak), chosen from
    measurements (module docstring). `options` are plan letters: k, s, f and budget digits."""
    workload = as_workload(workload)
    letters = _check(options)
    resolve_budget(budget, 1)  # bad input fails here, before any work
    n = len(find_blocks(workload.build("meta")))
    uniform = {o: str(Policy("plan", o * n, compiled=True)) for o in letters}
    costing = compare(workload, batch_size, seq_len, [Policy("plan", o * n, compiled=True) for o in letters], dtype=dtype, verify=True,
                      max_seconds=max_seconds, target_ci=target_ci).set_index("policy")
    keep = costing.loc[uniform["k"]]
    if keep["status"] != "ok":
        raise RuntimeError(f"the compiled all-keep plan did not run: {keep['message']}")
    budget_bytes = resolve_budget(budget, int(keep["peak_bytes"]))
    usable = [o for o in letters if costing.loc[uniform[o], "status"] == "ok"
              and costing.loc[uniform[o], "gradients"] != WRONG]
    saving = {o: (keep["peak_bytes"] - costing.loc[uniform[o], "peak_bytes"]) / n for o in usable}
    added = {o: (costing.loc[uniform[o], "step_ms"] - keep["step_ms"]) / n for o in usable}
    best = None
    for counts in _compositions(n, len(usable)):
        peak = keep["peak_bytes"] - sum(c * saving[o] for c, o in zip(counts, usable))
        step = keep["step_ms"] + sum(c * added[o] for c, o in zip(counts, usable))
        if peak <= budget_bytes and (best is None or step < best[0]):
            best = (step, peak, counts)
    if best is None:
        raise ValueError(f"budget={format_bytes(budget_bytes)} is infeasible for {workload.label} compiled at "
                         f"batch_size={batch_size}, seq_len={seq_len}: the lowest measured peak of a uniform plan "
                         f"with right gradients is {format_bytes(min(keep['peak_bytes'] - n * saving[o] for o in usable))}; "
                         "allowed is a budget >= that")
    step, peak, counts = best
    # The options that save most go first, as the eager planner's plans recompute early blocks.
    order = sorted(zip(usable, counts), key=lambda oc: -saving[oc[0]])
    chosen = "".join(o * c for o, c in order)
    policy = str(Policy("plan", chosen, compiled=True))
    rivals = [o * n for o in usable if costing.loc[uniform[o], "peak_bytes"] <= peak]
    verification = compare(workload, batch_size, seq_len,
                           [Policy("plan", letters, compiled=True) for letters in dict.fromkeys(["k" * n, chosen, *rivals])],
                           dtype=dtype, verify=True, max_seconds=max_seconds, target_ci=target_ci)
    rows = verification.set_index("policy")
    measured = rows.loc[policy]
    ok = verification[(verification["status"] == "ok") & (verification["gradients"] != WRONG)
                      & (verification["policy"] != policy)]
    best, vs_best = (versus_fastest_at_no_more_memory(measured, ok.to_dict("records"))
                     if measured["status"] == "ok" else (None, None))
    return CompiledPlan(
        letters=chosen, budget_bytes=budget_bytes, predicted_peak_bytes=int(peak), predicted_step_ms=float(step),
        peak_bytes=int(measured["peak_bytes"]) if measured["status"] == "ok" else None,
        gradients=measured.get("gradients"), best_uniform=None if best is None else best["policy"],
        vs_best_uniform=None if best is None else vs_best,
        options="".join(usable), costing=costing.reset_index(), verification=verification)


def _check(options: str) -> list[str]:
    allowed = set(PLAN_LETTERS) | set(COMPILE_DIGITS)
    if not isinstance(options, str) or not options or set(options) - allowed or "k" not in options:
        raise ValueError(f"options={options!r} is invalid: allowed are plan letters k, s, f and budget digits "
                         "0-9, k included (the baseline), e.g. ksf05")
    return list(dict.fromkeys(options))


def _compositions(n: int, k: int):
    """Every way to give n identical blocks one of k options: tuples of k counts summing to n."""
    for cuts in itertools.combinations(range(n + k - 1), k - 1):
        bounds = (-1, *cuts, n + k - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(k))


__all__ = ["CompiledPlan", "plan_compiled"]
