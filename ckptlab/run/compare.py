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

import functools
import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..checkpoint.compiled import Compiled, compile_with_budget, fresh_compiler_cache
from ..checkpoint.wrap import matmul_and_attention_ops
from ..core.dtypes import DTYPES
from ..core.policy import Policy, parse_policies
from ..core.records import new_record, tokens_per_second
from ..core.validate import choice
from ..plan.budget import resolve
from ..plan.compiled import KEEP, UniformCost, check_options, choose_compiled, uniform_policy
from ..probe.measure import (
    MAX_ROUNDS,
    check_policy_applies,
    failures_recorded,
    policy_applier,
    policy_notes,
    prepare_step,
)
from ..probe.step import autocast_dtype, device_name, resolve_device, with_dtype
from ..probe.timing import check_timing_options, time_interleaved
from ..probe.verify import (
    RELATIVE_TOLERANCE,
    WRONG,
    GradientComparison,
    gradient_difference,
    like_eager,
    step_gradients,
)
from ..workloads.base import Workload, is_transformers_model
from ..workloads.registry import as_workload
from ..workloads.stacks import find_blocks
from .progress import Progress

COLUMNS = ["policy", "source", "effective_density", "peak_bytes", "saved_activation_bytes", "step_ms",
           "step_ms_low", "step_ms_high", "time_ratio", "time_ratio_low", "time_ratio_high", "significant",
           "rounds", "threads", "load_before", "load_after", "busy", "status", "message"]
COMPILE_ANCHOR_BUDGETS = (0.0, 0.25, 0.5, 0.75)   # torch.compile's activation_memory_budget, one anchor each
COMPILED_PLAN_OPTIONS = "ksf05"   # what a compiled plan chooses among: keep, selective, full, budgets 0 and 0.5
COSTING_SHARE = 0.25              # of max_seconds: timing the options' uniform compiled plans
OPTIMIZER = "adamw"
CKPTLAB = "ckptlab"


@dataclass
class Contender:
    """One row of the comparison: a label, where it comes from, and how to apply it to a model
    (`apply(model, record) -> (model to run, compiled?, handle or None)`, as `prepare_step`
    takes it; None for a ckptlab policy, resolved when it is measured). `ckptlab_policy` is the
    ckptlab Policy a row applies (None for an anchor)."""

    policy: str
    source: str
    apply: Optional[Callable] = None
    anchor: bool = False
    ckptlab_policy: Optional[Policy] = None

    @property
    def compiled_budget(self) -> bool:
        """`budget=B+compile`: resolved to a compiled plan from measured costs, after the others."""
        p = self.ckptlab_policy
        return self.apply is None and p is not None and p.kind == "budget" and p.compiled


@dataclass
class Setup:
    """What every contender of one comparison shares: workload, batch shape, dtype, device,
    optimizer and run settings."""

    workload: Workload
    batch_size: int
    seq_len: int
    dtype: str
    dev: torch.device
    accum_steps: int = 1
    memory_limit_bytes: Optional[int] = None
    optimizer: str = OPTIMIZER
    min_rounds: int = 5
    warmup: int = 1

    @property
    def limit(self) -> Optional[int]:
        """The limit `prepare_step` caps a CUDA process at: the device's capacity by default."""
        if self.memory_limit_bytes is None and self.dev.type == "cuda":
            return torch.cuda.get_device_properties(self.dev).total_memory
        return self.memory_limit_bytes


