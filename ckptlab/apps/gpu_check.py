"""GPU validation (`make gpu-check`): ckptlab's claims about a GPU, tested in one command within
a stated time budget (BUDGET_S), into results/gpu-check-<device>/ with a report.md that says pass
or fail per claim. The verdicts are computed by `ckptlab.report.gpu_validation` (tested on CPU);
the claims, and how the budget is kept: docs/design.md, note "The GPU check".

Without a CUDA device it exits with status 2 and one line; it never pretends to pass. Exit status
on a GPU: 0 every claim passed, 1 one failed, 3 one was skipped for time (not tested).
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from torch.utils.checkpoint import get_device_states

from ..core.children import child_environment, die_with_parent
from ..core.policy import Policy
from ..estimate.fake_step import fake_training_step
from ..plan.budget import measure, predict
from ..probe.memory import cuda_memory_snapshot, saved_bytes_by_node
from ..probe.step import DTYPES
from ..report.gpu_validation import (
    FAIL,
    FRONTIER_CLAIM,
    MEMORY_MEASURED_CLAIM,
    MEMORY_PREDICTED_CLAIM,
    OVERHEAD_CLAIM,
    TRAINER_CLAIM,
    Claim,
    allocator_gap,
    exit_status,
    frontier_claim,
    frontier_rows,
    memory_measured_claim,
    memory_predicted_claim,
    overhead_claim,
    prediction_errors,
    report_markdown,
    saved_differences,
    skipped,
    trainer_claim,
)
from ..report.plots import compare_plot
from ..run.compare import compare
from ..run.provenance import environment, source_commit
from ..workloads.registry import get_workload

BUDGET_S = 450.0          # from main() on: with the interpreter's start and the report, within 8 minutes
REPORT_RESERVE_S = 15.0   # kept back for writing the report when the alarm stops a stage

MEMORY = dict(model="gpt2-small", batch_size=8, seq_len=1024, dtype="bf16",
              policies=("none", "selective", "density=0.5", "full"), dropouts=(0.0, 0.1))
OVERHEAD_TIMING_S = 60.0  # its rounds stop earlier at ±0.3%, enough to show +1% on a steady GPU
OVERHEAD_ARGS = ["--model", "gpt2-small", "--batch", "8", "--seq", "1024", "--target-ci", "0.003", "--threads", "1"]
TRAINER = dict(model="hf-llama-1b", batch_size=2, seq_len=1024, accum_steps=1, max_steps=20, track_steps=1)
FRONTIER = dict(model="hf-llama-1b", batch_size=4, seq_len=2048, dtype="bf16")
# (group, ckptlab policies, anchors by their labels in run.compare.anchor_configs); plans at each
# anchor's peak join its group. In order of what matters most if time runs short. Compiled groups'
# gradients are not checked (`verify` would compile every model a second time; compiled graphs
# round differently and are reported, not judged, anyway).
GROUPS = (
    ("ckptlab", ("none", "full", "selective", "density=0.5"), ()),
    ("anchors-torch", ("none",), ("torch.utils.checkpoint per block", "transformers checkpointing (every layer)")),
    ("compiled", ("none", "compile"), ("torch.compile activation_memory_budget=0.5",)),
    ("ckptlab-more", ("none", "segments=sqrt", "every=2", "full+offload"), ()),
    ("anchors-transformers", ("none",), ("transformers every_n_layers=2", "transformers + torch SAC (context_fn)")),
    ("compiled-budget", ("none", "compile:budget=0.5"), ()),
)
COMPARE_TIMING_S = 30.0   # timing rounds per group, at most (GPU steps are steady: ±2% comes early)

# Prior estimates (seconds) until the check has timed a stage of the kind itself.
ESTIMATES = dict(memory_cell=12.0, overhead=90.0, trainer=90.0, compare_config=30.0, compile=75.0, snapshot=20.0)


class BudgetExceeded(BaseException):
    """Raised by the alarm when the budget is spent, wherever the check is. Not an Exception, so
    that no `except Exception` on the way (a measurement records its failures) can swallow it."""


class TimeBudget:
    """The check's stated budget, read as it goes: `left()`, `fits(seconds)` before a stage
    starts, `reason(seconds)` for one that is skipped. `clock` is a test's to replace."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock, self.start = float(seconds), clock, clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()

    def reason(self, seconds: float) -> str:
        return f"needs about {seconds:.0f} s, {max(self.left(), 0):.0f} s of the {self.seconds:.0f} s budget left"


