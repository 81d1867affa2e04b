"""What does checkpointing cost, and what does ckptlab's wrapper add on top?

One process, timed with ckptlab's protocol (`ckptlab.probe.timing.time_interleaved`): each round
runs every variant once in a rotated order, and every ratio is the median of per-round ratios with
a 95% bootstrap interval; rounds go on until the ratios to `manual full` (the wrapper overhead
among them) are within ±--target-ci, or --max-seconds have passed.
  none               no checkpointing
  ckptlab full       apply_checkpointing(model, "full")
  manual full        a hand-written loop calling torch.utils.checkpoint.checkpoint on each block
  forward (no grad)  the forward of `none` under torch.no_grad()
Reports (a) the wrapper overhead, ckptlab full / manual full paired round by round (target <= +2%,
claimed only when the whole interval is), and (b) full against none beside the forward share of a
`none` step: the ideal recompute cost, since recomputing every block costs about one more forward.

    python benchmarks/overhead.py [--model gpt-tiny] [--batch 8] [--seq 128] [--target-ci 0.02] [--max-seconds 120] [--threads 1]
                                  [--device cuda] [--json overhead.json]

`--json` also writes the numbers (the wrapper ratio with its interval, how the rounds stopped) for
`make gpu-check`, which reads them.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from ckptlab import apply_checkpointing, find_blocks, get_workload
from ckptlab.probe.step import make_optimizer, resolve_device, training_step
from ckptlab.probe.timing import NO_DIFFERENCE, bootstrap_median, check_timing_options, time_interleaved, time_verdict

WRAPPER_TARGET = 1.02   # ckptlab full may take at most 2% longer than the hand-written loop


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


def wrapper_verdict(low: float, high: float) -> str:
    """What the interval of ckptlab full / manual full shows, and nothing more."""
    difference = {"slower": "slower than the hand-written loop", "faster": "faster than the hand-written loop",
                  NO_DIFFERENCE: "no difference from the hand-written loop (the interval contains 1)"}[
        time_verdict(low, high)]
    target = {"faster": f"within the {WRAPPER_TARGET - 1:+.0%} target",
              "slower": f"beyond the {WRAPPER_TARGET - 1:+.0%} target",
              NO_DIFFERENCE: f"the {WRAPPER_TARGET - 1:+.0%} target is not shown (the interval reaches above it): "
                             "time longer or to a smaller --target-ci"}[time_verdict(low, high, WRAPPER_TARGET)]
    return f"{difference}; {target}"


def pct(ratio: float, low: float, high: float, digits: int = 1) -> str:
    return f"{ratio - 1:+.{digits}%} [{low - 1:+.{digits}%}, {high - 1:+.{digits}%}]"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny", help="a GPT workload (the hand-written loop rewrites its forward)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--target-ci", type=float, default=0.02, help="stop when every interval is within ±this")
    parser.add_argument("--max-seconds", type=float, default=120, help="or when timing has taken this long")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 is steadiest on a shared machine)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    check_timing_options(args.target_ci, args.max_seconds)
    if args.threads < 1:
        parser.error(f"--threads {args.threads} is invalid: allowed is an integer >= 1")
    device = resolve_device(args.device)
    workload = get_workload(args.model)
    if not all(hasattr(workload.build("meta"), a) for a in ("wte", "wpe", "drop", "ln_f", "lm_head")):
        parser.error(f"--model {args.model!r} is invalid: allowed is a GPT workload (gpt-tiny, gpt2-small, ...)")
    batch = workload.batch(args.batch, args.seq, device)

    models = {name: workload.build(device).train() for name in ("none", "ckptlab full", "manual full")}
    apply_checkpointing(models["ckptlab full"], "full")
    manual_full(models["manual full"])
    steps = {name: training_step(model, workload, batch, make_optimizer("adamw", model))
             for name, model in models.items()}

    def forward_no_grad():
        with torch.no_grad():
            workload.loss(models["none"], batch)

    steps["forward (no grad)"] = forward_no_grad
    # "manual full" goes first: the protocol stops once the ratios to its first configuration are
    # within the target, and ckptlab full / manual full, the wrapper overhead, is the ratio this
    # benchmark exists for. The ratios to none are paired over the same rounds.
    t = time_interleaved({name: steps[name] for name in ("manual full", "ckptlab full", "none", "forward (no grad)")},
                         device=device, warmup=2, target_ci=args.target_ci, max_seconds=args.max_seconds,
                         threads=args.threads)
    per_round = {name: np.asarray(ms) for name, ms in t.times_ms.items()}
    to_none = {name: bootstrap_median(per_round[name] / per_round["none"]) for name in steps}

    print(f"{args.model}  batch={args.batch} seq={args.seq}  device={device}  torch={torch.__version__}  "
          f"threads={t.threads}")
    print(f"{t.rounds} interleaved rounds in {t.seconds:.0f} s, stopped by {t.stopped} (widest interval of a ratio "
          f"to manual full ±{t.ci_half_width:.1%}, target ±{t.target_ci:.1%}); load {t.load_before:.1f} -> "
          f"{t.load_after:.1f} on {t.cpu_count} cores{' (busy: other work competed for the CPU)' if t.busy else ''}")
    print(f"{'variant':>17}  {'step ms [95% CI]':>24}  {'time / none [95% CI]':>24}")
    for name in steps:
        ms = f"{t.step_ms[name]:.2f} [{t.step_ms_low[name]:.2f}, {t.step_ms_high[name]:.2f}]"
        ratio, low, high = to_none[name]
        print(f"{name:>17}  {ms:>24}  {f'{ratio:.3f} [{low:.3f}, {high:.3f}]':>24}")
    wrapper = (t.ratio["ckptlab full"], t.ratio_low["ckptlab full"], t.ratio_high["ckptlab full"])
    print(f"(a) wrapper overhead, ckptlab full / manual full paired per round: {pct(*wrapper, digits=2)}: "
          f"{wrapper_verdict(*wrapper[1:])}")
    share, share_low, share_high = to_none["forward (no grad)"]
    print(f"(b) full vs none: {pct(*to_none['ckptlab full'])};  forward share of a 'none' step (no-grad forward / "
          f"step, paired): {share:.1%} [{share_low:.1%}, {share_high:.1%}] = the ideal recompute cost")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "seq": args.seq, "device": str(device),
                       "rounds": t.rounds, "stopped": t.stopped, "ci_half_width": t.ci_half_width,
                       "target_ci": t.target_ci, "wrapper_ratio": wrapper[0], "wrapper_low": wrapper[1],
                       "wrapper_high": wrapper[2], "step_ms": t.step_ms, "step_ms_low": t.step_ms_low,
                       "step_ms_high": t.step_ms_high, "full_vs_none": list(to_none["ckptlab full"])}, f, indent=1)

if __name__ == "__main__":
    main()
