"""Policies side by side at one setup, timed together, against the knobs a user would pick instead.

    df = ckptlab.compare("gpt-tiny", 4, 64, ["none", "density=0.5", "full"], anchors=True)

Each configuration's memory is measured once with the live-tensor tracker (as `measure` does);
then all are timed together in interleaved rounds (`ckptlab.probe.timing`), so every row's
`time_ratio` to the first policy has a 95% interval and `significant` says whether it excludes 1.
`anchors=True` adds other frameworks' knobs, each applied through its own API, and at each
anchor's measured peak the planner's plan and the compiled plan (docs/design.md, note "Anchors").
A compiled plan (`budget=B+compile`, or one at an anchor's peak) is chosen from measured costs
(`ckptlab.plan.compiled`): each option's uniform compiled plan is built, its gradients checked and
timed briefly, then the chosen plan is built and timed with everything else, its gradients checked.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
import torch

from ..checkpoint.compiled import fresh_compiler_cache
from ..core.dtypes import DTYPES
from ..core.loop import Loop, as_loop
from ..core.policy import Policy, parse_policies
from ..core.records import new_record, tokens_per_second
from ..core.validate import choice, made_folder
from ..plan.budget import Resolved, resolve
from ..plan.compiled import KEEP, UniformCost, check_options, choose_compiled, uniform_policy
from ..probe.measure import (
    MAX_ROUNDS,
    check_policy_applies,
    failures_recorded,
    older_objects_frozen,
    policy_applier,
    policy_notes,
    prepare_step,
)
from ..probe.step import device_name, resolve_device
from ..probe.timing import check_timing_options, time_interleaved
from ..probe.verify import WRONG
from ..workloads.base import Workload
from ..workloads.registry import as_workload
from ..workloads.stacks import find_blocks
from .anchors import Contender, chosen_anchors
from .progress import Progress
from .verify_rows import verify_rows

COLUMNS = ["policy", "source", "effective_density", "peak_bytes", "saved_activation_bytes", "step_ms",
           "step_ms_low", "step_ms_high", "time_ratio", "time_ratio_low", "time_ratio_high", "significant",
           "rounds", "threads", "load_before", "load_after", "busy", "status", "message"]
COMPILED_PLAN_OPTIONS = "ksf05"   # what a compiled plan chooses among: keep, selective, full, budgets 0 and 0.5
COSTING_SHARE = 0.25              # of max_seconds: timing the options' uniform compiled plans
CKPTLAB = "ckptlab"


@dataclass
class Setup:
    """What every contender of one comparison shares: workload, batch shape, dtype, device,
    training loop and run settings."""

    workload: Workload
    batch_size: int
    seq_len: int
    dtype: str
    dev: torch.device
    loop: Loop = Loop()            # the training loop (`core.loop`)
    memory_limit_bytes: Optional[int] = None
    min_rounds: int = 5
    warmup: int = 1

    def resolve(self, policy: Policy) -> Resolved:
        """`policy` made concrete for this shape: a budget's plan predicted for this device and loop."""
        return resolve(policy, self.workload, self.batch_size, self.seq_len, self.dtype, self.loop, self.dev.type)

    @property
    def limit(self) -> Optional[int]:
        """The limit `prepare_step` caps a CUDA process at: the device's capacity by default."""
        if self.memory_limit_bytes is None and self.dev.type == "cuda":
            return torch.cuda.get_device_properties(self.dev).total_memory
        return self.memory_limit_bytes


