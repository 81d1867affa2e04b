"""Checkpointing measured under FSDP2 sharded data-parallel training (`fully_shard`), N ranks.

    rec = measure_sharded("gpt-tiny", batch_size=2, seq_len=64, policy="density=0.5", nproc=2)
    rec["world_size"], rec["peak_bytes_per_rank"], rec["peak_bytes"]   # peak = max over ranks

Each rank builds the same seeded model, checkpoints its blocks, shards it and trains on its own
slice of a global batch of `batch_size * nproc` rows (gloo on CPU, NCCL on CUDA: rank r on
cuda:r). Why checkpointing comes before sharding, and why the peaks come from the allocator:
docs/design.md, note "Checkpointing under FSDP2". This module starts the ranks (one fresh process
each: note "Why the sharded rank is its own module"); the first rank that dies ends the group with
its last stderr line as the reason, and a hung group is killed at `timeout_s`.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from ..core.children import child_environment, die_with_parent
from ..core.dtypes import DTYPES
from ..core.loop import Loop, as_loop
from ..core.policy import Policy, as_policy
from ..core.records import new_record, tokens_per_second
from ..core.units import parse_bytes
from ..core.validate import choice, integer
from ..workloads.base import Workload
from ..workloads.registry import get_workload
from .timing import check_timing_options


def measure_sharded(workload: Workload | str, batch_size: int, seq_len: int, policy: str = "none",
                    nproc: int = 2, **kwargs) -> dict:
    """Measure one training step of `workload` sharded over `nproc` ranks; one tidy record.

    Record: the `measure` columns that apply, plus `world_size`, `peak_bytes_per_rank` (list, by
    rank), `peak_bytes` (max over ranks), `saved_activation_bytes` (rank 0: allocated in forward
    and alive when backward starts), and rank 0's timing (ranks step in lockstep): `step_ms`, the
    median of exactly `steps` timed steps, with its 95% bootstrap interval `step_ms_low/high`
    (none from a single step), and the protocol's columns of a configuration timed alone
    (`rounds`, `threads`, `load_before/after`, `busy`, `timing_stopped`, ...; see
    `ckptlab.probe.timing`). The round count is fixed, not adaptive: every rank must run the same
    number of steps, so no rank may stop on its own interval. The policies of one group are timed
    one after another, not in interleaved rounds, so there is no paired ratio between them:
    `time_ratio`, its interval and `significant` stay None.
    Failures come back as status "error"/"oom" with a message, never an exception. Keyword
    arguments: see `measure_sharded_many`.
    """
    return measure_sharded_many(workload, batch_size, seq_len, [policy], nproc, **kwargs)[0]


def measure_sharded_many(workload: Workload | str, batch_size: int, seq_len: int,
                         policies=("none",), nproc: int = 2, device: str = "cpu", dtype: str = "fp32",
                         steps: int = 3, warmup: int = 1, memory_limit=None, loop: Loop | str | None = None,
                         seed: int = 0, model_overrides: Optional[dict] = None,
                         timeout_s: Optional[float] = 600, target_ci: float = 0.02) -> list[dict]:
    """One record per policy, all measured by one group of `nproc` ranks (one start-up, one
    process group; each policy on a freshly built and sharded model, timed after the previous
    one). `target_ci` is recorded and judged (`timing_stopped` is "target" when the interval
    reached it within `steps`), never a reason to stop early."""
    check_timing_options(target_ci, math.inf)   # no time budget: the round count is fixed
    spec = rank_spec(workload, batch_size, seq_len, policies, nproc, device, dtype, steps, warmup,
                 memory_limit, loop, seed, model_overrides)
    spec["target_ci"] = float(target_ci)
    with tempfile.TemporaryDirectory(prefix="ckptlab-ranks-") as tmp:
        error = _spawn(spec, nproc, tmp, timeout_s)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    ranks.sort(key=lambda r: r[0]["rank"])
    records = []
    for i, policy in enumerate(spec["policies"]):
        if error or len(ranks) != nproc:
            record = _base_record({**spec, "policy": policy}, nproc)
            oom = "OutOfMemoryError" in error
            record.update(status="oom" if oom else "error", fits=False if oom else None,
                          message=error or f"only {len(ranks)} of {nproc} ranks reported")
        else:
            record = combine([r[i] for r in ranks])
        records.append(record)
    return records


def sharded_gradients(workload: Workload | str, batch_size: int, seq_len: int, policies=("none",),
                      nproc: int = 2, seed: int = 0, model_overrides: Optional[dict] = None,
                      device: str = "cpu", timeout_s: Optional[float] = 600) -> list[dict]:
    """Per policy: {parameter name: full gradient (CPU tensor)} after one forward + backward of
    the checkpointed, sharded model on every rank's slice of the global batch of
    `batch_size * nproc` rows (FSDP averages over ranks: equal to the unsharded gradient of the
    whole global batch). For checking that sharding + checkpointing changes no gradient."""
    spec = rank_spec(workload, batch_size, seq_len, policies, nproc, device, "fp32", 1, 0, None, "none",
                 seed, model_overrides)
    spec["mode"] = "gradients"
    with tempfile.TemporaryDirectory(prefix="ckptlab-ranks-") as tmp:
        error = _spawn(spec, nproc, tmp, timeout_s)
        if error:
            raise RuntimeError(f"sharded_gradients: {error}")
        return torch.load(Path(tmp, "gradients.pt"))


def rank_spec(workload, batch_size, seq_len, policies, nproc, device, dtype, steps, warmup, memory_limit,
          loop, seed, model_overrides) -> dict:
    """Validate everything before any process starts; the JSON spec every rank reads."""
    overrides = dict(model_overrides or {})
    if not isinstance(workload, str):
        if workload.spec is None:
            raise ValueError(f"workload {workload.name!r} is invalid for ranks: each rank process re-creates the "
                             "workload from its spec; define it in a file and pass 'path/to/file.py:factory'")
        seed, overrides = workload.seed, {**workload.overrides, **overrides}
    name = workload if isinstance(workload, str) else workload.spec
    model_hash = get_workload(name, seed=seed, **overrides).spec_hash   # validates name and overrides
    integer("nproc", nproc, 1)
    choice("dtype", dtype, list(DTYPES))
    loop = as_loop(loop)
    loop.check_dtype(dtype)
    dev_type = torch.device(device).type
    if dev_type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid: allowed are cpu, cuda")
    if dev_type == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"nproc={nproc} is invalid here: only {torch.cuda.device_count()} CUDA devices")
    for label, value in (("batch_size", batch_size), ("seq_len", seq_len), ("steps", steps)):
        integer(label, value, 1)
    policies = [str(as_policy(p)) for p in ([policies] if isinstance(policies, (str, Policy)) else policies)]
    return dict(model=name, model_hash=model_hash, seed=seed, overrides=overrides, batch_size=batch_size, seq_len=seq_len,
                policies=policies, device_type=dev_type, dtype=dtype, steps=steps, warmup=warmup,
                memory_limit_bytes=parse_bytes(memory_limit), loop=str(loop))


def _spawn(spec: dict, nproc: int, out_dir: str, timeout_s: Optional[float]) -> str:
    """Start nproc rank processes and wait; '' on success, else why not. Each rank is a fresh
    `python -c` process with the environment torchrun would give it (RANK, WORLD_SIZE, ...)."""
    Path(out_dir, "spec.json").write_text(json.dumps(spec))
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = child_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
        err = open(Path(out_dir, f"rank{rank}.err"), "w")
        procs.append((subprocess.Popen([sys.executable, "-c", _RANK_MAIN, out_dir], env=env,
                                       stdout=subprocess.DEVNULL, stderr=err, preexec_fn=die_with_parent()), err))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed = ""
    try:
        while any(p.poll() is None for p, _ in procs):
            dead = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode not in (None, 0)]
            if dead and not failed:   # one rank died: the others would wait for it forever
                failed = _rank_failure(out_dir, *dead[0])
                break
            if deadline is not None and time.monotonic() > deadline:
                failed = f"{nproc} ranks timed out after {timeout_s} s"
                break
            time.sleep(0.05)
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            err.close()
    if not failed:
        dead = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode != 0]
        failed = _rank_failure(out_dir, *dead[0]) if dead else ""
    return failed


def _rank_failure(out_dir: str, rank: int, code: int) -> str:
    lines = [l for l in Path(out_dir, f"rank{rank}.err").read_text(errors="replace").splitlines() if l.strip()]
    return f"rank {rank} exited with code {code}: {lines[-1].strip() if lines else 'no output'}"[:500]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# os._exit once the results are on disk: gloo's C++ threads can abort the interpreter's normal
# shutdown ("terminate called without an active exception", seen here in the test suite).
_RANK_MAIN = ("import os, sys; from ckptlab.probe.sharded_rank import rank_main; rank_main(sys.argv[1]); "
              "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")


def _base_record(spec: dict, world: int) -> dict:
    return new_record(spec["model"], spec["batch_size"], spec["seq_len"], spec["loop"], world,
                      policy=spec["policy"], device=spec["device_type"], dtype=spec["dtype"],
                      steps=spec["steps"], warmup=spec["warmup"],
                      memory_limit_bytes=spec["memory_limit_bytes"], sharding="fsdp2", peak_bytes_per_rank=None,
                      start_bytes_per_rank=None, model_hash=spec.get("model_hash"))


def combine(ranks: list[dict]) -> dict:
    """Per-rank partial records -> one record: peak = max over ranks, the rest (timing included:
    the protocol's columns of one configuration timed alone) from rank 0."""
    r0 = ranks[0]
    record = _base_record(r0["spec"], r0["world_size"])
    bad = next((r for r in ranks if r.get("fits") is False), None) or next(
        (r for r in ranks if r.get("status") != "ok"), None)
    record.update({k: r0.get(k) for k in ("n_blocks", "block_stacks", "effective_density", "checkpointed_blocks",
                                          "device_name", "saved_activation_bytes", "recompute_count",
                                          "loss")})
    record.update(r0.get("timing") or {})
    peaks = [r.get("peak_bytes") for r in ranks]
    record.update(peak_bytes_per_rank=peaks, start_bytes_per_rank=[r.get("start_bytes") for r in ranks],
                  peak_bytes=max(peaks) if all(p is not None for p in peaks) else None,
                  fits=None if any(r.get("fits") is None for r in ranks) else all(r["fits"] for r in ranks))
    if record["step_ms"]:
        record["tokens_per_s"] = tokens_per_second(record["tokens"], record["step_ms"])
    if bad is not None:
        record.update(status=bad["status"], message=bad.get("message", ""))
    return record


