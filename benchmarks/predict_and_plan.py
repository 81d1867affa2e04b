"""Predict before you run, plan for a budget: prediction error, the measured frontier and what fits, in one run.

  1. prediction error: predicted (fake tensors) vs measured peak and saved-activation bytes on the
     default CPU grid (gpt-tiny, batch 1..8 x seq 32..256, every policy; mlp-chain; bf16), with
     the closed form beside it;
  2. the measured frontier at one shape: none, full, density steps, every-k, segments=sqrt,
     selective (+ variants), compile:budget at a few budgets, budget plans at several budgets,
     all timed together in interleaved rounds (`measure_together`): each time ratio to `none` is
     paired round by round and carries its 95% interval. The Pareto frontier; whether budget
     plans dominate the uniform policies (no more memory and a time interval entirely below the
     uniform's, paired round by round; an interval that contains 1 is no difference); at the peak of `full`, the best plan's
     time against full's; what fraction of full's savings selective gets, at what overhead;
  3. what fits on an RTX 4090, A100-40, H100-80 and H200 (their usable bytes, less context and
     margin), by prediction, and the cost of predicting a
     Llama-7B-shaped GPT at batch 8, seq 4096;
  4. compile:budget: what the budget does to the allocator-measured peak, checked first on a case
     where the answer is known, and where the peak happens.

    python benchmarks/predict_and_plan.py [--quick] [--max-seconds 120] [--target-ci 0.02] [--out results/predict_and_plan.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from ckptlab import closed_form, get_workload, measure, measure_together, predict, predict_fits, track_memory
from ckptlab.checkpoint.compiled import apply_policy, fresh_compiler_cache
from ckptlab.core.policy import parse_policy, policy_label
from ckptlab.core.units import format_bytes
from ckptlab.estimate.predict import prediction_error
from ckptlab.plan.budget import plan_budget
from ckptlab.probe.measure import allocator_step_memory
from ckptlab.probe.step import make_optimizer, training_step
from ckptlab.probe.timing import (
    check_timing_options,
    time_steps,
    time_verdict,
    versus_fastest_at_no_more_memory,
)
from ckptlab.report.analysis import on_frontier
from ckptlab.report.tables import format_table

GRID_POLICIES = ["none", "full", "density=0.25", "density=0.5", "density=0.75", "every=2", "segments=sqrt",
                 "selective", "selective=alt", "selective=attn", "plan=kfsk", "density=0.5+offload",
                 "budget=mid"]
QUICK_POLICIES = ["none", "full", "selective", "plan=kfsk", "density=0.5+offload", "budget=mid"]  # --quick
MLP_POLICIES = ["none", "full", "density=0.5", "every=3", "segments=sqrt", "selective", "selective=alt",
                "plan=kfskkfsk", "budget=mid"]


def pct(v):
    return "-" if v is None else f"{v:+.2%}"


def mib(v):
    return format_bytes(v)


_PREDICTIONS: dict = {}


def predicted(workload, batch: int, seq: int, policy: str, dtype: str = "fp32"):
    """`predict`, once per setting in a run: a prediction is deterministic (fake tensors, exact to
    the byte), and sections 1 and 2 predict none, full and selective again wherever their shapes
    agree (seconds each)."""
    key = (workload.identity, batch, seq, policy, dtype)
    if key not in _PREDICTIONS:
        _PREDICTIONS[key] = predict(workload, batch, seq, policy, dtype=dtype)
    return _PREDICTIONS[key]


# --------------------------------------------------------------------------- 1. prediction error

def prediction_table(quick: bool) -> list[dict]:
    rows = []
    gpt = get_workload("gpt-tiny")
    batches, seqs = ([2], [32]) if quick else ([1, 2, 4, 8], [32, 64, 128, 256])
    grid, mlp = (QUICK_POLICIES, QUICK_POLICIES[:1]) if quick else (GRID_POLICIES, MLP_POLICIES)
    cases = [(gpt, b, s, p, "fp32") for b in batches for s in seqs for p in grid]
    b_other, s_other = (2, 32) if quick else (8, 128)
    cases += [(get_workload("mlp-chain"), b_other, s_other, p, "fp32") for p in mlp]
    cases += [(gpt, b_other, s_other, p, "bf16") for p in grid[:1] if quick] or [
        (gpt, 8, 128, p, "bf16") for p in ("none", "full", "density=0.5", "selective", "segments=sqrt")]
    for workload, b, s, policy, dtype in cases:
        if policy == "budget=mid":  # halfway between full's and none's peak: always feasible
            mid = (predicted(workload, b, s, "none", dtype).peak_bytes
                   + predicted(workload, b, s, "full", dtype).peak_bytes) // 2
            policy = f"budget={mid}B"
        pred = predicted(workload, b, s, policy, dtype)
        # Bytes only: the step is timed for the shortest budget, its time is not in this table.
        rec = measure(workload, b, s, policy, dtype=dtype, steps=1, warmup=0, max_seconds=0.1)
        row = {"model": workload.name, "batch": b, "seq": s, "policy": policy, "dtype": dtype,
               "measured_peak": rec["peak_bytes"], "predicted_peak": pred.peak_bytes,
               "error": prediction_error(pred.peak_bytes, rec["peak_bytes"]),
               "saved_error": prediction_error(pred.saved_activation_bytes, rec["saved_activation_bytes"]),
               "predict_s": pred.predict_s, "status": rec["status"], "cf_error": None, "cf_saved_error": None}
        if workload.name.startswith("gpt") and not policy.startswith("budget"):
            cf = closed_form(workload, b, s, policy.replace("+offload", ""), dtype)
            row["cf_error"] = prediction_error(cf["closed_form_peak_bytes"], rec["peak_bytes"])
            row["cf_saved_error"] = prediction_error(cf["closed_form_saved_activation_bytes"], rec["saved_activation_bytes"])
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- 2. frontier

def frontier(quick: bool, batch: int, seq: int, target_ci: float, max_seconds: float,
             with_compile: bool) -> tuple[list[dict], dict]:
    """Every policy measured, then all timed together (`measure_together`): interleaved rounds,
    each row's time ratio to `none` paired round by round, with its 95% interval."""
    workload = get_workload("gpt-tiny")
    uniform = ["none", "full", "selective"] if quick else [
        "none", "full", "density=0.25", "density=0.5", "density=0.75", "every=2", "segments=sqrt", "selective",
        "selective=alt", "selective=attn"]
    none_p, full_p = predicted(workload, batch, seq, "none"), predicted(workload, batch, seq, "full")
    fracs = [0.9] if quick else [0.95, 0.9, 0.85, 0.8]
    budgets = [f"budget={f}" for f in fracs] + [f"budget={full_p.peak_bytes}B"]
    plans = {}
    for b in budgets:
        try:
            plans[b] = plan_budget(workload, batch, seq, b.split("=", 1)[1] if b.endswith("B") else b)
        except ValueError as exc:
            print(f"  {b}: {exc}")
    planned = [f"plan={p.letters}" for p in plans.values()]
    compiled = [f"compile:budget={cb}" for cb in ([1.0, 0.0] if quick else [1.0, 0.5, 0.0])] if with_compile else []
    records = measure_together(workload, batch, seq, list(dict.fromkeys(uniform + planned + compiled)),
                               target_ci=target_ci, max_seconds=max_seconds)
    if records[0]["status"] != "ok":
        raise RuntimeError(f"the baseline `none` did not run: {records[0]['message']}")
    rows = []
    for rec in records:
        p = rec["policy"]
        kind = "plan" if p.startswith("plan") else "compile" if p.startswith("compile") else "uniform"
        pred = predicted(workload, batch, seq, p).peak_bytes if kind != "compile" else None
        row = {"policy": p, "from": next((b for b, pl in plans.items() if f"plan={pl.letters}" == p), ""),
               "kind": kind, "status": rec["status"], "message": rec["message"], "peak_bytes": rec["peak_bytes"],
               "predicted_peak_bytes": pred, "error": None if pred is None else prediction_error(pred, rec["peak_bytes"]),
               "saved_activation_bytes": rec["saved_activation_bytes"]}
        if rec["status"] == "ok":
            row.update({k: rec[k] for k in ("step_ms", "step_ms_low", "step_ms_high", "time_ratio", "time_ratio_low",
                                            "time_ratio_high", "round_ms", "rounds")})
            row.update(overhead=rec["time_ratio"] - 1, overhead_low=rec["time_ratio_low"] - 1,
                       overhead_high=rec["time_ratio_high"] - 1)
        rows.append(row)
    timed = [r for r in rows if r["status"] == "ok"]
    # Dominance by time ratios to `none` (a compile row's from its own rounds: non-overlap of the
    # intervals is still required).
    frontier = on_frontier([r["peak_bytes"] for r in timed], [r["time_ratio_low"] for r in timed],
                           [r["time_ratio_high"] for r in timed])
    for r, on in zip(timed, frontier):
        r["pareto"] = on
    timing = {k: records[0][k] for k in ("rounds", "timing_stopped", "timing_ci_half_width", "timing_target_ci",
                                          "threads", "load_before", "load_after", "busy")}
    return rows, {"plans": plans, "none": none_p, "full": full_p, "timing": timing}


