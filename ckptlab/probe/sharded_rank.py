"""One rank of a sharded (FSDP2) measurement: the process that `ckptlab.probe.distributed` starts
per rank, or that torchrun starts (`torchrun --nproc-per-node 2 -m ckptlab.probe.sharded_rank
--policy none,full`). Kept apart from the launcher because FSDP2's stack takes half a second to
import, and only rank processes need it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ..checkpoint.wrap import apply_checkpointing
from ..core.parsing import split_list
from ..core.policy import parse_policy
from ..workloads.base import Workload
from ..workloads.registry import get_workload
from ..workloads.stacks import find_blocks
from .distributed import combine, measure_sharded_many, rank_spec
from .memory import allocator_peak
from .step import device_name, make_optimizer, training_step, with_dtype
from .timing import time_steps


def rank_main(out_dir: str) -> None:
    spec = json.loads(Path(out_dir, "spec.json").read_text())
    result = run_rank(spec)
    if spec.get("mode") == "gradients":
        if int(os.environ["RANK"]) == 0:
            torch.save(result, Path(out_dir, "gradients.pt"))
        return
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(result, default=str))


def run_rank(spec: dict, gather: bool = False):
    """This rank's part, for every policy of the spec, in a process group initialised from the
    environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT: as torchrun or `_spawn` set them). Returns
    this rank's partial records (or, in gradients mode, rank 0's full gradients per policy);
    with `gather`, every rank's partial records, collected over the process group."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec["device_type"] == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        # ranks share the machine's cores: split them instead of oversubscribing
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo")
    try:
        if spec.get("mode") == "gradients":
            result = [_gradients_rank(spec, p, rank, world, dev) for p in spec["policies"]]
        else:
            result = [_measure_rank({**spec, "policy": p}, rank, world, dev) for p in spec["policies"]]
            if gather:
                everyone = [None] * world
                dist.all_gather_object(everyone, result)
                result = everyone
        # No rank tears down its group while a peer is still in a collective with it (only on
        # success: after a failure the launcher ends the group instead of a barrier hanging).
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _gradients_rank(spec: dict, policy: str, rank: int, world: int, dev: torch.device) -> dict:
    workload = get_workload(spec["model"], seed=spec["seed"], **spec["overrides"])
    model = workload.build(dev)
    model.train()
    shard_model(model, parse_policy(policy), world, dev.type)
    batch = rank_batch(workload, spec["batch_size"], spec["seq_len"], rank, world, dev)
    torch.manual_seed(workload.seed + rank)
    workload.loss(model, batch).backward()
    # full_tensor() is a collective: every rank calls it, rank 0 keeps the result
    return {n: p.grad.full_tensor().detach().cpu() for n, p in model.named_parameters() if p.grad is not None}


def shard_model(model: torch.nn.Module, policy, world: int, device_type: str):
    """Checkpoint, then fully_shard each block, then the root (docs/design.md, note "Checkpointing
    under FSDP2")."""
    handle = apply_checkpointing(model, policy)
    mesh = init_device_mesh(device_type, (world,))
    for block in find_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return handle


def rank_batch(workload: Workload, batch_size: int, seq_len: int, rank: int, world: int, dev) -> tuple:
    """Rank r's slice (rows r*b..(r+1)*b) of the global batch of batch_size * world rows."""
    full = workload.batch(batch_size * world, seq_len, "cpu")
    return tuple(t[rank * batch_size:(rank + 1) * batch_size].contiguous().to(dev) for t in full)


def _measure_rank(spec: dict, rank: int, world: int, dev: torch.device) -> dict:
    """This rank's partial record. An exception is not caught: it ends this rank's process, and
    the launcher ends the group (a rank that stopped early would leave the others waiting in a
    collective) and reports the error — an out-of-memory error as status "oom"."""
    out = {"rank": rank, "world_size": world, "spec": spec, "device_name": device_name(dev)}
    limit = spec["memory_limit_bytes"]
    if dev.type == "cuda" and limit is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / torch.cuda.get_device_properties(dev).total_memory), dev)
    workload = with_dtype(get_workload(spec["model"], seed=spec["seed"], **spec["overrides"]), spec["dtype"])
    model = workload.build(dev)
    model.train()
    handle = shard_model(model, parse_policy(spec["policy"]), world, dev.type)
    out.update(n_blocks=handle.n_blocks, block_stacks=handle.stacks_found, effective_density=handle.effective_density,
               checkpointed_blocks=",".join(map(str, handle.checkpointed_blocks)))
    batch = rank_batch(workload, spec["batch_size"], spec["seq_len"], rank, world, dev)
    optimizer = make_optimizer(spec["loop"], model, dev.type)
    step = training_step(model, workload, batch, optimizer, spec["dtype"], spec["loop"])
    torch.manual_seed(workload.seed + rank)
    step()   # warm-up: optimizer state exists
    handle.reset_counts()

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    held = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None] + list(step.inputs())
    if optimizer is not None:
        held += [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    start = {}
    for t in map(local, held):
        if t.device == dev:
            start[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    report, loss = allocator_peak(step, dev, sum(start.values()))
    peak, saved = report.peak_bytes, report.saved_activation_bytes
    out.update(peak_bytes=peak, start_bytes=sum(start.values()), saved_activation_bytes=saved,
               recompute_count=handle.recompute_count, loss=float(loss), status="ok", message="")
    out["fits"] = None if limit is None else peak <= limit
    # Every rank must take the same branch: time the steps only if every rank fits.
    all_fit = torch.tensor([0 if out["fits"] is False else 1], device=dev)
    dist.all_reduce(all_fit, op=dist.ReduceOp.MIN)
    if not all_fit.item():
        out.update(status="oom", message=f"rank {rank}: peak {peak} B exceeds the memory limit {limit} B"
                   if out["fits"] is False else f"another rank exceeds the memory limit {limit} B")
        return out
    timing = time_steps(step, steps=spec["steps"], warmup=spec["warmup"], device=dev,
                        target_ci=spec.get("target_ci", 0.02))
    out["timing"] = timing.row("step")
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure policies sharded over N ranks and print one JSON record per policy. Under torchrun
    (`torchrun --nproc-per-node 2 -m ckptlab.probe.sharded_rank ...`) this process is one rank and
    rank 0 prints; otherwise it starts --nproc ranks itself."""
    p = argparse.ArgumentParser(prog="python -m ckptlab.probe.sharded_rank", description=main.__doc__)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch", type=int, default=2, help="per-rank batch size")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--policy", default="none", help="policies, comma-separated")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not under torchrun")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    policies = split_list(args.policy, "--policy")
    if "RANK" not in os.environ:
        records = measure_sharded_many(args.model, args.batch, args.seq, policies, nproc=args.nproc,
                                       device=args.device, dtype=args.dtype, steps=args.steps, warmup=args.warmup)
    else:
        world = int(os.environ["WORLD_SIZE"])
        spec = rank_spec(args.model, args.batch, args.seq, policies, world, args.device, args.dtype, args.steps,
                     args.warmup, None, "adamw", 1, 0, None)
        ranks = run_rank(spec, gather=True)
        if int(os.environ["RANK"]) != 0:
            return 0
        records = [combine([r[i] for r in ranks]) for i in range(len(policies))]
    for record in records:
        print(json.dumps(record, default=str))
    return 0 if all(r["status"] != "error" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