def compare(workload: Workload | str, batch_size: int, seq_len: int, policies: Sequence[str | Policy] | str, *,
            dtype: str = "fp32", loop: Loop | str | None = None, device: str = "cpu", target_ci: float = 0.02,
            max_seconds: float = 120,
            anchors: bool | Sequence[str] = False, verify: bool = False, compiled_options: str = COMPILED_PLAN_OPTIONS,
            progress: bool = True, out: Optional[str | Path] = None) -> pd.DataFrame:
    """One row per configuration; the first policy is the time baseline. Every configuration runs
    the training `loop` (`core.loop.Loop` or its text; default adamw).

    `anchors` is True for every anchor of this workload, or a list of anchor labels (as
    `run.anchors.anchor_configs` names them) for those only: configurations timed together share the
    device's memory, so a large model's comparison may be split into groups.
    `target_ci`/`max_seconds` control the timing protocol (stop at ±target_ci or after
    max_seconds of timing); `verify=True` adds `gradients`, each row's verdict against the
    un-checkpointed eager model (exact | within tolerance | wrong, `ckptlab.probe.verify`), and
    the largest absolute and relative differences it judged (`max_grad_diff`, `max_grad_rel_diff`);
    compiled plans (rows with `plan_cost_basis`) always carry their verdict.
    `compiled_options` are the plan letters and compile-budget digits a compiled plan chooses
    among (`ckptlab.plan.compiled`); "" leaves the compiled plans at the anchors' peaks out.
    `progress` shows the phases on a terminal (`ckptlab.run.progress`).
    `out=DIR` writes compare.csv and compare.json there, over those of an earlier comparison
    (`ckptlab.report.plots.compare_plot` draws them); a folder that cannot be made is refused first."""
    workload = as_workload(workload)
    policies = parse_policies(policies)
    loop = _check(workload, batch_size, seq_len, policies, dtype, loop, target_ci, max_seconds)
    if compiled_options:
        check_options(compiled_options)
    chosen = chosen_anchors(workload, anchors)
    dev = resolve_device(device)
    if out is not None:   # made before any timing: a folder that cannot be made is refused at once
        made_folder("out", out)
    contenders = [_ckptlab_contender(p) for p in policies] + chosen
    setup = Setup(workload, batch_size, seq_len, dtype, dev, loop)
    bar = Progress(f"compare {workload.label}", progress)

    def add_plans(rows, steps):
        anchor_rows = [r for r in rows if r["source"] != CKPTLAB and r["status"] == "ok"] if anchors else []
        if anchor_rows:
            bar.phase("eager plans at the anchors' peaks", len(anchor_rows), "plan")
        for anchor_row in anchor_rows:
            _add_plan_for(anchor_row, setup, rows, steps, contenders)
            bar.step(anchor_row["policy"])
        requests = [(c.ckptlab_policy.value, c.policy, None) for c in contenders if c.compiled_budget]
        if compiled_options:
            requests += [(int(r["peak_bytes"]), None, r["policy"]) for r in anchor_rows]
        if requests:
            _add_compiled_plans(requests, compiled_options or COMPILED_PLAN_OPTIONS, setup, rows, steps, contenders,
                                target_ci, max_seconds, bar)

    rows = _measure(contenders, setup, target_ci, max_seconds, add_plans,
                    (lambda rows: _verify(rows, contenders, setup, bar)) if verify else None, bar)
    df = pd.DataFrame(rows)
    df = df[[c for c in COLUMNS if c in df] + [c for c in df if c not in COLUMNS]]
    if out is not None:
        write(df, out)
    return df


def measure_together(workload: Workload, batch_size: int, seq_len: int, policies: Sequence[str | Policy], *,
                     device: str = "cpu", dtype: str = "fp32", loop: Loop | str | None = None,
                     memory_limit_bytes: Optional[int] = None, steps: int = 5, warmup: int = 1,
                     target_ci: float = 0.02, max_seconds: float = 30, progress: bool = False) -> list[dict]:
    """ckptlab policies at one (batch, seq, dtype, loop), each measured like `measure` (same
    record), then timed together: the records carry paired time ratios to the first policy that
    ran. `steps` is the minimum number of rounds. Inputs are assumed validated (`SweepConfig`).
    A `budget=B+compile` becomes the compiled plan chosen from measured costs; the uniform
    compiled plans measured to cost it are timed too but not returned: one record per policy.
    `loop` as `measure`'s. `progress` shows the phases on a terminal (off by default: a sweep
    calls this per cell under its own bar)."""
    setup = Setup(workload, batch_size, seq_len, dtype, resolve_device(device), as_loop(loop), memory_limit_bytes,
                  steps, warmup)
    contenders = [_ckptlab_contender(p) for p in parse_policies(policies)]

    def add_plans(rows, steps):
        requests = [(c.ckptlab_policy.value, c.policy, None) for c in contenders if c.compiled_budget]
        if requests:
            _add_compiled_plans(requests, COMPILED_PLAN_OPTIONS, setup, rows, steps, contenders, target_ci, max_seconds,
                                Progress("measure", False))
    wanted = {c.policy for c in contenders}  # a compiled budget's costing rows are not cells of their own
    bar = Progress(f"measure b={batch_size} s={seq_len}", progress)
    return [r for r in _measure(contenders, setup, target_ci, max_seconds, add_plans, bar=bar) if r["policy"] in wanted]


