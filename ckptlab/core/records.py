"""The record: one tidy row per measured configuration, every input and every output a column,
units in the column names. Every record — measured, compared, sharded, failed, inferred
out-of-memory, a Trainer step — is made by `new_record`: the columns of FIELDS first, in this
order, then any a kind of row adds (a compare row's `source`, a Trainer step's `step`).
Predictions (`predict`, `predict_fits`) are not records: they have columns of their own."""

from __future__ import annotations

from .loop import DEFAULT_LOOP, Loop, as_loop

# parameters are the trainable ones; frozen_parameters those with requires_grad=False (a LoRA
# fine-tune's base weights), which have no gradient and no optimizer state.
CATEGORIES = ("parameters", "frozen_parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")
PHASES = ("setup", "forward", "backward", "optimizer")
STATUSES = ("ok", "oom", "error")

FIELDS: dict[str, object] = {
    "model": None,                    # the spec that re-creates the workload (a preset name, hf:..., file.py:factory)
    "model_hash": None,               # content hash of the file that defines a spec's model (None: built in)
    "loss_fn": None,                  # the training step's loss
    "n_blocks": None,
    "block_stacks": None,             # the stacks of repeated blocks found: "encoder.block[6] + decoder.block[6]"
    "batch_size": None,
    "seq_len": None,
    "loop": DEFAULT_LOOP,             # the training loop (`core.loop`), as text; its fields follow
    "accum_steps": 1,                 # micro-batches per optimizer step
    "holds_output": False,            # the loop keeps the model's output into the next step's forward
    "optimizer": None,                # core.optimizers.OPTIMIZERS: the optimizer and its implementation
    "zero_grad": "set_to_none",       # set_to_none | zeros (gradients zero-filled and kept)
    "clip_grad_norm": None,           # clip_grad_norm_'s max norm (None: no clipping)
    "grad_scaler": False,             # fp16's GradScaler
    "world_size": 1,                  # ranks the batch is split over (FSDP2 runs)
    "effective_batch_size": None,     # batch_size * accum_steps * world_size
    "tokens": None,                   # per optimizer step
    "policy": None,
    "effective_density": None,
    "checkpointed_blocks": None,
    "device": None,
    "device_name": None,
    "dtype": "fp32",
    "steps": None,
    "warmup": None,
    "memory_limit_bytes": None,
    "trainable_param_bytes": None,    # storage bytes of the parameters that train (requires_grad)
    "frozen_param_bytes": None,       # and of those that do not (a LoRA fine-tune's base weights)
    "peak_bytes": None,
    **{f"peak_{c}_bytes": None for c in CATEGORIES},
    "peak_activations_in_blocks_bytes": None,   # of peak_activations_bytes: allocated by the blocks' forwards
    "peak_phase": None,
    "saved_activation_bytes": None,
    "cuda_max_allocated_bytes": None,
    "cuda_max_requested_bytes": None,  # the sizes asked of the allocator, before its rounding
    "cuda_max_reserved_bytes": None,
    "cuda_alloc_retries": None,
    "cuda_ooms": None,
    "recompute_count": None,
    "plan": None,                     # budget=...: the per-block plan it resolved to (k/s/f)
    "allocator_peak_bytes": None,     # compile: peak from the profiler's allocator events
    "note": "",                       # what the policy did not do here (offload on CPU, ...)
    "loss": None,
    "step_ms": None,                  # median over the timing protocol's rounds (probe.timing)
    "step_ms_low": None,              # its 95% interval (None: a single round)
    "step_ms_high": None,
    "step_ms_min": None,
    "step_ms_max": None,
    "time_ratio": None,               # paired, to timing_baseline when timed together with it
    "time_ratio_low": None,           # its 95% interval
    "time_ratio_high": None,
    "significant": None,              # the ratio's interval excludes 1
    "timing_baseline": None,
    "timing_cycle": None,             # rounds per rotation cycle: the configurations timed together
    "rounds": None,
    "timing_target_ci": None,
    "timing_ci_half_width": None,     # the relative half-width reached
    "timing_stopped": None,           # target | max_seconds | max_rounds
    "threads": None,
    "load_before": None,              # 1-minute load average before and after timing
    "load_after": None,
    "busy": None,                     # the load exceeded the CPU cores
    "tokens_per_s": None,
    "fits": None,
    "status": "ok",
    "message": "",
}


def new_record(model: str, batch_size: int, seq_len: int, loop: Loop | str | None = None, world_size: int = 1,
               **values) -> dict:
    """A record with every column of FIELDS (defaults where not given), the loop's columns
    (`Loop.record`), the derived sizes computed here once, and `values` filling or adding columns
    (a sharded run adds its per-rank peaks)."""
    loop = as_loop(loop)
    accum_steps = loop.accum_steps
    record = dict(FIELDS)
    record.update(model=model, batch_size=batch_size, seq_len=seq_len, **loop.record(), world_size=world_size,
                  effective_batch_size=batch_size * accum_steps * world_size,
                  tokens=batch_size * seq_len * accum_steps * world_size)
    record.update(values)
    if record["status"] not in STATUSES:
        raise ValueError(f"status={record['status']!r} is invalid: allowed are {', '.join(STATUSES)}")
    return record


def tokens_per_second(tokens: int, step_ms: float) -> float:
    """A step's throughput: the tokens it trained on over its time."""
    return tokens / (step_ms / 1e3)


__all__ = ["CATEGORIES", "FIELDS", "PHASES", "STATUSES", "new_record", "tokens_per_second"]
