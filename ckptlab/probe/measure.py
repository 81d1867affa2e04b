"""One configuration -> one tidy record: peak memory (by category), saved-activation bytes,
step time, tokens/s, recompute count, and whether it fits a memory limit.

A measurement is two passes over the same model and batch:
  1. memory: one warm-up step (so optimizer state and lazy buffers exist), then one step under
     the live-tensor tracker (and, on CUDA, the allocator's peak counters);
  2. time: `warmup` untracked steps, then at least `steps` timed steps with the protocol of
     `ckptlab.probe.timing` (more, up to `max_seconds`, until the median step time is known to
     ±`target_ci`): step_ms is the median, step_ms_low/high its 95% interval — never under the
     tracker, whose Python hooks would distort the time.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Optional

import torch

from ..checkpoint.compiled import apply_policy, fresh_compiler_cache
from ..core.dtypes import DTYPES
from ..core.loop import Loop, as_loop
from ..core.policy import Policy
from ..core.records import CATEGORIES, new_record, tokens_per_second
from ..core.units import parse_bytes
from ..core.validate import choice, integer
from ..workloads.base import Workload, is_transformers_model
from ..workloads.registry import as_workload
from ..workloads.stacks import find_blocks
from .memory import allocator_peak, cuda_allocator_stats, parameter_bytes, track_memory
from .step import device_name, make_optimizer, resolve_device, training_step, with_dtype
from .timing import check_timing_options, time_interleaved

MAX_ROUNDS = 200   # a step timed alone: at most this many rounds, even if the interval stays wide


def measure_policy(
    workload: Workload | str,
    batch_size: int,
    seq_len: int,
    policy: Policy,
    device: str = "cpu",
    dtype: str = "fp32",
    steps: int = 5,
    warmup: int = 2,
    memory_limit: Optional[str | int] = None,
    loop: Loop | str | None = None,
    with_report: bool = False,
    target_ci: float = 0.02,
    max_seconds: float = 1.0,
) -> dict:
    """Measure one training step of `workload` at (batch_size, seq_len) under a concrete `policy`
    (`ckptlab.measure` resolves a budget first).

    Returns a flat dict (one row of a results table), or with `with_report=True` the pair
    (record, MemoryReport of the tracked step, timeline included; None if it failed). Inputs are validated before any work and
    raise ValueError; failures during the measurement come back as status "oom" or "error" with a
    message, so a sweep never loses a row. On CPU `memory_limit` is emulated: a peak above it is
    reported as status "oom". On CUDA it caps the process (real OOMs), defaulting to the device's
    capacity. `loop` (`core.loop.Loop`, or its text such as "adamw-fused,accum=2,holds-output";
    default: adamw) is the training loop the step runs in (`probe.step.training_step`): with
    accum_steps > 1 the effective batch is batch_size * accum_steps.
    """
    record, workload, policy, dev, limit = measurement_record(
        workload, batch_size, seq_len, policy, device=device, dtype=dtype, steps=steps, warmup=warmup,
        memory_limit=memory_limit, loop=loop, target_ci=target_ci, max_seconds=max_seconds)
    if policy.kind == "budget":
        raise ValueError(f"policy={policy} is invalid here: this measures a concrete policy; ckptlab.measure "
                         "resolves a budget to its plan first")
    report = None
    with failures_recorded(record, dev), fresh_compiler_cache(policy.compiles):
        report = _run(record, workload, policy, dev, dtype, steps, warmup, limit, as_loop(loop), target_ci,
                      max_seconds)
    return (record, report) if with_report else record


def measurement_record(workload: Workload | str, batch_size: int, seq_len: int, policy: Policy, *, device: str = "cpu",
                       dtype: str = "fp32", steps: int = 5, warmup: int = 2, memory_limit=None,
                       loop: Loop | str | None = None, target_ci: float = 0.02, max_seconds: float = 1.0):
    """Check every input of `measure_policy` (ValueError naming the first bad one) and start its record.
    Returns (record, workload, policy, device, memory limit in bytes or None)."""
    workload = as_workload(workload)
    workload.check_shape(batch_size, seq_len)
    integer("steps", steps, 1)
    integer("warmup", warmup, 0)
    check_timing_options(target_ci, max_seconds)
    choice("dtype", dtype, list(DTYPES))
    loop = as_loop(loop)
    loop.check_dtype(dtype)
    dev = resolve_device(device)
    limit = parse_bytes(memory_limit)
    check_policy_applies(workload, policy)
    if dev.type == "cuda" and limit is None:
        limit = torch.cuda.get_device_properties(dev).total_memory
    record = new_record(workload.label, batch_size, seq_len, loop, policy=str(policy), device=str(dev),
                        device_name=device_name(dev), dtype=dtype, steps=steps, warmup=warmup,
                        memory_limit_bytes=limit, model_hash=workload.spec_hash, loss_fn=workload.loss_name)
    return record, workload, policy, dev, limit


@contextlib.contextmanager
def older_objects_frozen(dev: torch.device | str):
    """Within, on a CPU, the objects alive on entry are frozen (`gc.freeze`), after one full
    collection so that none of them is garbage: a collection inside walks only what was made
    inside, which is where a measurement's cyclic garbage is (a step's model, an exception's
    frames). A full walk of the objects torch, transformers and a notebook keep takes 0.15 s or
    more: once per sweep or comparison instead of once per configuration (60 times in a 48-cell
    sweep, a quarter of its time), and an automatic collection that lands in a timed step is as
    short. An object alive on entry that turns into garbage inside is freed by a collection after
    the way out. Left as found: nothing is frozen where something already is (a caller's freeze
    stays whole), and on CUDA nothing is: any old cycle may hold device memory that the
    allocator's cache should give back, so every collection walks the whole heap."""
    freeze = torch.device(dev).type != "cuda" and gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