def group_estimate(n_configs: int, n_compiled: int, per_config_s: float, compile_s: float,
                   timing_s: float = COMPARE_TIMING_S) -> float:
    """Seconds a comparison group needs: each configuration built, measured (and verified), each
    compiled one compiled, and the timing rounds."""
    return n_configs * per_config_s + n_compiled * compile_s + timing_s


def run_dir_name(device_name: str) -> str:
    return "gpu-check-" + (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "cuda")


# ----------------------------------------------------------------------------- CUDA measurements

def fresh_allocator(dev: torch.device) -> None:
    """Nothing of an earlier cell left: its tensors collected, the cuBLAS workspaces released and
    the cache emptied, so each cell's allocator counts its own library workspaces."""
    gc.collect()
    torch.cuda.synchronize(dev)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def library_workspace_bytes(dev: torch.device) -> int:
    """Bytes the libraries (cuBLAS, cuBLASLt, the attention kernels) keep in the caching
    allocator after a forward and backward of matmuls and attention, fp32 and bf16, with every
    tensor of the probe freed. Measured the second time: whatever `fresh_allocator` cannot
    release is resident in a cell too, and so not part of its difference."""
    held = 0
    for _ in range(2):
        fresh_allocator(dev)
        base = torch.cuda.memory_allocated(dev)
        layer = torch.nn.Linear(256, 256, device=dev)
        x = torch.randn(2, 4, 64, 256, device=dev, requires_grad=True)
        for autocast in (contextlib.nullcontext(), torch.autocast("cuda", dtype=torch.bfloat16)):
            with autocast:
                q = layer(x)
                y = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            y.float().sum().backward()
        del layer, x, q, y
        gc.collect()
        torch.cuda.synchronize(dev)
        held = torch.cuda.memory_allocated(dev) - base
    return held


def rng_state_bytes(dev: torch.device) -> int:
    """Device bytes one saved RNG state holds: what `torch.utils.checkpoint` keeps per region
    (`get_device_states`, as its forward calls it)."""
    x = torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    states = get_device_states(x)
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev) - base
    del states
    return held


# ----------------------------------------------------------------------------- stages

def memory_cell(workload, policy: str, dropout: float, dev: torch.device) -> dict:
    """One cell: measured on CUDA (its time is not a claim here), then predicted on CPU."""
    fresh_allocator(dev)
    record = measure(workload, MEMORY["batch_size"], MEMORY["seq_len"], policy, device=str(dev),
                     dtype=MEMORY["dtype"], steps=2, warmup=1, max_seconds=0.1)
    record["dropout"] = dropout
    if record["status"] == "ok":
        p = predict(workload, MEMORY["batch_size"], MEMORY["seq_len"], policy, dtype=MEMORY["dtype"])
        record.update(predicted_peak_bytes=p.peak_bytes, predicted_saved_bytes=p.saved_activation_bytes)
    return record


def saved_by_node(workload, dev: torch.device) -> dict[str, int]:
    """What one forward at the memory cells' shape leaves for backward, by autograd node, without
    checkpointing: on `dev` for real, or (dev None) predicted on CPU fake tensors."""
    b, s, dtype = MEMORY["batch_size"], MEMORY["seq_len"], DTYPES[MEMORY["dtype"]]
    if dev is None:
        with fake_training_step(workload, b, s, Policy("none"), MEMORY["dtype"], "none") as (model, _, batch, _, _):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                return saved_bytes_by_node(workload.loss(model, batch))
    model = workload.build(dev).train()
    batch = workload.batch(b, s, dev)
    with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
        return saved_bytes_by_node(workload.loss(model, batch))


