"""What does checkpointing cost, and what does ckptlab's wrapper add on top?

One process, variants interleaved round by round (so drift in machine load hits all alike):
  none           no checkpointing
  ckptlab full   apply_checkpointing(model, "full")
  manual full    a hand-written loop calling torch.utils.checkpoint.checkpoint on each block
Reports (a) wrapper overhead = ckptlab full / manual full - 1 (target <= 2%), and (b) full vs
none with the forward share of the step — the ideal recompute cost, since recomputing every
block costs about one more forward of the blocks.

    python benchmarks/overhead.py [--model gpt-tiny] [--batch 8] [--seq 128] [--rounds 7] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils.checkpoint import checkpoint

from ckptlab import apply_checkpointing, find_blocks, get_workload
from ckptlab.probe.step import make_optimizer, resolve_device, training_step
from ckptlab.probe.timing import time_steps


def manual_full(model: torch.nn.Module) -> None:
    """The hand-written reference: the GPT's forward rewritten to checkpoint each block."""
    blocks = find_blocks(model)

    def forward(idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = model.drop(model.wte(idx) + model.wpe(pos))
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return model.lm_head(model.ln_f(x))

    model.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = resolve_device(args.device)
    workload = get_workload(args.model)
    batch = workload.batch(args.batch, args.seq, device)

    steps, forwards = {}, {}
    for name in ("none", "ckptlab full", "manual full"):
        model = workload.build(device).train()
        if name == "ckptlab full":
            apply_checkpointing(model, "full")
        elif name == "manual full":
            manual_full(model)
        steps[name] = training_step(model, workload, batch, make_optimizer("adamw", model))
        forwards[name] = lambda model=model: workload.loss(model, batch)

    times = {name: [] for name in steps}
    forward_ms = []
    for name, step in steps.items():  # warm-up, untimed
        time_steps(step, steps=1, warmup=2, device=device)
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name] += time_steps(step, steps=args.steps, warmup=0, device=device).times_ms["step"]
        with torch.no_grad():
            forward_ms += time_steps(forwards["none"], steps=args.steps, warmup=0, device=device).times_ms["step"]

    med = {name: statistics.median(t) for name, t in times.items()}
    fwd = statistics.median(forward_ms)
    print(f"{args.model}  batch={args.batch} seq={args.seq}  device={device}  torch={torch.__version__}  "
          f"threads={torch.get_num_threads()}  {args.rounds} rounds x {args.steps} steps, medians")
    print(f"{'variant':>14}  {'step ms':>8}  {'min':>7}  {'max':>7}  {'vs none':>8}")
    for name, t in times.items():
        print(f"{name:>14}  {med[name]:8.2f}  {min(t):7.2f}  {max(t):7.2f}  {med[name] / med['none'] - 1:+8.1%}")
    print(f"(a) wrapper overhead, ckptlab full vs manual full: {med['ckptlab full'] / med['manual full'] - 1:+.1%}  (target <= +2%)")
    print(f"(b) full vs none: {med['ckptlab full'] / med['none'] - 1:+.1%};  forward share of a 'none' step "
          f"(no-grad forward {fwd:.2f} ms / step {med['none']:.2f} ms): {fwd / med['none']:.1%} = the ideal recompute cost")


if __name__ == "__main__":
    main()