def compare(workload: Workload | str, batch_size: int, seq_len: int, policies: Sequence[str | Policy] | str, *,
            dtype: str = "fp32", device: str = "cpu", target_ci: float = 0.02, max_seconds: float = 120,
            anchors: bool | Sequence[str] = False, verify: bool = False, compiled_options: str = COMPILED_PLAN_OPTIONS,
            progress: bool = True, out: Optional[str | Path] = None) -> pd.DataFrame:
    """One row per configuration; the first policy is the time baseline.

    `anchors` is True for every anchor of this workload, or a list of anchor labels (as
    `anchor_configs` names them) for those only: configurations timed together share the
    device's memory, so a large model's comparison may be split into groups.
    `target_ci`/`max_seconds` control the timing protocol (stop at ±target_ci or after
    max_seconds of timing); `verify=True` adds `gradients`, each row's verdict against the
    un-checkpointed eager model (exact | within tolerance | wrong, `ckptlab.probe.verify`), and
    the largest absolute and relative differences it judged (`max_grad_diff`, `max_grad_rel_diff`);
    compiled plans (rows with `plan_cost_basis`) always carry their verdict.
    `compiled_options` are the plan letters and compile-budget digits a compiled plan chooses
    among (`ckptlab.plan.compiled`); "" leaves the compiled plans at the anchors' peaks out.
    `progress` shows the phases on a terminal (`ckptlab.run.progress`).
    `out=DIR` writes compare.csv and compare.json there (`ckptlab.report.plots.compare_plot` draws them)."""
    workload = as_workload(workload)
    policies = parse_policies(policies)
    _check(workload, batch_size, seq_len, policies, dtype, target_ci, max_seconds)
    if compiled_options:
        check_options(compiled_options)
    chosen = chosen_anchors(workload, anchors)
    dev = resolve_device(device)
    contenders = [_ckptlab_contender(p) for p in policies] + chosen
    setup = Setup(workload, batch_size, seq_len, dtype, dev)
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
                     device: str = "cpu", dtype: str = "fp32", accum_steps: int = 1,
                     memory_limit_bytes: Optional[int] = None, optimizer: str = OPTIMIZER, steps: int = 5,
                     warmup: int = 1, target_ci: float = 0.02, max_seconds: float = 30) -> list[dict]:
    """ckptlab policies at one (batch, seq, dtype, accum), each measured like `measure` (same
    record), then timed together: the records carry paired time ratios to the first policy that
    ran. `steps` is the minimum number of rounds. Inputs are assumed validated (`SweepConfig`).
    A `budget=B+compile` becomes the compiled plan chosen from measured costs; the uniform
    compiled plans measured to cost it are timed too but not returned: one record per policy."""
    setup = Setup(workload, batch_size, seq_len, dtype, resolve_device(device), accum_steps, memory_limit_bytes,
                  optimizer, steps, warmup)
    contenders = [_ckptlab_contender(p) for p in parse_policies(policies)]

    def add_plans(rows, steps):
        requests = [(c.ckptlab_policy.value, c.policy, None) for c in contenders if c.compiled_budget]
        if requests:
            _add_compiled_plans(requests, COMPILED_PLAN_OPTIONS, setup, rows, steps, contenders, target_ci, max_seconds,
                                Progress("measure", False))
    wanted = {c.policy for c in contenders}  # a compiled budget's costing rows are not cells of their own
    return [r for r in _measure(contenders, setup, target_ci, max_seconds, add_plans) if r["policy"] in wanted]


def _measure(contenders, setup: Setup, target_ci, max_seconds, after_prepare=None, after_timing=None,
             bar: Optional[Progress] = None) -> list[dict]:
    """Prepare every configuration (a compiled budget's after the others, by `after_prepare`),
    time them together, then `after_timing`; rows in the order of `contenders`."""
    rows, steps = [], {}
    bar = bar or Progress("measure", False)
    with fresh_compiler_cache():   # an anchor may compile whatever the policies are
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


def _check(workload, batch_size, seq_len, policies, dtype, target_ci, max_seconds) -> None:
    workload.check_shape(batch_size, seq_len)
    for p in policies:
        check_policy_applies(workload, p)
    choice("dtype", dtype, list(DTYPES))
    check_timing_options(target_ci, max_seconds)


# ----------------------------------------------------------------------------- configurations

def _ckptlab_contender(policy: Policy) -> Contender:
    return Contender(str(policy), CKPTLAB, ckptlab_policy=policy)


def anchor_configs(workload: Workload) -> list[Contender]:
    """The knobs a user would use instead of ckptlab, for this workload (docs/design.md, note "Anchors")."""
    contenders = [
        Contender("torch.utils.checkpoint per block", "torch.utils.checkpoint", _per_block_checkpoint, anchor=True),
    ] + [Contender(f"torch.compile activation_memory_budget={budget}", "torch.compile", _compiled(budget), anchor=True)
         for budget in COMPILE_ANCHOR_BUDGETS]
    if is_transformers_model(workload.build("meta")):
        contenders += [
            Contender("transformers checkpointing (every layer)", "transformers", _transformers_checkpointing(), anchor=True),
            Contender("transformers every_n_layers=2", "transformers", _transformers_checkpointing(every_n_layers=2),
                   anchor=True),
            Contender("transformers every_n_layers=4", "transformers", _transformers_checkpointing(every_n_layers=4),
                   anchor=True),
            Contender("transformers + torch SAC (context_fn)", "transformers + torch SAC",
                   _transformers_checkpointing(selective=True), anchor=True),
        ]
    return contenders


def chosen_anchors(workload: Workload, anchors: bool | Sequence[str]) -> list[Contender]:
    """`anchor_configs(workload)` for anchors=True, none for False, or the ones a list names
    (ValueError naming one that is not an anchor of this workload)."""
    if isinstance(anchors, bool):
        return anchor_configs(workload) if anchors else []
    anchors = [anchors] if isinstance(anchors, str) else list(anchors)
    available = anchor_configs(workload)
    labels = [c.policy for c in available]
    for label in anchors:
        choice("anchors", label, labels)
    return [c for c in available if c.policy in anchors]


def _per_block_checkpoint(model, record):
    blocks = find_blocks(model)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    _checkpointed(record, len(blocks), range(len(blocks)))
    return model, False, None


def _compiled(budget: float):
    def apply(model, record):
        record["note"] = "torch.compile: peak from the profiler's allocator events"
        compiled = Compiled()
        return compile_with_budget(model, budget, compiled), compiled, None
    return apply


