"""GPU validation (`python3 -m ckptlab.apps.gpu_check`, or `make gpu-check`): ckptlab's claims about a
GPU, tested in one command within a stated time budget (BUDGET_S), into
results/gpu-check-<device>/ with a report.md that says pass or fail per claim and what it ran on.
The verdicts are computed by `ckptlab.report.gpu_validation` (tested on CPU); the claims, and how
the budget is kept: docs/design.md, note "The GPU check".

It runs from a checkout with the machine's own Python and torch: it needs nothing but torch to
start, uses the other packages (transformers, pandas, matplotlib, numpy) where they are installed
and skips, saying so, the claims that need one that is not. It installs nothing and downloads
nothing (every model is built from a config, with random weights; Hugging Face is set offline).

Without a CUDA device it exits with status 2 and one line, writing nothing; it never pretends to
pass. Exit status on a GPU: 0 every claim passed, 1 one failed, 3 one was skipped (not tested).
"""

from __future__ import annotations

import contextlib
import csv
import gc
import importlib.util
import json
import multiprocessing
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import get_device_states

from ..core.cards import Card, cards
from ..core.children import child_environment, die_with_parent
from ..core.policy import Policy, parse_policy
from ..core.records import new_record
from ..estimate.cuda_device import DEFAULT_ARCH
from ..estimate.cuda_semantics import cuda_semantics
from ..estimate.torch_versions import torch_rules
from ..plan.budget import plan_budget, predict
from ..probe.measure import failures_recorded, measurement_record, policy_applier, policy_notes, prepare_step
from ..probe.memory import cuda_memory_snapshot, saved_bytes_by_node
from ..probe.step import autocast_dtype
from ..report.gpu_validation import (
    ALLOCATED_CLAIM,
    FAIL,
    FRONTIER_CLAIM,
    MEMORY_MEASURED_CLAIM,
    OVERHEAD_CLAIM,
    RESERVED_CLAIM,
    TRAINER_CLAIM,
    Claim,
    allocator_gap,
    attention_backend_of,
    cell_label,
    exit_status,
    frontier_claim,
    memory_measured_claim,
    memory_predicted_claim,
    overhead_claim,
    prediction_errors,
    report_markdown,
    skipped,
    trainer_claim,
)
from ..run.provenance import environment, source_commit
from ..workloads.registry import get_workload

BUDGET_S = 450.0          # from main() on: with the interpreter's start and the report, within 8 minutes
REPORT_RESERVE_S = 15.0   # kept back for writing the report when the alarm stops a stage

# The memory cells: (label, workload spec, config overrides, batch, seq), each policy, each
# attention dropout, in bf16, with the attention kernel the card picks (flash on sm80 / sm89; on
# sm90 cuDNN where the torch prefers it, except with dropout 0.1, which cuDNN refuses from 2.12). PLAN stands for the planner's plan (for
# CUDA) at the budget halfway between the peaks predicted for the model's none and full without
# dropout. Small model first, the plans' cells last: if time runs short, both models have cells.
SMALL_LLAMA = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048)
PLAN = "plan"
MEMORY = dict(models=(("small Llama", "hf-llama-tiny", SMALL_LLAMA, 8, 1024), ("hf-llama-1b", "hf-llama-1b", {}, 2, 2048)),
              dtype="bf16", loop="adamw", policies=("none", "full", "selective", PLAN), dropouts=(0.0, 0.1))
OVERHEAD_TIMING_S = 60.0  # its rounds stop earlier at ±0.3%, enough to show +1% on a steady GPU
OVERHEAD_ARGS = ["--model", "gpt2-small", "--batch", "8", "--seq", "1024", "--target-ci", "0.003", "--threads", "1"]
TRAINER = dict(model="hf-llama-1b", batch_size=2, seq_len=1024, accum_steps=1, max_steps=20, track_steps=1)
FRONTIER = dict(model="hf-llama-1b", batch_size=4, seq_len=2048, dtype="bf16")
# (group, ckptlab policies, anchors by their labels in run.anchors.anchor_configs); plans at each
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

# What each stage imports beyond torch: a stage whose packages are not all installed is skipped.
NEEDS = dict(memory=("transformers",), overhead=("numpy",), trainer=("transformers", "accelerate", "pandas", "matplotlib"),
             frontier=("transformers", "numpy", "pandas", "matplotlib"), snapshot=("transformers",))
# The packages whose versions report.md names (None: not installed).
REPORTED_PACKAGES = ("transformers", "accelerate", "peft", "numpy", "pandas", "matplotlib", "papermill", "nbformat")


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