def _measure(contenders, setup: Setup, target_ci, max_seconds, after_prepare=None, after_timing=None,
             bar: Optional[Progress] = None) -> list[dict]:
    """Prepare every configuration (a compiled budget's after the others, by `after_prepare`),
    time them together, then `after_timing`; rows in the order of `contenders`."""
    rows, steps = [], {}
    bar = bar or Progress("measure", False)
    # the collections below and in each preparation walk only what the configurations made
    with older_objects_frozen(setup.dev), fresh_compiler_cache():   # an anchor may compile whatever the policies are
        try:
            ready = [c for c in contenders if not c.compiled_budget]
            bar.phase("build, compile and measure memory", len(ready), "config")
            for contender in ready:
                _prepare(contender, setup, rows, steps)
                bar.step(contender.policy)
            if after_prepare is not None:
                after_prepare(rows, steps)
            order = {c.policy: i for i, c in enumerate(contenders)}
            rows.sort(key=lambda r: order.get(r["policy"], len(order)))
            _time_together(rows, steps, setup, target_ci, max_seconds, bar)
            # Each step holds its model and optimizer state: freed before the gradient check builds
            # fresh models, so the device holds the check's models, not every contender's too.
            steps.clear()
            gc.collect()
            if after_timing is not None:
                after_timing(rows)
        finally:
            bar.close()
            steps.clear()
    return rows


def _verify(rows, contenders, setup: Setup, bar: Progress) -> None:
    """`verify_rows` for these rows, each applied as its contender applies it."""
    verify_rows(rows, {c.policy: c.apply for c in contenders}, setup.workload, setup.batch_size, setup.seq_len,
                setup.dtype, setup.dev, bar)


def _check(workload, batch_size, seq_len, policies, dtype, loop, target_ci, max_seconds) -> Loop:
    """Every input of `compare` checked (ValueError naming the first bad one); the loop parsed."""
    workload.check_shape(batch_size, seq_len)
    for p in policies:
        check_policy_applies(workload, p)
    choice("dtype", dtype, list(DTYPES))
    loop = as_loop(loop)
    loop.check_dtype(dtype)
    check_timing_options(target_ci, max_seconds)
    return loop


def _ckptlab_contender(policy: Policy) -> Contender:
    return Contender(str(policy), CKPTLAB, ckptlab_policy=policy)


# ----------------------------------------------------------------------------- measuring

def _new_record(setup: Setup, policy: str, source: str) -> dict:
    return new_record(setup.workload.label, setup.batch_size, setup.seq_len, setup.loop, policy=policy,
                      device=str(setup.dev), device_name=device_name(setup.dev), dtype=setup.dtype,
                      steps=setup.min_rounds, warmup=setup.warmup,
                      memory_limit_bytes=setup.limit, source=source, model_hash=setup.workload.spec_hash,
                      loss_fn=setup.workload.loss_name)


def _prepare(contender: Contender, setup: Setup, rows, steps) -> None:
    """Build, apply and measure the memory of one configuration; keep its step for timing."""
    record = _new_record(setup, contender.policy, contender.source)
    dev = setup.dev
    with failures_recorded(record, dev):
        if contender.apply is None:
            resolved = setup.resolve(contender.ckptlab_policy)
            if resolved.plan is not None:
                record["plan"] = resolved.plan.letters
            policy_notes(record, resolved.policy, dev)
            contender.apply = policy_applier(resolved.policy)
        step, _ = prepare_step(record, setup.workload, contender.apply, dev, setup.dtype, setup.limit, setup.loop)
        steps[contender.policy] = step
    rows.append(record)