@contextlib.contextmanager
def failures_recorded(record: dict, dev: torch.device):
    """An exception inside becomes the record's status ("oom" or "error") and message instead of
    propagating, so a table never loses a row; the garbage made inside is collected and the
    device's memory settings are reset after."""
    with older_objects_frozen(dev):
        try:
            yield
        except torch.OutOfMemoryError as exc:
            record.update(status="oom", fits=False, message=_first_line(exc))
        except Exception as exc:  # noqa: BLE001 - a record with the reason beats a lost sweep
            record.update(status="error", message=f"{type(exc).__name__}: {_first_line(exc)}")
        finally:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, dev)
                torch.cuda.empty_cache()


def _run(record, workload, policy, dev, dtype, steps, warmup, limit, loop, target_ci, max_seconds):
    policy_notes(record, policy, dev)
    step, report = prepare_step(record, workload, policy_applier(policy), dev, dtype, limit, loop)
    if step is None:
        return report
    timing = time_interleaved({record["policy"]: step}, device=dev, warmup=warmup, target_ci=target_ci,
                              max_seconds=max_seconds, min_rounds=steps, max_rounds=max(steps, MAX_ROUNDS))
    record.update(timing.row(record["policy"]))
    record["tokens_per_s"] = tokens_per_second(record["tokens"], record["step_ms"])
    return report


def policy_applier(policy):
    """`apply(model, record)` for `prepare_step` from a resolved ckptlab policy (no budget=)."""
    def apply(model, record):
        runner, handle, compiled = apply_policy(model, policy)
        record.update(
            n_blocks=handle.n_blocks,
            block_stacks=handle.stacks_found,
            effective_density=handle.effective_density,
            checkpointed_blocks=",".join(map(str, handle.checkpointed_blocks)),
        )
        return runner, compiled or False, handle
    return apply