def memory_stage(out: Path, dev: torch.device, budget: TimeBudget, notes: list[str]) -> list[Claim]:
    """Claims 1 and 2 from the same cells: each measured on CUDA and predicted on CPU."""
    workspace, rng = library_workspace_bytes(dev), rng_state_bytes(dev)
    notes.append(f"Library workspaces measured on this device: {workspace} B; one saved RNG state: {rng} B of "
                 "device memory.")
    cells, per_cell = [], ESTIMATES["memory_cell"]
    todo = [(dropout, policy) for dropout in MEMORY["dropouts"] for policy in MEMORY["policies"]]
    for k, (dropout, policy) in enumerate(todo):
        if not budget.fits(per_cell + REPORT_RESERVE_S):
            notes.append(f"Memory: {len(todo) - k} cells left out for time ({budget.reason(per_cell)}).")
            break
        t0 = time.monotonic()
        try:
            cells.append(memory_cell(get_workload(MEMORY["model"], dropout=dropout), policy, dropout, dev))
        except BudgetExceeded:
            notes.append("Memory: the time budget ran out during a cell; the claims use the cells before it.")
            break
        per_cell = time.monotonic() - t0
    differences, by_node = {}, []
    for dropout in MEMORY["dropouts"]:   # which op keeps what, side by side, where time allows
        if not budget.fits(per_cell + REPORT_RESERVE_S):
            break
        try:
            workload = get_workload(MEMORY["model"], dropout=dropout)
            fresh_allocator(dev)
            on_cuda, on_cpu = saved_by_node(workload, dev), saved_by_node(workload, None)
        except BudgetExceeded:
            break
        differences[dropout] = saved_differences(on_cpu, on_cuda)
        by_node += [dict(dropout=dropout, node=n, predicted_bytes=on_cpu.get(n, 0), measured_bytes=on_cuda.get(n, 0))
                    for n in dict.fromkeys([*on_cpu, *on_cuda])]
    (out / "memory").mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(cells)
    df.to_csv(out / "memory" / "cells.csv", index=False)
    gaps = allocator_gap(df, workspace, rng)
    gaps.to_csv(out / "memory" / "allocator_gap.csv", index=False)
    measured = memory_measured_claim(gaps)
    with_prediction = df[df["status"] == "ok"] if len(df) else df
    if "predicted_peak_bytes" not in with_prediction or with_prediction.empty:
        return [measured, Claim(MEMORY_PREDICTED_CLAIM, FAIL, "no cell was measured ok on CUDA")]
    pd.DataFrame(by_node).to_csv(out / "memory" / "saved_by_node.csv", index=False)
    errors = prediction_errors(with_prediction, differences=differences)
    errors.to_csv(out / "memory" / "prediction_errors.csv", index=False)
    return [measured, memory_predicted_claim(errors, differences=differences)]


