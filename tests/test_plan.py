"""The budget planner: exact on chains (checked by brute force), faithful to prediction, clear
when a budget cannot be met."""

import itertools
import random

import pytest

from ckptlab import get_workload, plan_budget, predict
from ckptlab.core.policy import PLAN_OPTIONS as OPTIONS
from ckptlab.plan.profile import Profile, profile_blocks
from ckptlab.plan.solve import brute_force, min_peak, model_peak, plan_cost, solve


def _random_profile(n: int, rng: random.Random) -> Profile:
    """Blocks of different sizes and costs, so the DP has real choices to get wrong."""
    kept, bwd, cost = [], [], []
    for _ in range(n):
        full = rng.randint(1, 5) * 100
        keep = full + rng.randint(5, 40) * 100
        sel = rng.randint(full, keep)
        kept.append({"keep": keep, "selective": sel, "full": full})
        extra = rng.randint(1, 30) * 100
        bwd.append({o: 10_000 + extra + kept[-1]["keep"] * (2 if o != "keep" else 1) for o in OPTIONS})
        f = rng.uniform(1, 10)
        cost.append({"keep": 0.0, "selective": rng.uniform(0.05, 0.6) * f, "full": f})
    total = {o: sum(k[o] for k in kept) for o in OPTIONS}
    head = {o: 12_000 + total[o] for o in OPTIONS}
    return Profile(n_blocks=n, kept=kept, bwd_peak=bwd, head=head, tail={o: 9_000 for o in OPTIONS},
                   cost_ms=cost, peak={o: head[o] for o in OPTIONS}, cost_basis="given")


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_on_random_chains(seed):
    rng = random.Random(seed)
    profile = _random_profile(rng.randint(3, 8), rng)
    lowest, _ = min_peak(profile)
    highest = model_peak(profile, ["keep"] * profile.n_blocks)
    for budget in sorted({lowest - 1, lowest, highest, *(rng.randint(lowest, highest) for _ in range(12))}):
        dp, bf = solve(profile, budget), brute_force(profile, budget)
        assert (dp is None) == (bf is None), budget
        if dp is not None:
            assert model_peak(profile, dp) <= budget
            assert plan_cost(profile, dp) == pytest.approx(plan_cost(profile, bf)), (budget, dp, bf)


@pytest.mark.parametrize("seed", range(3))
def test_min_peak_is_the_brute_force_minimum(seed):
    profile = _random_profile(6, random.Random(100 + seed))
    exhaustive = min(model_peak(profile, p) for p in itertools.product(OPTIONS, repeat=6))
    lowest, plan = min_peak(profile)
    assert lowest == exhaustive == model_peak(profile, plan)
    assert solve(profile, lowest - 1) is None and solve(profile, lowest) is not None


def test_brute_force_refuses_long_chains():
    with pytest.raises(ValueError, match="n_blocks=11"):
        brute_force(_random_profile(11, random.Random(0)), 10**9)


@pytest.mark.parametrize("name, n", [("gpt-tiny", 4), ("mlp-chain", 8)])
def test_peak_model_matches_fake_runs_of_mixed_plans(name, n):
    workload = get_workload(name)
    profile = profile_blocks(workload, 4, 64)
    rng = random.Random(1)
    plans = rng.sample(list(itertools.product(OPTIONS, repeat=n)), 6)
    for plan in plans:
        letters = "".join(o[0] for o in plan)
        predicted = predict(workload, 4, 64, f"plan={letters}").peak_bytes
        assert abs(model_peak(profile, plan) / predicted - 1) <= 0.03, letters
    # and the DP on the real profile agrees with brute force
    for frac in (0.95, 0.85, 0.8, 0.75):
        budget = int(frac * profile.peak["keep"])
        dp, bf = solve(profile, budget), brute_force(profile, budget)
        assert (dp is None) == (bf is None)
        if dp:
            assert plan_cost(profile, dp) == pytest.approx(plan_cost(profile, bf))


def test_plan_budget_fits_beats_full_and_is_printable():
    workload = get_workload("gpt-tiny")
    plan = plan_budget(workload, 4, 64, "budget=0.8")
    assert plan.predicted_peak_bytes <= plan.budget_bytes == int(0.8 * plan.none_peak_bytes)
    assert 0 < plan.recompute_ms < plan.full_recompute_ms
    text = str(plan)
    assert plan.letters in text and "budget" in text and "recompute" in text
    assert plan.record()["plan"] == plan.letters
    # a budget of the full peak is met without recomputing everything
    at_full = plan_budget(workload, 4, 64, plan.full_peak_bytes)
    assert at_full.predicted_peak_bytes <= plan.full_peak_bytes


def test_infeasible_budget_states_the_minimum_achievable_peak():
    with pytest.raises(ValueError, match="infeasible.*minimum achievable peak is .*plan f") as info:
        plan_budget(get_workload("mlp-chain"), 4, 64, "1MiB")
    assert "budget=1.0 MiB" in str(info.value)


def test_block_memory_and_roofline_costs_are_predicted_per_block():
    from ckptlab.estimate.block_profile import block_count, block_memory, roofline_block_costs

    workload = get_workload("gpt-tiny")
    n = block_count(workload)
    keep, full = (block_memory(workload, 2, 32, o) for o in ("keep", "full"))
    assert len(keep.kept) == len(keep.bwd_peak) == n
    assert all(f < k for f, k in zip(full.kept, keep.kept)) and full.head < keep.head <= keep.peak
    assert max(keep.head, keep.tail, *keep.bwd_peak) == keep.peak
    costs = roofline_block_costs(workload, 2, 32)
    assert len(costs) == n and all(c == costs[0] for c in costs)   # alike blocks do the same work
    assert costs[0]["keep"] == 0 < costs[0]["selective"] < costs[0]["full"]


def test_auto_costs_are_measured_for_a_cpu_step_and_roofline_for_a_card():
    """This CPU's timings say nothing of what recomputing costs on a card."""
    assert profile_blocks("gpt-tiny", 2, 16).cost_basis == "measured"
    assert profile_blocks("gpt-tiny", 2, 16, device="cuda", card="rtx4090").cost_basis == "roofline"