def prepare_step(record: dict, workload: Workload, apply, dev: torch.device, dtype: str, limit: Optional[int],
                 loop: Loop | str):
    """Everything of a measurement but the timing: build the model on `dev`, apply checkpointing
    with `apply(model, record) -> (model to run, Compiled or False, handle or None)` (which fills
    the record's checkpointing columns), run one warm-up step of `loop` and one step under the live-tensor
    tracker (allocator events for compiled models), and fill `record`'s memory columns. A compiled
    model records `compiled_graphs`, the graphs its backends compiled; none is an error (it ran eager).
    Returns (step closure, MemoryReport); the step is None when the peak exceeds the emulated
    CPU limit (status "oom")."""
    # Configurations timed together live side by side: on CUDA the allocator's peak counts the
    # others' resident memory too, which is taken out again below.
    resident = resident_requested = 0
    if dev.type == "cuda":
        capacity = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / capacity), dev)
        resident = torch.cuda.memory_allocated(dev)
        resident_requested = torch.cuda.memory_stats(dev).get("requested_bytes.all.current", 0)
    workload = with_dtype(workload, dtype)
    model = workload.build(dev)
    model.train()
    runner, compiled, handle = apply(model, record)
    batch = workload.batch(record["batch_size"], record["seq_len"], dev)
    optimizer = make_optimizer(loop, model, dev.type)
    step = training_step(runner, workload, batch, optimizer, dtype, loop)

    torch.manual_seed(workload.seed)
    scales = [_scale_of(step.scaler)]   # a grad scaler lowers its scale where it skips a step
    step()
    scales.append(_scale_of(step.scaler))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    if handle is not None:
        handle.reset_counts()
    if compiled:  # a dispatch-mode tracker cannot see inside compiled graphs
        if not compiled.graphs:
            raise RuntimeError("torch.compile compiled no graph for this model: it ran eager")
        report, loss = allocator_step_memory(step, model, optimizer, step.inputs(), dev)
        record.update(allocator_peak_bytes=report.peak_bytes, compiled_graphs=compiled.graphs)
    else:
        blocks = handle.blocks if handle is not None else ()
        with track_memory(model, optimizer, inputs=step.inputs(), device=dev, blocks=blocks) as tracker:
            loss = step(tracker)
        report = tracker.report()
        record["peak_activations_in_blocks_bytes"] = report.peak_in_blocks_by_category.get("activations")
    scales.append(_scale_of(step.scaler))
    skipped = [name for name, before, after in zip(("the warm-up", "the step measured"), scales, scales[1:])
               if before is not None and after < before]
    if skipped:
        note = (f"the grad scaler skipped the optimizer step of {' and of '.join(skipped)} (inf or NaN gradients): "
                "not the healthy step a prediction is of" + (", the step measured starts without optimizer state"
                                                              if skipped[0] == "the warm-up" else ""))
        record["note"] = "; ".join(n for n in (record.get("note"), note) if n)
    record.update(
        **parameter_bytes(model),
        peak_bytes=report.peak_bytes,
        **{f"peak_{c}_bytes": report.peak_by_category.get(c) for c in CATEGORIES},
        peak_phase=report.peak_phase,
        saved_activation_bytes=report.saved_activation_bytes,
        recompute_count=None if handle is None or compiled else handle.recompute_count,
        loss=float(loss),
    )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        record.update(cuda_allocator_stats(dev))
        record["cuda_max_allocated_bytes"] -= resident
        if record["cuda_max_requested_bytes"] is not None:
            record["cuda_max_requested_bytes"] -= resident_requested
    peak = max(report.peak_bytes, record["cuda_max_allocated_bytes"] or 0)
    if limit is not None:
        record["fits"] = peak <= limit
    if dev.type == "cpu" and limit is not None and not record["fits"]:
        record.update(status="oom", message=f"peak {peak} B exceeds the emulated memory limit {limit} B")
        return None, report
    return step, report


def _scale_of(scaler) -> Optional[float]:
    return None if scaler is None else scaler.get_scale()


def policy_notes(record, policy, dev):
    """Offload on CPU is noted as a no-op; compile is noted as measured by allocator events."""
    notes = []
    if policy.offload and dev.type == "cpu":
        notes.append("offload is a no-op on CPU: activations already live in host memory")
    if policy.compiles:
        notes.append("torch.compile: peak from the profiler's allocator events (categories and "
                     "recompute count not visible inside compiled graphs)")
    record["note"] = "; ".join(notes)


def allocator_step_memory(step, model, optimizer, inputs, dev):
    """One step's memory from the allocator rather than from tensors: CUDA's peak counters, or on
    CPU the profiler's `[memory]` events (each allocation and free, with its size and time) —
    which see allocations inside compiled graphs that a dispatch-mode tracker cannot. Returns a
    MemoryReport (peak = bytes held when the step began + the allocator's high-water mark above
    it; saved activations = bytes the forward left allocated) and the loss."""
    start = {}
    grads = [p.grad for p in model.parameters() if p.grad is not None]   # a loop that keeps them zero-filled
    for t in list(model.parameters()) + grads + list(inputs) + [
            t for st in (optimizer.state.values() if optimizer else []) for t in st.values()
            if isinstance(t, torch.Tensor)]:
        if t.device == dev:
            start[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    inputs = t = None   # a held output (`probe.step.HeldOutput`) is the step's to release
    return allocator_peak(step, dev, sum(start.values()))


def check_policy_applies(workload: Workload, policy: Policy) -> None:
    """Raise ValueError when `policy` cannot apply to `workload` (layers=9 or a plan of the wrong
    length on a 4-block model, an hf policy on a model that is not a transformers model), using
    the model built on the meta device: no memory, no time."""
    model = workload.build("meta")
    if policy.mechanism == "transformers" and not is_transformers_model(model):
        raise ValueError(f"policy={str(policy)!r} is invalid for model={workload.name!r}: the hf policies apply "
                         "to transformers models (the hf-* presets) only")
    if policy.kind != "budget":  # a budget becomes a plan per cell, from that cell's shapes
        policy.regions(len(find_blocks(model)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["allocator_step_memory", "check_policy_applies", "failures_recorded", "measure_policy", "measurement_record",
           "older_objects_frozen", "policy_applier", "policy_notes", "prepare_step"]
