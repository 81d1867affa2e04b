"""A plan for a compiled model, chosen from measured costs: one option per block (k keep, s
selective, f full, a digit d: that block compiled with activation_memory_budget d/10).

The eager planner predicts peaks with fake tensors, which do not follow inductor: what a compiled
block keeps is the partitioner's choice. So the costs here are measurements (`ckptlab.run`
measures them): for each option, the uniform plan `plan=oooo+compile`, its peak and its step
time. Each option's per-block effect is its uniform run's difference to all-keep divided by the
number of blocks; the chosen plan is the mix with the least predicted step time whose predicted
peak fits the budget. Blocks are identical, so only how many blocks take each option matters.
Only the sum is a prediction, and whoever measures the costs measures the chosen plan too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping

from ..core.policy import COMPILE_DIGITS, PLAN_LETTERS, Policy
from ..core.units import format_bytes

COST_BASIS = "measured uniform compiled plans"
COMPILED_DESCRIPTION = ("measured: every peak, step time and gradient verdict; predicted: only the chosen plan's "
                        "predicted peak and step (its blocks' shares of the uniform plans' measured differences)")
KEEP = "k"


@dataclass(frozen=True)
class UniformCost:
    """One option's uniform compiled plan, measured: its peak and median step time."""

    peak_bytes: int
    step_ms: float


@dataclass(frozen=True)
class CompiledChoice:
    """A chosen compiled plan and what it is predicted to hold and take (field names as `Plan`'s)."""

    letters: str
    budget_bytes: int
    predicted_peak_bytes: int        # all-keep's measured peak minus the chosen options' measured savings
    predicted_step_ms: float         # all-keep's measured time plus the chosen options' measured additions
    options: str                     # the options it chose among
    cost_basis: str = COST_BASIS

    @property
    def policy(self) -> Policy:
        return Policy("plan", self.letters, compiled=True)

    def compile_budgets(self) -> list[float]:
        """Per block, the activation_memory_budget its compiled graph holds."""
        return self.policy.compile_budgets(len(self.letters))

    def record(self) -> dict:
        return {"plan": self.letters, "plan_budget_bytes": self.budget_bytes,
                "plan_predicted_peak_bytes": self.predicted_peak_bytes,
                "plan_predicted_step_ms": self.predicted_step_ms, "plan_cost_basis": self.cost_basis,
                "plan_options": self.options}


def check_options(options: str) -> list[str]:
    """Plan letters and budget digits, k included (the baseline every effect is measured from)."""
    allowed = set(PLAN_LETTERS) | set(COMPILE_DIGITS)
    if not isinstance(options, str) or not options or set(options) - allowed or KEEP not in options:
        raise ValueError(f"options={options!r} is invalid: allowed are plan letters k, s, f and budget digits "
                         "0-9, k included (the baseline), e.g. ksf05")
    return list(dict.fromkeys(options))


def uniform_policy(option: str, n_blocks: int) -> Policy:
    """The uniform compiled plan that measures one option's cost: plan=ffff+compile."""
    return Policy("plan", option * n_blocks, compiled=True)


def choose_compiled(costs: Mapping[str, UniformCost], n_blocks: int, budget_bytes: int,
                    label: str = "this model") -> CompiledChoice:
    """The least-predicted-time mix of the measured options whose predicted peak fits
    `budget_bytes` (module docstring). `costs` holds only options whose gradients were right, and
    k. Raises ValueError, naming the lowest measured peak, when no mix fits."""
    keep = costs[KEEP]
    usable = list(costs)
    saving = {o: (keep.peak_bytes - costs[o].peak_bytes) / n_blocks for o in usable}
    added = {o: (costs[o].step_ms - keep.step_ms) / n_blocks for o in usable}
    best = None
    for counts in compositions(n_blocks, len(usable)):
        peak = keep.peak_bytes - sum(c * saving[o] for c, o in zip(counts, usable))
        step = keep.step_ms + sum(c * added[o] for c, o in zip(counts, usable))
        if peak <= budget_bytes and (best is None or step < best[0]):
            best = (step, peak, counts)
    if best is None:
        lowest = min(costs.values(), key=lambda c: c.peak_bytes).peak_bytes
        raise ValueError(f"budget={format_bytes(budget_bytes)} is infeasible for {label} compiled: the lowest "
                         f"measured peak of a uniform plan with right gradients is {format_bytes(lowest)}; "
                         "allowed is a budget >= that")
    step, peak, counts = best
    # The options that save most go first, as the eager planner's plans recompute early blocks.
    order = sorted(zip(usable, counts), key=lambda oc: -saving[oc[0]])
    return CompiledChoice("".join(o * c for o, c in order), int(budget_bytes), int(peak), float(step), "".join(usable))


def compositions(n: int, k: int):
    """Every way to give n identical blocks one of k options: tuples of k counts summing to n."""
    for cuts in itertools.combinations(range(n + k - 1), k - 1):
        bounds = (-1, *cuts, n + k - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(k))


def describe_blocks(letters: str) -> list[str]:
    """Per block, its option and compile budget in words: 'block 0: full, compile budget 1.0'."""
    budgets = Policy("plan", letters, compiled=True).compile_budgets(len(letters))
    return [f"block {i}: {PLAN_LETTERS.get(c, 'keep')}, compile budget {b:g}" for i, (c, b) in enumerate(zip(letters, budgets))]


__all__ = ["COMPILED_DESCRIPTION", "COST_BASIS", "CompiledChoice", "UniformCost", "check_options", "choose_compiled", "compositions",
           "describe_blocks", "uniform_policy"]