def overhead_stage(out: Path, dev: torch.device, budget: TimeBudget) -> Claim:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "overhead.py"
    if not script.exists():
        return skipped(OVERHEAD_CLAIM, f"{script.name} is not here (benchmarks/ comes with the source tree)")
    folder = out / "overhead"
    folder.mkdir(parents=True, exist_ok=True)
    fresh_allocator(dev)   # the benchmark's process gets the card this one is not using
    timing_s = max(1.0, min(OVERHEAD_TIMING_S, budget.left() - REPORT_RESERVE_S - 30))
    args = [sys.executable, str(script), *OVERHEAD_ARGS, "--device", str(dev), "--max-seconds", f"{timing_s:.0f}",
            "--json", str(folder / "overhead.json")]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=child_environment(),
                              preexec_fn=die_with_parent(), timeout=max(10.0, budget.left() - REPORT_RESERVE_S))
    except subprocess.TimeoutExpired:
        return skipped(OVERHEAD_CLAIM, "benchmarks/overhead.py did not finish in the time left")
    (folder / "overhead.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return Claim(OVERHEAD_CLAIM, FAIL, f"benchmarks/overhead.py exited {proc.returncode}: see overhead/overhead.txt")
    result = json.loads((folder / "overhead.json").read_text())
    return overhead_claim(result["wrapper_ratio"], result["wrapper_low"], result["wrapper_high"])


def trainer_stage(out: Path, dev: torch.device) -> Claim:
    from ..report.analysis import trainer_summary  # noqa: PLC0415 - kept beside the transformers import below
    from ..report.plots import trainer_plot  # noqa: PLC0415 - as above
    from ..run.trainer import TRANSFORMERS_FLAG, compare_trainer_runs  # noqa: PLC0415 - transformers is heavy

    folder = out / "trainer"
    df = compare_trainer_runs(folder, runs=("none", TRANSFORMERS_FLAG), device=dev.type, **TRAINER)
    summary = trainer_summary(df)
    summary.to_csv(folder / "summary.csv", index=False)
    trainer_plot(df, folder / "figures" / "trainer")
    return trainer_claim(summary, TRANSFORMERS_FLAG)


def frontier_stage(out: Path, dev: torch.device, budget: TimeBudget) -> Claim:
    """The groups in order while they fit; the claim from the groups that ran, naming the rest."""
    workload = get_workload(FRONTIER["model"])
    frames, not_run = [], []
    per_config, compile_s = ESTIMATES["compare_config"], ESTIMATES["compile"]
    for k, (name, policies, anchors) in enumerate(GROUPS):
        n_compiled = sum(p.startswith("compile") for p in policies) + sum("compile" in a for a in anchors)
        # an anchor's plan joins its group: count it as one more configuration
        need = group_estimate(len(policies) + 2 * len(anchors), n_compiled, per_config, compile_s)
        if not budget.fits(need + REPORT_RESERVE_S):
            not_run.append(f"{name} ({budget.reason(need)})")
            continue
        fresh_allocator(dev)
        t0 = time.monotonic()
        try:
            df = compare(workload, FRONTIER["batch_size"], FRONTIER["seq_len"], list(policies),
                         dtype=FRONTIER["dtype"], device=str(dev), max_seconds=COMPARE_TIMING_S,
                         anchors=list(anchors), verify=n_compiled == 0, out=out / "compare" / name)
        except BudgetExceeded:
            not_run += [f"{name} (stopped by the time budget while it ran)"] + [g[0] for g in GROUPS[k + 1:]]
            break
        compare_plot(df, out / "compare" / name / "figures" / "compare")
        df.insert(0, "group", name)
        frames.append(df)
        if n_compiled == 0:  # what an eager configuration took here, timing included: the next estimates
            per_config = max(1.0, (time.monotonic() - t0) / max(1, len(df)))
    rows = frontier_rows(pd.concat(frames, ignore_index=True)) if frames else pd.DataFrame()
    if len(rows):
        rows.drop(columns=[c for c in ("round_ms",) if c in rows]).to_csv(out / "compare" / "frontier.csv", index=False)
    return frontier_claim(rows, not_run)


def snapshot_stage(out: Path, dev: torch.device) -> None:
    """A CUDA memory snapshot of one memory cell (snapshot.pickle, for https://pytorch.org/memory_viz):
    where the allocator's bytes went, for reading a rest that the report could not explain."""
    fresh_allocator(dev)
    workload = get_workload(MEMORY["model"], dropout=0.0)
    with cuda_memory_snapshot(str(out / "memory" / "snapshot.pickle")):
        measure(workload, MEMORY["batch_size"], MEMORY["seq_len"], "density=0.5", device=str(dev),
                dtype=MEMORY["dtype"], steps=1, warmup=0, max_seconds=0.1)


# ----------------------------------------------------------------------------- the check

def run_check(out: Path, dev: torch.device, budget: TimeBudget) -> tuple[list[Claim], list[str]]:
    """Every stage in order of priority, each skipped when it does not fit what is left; a stage
    that fails with an exception is a failed claim (its traceback in errors.txt), the others run;
    when the alarm stops a stage, it and the stages after it are skipped."""
    claims: list[Claim] = []
    notes: list[str] = []
    stages = [
        ((MEMORY_MEASURED_CLAIM, MEMORY_PREDICTED_CLAIM), ESTIMATES["memory_cell"] + 10,
         lambda: memory_stage(out, dev, budget, notes)),
        ((OVERHEAD_CLAIM,), ESTIMATES["overhead"], lambda: [overhead_stage(out, dev, budget)]),
        ((TRAINER_CLAIM,), ESTIMATES["trainer"], lambda: [trainer_stage(out, dev)]),
        ((FRONTIER_CLAIM,), 0.0, lambda: [frontier_stage(out, dev, budget)]),
    ]
    stopped = False
    for names, need, stage in stages:
        counts = [n != TRAINER_CLAIM for n in names]
        if stopped or not budget.fits(need + REPORT_RESERVE_S):
            reason = "the time budget was spent by an earlier stage" if stopped else budget.reason(need)
            claims += [skipped(n, reason, c) for n, c in zip(names, counts)]
            continue
        try:
            claims += stage()
        except BudgetExceeded:
            claims += [skipped(n, "stopped by the time budget while it ran", c) for n, c in zip(names, counts)]
            stopped = True
        except Exception as exc:  # noqa: BLE001 - one stage's crash is its claim's failure, not the check's end
            with open(out / "errors.txt", "a") as f:
                f.write(f"--- {', '.join(names)}\n{traceback.format_exc()}\n")
            message = str(exc).splitlines()[0] if str(exc) else ""
            claims += [Claim(n, FAIL, f"{type(exc).__name__}: {message} (errors.txt)", counts=c)
                       for n, c in zip(names, counts)]
    if not stopped and budget.fits(ESTIMATES["snapshot"] + REPORT_RESERVE_S):
        try:
            snapshot_stage(out, dev)
            notes.append("memory/snapshot.pickle: the allocator's history of one cell (gpt2-small b=8 s=1024 "
                         "density=0.5 bf16), for https://pytorch.org/memory_viz.")
        except BudgetExceeded:
            notes.append("No memory snapshot: the time budget ran out while it was taken.")
        except Exception as exc:  # noqa: BLE001 - a diagnosis only: its failure is noted, the report still written
            notes.append(f"No memory snapshot: {type(exc).__name__}: {exc}")
    return claims, notes


@contextlib.contextmanager
def budget_alarm(seconds: float):
    """BudgetExceeded raised in this (the main) thread after `seconds`, wherever it is then."""
    def alarm(signum, frame):
        raise BudgetExceeded()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None, results: str = "results") -> int:
    if argv:
        print(f"gpu-check: arguments={' '.join(argv)!r} are invalid: allowed is none (the check is fixed: "
              "python -m ckptlab.apps.gpu_check)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is available on this machine (torch.cuda.is_available() is False); "
              "this check needs one NVIDIA GPU: run `make gpu-check` on a GPU machine.", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(dev)
    out = Path(results) / run_dir_name(name)
    out.mkdir(parents=True, exist_ok=True)
    budget = TimeBudget(BUDGET_S)
    print(f"gpu-check on {name}: budget {BUDGET_S:.0f} s; writing {out}", flush=True)
    with budget_alarm(BUDGET_S - REPORT_RESERVE_S):
        claims, notes = run_check(out, dev, budget)
    return finish(out, claims, notes, name, budget, environment(str(dev)))


def finish(out: Path, claims: list[Claim], notes: list[str], device: str, budget: TimeBudget, env: dict) -> int:
    """report.md and claims.json (every claim, the environment, the commit) into `out`; the report
    printed; the exit status returned."""
    meta = {"device": device, "budget_s": budget.seconds, "elapsed_s": budget.elapsed(), "commit": source_commit(),
            "environment": env, "claims": [vars(c) for c in claims]}
    (out / "claims.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    report = report_markdown(claims, device, budget.seconds, budget.elapsed(), notes)
    (out / "report.md").write_text(report)
    print(report)
    status = exit_status(claims)
    print({0: "gpu-check passed", 1: "gpu-check FAILED", 3: "gpu-check INCOMPLETE: claims skipped for time"}[status]
          + f": {out / 'report.md'}", file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