def _transformers_checkpointing(every_n_layers: Optional[int] = None, selective: bool = False):
    def apply(model, record):
        from ..checkpoint.hf import checkpointing_methods, hf_capabilities, hf_layers  # noqa: PLC0415 - the hf extra

        enable, _, kwargs_name = checkpointing_methods(model)
        options = {}
        if every_n_layers is not None:
            if not hf_capabilities(model)["every_n_layers"]:
                raise ValueError("every_n_layers is not supported by the installed transformers")
            options["every_n_layers"] = every_n_layers
        checkpoint_kwargs = {"use_reentrant": False}
        if selective:
            checkpoint_kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, list(matmul_and_attention_ops()))
        enable(**{kwargs_name: checkpoint_kwargs}, **options)
        layers = hf_layers(model)
        _checkpointed(record, len(layers), [i for i, layer in enumerate(layers) if layer.gradient_checkpointing])
        return model, False, None
    return apply


def _checkpointed(record: dict, n_blocks: int, blocks) -> None:
    blocks = list(blocks)
    record.update(n_blocks=n_blocks, effective_density=len(blocks) / n_blocks,
                  checkpointed_blocks=",".join(map(str, blocks)))


# ----------------------------------------------------------------------------- measuring

def _new_record(setup: Setup, policy: str, source: str) -> dict:
    return new_record(setup.workload.label, setup.batch_size, setup.seq_len, setup.accum_steps, policy=policy,
                      device=str(setup.dev), device_name=device_name(setup.dev), dtype=setup.dtype,
                      optimizer=setup.optimizer, steps=setup.min_rounds, warmup=setup.warmup,
                      memory_limit_bytes=setup.limit, source=source, model_hash=setup.workload.spec_hash,
                      loss_fn=setup.workload.loss_name)


def _prepare(contender: Contender, setup: Setup, rows, steps) -> None:
    """Build, apply and measure the memory of one configuration; keep its step for timing."""
    record = _new_record(setup, contender.policy, contender.source)
    dev = setup.dev
    with failures_recorded(record, dev):
        if contender.apply is None:
            resolved = resolve(contender.ckptlab_policy, setup.workload, setup.batch_size, setup.seq_len, setup.dtype,
                               setup.optimizer)
            if resolved.plan is not None:
                record["plan"] = resolved.plan.letters
            policy_notes(record, resolved.policy, dev)
            contender.apply = policy_applier(resolved.policy)
        step, _ = prepare_step(record, setup.workload, contender.apply, dev, setup.dtype, setup.limit, setup.optimizer)
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
        resolved = resolve(Policy("budget", peak), setup.workload, setup.batch_size, setup.seq_len, setup.dtype,
                           setup.optimizer)
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
        label = uniform_policy(o, n)
        if not any(r["policy"] == label for r in rows):
            contender = Contender(label, PLAN_SOURCE)
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


def _verify(rows, contenders, setup: Setup, bar: Progress) -> None:
    """Per row not yet checked, its gradients against the un-checkpointed eager model's: fresh
    models from the workload's seed, one forward + backward, compiled ones drawing random numbers
    as eager does (`ckptlab.probe.verify`). `gradients` is the verdict (exact | within tolerance |
    wrong), `max_grad_diff` and `max_grad_rel_diff` the differences it judged."""
    rows = [r for r in rows if "gradients" not in r]
    if not rows:
        return
    bar.phase("verify gradients", len(rows), "config")
    workload, dev = with_dtype(setup.workload, setup.dtype), setup.dev
    batch = workload.batch(setup.batch_size, setup.seq_len, dev)
    autocast = autocast_dtype(setup.dtype)
    reference = step_gradients(workload.build(dev).train(), workload, batch, workload.seed, autocast_dtype=autocast)
    by_label = {c.policy: c for c in contenders}
    for r in rows:
        contender = by_label.get(r["policy"])
        r.update(gradients=None, max_grad_diff=None, max_grad_rel_diff=None)
        bar.step(r["policy"])
        if r["status"] != "ok" or contender is None or contender.apply is None:
            continue
        model = workload.build(dev).train()
        try:
            runner, compiled, _ = contender.apply(model, {})
            with like_eager(bool(compiled)):
                loss, grads = step_gradients(model, workload, batch, workload.seed, runner=runner,
                                             autocast_dtype=autocast)
        except Exception as exc:  # noqa: BLE001 - the row keeps its measurements and says why
            r["message"] = f"gradient check failed: {type(exc).__name__}: {exc}"
            continue
        check = GradientComparison(r["policy"], reference[0].item(), loss.item(),
                                   *gradient_difference(*reference, loss, grads), RELATIVE_TOLERANCE[setup.dtype])
        r.update(gradients=check.verdict, max_grad_diff=check.max_abs_diff, max_grad_rel_diff=check.max_rel_diff)


# ----------------------------------------------------------------------------- output

def write(df: pd.DataFrame, out: str | Path) -> Path:
    """compare.csv and compare.json (one record per row) in `out`: everything
    `ckptlab.report.plots.compare_plot` needs to draw the figure (the CLI draws it into out/figures/)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "compare.csv", index=False)
    (out / "compare.json").write_text(json.dumps(df.to_dict("records"), indent=1, default=str) + "\n")
    return out


__all__ = ["anchor_configs", "chosen_anchors", "compare", "measure_together", "write"]
