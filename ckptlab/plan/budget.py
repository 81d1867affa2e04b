"""An eager budget becomes a plan here, and only here: `plan_budget` chooses the minimum-recompute
plan of {keep, selective, full} per block whose predicted peak fits a budget, verifies it by a
fake run of the real plan (re-solving with a tightened target when the peak model was
optimistic), and `resolve` turns a `budget=` policy into that plan for measure, predict, compare
and explain alike, before the probe and the estimator, which see only concrete policies. An
infeasible budget raises ValueError stating the minimum achievable peak. A compiled budget
(`budget=B+compile`) is chosen from measured costs (`plan.compiled`), which `run.compare` measures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..core.loop import Loop, as_loop, loop_of_record
from ..core.policy import PLAN_OPTIONS as OPTIONS
from ..core.policy import Policy, as_policy, budget_value, plan_policy
from ..core.units import format_bytes
from ..core.validate import choice
from ..estimate.compose import fast_memory
from ..estimate.fake_step import FakeMemory, Prediction, as_card
from ..estimate.predict import TRACES, check_prediction, implied_device, predict_policy
from ..probe.measure import measure_policy, measurement_record
from ..workloads.base import Workload
from ..workloads.registry import as_workload
from .profile import profile_blocks
from .solve import min_peak, model_peak, plan_cost, solve


@dataclass
class Plan:
    """A chosen plan: one option per block, with what it is predicted to cost and hold."""

    options: list[str]
    budget_bytes: int
    predicted_peak_bytes: int          # a fake-run prediction of the real plan
    model_peak_bytes: int              # the planner's peak model
    recompute_ms: float                # sum of the chosen options' recompute cost
    full_recompute_ms: float           # the same for full checkpointing, for scale
    none_peak_bytes: int               # uniform keep (no checkpointing)
    full_peak_bytes: int               # uniform full
    cost_basis: str
    iterations: int = 1
    loss_fn: str = ""                  # the training step's loss the plan was made for (its memory counts)
    loop: Loop = Loop()                # the training loop it was made and verified for
    fit: Optional[str] = None          # on a card: does the plan fit it ("yes", "with cache flushes", "no")
    refused: dict = dataclasses.field(default_factory=dict)   # option -> why no block may take it

    @property
    def policy(self) -> Policy:
        return plan_policy(self.options)

    @property
    def letters(self) -> str:
        return self.policy.value

    def record(self) -> dict:
        return {"plan": self.letters, "plan_budget_bytes": self.budget_bytes,
                "plan_predicted_peak_bytes": self.predicted_peak_bytes,
                "plan_model_peak_bytes": self.model_peak_bytes, "plan_recompute_ms": self.recompute_ms,
                "plan_cost_basis": self.cost_basis, "plan_loss_fn": self.loss_fn, "plan_loop": str(self.loop),
                "plan_fit": self.fit, "plan_refused": dict(self.refused)}

    def __str__(self) -> str:
        counts = {o: self.options.count(o) for o in OPTIONS}
        lines = [
            f"plan {self.letters}  (k keep, s selective, f full): "
            f"{counts['keep']} keep, {counts['selective']} selective, {counts['full']} full",
            f"  budget {format_bytes(self.budget_bytes)}; predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(none {format_bytes(self.none_peak_bytes)}, full {format_bytes(self.full_peak_bytes)})",
            f"  recompute {self.recompute_ms:.2f} ms/step ({self.cost_basis}) vs "
            f"{self.full_recompute_ms:.2f} ms for full checkpointing",
            f"  made for the training step with loss {self.loss_fn}, loop {self.loop}: another loss or loop "
            "keeps other tensors",
        ]
        if self.fit is not None:
            lines.append(f"  on the card: fits {self.fit} (predict --card says why)")
        for option, why in self.refused.items():
            lines.append(f"  no block {option}: the step fails in torch's {option} checkpointing: {why}")
        return "\n".join(lines)


def resolve_budget(budget, none_peak: int) -> int:
    """A budget policy/str/number (`core.policy.budget_value`) -> bytes: a fraction in (0, 1] is
    of `none_peak`, the no-checkpointing peak."""
    value = budget_value(budget)
    return int(value * none_peak) if isinstance(value, float) else int(value)


def _exact_bytes(n: int) -> str:
    """'6.0 GiB (6442450944 B)': a size and its bytes, once where they read the same ('512 B')."""
    shown = format_bytes(n)
    return shown if shown == f"{n} B" else f"{shown} ({n} B)"


def plan_budget(workload: Workload | str, batch_size: int, seq_len: int, budget, dtype: str = "fp32",
                loop: Loop | str | None = None, cost: str = "auto", max_iterations: int = 4, device: str | None = None,
                card=None, attention: str | None = None, *, torch_version: str | None = None,
                alloc_conf: str | None = None) -> Plan:
    """Minimum-recompute plan of {keep, selective, full} per block whose predicted peak fits
    `budget` (e.g. "6GiB", "budget=0.5", 0.5, 6 * 2**30). Raises ValueError, stating the minimum
    achievable peak, if no plan fits. With device="cuda" (on `card`, with `attention`, under
    `torch_version`'s rules, with the allocator's `alloc_conf`, as `predict`) the plan is made and
    verified on the CUDA prediction's allocated peak, and on a card `fit` says whether it fits
    there; for the training `loop` (`core.loop`, `predict`'s): profiled as
    `plan.profile.profiled_loop`, verified in the loop itself. Without `device`, a `card` means
    "cuda", else "cpu"."""
    device = implied_device(device, card)
    workload, loop = as_workload(workload), as_loop(loop)
    workload.check_shape(batch_size, seq_len)
    budget_value(budget)   # refused before any work
    card = as_card(card)
    predicted_for = {"device": device, "card": card, "attention": attention, "torch_version": torch_version}
    profile = profile_blocks(workload, batch_size, seq_len, dtype, loop, cost, **predicted_for)
    none_peak, full_peak, on_top = profile.peak["keep"], profile.peak["full"], 0
    if device == "cuda":
        # The profile counts tensors; the workspaces and the allocator's rounding come on top. A
        # fraction is of the allocated peak without checkpointing, as `predict` reports it.
        keep, full = (fast_memory(workload, batch_size, seq_len, plan_policy([option] * profile.n_blocks), dtype,
                                  loop, **predicted_for, alloc_conf=alloc_conf) for option in ("keep", "full"))
        none_peak, full_peak, on_top = _peak(keep), _peak(full), _peak(keep) - keep.report.peak_bytes
    budget_bytes = resolve_budget(budget, none_peak)
    target = budget_bytes - on_top
    for iteration in range(1, max_iterations + 1):
        options = solve(profile, target)
        if options is None:
            lowest, lowest_plan = min_peak(profile)
            verified = _peak(fast_memory(workload, batch_size, seq_len, plan_policy(lowest_plan), dtype,
                                         loop, **predicted_for, alloc_conf=alloc_conf))
            raise ValueError(
                f"budget={_exact_bytes(budget_bytes)} is infeasible for "
                f"{workload.label} at batch_size={batch_size}, seq_len={seq_len}, {dtype}: the minimum "
                f"achievable peak is {format_bytes(verified)} ({verified} B, plan "
                f"{plan_policy(lowest_plan).value}); allowed is a budget >= that"
            )
        chosen = fast_memory(workload, batch_size, seq_len, plan_policy(options), dtype, loop, **predicted_for,
                             alloc_conf=alloc_conf)
        predicted = _peak(chosen)
        if predicted <= budget_bytes:
            break
        target -= predicted - budget_bytes  # the model was optimistic: tighten and re-solve
    else:
        raise ValueError(f"budget={format_bytes(budget_bytes)} could not be met after {max_iterations} "
                         f"re-plans (last predicted peak {format_bytes(predicted)}); try a larger budget")
    n = profile.n_blocks
    return Plan(
        options=options, budget_bytes=budget_bytes, predicted_peak_bytes=predicted,
        model_peak_bytes=model_peak(profile, options), recompute_ms=plan_cost(profile, options),
        full_recompute_ms=plan_cost(profile, ["full"] * n), none_peak_bytes=none_peak,
        full_peak_bytes=full_peak, cost_basis=profile.cost_basis, iterations=iteration,
        loss_fn=workload.loss_name, loop=loop,
        fit=chosen.device.fit if chosen.device is not None else None, refused=dict(profile.refused),
    )


def _peak(fake: FakeMemory) -> int:
    """A fake step's peak as `predict` reports it: on CUDA, the allocator's allocated peak."""
    return fake.device.allocated_bytes if fake.device is not None else fake.report.peak_bytes


@dataclass(frozen=True)
class Resolved:
    """A policy made concrete for one shape: what is applied, and the plan a budget chose."""

    policy: Policy                 # concrete: no budget=
    plan: Optional[Plan] = None    # the plan a budget became (None for any other policy)


def refuse_compiled_budget(policy: Policy) -> None:
    """A compiled budget's plan is chosen from measured costs, which `run.compare` measures."""
    if policy.kind == "budget" and policy.compiled:
        raise ValueError(f"policy={policy} is invalid here: a compiled budget's plan is chosen from measured costs; "
                         "allowed is ckptlab.compare(..., [policy]), a sweep, or `ckptlab plan --compile`")


def resolve(policy: Policy, workload: Workload, batch_size: int, seq_len: int, dtype: str = "fp32",
            loop: Loop | str | None = None, device: str = "cpu", card=None, attention: str | None = None, *,
            torch_version: str | None = None, alloc_conf: str | None = None) -> Resolved:
    """The one place an eager `budget=` becomes a plan: the plan `plan_budget` chooses for this
    shape (predicted for `device`, and a card's), with the budget's +offload. Any other policy is
    already concrete. An infeasible budget raises ValueError stating the minimum achievable peak;
    a compiled budget, whose plan comes from measured costs (`run.compare`), is refused."""
    if policy.kind != "budget":
        return Resolved(policy)
    refuse_compiled_budget(policy)
    plan = plan_budget(workload, batch_size, seq_len, policy, dtype=dtype, loop=loop, device=device,
                       card=card, attention=attention, torch_version=torch_version, alloc_conf=alloc_conf)
    return Resolved(plan_policy(plan.options, policy.offload), plan)


def measure(workload: Workload | str, batch_size: int, seq_len: int, policy: str | Policy = "none",
            **options):
    """`ckptlab.probe.measure.measure_policy` (same arguments, same record) for any policy: a
    `budget=` is first resolved to the plan `plan_budget` chooses for this shape, and the record
    keeps the budget as its policy and the plan in `plan`. An infeasible budget is this
    configuration's result (status "error", the minimum achievable peak in the message), not bad
    input."""
    workload, policy = as_workload(workload), as_policy(policy)
    if policy.kind != "budget":
        return measure_policy(workload, batch_size, seq_len, policy, **options)
    refuse_compiled_budget(policy)
    with_report = options.pop("with_report", False)
    record = measurement_record(workload, batch_size, seq_len, policy, **options)[0]
    try:
        device = "cuda" if record["device"].startswith("cuda") else "cpu"  # the plan predicted as it will run
        resolved = resolve(policy, workload, batch_size, seq_len, record["dtype"], loop_of_record(record), device)
    except ValueError as exc:
        record.update(status="error", message=f"ValueError: {exc}")
        return (record, None) if with_report else record
    result = measure_policy(workload, batch_size, seq_len, resolved.policy, with_report=with_report, **options)
    measured = result[0] if with_report else result
    plan = resolved.plan
    planned = f"plan {plan.letters} (predicted peak {plan.predicted_peak_bytes} B <= budget {plan.budget_bytes} B)"
    measured.update(policy=str(policy), plan=plan.letters,
                    note="; ".join(filter(None, [planned, measured.get("note")])))
    return result


def predict(workload: Workload | str, batch_size: int, seq_len: int, policy: str | Policy = "none",
            dtype: str = "fp32", loop: Loop | str | None = None, device: str | None = None, card=None,
            attention: str | None = None, *, torch_version: str | None = None,
            alloc_conf: str | None = None, trace: str = "fast") -> Prediction:
    """`ckptlab.estimate.predict.predict_policy` for any policy: a `budget=` is first resolved to
    the plan `plan_budget` chooses (on the same device, for the same loop, under the same torch
    version's rules, with the same allocator); the prediction names the budget as its policy and
    the plan in `plan`. `trace` as predict_policy's: "fast" (the step composed from a few blocks'
    traces where it can be) or "full". Without `device`, a `card` means "cuda", else "cpu"."""
    choice("trace", trace, TRACES)
    device = implied_device(device, card)
    predicted_for = {"device": device, "card": card, "attention": attention, "torch_version": torch_version}
    workload, policy, loop = check_prediction(workload, batch_size, seq_len, as_policy(policy), dtype, loop,
                                              **predicted_for, alloc_conf=alloc_conf)
    resolved = resolve(policy, workload, batch_size, seq_len, dtype, loop, **predicted_for, alloc_conf=alloc_conf)
    prediction = predict_policy(workload, batch_size, seq_len, resolved.policy, dtype, loop, **predicted_for,
                                alloc_conf=alloc_conf, trace=trace)
    if resolved.plan is None:
        return prediction
    return dataclasses.replace(prediction, policy=str(policy), plan=resolved.plan.letters)


__all__ = ["Plan", "Resolved", "measure", "plan_budget", "predict", "refuse_compiled_budget", "resolve", "resolve_budget"]
