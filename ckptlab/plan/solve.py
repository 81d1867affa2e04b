"""The peak model of a plan and its exact solver. The planner's only input is a `Profile`.

Peak model of a plan o_0..o_{N-1}, with d_i(o) = kept[i][o] - kept[i][keep]:

    head    = max_o (head_o - sum_i d_i(o)) + sum_i d_i(o_i)
    block j = bwd_peak[j][o_j] - sum_{i<j} d_i(o_j) + sum_{i<j} d_i(o_i)
    tail    = max_o tail_o
    peak    = max(head, max_j block j, tail)

While block j runs backward, the blocks after it have freed their activations and the blocks
before it still hold what their option kept: that is the only way the others' choices enter.
`solve` is exact (docs/design.md, note "The planner's solver"); `brute_force` checks it.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence

from .profile import Profile


def _consts(profile: Profile):
    n = profile.n_blocks
    head = max(profile.head[o] - sum(profile.delta(i, o) for i in range(n)) for o in profile.options)
    tail = max(profile.tail.values())
    # block j's backward peak with the blocks before it at option o removed: m[j][o]
    m = [{o: profile.bwd_peak[j][o] - sum(profile.delta(i, o) for i in range(j)) for o in profile.options}
         for j in range(n)]
    return head, tail, m


def model_peak(profile: Profile, options: Sequence[str]) -> int:
    """The peak model (module docstring) for one plan."""
    head, tail, m = _consts(profile)
    peak, prefix = tail, 0
    for j, o in enumerate(options):
        peak = max(peak, m[j][o] + prefix)
        prefix += profile.delta(j, o)
    return max(peak, head + prefix)


def plan_cost(profile: Profile, options: Sequence[str]) -> float:
    return sum(profile.cost_ms[j][o] for j, o in enumerate(options))


def solve(profile: Profile, budget_bytes: int) -> Optional[list[str]]:
    """Exact minimum-cost plan with model_peak <= budget_bytes (None if none exists).

    Pareto front of (prefix bytes D, cost) over the blocks; ties go to the smaller peak."""
    head, tail, m = _consts(profile)
    if tail > budget_bytes:
        return None
    front: list[tuple[int, float, tuple]] = [(0, 0.0, ())]
    for j in range(profile.n_blocks):
        nxt = []
        for d, cost, choice in front:
            for o in profile.options:
                if m[j][o] + d <= budget_bytes:
                    nxt.append((d + profile.delta(j, o), cost + profile.cost_ms[j][o], choice + (o,)))
        front = _pareto(nxt)
        if not front:
            return None
    feasible = [(cost, d, choice) for d, cost, choice in front if head + d <= budget_bytes]
    if not feasible:
        return None
    best = min(cost for cost, _, _ in feasible)
    ties = [c for c in feasible if c[0] <= best + 1e-12]
    return list(min(ties, key=lambda c: (model_peak(profile, c[2]), c[2]))[2])


def _pareto(states):
    """The states (bytes so far, second value, choice) that no state with no more bytes betters in
    the second value (cost, or running peak): the only ones a plan can still be built on."""
    states.sort(key=lambda s: (s[0], s[1]))
    out, best_cost = [], math.inf
    for s in states:
        if s[1] < best_cost - 1e-12:
            out.append(s)
            best_cost = s[1]
    return out


def min_peak(profile: Profile) -> tuple[int, list[str]]:
    """The smallest model peak any plan reaches, and a plan reaching it (exact: Pareto front of
    (prefix bytes, running peak))."""
    head, tail, m = _consts(profile)
    front = [(0, tail, ())]
    for j in range(profile.n_blocks):
        front = _pareto([(d + profile.delta(j, o), max(run, m[j][o] + d), choice + (o,))
                         for d, run, choice in front for o in profile.options])
    peak, choice = min(((max(run, head + d), choice) for d, run, choice in front), key=lambda x: x[0])
    return peak, list(choice)


def brute_force(profile: Profile, budget_bytes: int) -> Optional[list[str]]:
    """All 3^N plans (N <= 10): the minimum-cost one within the budget, ties to the smaller peak."""
    if profile.n_blocks > 10:
        raise ValueError(f"n_blocks={profile.n_blocks} is invalid for brute_force: allowed is <= 10")
    best = None
    for options in itertools.product(profile.options, repeat=profile.n_blocks):
        peak = model_peak(profile, options)
        if peak <= budget_bytes:
            key = (round(plan_cost(profile, options), 9), peak, options)
            if best is None or key < best:
                best = key
    return list(best[2]) if best else None


__all__ = ["brute_force", "min_peak", "model_peak", "plan_cost", "solve"]