def with_interval(name: str, value: float, low: float, high: float) -> dict:
    return {name: value, f"{name}_low": low, f"{name}_high": high}


def share(part: int, whole: int) -> float | None:
    """part / whole; None where full saves nothing (a shape whose peak is not activations)."""
    return part / whole if whole else None


def frontier_summary(rows: list[dict]) -> dict:
    by = {r["policy"]: r for r in rows if r["status"] == "ok"}
    none, full, sel = by["none"], by["full"], by["selective"]
    plans = [r for r in by.values() if r["kind"] == "plan"]
    best_at_full, full_over_plan = versus_fastest_at_no_more_memory(full, plans)  # above 1: the plan is faster
    # A plan dominates a uniform policy only with no more memory and a paired time ratio whose
    # interval lies below 1 (compile rows are not plans): the uniform policy is then slower.
    dom = []
    for u in (r for r in by.values() if r["kind"] == "uniform" and r["policy"] != "none"):
        best, (_, low, high) = versus_fastest_at_no_more_memory(u, plans)
        verdict = "-" if best is None else time_verdict(low, high)
        verdict = {"slower": "plan faster", "faster": "plan slower"}.get(verdict, verdict)
        dom.append({"uniform": u["policy"], "uniform_peak": u["peak_bytes"], "uniform_ratio": u["time_ratio"],
                    "uniform_low": u["time_ratio_low"], "uniform_high": u["time_ratio_high"],
                    "best_plan": best["policy"] if best else "-", "plan_peak": best["peak_bytes"] if best else None,
                    "plan_ratio": best["time_ratio"] if best else None,
                    "plan_low": best["time_ratio_low"] if best else None,
                    "plan_high": best["time_ratio_high"] if best else None,
                    "dominated": verdict == "plan faster", "verdict": verdict})
    speedup = {"speedup_at_full_peak": None, "speedup_at_full_peak_low": None, "speedup_at_full_peak_high": None,
               "speedup_verdict": None}
    if best_at_full is not None:
        ratio, low, high = full_over_plan
        speedup = {**with_interval("speedup_at_full_peak", ratio - 1, low - 1, high - 1),
                   "speedup_verdict": time_verdict(1 / high, 1 / low)}
    saved_total = none["peak_bytes"] - full["peak_bytes"]
    return {
        "best_plan_at_full_peak": best_at_full["policy"] if best_at_full else None, **speedup,
        "selective_fraction_of_full_peak_savings": share(none["peak_bytes"] - sel["peak_bytes"], saved_total),
        "selective_fraction_of_full_saved_bytes": share(none["saved_activation_bytes"] - sel["saved_activation_bytes"],
                                                        none["saved_activation_bytes"] - full["saved_activation_bytes"]),
        **with_interval("selective_overhead", sel["overhead"], sel["overhead_low"], sel["overhead_high"]),
        **with_interval("full_overhead", full["overhead"], full["overhead_low"], full["overhead_high"]),
        "dominance": dom,
    }