def missing(packages) -> list[str]:
    """The packages of `packages` that cannot be imported here (looked up, not imported)."""
    return [p for p in packages if importlib.util.find_spec(p) is None]


def versions() -> dict:
    """What the check runs on, for report.md: Python, torch (with its CUDA), and each of
    REPORTED_PACKAGES' version or None."""
    found = {"Python": platform.python_version(), "torch": f"{torch.__version__} (CUDA {torch.version.cuda})"}
    for name in REPORTED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def write_csv(rows: list[dict], path: Path) -> None:
    """Records as a CSV file (every key of every row a column), with the standard library only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)


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

def memory_workload(spec: str, overrides: dict, dropout: float):
    return get_workload(spec, **overrides, attention_dropout=dropout)


# Predictions run on CPU fake tensors while the GPU measures: in worker processes (spawned, so no
# CUDA state is inherited), each handed everything it needs (a worker does not see MEMORY).

def predicted(spec: str, overrides: dict, dropout: float, batch_size: int, seq_len: int, policy: str, dtype: str,
              loop: str, card: Card | None) -> dict:
    """One cell's `predict(device="cuda", card=card)` as record columns; a prediction that fails is
    the cell's `prediction_message`, which fails its claims with the reason."""
    try:
        p = predict(memory_workload(spec, overrides, dropout), batch_size, seq_len, policy, dtype=dtype,
                    loop=loop, device="cuda", card=card)
    except Exception as exc:  # noqa: BLE001 - the cell's claims fail with the reason; the others go on
        return {"prediction_message": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return dict(predicted_peak_bytes=p.peak_bytes, predicted_reserved_bytes=p.reserved_bytes,
                predicted_device_bytes=p.device_bytes, predicted_backend=p.attention_backend,
                predicted_saved_bytes=p.saved_activation_bytes)


def midpoint_plan(spec: str, overrides: dict, dropout: float, batch_size: int, seq_len: int, dtype: str,
                  loop: str, card: Card | None) -> str:
    """The planner's plan for CUDA at the budget halfway between the peaks predicted for none and
    full. Its recompute costs are the roofline's: which plan it is matters here, not what it
    costs, and timing blocks on a CPU takes long."""
    workload = memory_workload(spec, overrides, dropout)
    none, full = (predict(workload, batch_size, seq_len, p, dtype=dtype, loop=loop, device="cuda",
                          card=card).peak_bytes for p in ("none", "full"))
    plan = plan_budget(workload, batch_size, seq_len, (none + full) // 2, dtype=dtype, loop=loop,
                       cost="roofline", device="cuda", card=card)
    return str(plan.policy)


WORKER_START_S = 90.0     # a spawned worker imports torch, ckptlab and transformers: seconds, not minutes


def card_of(dev: torch.device) -> Card | None:
    """The card of the table this device is: its compute capability (which decides the attention
    kernels and cuBLAS's workspace), the nearest usable bytes; None when no card has its
    capability (the prediction's default card then)."""
    if dev.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(dev)
    same = [c for c in cards() if c.compute_capability == (props.major, props.minor)]
    return min(same, key=lambda c: abs(c.usable_bytes - props.total_memory), default=None)


# The attention call whose kernel the report names: a Llama-like head (bf16, causal, head dim 64,
# no mask, no dropout), with grad.
KERNEL_PROBE = dict(shape=(1, 8, 1024, 64), dtype=torch.bfloat16)


def default_attention_kernel(dev: torch.device) -> str:
    """The kernel scaled_dot_product_attention runs on `dev` for KERNEL_PROBE by default, read from
    its autograd nodes."""
    q = torch.randn(*KERNEL_PROBE["shape"], dtype=KERNEL_PROBE["dtype"], device=dev, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    return attention_backend_of(list(saved_bytes_by_node(out.float().sum()))) or "not known"


def predicted_attention_kernel(card: Card | None, torch_version: str | None = None) -> str:
    """The kernel ckptlab's CUDA model picks for KERNEL_PROBE on `card` (None: the default card's
    architecture), under the rules of `torch_version` (default: this torch's)."""
    with FakeTensorMode(), cuda_semantics(card.arch if card else DEFAULT_ARCH, torch_version=torch_version) as cuda:
        q = torch.randn(*KERNEL_PROBE["shape"], dtype=KERNEL_PROBE["dtype"], requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    return cuda.attention_backend


def attention_kernel_note(dev: torch.device, card: Card | None) -> str:
    """report.md's line naming the attention kernel this card runs by default and the one predicted."""
    measured = default_attention_kernel(dev) if dev.type == "cuda" else "not measured (no CUDA device)"
    return (f"Attention kernel this card picks by default (bf16, causal, head dim 64, torch {torch.__version__}): "
            f"{measured}; ckptlab predicts {predicted_attention_kernel(card)} for it (torch "
            f"{torch_rules().version}'s rules). Each memory cell's kernel is compared in the allocated claim.")


def prediction_workers() -> int:
    """Worker processes for the predictions: the CPUs but two (the measuring process and the GPU's
    driver), at most eight (each holds a fake model; a GPU host has 16 cores or more)."""
    return max(1, min(8, (os.cpu_count() or 1) - 2))


def memory_cell(workload, batch_size: int, seq_len: int, policy: str, dropout: float, dev: torch.device) -> dict:
    """One cell measured on CUDA: one step as `measure` takes it, without its timing, its allocator
    peaks counted from what the device held before it."""
    fresh_allocator(dev)
    dtype, loop = MEMORY["dtype"], MEMORY["loop"]
    record, workload, parsed, dev, limit = measurement_record(workload, batch_size, seq_len, parse_policy(policy), device=str(dev),
                                                              dtype=dtype, loop=loop)
    record["dropout"] = dropout
    reserved_before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    with failures_recorded(record, dev):
        policy_notes(record, parsed, dev)
        prepare_step(record, workload, policy_applier(parsed), dev, dtype, limit, loop)
        if dev.type == "cuda":  # as prepare_step takes out what the device allocated before
            record["cuda_max_reserved_bytes"] -= reserved_before
    return record


def backend_on_cuda(workload, batch_size: int, seq_len: int, dev: torch.device) -> str | None:
    """The attention backend one forward of `workload` ran on `dev` (from its autograd nodes); a
    forward that fails gives "not known: <why>", which no prediction matches."""
    fresh_allocator(dev)
    try:
        model = workload.build(dev).train()
        batch = workload.batch(batch_size, seq_len, dev)
        with torch.autocast(dev.type, dtype=autocast_dtype(MEMORY["dtype"])):
            return attention_backend_of(list(saved_bytes_by_node(workload.loss(model, batch))))
    except Exception as exc:  # noqa: BLE001 - the cells' allocated claim fails with the reason
        return f"not known: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def memory_stage(out: Path, dev: torch.device, budget: TimeBudget, notes: list[str]) -> list[Claim]:
    """The memory claims from the same cells: each measured on CUDA (the tracker against the
    allocator) and predicted with CUDA semantics (allocated and reserved against the allocator's).
    Cells are measured in order while they fit, their predictions made meanwhile by worker
    processes; the cells left out, or not predicted in the time, are named in the claims."""
    workspace, rng = library_workspace_bytes(dev), rng_state_bytes(dev)
    notes.append(f"Library workspaces measured on this device: {workspace} B; one saved RNG state: {rng} B of "
                 "device memory.")
    dtype, loop, card = MEMORY["dtype"], MEMORY["loop"], card_of(dev)
    notes.append(f"Predicted for the card {card.label if card else 'of no entry of the table (the default card)'}.")
    # The plans' cells last: their plans are made (in a worker) while the GPU measures the others.
    todo = sorted([(model, dropout, policy) for model in MEMORY["models"] for dropout in MEMORY["dropouts"]
                   for policy in MEMORY["policies"]], key=lambda cell: cell[2] == PLAN)
    cells, pending, not_run, backends, per_cell = [], [], [], {}, ESTIMATES["memory_cell"]
    with multiprocessing.get_context("spawn").Pool(prediction_workers()) as pool:   # terminated on the way out
        try:   # a worker that cannot start is respawned for ever: that is a failure, not a wait
            pool.apply_async(os.getpid).get(WORKER_START_S)
        except multiprocessing.TimeoutError:
            raise RuntimeError(f"the prediction workers did not start within {WORKER_START_S:.0f} s") from None
        plans = {label: pool.apply_async(midpoint_plan, (spec, overrides, MEMORY["dropouts"][0], b, s, dtype, loop,
                                                         card))
                 for label, spec, overrides, b, s in MEMORY["models"] if PLAN in MEMORY["policies"]}
        predictions = {(label, dropout, policy): pool.apply_async(predicted, (spec, overrides, dropout, b, s, policy,
                                                                              dtype, loop, card))
                       for (label, spec, overrides, b, s), dropout, policy in todo if policy != PLAN}
        for k, ((label, spec, overrides, batch_size, seq_len), dropout, policy) in enumerate(todo):
            if k and label != todo[k - 1][0][0]:   # another model: what a cell of the last one took is no estimate
                per_cell = max(per_cell, ESTIMATES["memory_cell"])
            if not budget.fits(per_cell + REPORT_RESERVE_S):
                not_run.append(f"{len(todo) - k} cells from {label} {policy} dropout={dropout:g} on "
                               f"({budget.reason(per_cell)})")
                break
            t0 = time.monotonic()
            try:
                workload = memory_workload(spec, overrides, dropout)
                key = (label, dropout, policy)
                if policy == PLAN:
                    try:
                        policy = plans[label].get(max(0.1, budget.left() - 2 * REPORT_RESERVE_S))
                    except multiprocessing.TimeoutError:
                        not_run.append(f"{len(todo) - k} cells from {label} {PLAN} dropout={dropout:g} on (no plan "
                                       "within the time budget)")
                        break
                    except Exception as exc:  # noqa: BLE001 - the plan's cells fail their claims, saying why
                        policy = exc
                    if isinstance(policy, str):
                        predictions[key] = pool.apply_async(predicted, (spec, overrides, dropout, batch_size, seq_len,
                                                                        policy, dtype, loop, card))
                if (label, dropout) not in backends:
                    backends[label, dropout] = backend_on_cuda(workload, batch_size, seq_len, dev)
                cell = (memory_cell(workload, batch_size, seq_len, policy, dropout, dev) if isinstance(policy, str) else
                        new_record(workload.label, batch_size, seq_len, loop, policy=PLAN, dtype=dtype, dropout=dropout,
                                   status="error", message=f"no plan: {type(policy).__name__}: {policy}"))
            except BudgetExceeded:
                not_run.append(f"{len(todo) - k} cells from {label} {policy} dropout={dropout:g} on (stopped by the "
                               "time budget while it ran)")
                break
            cells.append(dict(cell, measured_backend=backends[label, dropout]))
            pending.append(predictions.get(key))
            per_cell = time.monotonic() - t0
        for cell, prediction in zip(list(cells), pending):   # the claims are written before the alarm
            if prediction is None or cell["status"] != "ok":
                continue
            try:
                cell.update(prediction.get(max(0.1, budget.left() - 2 * REPORT_RESERVE_S)))
            except (multiprocessing.TimeoutError, BudgetExceeded):
                cells.remove(cell)
                not_run.append(f"{cell_label(cell)} (not predicted within the time budget)")
            except Exception as exc:  # noqa: BLE001 - a worker that failed: the cell's claims fail with why
                cell["prediction_message"] = f"{type(exc).__name__}: {exc}"
    if dev.type == "cuda":   # reported beside the card table's estimate, not judged
        free, total = torch.cuda.mem_get_info(dev)
        outside = total - free - torch.cuda.memory_reserved(dev)
        notes.append(f"Outside the caching allocator (CUDA context, kernel images) the device holds {outside} B after "
                     "the memory cells (total - free - reserved; other processes on the card count too); the card "
                     f"table estimates {card.context_bytes if card else '-'} B.")
    write_csv(cells, out / "memory" / "cells.csv")
    gaps = allocator_gap(cells, workspace, rng)
    write_csv(gaps, out / "memory" / "allocator_gap.csv")
    errors = prediction_errors(cells)
    write_csv(errors, out / "memory" / "prediction_errors.csv")
    return [memory_measured_claim(gaps), memory_predicted_claim(errors, "allocated", not_run),
            memory_predicted_claim(errors, "reserved", not_run)]


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
    # transformers, pandas and matplotlib: imported by the stage that needs them (NEEDS), not to start
    from ..report.analysis import trainer_summary  # noqa: PLC0415
    from ..report.plots import trainer_plot  # noqa: PLC0415
    from ..run.trainer import TRANSFORMERS_FLAG, compare_trainer_runs  # noqa: PLC0415

    folder = out / "trainer"
    df = compare_trainer_runs(folder, runs=("none", TRANSFORMERS_FLAG), device=dev.type, **TRAINER)
    summary = trainer_summary(df)
    summary.to_csv(folder / "summary.csv", index=False)
    trainer_plot(df, folder / "figures" / "trainer")
    return trainer_claim(summary, TRANSFORMERS_FLAG)


def frontier_stage(out: Path, dev: torch.device, budget: TimeBudget) -> Claim:
    """The groups in order while they fit; the claim from the groups that ran, naming the rest."""
    import pandas as pd  # noqa: PLC0415 - pandas and matplotlib: as trainer_stage

    from ..report.gpu_validation import frontier_rows  # noqa: PLC0415
    from ..report.plots import compare_plot  # noqa: PLC0415
    from ..run.compare import compare  # noqa: PLC0415

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
                         anchors=list(anchors), verify=n_compiled == 0, out=out / "compare" / name,
                         # an eager group stays eager: no compiled plans at its anchors' peaks (minutes of compiling)
                         **({} if n_compiled else {"compiled_options": ""}))
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


def snapshot_stage(out: Path, dev: torch.device) -> str:
    """A CUDA memory snapshot of one memory cell (snapshot.pickle, for https://pytorch.org/memory_viz):
    where the allocator's bytes went, for reading a rest that the report could not explain. Returns
    what the cell was."""
    label, spec, overrides, batch_size, seq_len = MEMORY["models"][0]
    dropout, dtype, loop = MEMORY["dropouts"][-1], MEMORY["dtype"], MEMORY["loop"]
    fresh_allocator(dev)
    record, workload, policy, dev, limit = measurement_record(memory_workload(spec, overrides, dropout), batch_size,
                                                              seq_len, Policy("full"), device=str(dev), dtype=dtype,
                                                              loop=loop)
    with cuda_memory_snapshot(str(out / "memory" / "snapshot.pickle")):
        prepare_step(record, workload, policy_applier(policy), dev, dtype, limit, loop)
    return f"{label} b={batch_size} s={seq_len} full {dtype} dropout={dropout:g}"


# ----------------------------------------------------------------------------- the check

def run_check(out: Path, dev: torch.device, budget: TimeBudget) -> tuple[list[Claim], list[str]]:
    """Every stage in order of priority, each skipped when a package it needs is not installed or
    it does not fit what is left; a stage that fails with an exception is a failed claim (its
    traceback in errors.txt), the others run; when the alarm stops a stage, it and the stages
    after it are skipped."""
    claims: list[Claim] = []
    # The kernels run as torch picks them on this card (cuDNN attention first on sm90 where this
    # torch prefers it): the check measures what users of the card run, and names it.
    notes = [attention_kernel_note(dev, card_of(dev))]
    stages = [
        ("memory", (MEMORY_MEASURED_CLAIM, ALLOCATED_CLAIM, RESERVED_CLAIM), ESTIMATES["memory_cell"] + 10,
         lambda: memory_stage(out, dev, budget, notes)),
        ("overhead", (OVERHEAD_CLAIM,), ESTIMATES["overhead"], lambda: [overhead_stage(out, dev, budget)]),
        ("trainer", (TRAINER_CLAIM,), ESTIMATES["trainer"], lambda: [trainer_stage(out, dev)]),
        ("frontier", (FRONTIER_CLAIM,), 0.0, lambda: [frontier_stage(out, dev, budget)]),
    ]
    stopped = False
    for stage_name, names, need, stage in stages:
        counts = [n != TRAINER_CLAIM for n in names]
        absent = missing(NEEDS[stage_name])
        if stopped or absent or not budget.fits(need + REPORT_RESERVE_S):
            reason = ("the time budget was spent by an earlier stage" if stopped
                      else f"needs {', '.join(absent)}, not installed here" if absent else budget.reason(need))
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
    if not stopped and not missing(NEEDS["snapshot"]) and budget.fits(ESTIMATES["snapshot"] + REPORT_RESERVE_S):
        try:
            cell = snapshot_stage(out, dev)
            notes.append(f"memory/snapshot.pickle: the allocator's history of one cell ({cell}), for "
                         "https://pytorch.org/memory_viz.")
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
              "python3 -m ckptlab.apps.gpu_check)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is available on this machine (torch.cuda.is_available() is False); "
              "this check needs one NVIDIA GPU: run `python3 -m ckptlab.apps.gpu_check` on a GPU machine.",
              file=sys.stderr)
        return 2
    # Nothing is downloaded: every model is built from a config. Set before transformers is imported.
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
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
    """report.md and claims.json (every claim, the versions it ran on, the environment, the
    commit) into `out`; the report printed; the exit status returned."""
    ran_on = versions()
    meta = {"device": device, "budget_s": budget.seconds, "elapsed_s": budget.elapsed(), "commit": source_commit(),
            "versions": ran_on, "environment": env, "claims": [vars(c) for c in claims]}
    (out / "claims.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    report = report_markdown(claims, device, budget.seconds, budget.elapsed(), notes, ran_on)
    (out / "report.md").write_text(report)
    print(report)
    status = exit_status(claims)
    print({0: "gpu-check passed", 1: "gpu-check FAILED", 3: "gpu-check INCOMPLETE: claims skipped (not tested)"}[status]
          + f": {out / 'report.md'}", file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