PLAN_SOURCE = "ckptlab plan"


def _add_plan_for(anchor_row: dict, setup: Setup, rows, steps, contenders) -> None:
    """The planner's plan whose predicted peak fits the anchor's measured peak, as a ckptlab row
    (`plan_at_peak_of` names the anchors whose peak chose it: one row per distinct plan)."""
    peak = int(anchor_row["peak_bytes"])
    same_peak = next((r for r in rows if r["source"] == PLAN_SOURCE and r.get("plan_budget_bytes") == peak), None)
    if same_peak is not None:
        same_peak["plan_at_peak_of"] += f"; {anchor_row['policy']}"
        return
    record = _new_record(setup, f"budget={peak}B", PLAN_SOURCE)
    record.update(plan_at_peak_of=anchor_row["policy"], plan_budget_bytes=peak)
    try:
        resolved = setup.resolve(Policy("budget", peak))
    except ValueError as exc:
        rows.append({**record, "status": "error", "message": str(exc)})
        return
    plan = resolved.plan
    label = str(resolved.policy)
    existing = next((r for r in rows if r["policy"] == label), None)
    if existing is not None:  # the same plan is already a row: name this anchor there
        existing["plan_at_peak_of"] = "; ".join(filter(None, [existing.get("plan_at_peak_of"), anchor_row["policy"]]))
        existing.setdefault("plan_budget_bytes", peak)
        return
    contender = Contender(label, PLAN_SOURCE, policy_applier(resolved.policy), ckptlab_policy=resolved.policy)
    contenders.append(contender)
    _prepare(contender, setup, rows, steps)
    rows[-1].update(plan=plan.letters, plan_at_peak_of=anchor_row["policy"], plan_budget_bytes=peak)