# --------------------------------------------------------------------------- 3. what fits

LLAMA = """
import json, resource, time
t = time.perf_counter()
from ckptlab.estimate.predict import llama7b_shape
from ckptlab.plan.budget import predict
out = {}
for policy in ("none", "full", "selective"):
    p = predict(llama7b_shape(), 8, 4096, policy, dtype="bf16")
    out[policy] = {"peak": p.peak_bytes, "saved": p.saved_activation_bytes, "s": p.predict_s}
out["total_s"] = time.perf_counter() - t
out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""


def llama_cost() -> dict:
    out = subprocess.run([sys.executable, "-c", LLAMA], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def fits_table(quick: bool) -> list[dict]:
    # GPT-3 XL shape (1.3B, 24 blocks, width 2048, no dropout) in bf16 autocast with AdamW (fp32
    # master weights and state: 16 B/parameter before any activation).
    # --quick: the same width with 2 blocks, the smallest run of every step.
    workload = get_workload("gpt2-small", n_layer=2 if quick else 24, n_embd=2048, n_head=16, vocab_size=50257,
                            block_size=8192, dropout=0.0)
    policies = ["none", "full"] if quick else ["none", "selective", "density=0.5", "segments=sqrt", "full"]
    return predict_fits(workload, policies, seq_len=2048, batch_size=1, dtype="bf16", max_batch=8 if quick else 512,
                        seq_lens=[512] if quick else [512, 1024, 2048, 4096, 8192])


# --------------------------------------------------------------------------- 4. compile:budget

def compile_investigation(quick: bool) -> list[dict]:
    """mlp-chain with activations >> parameters. Known answers first: eager none / full, where
    the live-tensor tracker is ground truth, measured with the same allocator accounting."""

    workload = get_workload("mlp-chain", n_layer=4, n_embd=64)
    b, s = 32, 256
    rows = []
    for policy in ["none", "full", "compile:budget=1.0", "compile:budget=0.5", "compile:budget=0.0"]:
        pol = parse_policy(policy)
        with fresh_compiler_cache(pol.compiles):
            model = workload.build()
            run, _, _ = apply_policy(model, pol)  # compile:budget=B compiles with that activation_memory_budget
            batch = workload.batch(b, s)
            opt = make_optimizer("adamw", model)
            step = training_step(run, workload, batch, opt)
            step()
            tracker_peak = tracker_saved = None
            if pol.kind != "compile":
                with track_memory(model, opt, inputs=batch) as tracker:
                    step(tracker)
                tracker_peak = tracker.report().peak_bytes
                tracker_saved = tracker.report().saved_activation_bytes
            report, _ = allocator_step_memory(step, model, opt, batch, torch.device("cpu"))
            timing = time_steps(step, steps=5, warmup=0)  # alone, not compared: its interval only
        # Where in backward is the peak? Fraction of backward's allocator events before it.
        bwd = [(i, v) for i, (ph, v) in enumerate(report.timeline) if ph == "backward"]
        peak_i = max(bwd, key=lambda x: x[1])[0] if bwd else None
        frac = (peak_i - bwd[0][0]) / max(1, len(bwd)) if bwd else None
        rows.append({"policy": policy, "tracker_peak": tracker_peak, "allocator_peak": report.peak_bytes,
                     "tracker_saved": tracker_saved, "allocator_saved": report.saved_activation_bytes,
                     "peak_phase": report.peak_phase, "peak_at_backward_fraction": frac,
                     "step_ms": timing.step_ms["step"], "step_ms_low": timing.step_ms_low["step"],
                     "step_ms_high": timing.step_ms_high["step"],
                     # bytes the backward materialises above what forward left for it
                     "backward_rise": report.peak_bytes - report.start_bytes - (report.saved_activation_bytes or 0)})
    return rows


def backward_graph_order() -> dict:
    """Where does the partitioner put recomputation? Capture AOTAutograd's joint-partitioned
    backward graph (same min-cut partitioner inductor uses, eager-executed) for a 4-block
    mlp-chain and list the positions of the forward ops (addmm, relu) it re-runs."""
    import torch._functorch.config as fc
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    workload = get_workload("mlp-chain", n_layer=4, n_embd=16)
    out = {}
    for budget in (1.0, 0.5, 0.0):
        graphs = {}

        def keep(name):
            def compiler(gm, inputs):
                graphs[name] = gm
                return make_boxed_func(gm.forward)
            return compiler

        with fresh_compiler_cache(), fc.patch(activation_memory_budget=budget):
            backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                                   partition_fn=min_cut_rematerialization_partition)
            workload.loss(torch.compile(workload.build(), backend=backend), workload.batch(2, 8)).backward()
        names = [str(n.target) for n in graphs["bw"].graph.nodes if n.op == "call_function"]
        recompute = [i for i, n in enumerate(names) if n in ("aten.addmm.default", "aten.relu.default")]
        grads = [i for i, n in enumerate(names) if n == "aten.threshold_backward.default"]
        out[budget] = {"bw_ops": len(names), "recompute_positions": recompute,
                       "first_relu_grad": grads[0] if grads else None}
    return out


def compile_dropout_check() -> dict:
    """gpt-tiny with dropout: compile:budget=0.5 vs 1.0 gradients, under inductor's own RNG and
    under fallback_random (eager RNG)."""
    import torch._functorch.config as fc
    import torch._inductor.config as ic

    workload = get_workload("gpt-tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64, dropout=0.2)
    batch = workload.batch(2, 16)

    def grads(budget, fallback):
        model = workload.build().train()
        with fresh_compiler_cache(), fc.patch(activation_memory_budget=budget), ic.patch(fallback_random=fallback):
            torch.manual_seed(0)
            workload.loss(torch.compile(model), batch).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    out = {}
    for fallback in (False, True):
        g1, g05 = grads(1.0, fallback), grads(0.5, fallback)
        out[f"fallback_random={fallback}"] = max((g05[n] - g1[n]).abs().max().item() for n in g1)
    return out


# --------------------------------------------------------------------------- main

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest setting: every section at toy size "
                        "(a smoke run; its numbers are not the claims)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--target-ci", type=float, default=0.02,
                        help="frontier timing: stop when every time ratio's interval is within ±this")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="frontier timing: or after this many seconds (default 30 with --quick, else 120)")
    parser.add_argument("--out", default=None, help="write every table as JSON here")
    parser.add_argument("--skip-compile", action="store_true", help="skip torch.compile runs (slow on CPU)")
    parser.add_argument("--sections", default="1,2,3,4", help="which sections to run, e.g. 2,4")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 is steadiest on a shared machine)")
    args = parser.parse_args(argv)
    if args.max_seconds is None:
        args.max_seconds = 30 if args.quick else 120
    check_timing_options(args.target_ci, args.max_seconds)
    if args.threads < 1:
        parser.error(f"--threads {args.threads} is invalid: allowed is an integer >= 1")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    result = {}
    sections = set(args.sections.split(","))
    if "1" in sections:
        section_prediction(args, result)
    if "2" in sections:
        section_frontier(args, result)
    if "3" in sections:
        section_fits(args, result)
    if "4" in sections and not args.skip_compile:
        section_compile(args, result)
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=lambda o: str(o))


def section_prediction(args, result) -> None:
    print("== 1. predicted vs measured peak (fake tensors vs live-tensor tracker), closed form beside ==")
    pred_rows = prediction_table(args.quick)
    result["prediction"] = pred_rows
    print(format_table(pred_rows, [
        ("model", "model", str), ("b", "batch", str), ("s", "seq", str), ("policy", "policy", policy_label),
        ("dtype", "dtype", str), ("measured", "measured_peak", mib), ("predicted", "predicted_peak", mib),
        ("error", "error", pct), ("saved err", "saved_error", pct), ("closed form err", "cf_error", pct),
        ("cf saved err", "cf_saved_error", pct), ("predict s", "predict_s", lambda v: f"{v:.2f}")]))
    worst = max(pred_rows, key=lambda r: abs(r["error"]))
    cf = [r for r in pred_rows if r["cf_error"] is not None]
    print(f"worst prediction error: {worst['error']:+.3%} ({policy_label(worst['policy'])} b={worst['batch']} s={worst['seq']}) "
          f"over {len(pred_rows)} configurations; closed form: peak error "
          f"{min(r['cf_error'] for r in cf):+.1%}..{max(r['cf_error'] for r in cf):+.1%}, "
          f"saved-activation error {min(r['cf_saved_error'] for r in cf):+.1%}..{max(r['cf_saved_error'] for r in cf):+.1%}")


def section_frontier(args, result) -> None:
    print(f"\n== 2. measured frontier: gpt-tiny b={args.batch} s={args.seq}, fp32, every policy timed together: "
          "median step time and time ratio to none (paired per round), each with its 95% interval ==")
    rows, ctx = frontier(args.quick, args.batch, args.seq, args.target_ci, args.max_seconds, not args.skip_compile)
    for name, plan in ctx["plans"].items():
        print(f"{name}:\n{plan}")
    t = ctx["timing"]
    print(f"{t['rounds']} interleaved rounds, stopped by {t['timing_stopped']} (widest interval "
          f"±{t['timing_ci_half_width']:.1%}, target ±{t['timing_target_ci']:.1%}), {t['threads']} threads, "
          f"load {t['load_before']:.1f} -> {t['load_after']:.1f}{' (busy)' if t['busy'] else ''}")
    shown = [{**r, "step": interval(r, "step_ms", "{:.1f}"), "overhead_ci": interval(r, "overhead", "{:+.1%}")}
             for r in rows]
    print(format_table(shown, [
        ("policy", "policy", policy_label), ("from", "from", policy_label), ("peak", "peak_bytes", mib),
        ("predicted", "predicted_peak_bytes", mib), ("error", "error", pct),
        ("saved", "saved_activation_bytes", mib), ("step ms [95% CI]", "step", str),
        ("overhead [95% CI]", "overhead_ci", str),
        ("pareto", "pareto", lambda v: "*" if v else ""), ("status", "status", str)]))
    summary = frontier_summary(rows)
    result["frontier"], result["frontier_summary"], result["frontier_timing"] = rows, summary, t
    dominance = [{**d, "uniform_ci": interval(d, "uniform", "{:.3f}", value="uniform_ratio"),
                  "plan_ci": interval(d, "plan", "{:.3f}", value="plan_ratio")} for d in summary["dominance"]]
    print(format_table(dominance, [
        ("uniform", "uniform", str), ("peak", "uniform_peak", mib), ("time / none [95% CI]", "uniform_ci", str),
        ("best plan with <= peak", "best_plan", str), ("peak", "plan_peak", mib),
        ("time / none [95% CI]", "plan_ci", str), ("plan vs uniform", "verdict", str)]))
    if summary["best_plan_at_full_peak"] is None:
        print("at the peak of full: no plan reaches it")
    else:
        print(f"at the peak of full: best plan {summary['best_plan_at_full_peak']}, full's time over the plan's "
              f"(paired) - 1: {interval(summary, 'speedup_at_full_peak', '{:+.1%}')}: {summary['speedup_verdict']}")
    peak_share, saved_share = (summary[f"selective_fraction_of_full_{k}"] for k in ("peak_savings", "saved_bytes"))
    print(f"selective gets {'-' if peak_share is None else f'{peak_share:.0%}'} of full's peak savings "
          f"({'-' if saved_share is None else f'{saved_share:.0%}'} of its saved-activation savings) at "
          f"{interval(summary, 'selective_overhead', '{:+.1%}')} overhead "
          f"(full: {interval(summary, 'full_overhead', '{:+.1%}')})")


def interval(row: dict, name: str, fmt: str, value: str | None = None) -> str:
    """`value [low, high]` from row[value or name], row[name_low], row[name_high]; "-" where not timed."""
    v = row.get(value or name)
    if v is None:
        return "-"
    return f"{fmt.format(v)} [{fmt.format(row[f'{name}_low'])}, {fmt.format(row[f'{name}_high'])}]"


def section_fits(args, result) -> None:
    shape = "2 x 2048 (--quick)" if args.quick else "GPT 1.3B shape (24 x 2048)"
    print(f"\n== 3. what fits, by prediction: {shape}, bf16 autocast, AdamW ==")
    fits = fits_table(args.quick)
    result["predict_fits"] = fits
    print(format_table(fits, [("policy", "policy", str), ("card", "capacity", str),
                              ("max batch @ seq 2048", "max_batch_size", str),
                              ("margin left", "batch_margin_bytes", format_bytes),
                              ("with cache flushes", "max_batch_size_with_flushes", str),
                              ("max seq @ batch 1", "max_seq_len", str)]))
    if args.quick:
        print("Llama-7B-shaped GPT cost: not run with --quick")
        return
    llama = llama_cost()
    result["llama7b"] = llama
    print("Llama-7B-shaped GPT (6.7B) at batch 8, seq 4096, bf16, fresh process: "
          + ", ".join(f"{p} peak {mib(llama[p]['peak'])} ({llama[p]['s']:.1f} s)" for p in ("none", "full", "selective"))
          + f"; whole process {llama['total_s']:.1f} s incl. import, max RSS {mib(llama['max_rss'])}")


def section_compile(args, result) -> None:
    print("\n== 4. compile:budget on mlp-chain (4 x 64, b=32, s=256): allocator-level accounting ==")
    comp = compile_investigation(args.quick)
    result["compile"] = comp
    shown = [{**r, "step": interval(r, "step_ms", "{:.1f}")} for r in comp]
    print(format_table(shown, [
        ("policy", "policy", str), ("tracker peak", "tracker_peak", mib), ("allocator peak", "allocator_peak", mib),
        ("tracker saved", "tracker_saved", mib), ("allocator saved", "allocator_saved", mib),
        ("backward rise", "backward_rise", mib), ("peak in", "peak_phase", str),
        ("peak at % of bwd", "peak_at_backward_fraction", lambda v: "-" if v is None else f"{v:.0%}"),
        ("step ms [95% CI]", "step", str)]))
    order = backward_graph_order()
    result["compile_bw_order"] = order
    for budget, o in order.items():
        rc = o["recompute_positions"]
        print(f"budget {budget}: backward graph of {o['bw_ops']} ops re-runs {len(rc)} forward ops"
              + (f" at positions {rc[0]}..{rc[-1]}, "
                 f"{'all before the first relu gradient at' if rc[-1] < o['first_relu_grad'] else 'the first relu gradient at'} position "
                 f"{o['first_relu_grad']}" if rc else ""))
    drop = compile_dropout_check()
    result["compile_dropout"] = drop
    print("gpt-tiny with dropout, max |grad(compile:budget=0.5) - grad(compile:budget=1.0)|: "
          + ", ".join(f"{k}: {v:.3g}" for k, v in drop.items()))


if __name__ == "__main__":
    main()