def _add_compiled_plans(requests, options: str, setup: Setup, rows, steps, contenders, target_ci, max_seconds,
                        bar: Progress) -> None:
    """Compiled plans from measured costs (`ckptlab.plan.compiled`), one per request
    `(budget, label, anchor)`: a `budget=B+compile` policy (label; a fraction B is of the compiled
    all-keep plan's measured peak) or an anchor's measured peak in bytes (anchor: its name). Each
    option's uniform compiled plan is built and its gradients checked (an option whose gradients
    are wrong is never chosen), the uniform plans are timed together for `COSTING_SHARE` of
    `max_seconds`, then each chosen plan is built and its gradients checked; all of them are timed
    again with every other row."""
    n = len(find_blocks(setup.workload.build("meta")))
    letters = check_options(options)
    bar.phase("compiled plans: build and compile each option's uniform plan", len(letters), "option")
    uniform = {}
    for o in letters:
        policy = uniform_policy(o, n)
        label = str(policy)
        if not any(r["policy"] == label for r in rows):
            contender = Contender(label, PLAN_SOURCE, ckptlab_policy=policy)
            contenders.append(contender)
            _prepare(contender, setup, rows, steps)
        uniform[o] = next(r for r in rows if r["policy"] == label)
        bar.step(label)
    _verify(list(uniform.values()), contenders, setup, bar)
    right = {o: r for o, r in uniform.items() if r["status"] == "ok" and r["gradients"] != WRONG}
    keep = uniform[KEEP]
    if KEEP not in right:
        reason = f"the compiled all-keep plan {keep['policy']} did not run or its gradients are wrong: " + (
            keep.get("message") or str(keep.get("gradients")))
        for budget, label, anchor in requests:
            rows.append({**_new_record(setup, label or f"budget={budget}B+compile", PLAN_SOURCE),
                         "plan_at_peak_of": anchor, "status": "error", "message": reason})
        return
    costing = _time_alone({r["policy"]: steps[r["policy"]] for r in right.values()}, setup, target_ci,
                          max_seconds * COSTING_SHARE, bar, "compiled plans: time each option's uniform plan")
    costs = {o: UniformCost(int(r["peak_bytes"]), costing.step_ms[r["policy"]]) for o, r in right.items()}
    for r in right.values():
        r["plan_costing_step_ms"] = costing.step_ms[r["policy"]]
    chosen = []
    bar.phase("compiled plans: build the chosen plans", len(requests), "plan")
    for budget, label, anchor in requests:
        budget_bytes = int(budget * keep["peak_bytes"]) if isinstance(budget, float) else int(budget)
        try:
            choice = choose_compiled(costs, n, budget_bytes, setup.workload.label)
        except ValueError as exc:
            rows.append({**_new_record(setup, label or f"budget={budget_bytes}B+compile", PLAN_SOURCE),
                         "plan_at_peak_of": anchor, "plan_budget_bytes": budget_bytes, "status": "error",
                         "message": str(exc)})
            continue
        existing = next((r for r in rows if r["policy"] == str(choice.policy)), None)
        if existing is not None and label is None:  # the same plan is already a row: name this anchor there
            existing["plan_at_peak_of"] = "; ".join(filter(None, [existing.get("plan_at_peak_of"), anchor]))
            existing.update({k: v for k, v in choice.record().items() if existing.get(k) is None})
            bar.step(str(choice.policy))
            continue
        if existing is not None:  # a budget's plan is a uniform plan already measured: its row, under the budget's name
            rows.append({**existing, "policy": label, "source": CKPTLAB, "same_as": existing["policy"], **choice.record()})
            bar.step(str(choice.policy))
            continue
        contender = next(c for c in contenders if c.policy == label) if label else Contender(str(choice.policy), PLAN_SOURCE)
        contender.apply = policy_applier(choice.policy)
        if label is None:
            contenders.append(contender)
        _prepare(contender, setup, rows, steps)
        rows[-1].update(choice.record(), plan_at_peak_of=anchor)
        chosen.append(rows[-1])
        bar.step(str(choice.policy))
    _verify(chosen, contenders, setup, bar)


def _time_alone(timed: dict, setup: Setup, target_ci, max_seconds, bar: Progress, what: str):
    """`time_interleaved` over `timed` with the comparison's settings, its rounds on the bar."""
    bar.phase(what, None, "round")

    def on_round(rounds, half_width):
        bar.step(f"widest interval ±{half_width:.1%} (target ±{target_ci:.0%})")
    return time_interleaved(timed, device=setup.dev, target_ci=target_ci, max_seconds=max_seconds,
                            warmup=setup.warmup, min_rounds=setup.min_rounds,
                            max_rounds=max(setup.min_rounds, MAX_ROUNDS), on_round=on_round)


def _time_together(rows, steps, setup: Setup, target_ci, max_seconds, bar: Progress) -> None:
    timed = {r["policy"]: steps[r["policy"]] for r in rows if r["status"] == "ok" and steps.get(r["policy"])}
    if not timed:
        return
    timing = _time_alone(timed, setup, target_ci, max_seconds, bar, f"time {len(timed)} configurations together")
    for r in rows:
        name = r.get("same_as") or r["policy"]  # a row measured under another name shares its times
        if name in timed:
            r.update(timing.row(name))
            r["round_ms"] = list(timing.times_ms[name])  # aligned across rows: any pair can be paired
            r["tokens_per_s"] = tokens_per_second(r["tokens"], r["step_ms"])


# ----------------------------------------------------------------------------- output

def write(df: pd.DataFrame, out: str | Path) -> Path:
    """compare.csv and compare.json (one record per row) in `out`: everything
    `ckptlab.report.plots.compare_plot` needs to draw the figure (the CLI draws it into out/figures/)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "compare.csv", index=False)
    (out / "compare.json").write_text(json.dumps(df.to_dict("records"), indent=1, default=str) + "\n")
    return out


__all__ = ["compare", "measure_together", "write"]
