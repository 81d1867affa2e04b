"""ckptlab against the knobs users would use instead, on transformers Llama shapes (CPU).

For each shape, `ckptlab.compare(..., anchors=True)` measures ckptlab's uniform policies, the
anchors (per-block torch.utils.checkpoint, torch.compile with activation_memory_budget=0.5,
transformers' own checkpointing full / every_n_layers=2 / 4, SAC through transformers'
context_fn) and the planner's plan at each anchor's measured peak, all timed together. Then, per
anchor, the fastest ckptlab configuration (policy or plan) whose measured peak is at or below the
anchor's, and its time against the anchor's: the paired per-round ratio with its 95% interval.
ckptlab's policies run eager and compiled (`P+compile`); every row's gradients are verified
against the eager un-checkpointed model (`verify=True`), a row whose gradients are wrong is never
a candidate, and an anchor whose gradients are wrong is reported as such, not as faster.

    python benchmarks/frontier.py --shapes small --max-seconds 300 --out results/frontier
    python benchmarks/frontier.py --shapes medium --max-seconds 240 --out results/frontier

On a quiet 2-core CPU (load about 1), one thread, compiled rows and gradient checks included:
`small` took 399 s (18 rounds) and `medium` 1267 s (5 rounds, one step of `none` 4.4 s): the
memory measurements, torch.compile (twice: timed and verified) and the planner's profile, then
the timing budget and the round that ran past it. More rounds need a larger --max-seconds. A loaded machine (load 7-11) made the
same steps up to 7x slower and left 5 rounds with intervals of up to ±50%.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ckptlab import compare, get_workload
from ckptlab.core.units import format_bytes
from ckptlab.probe.timing import paired_ratio, time_verdict

# Llama blocks (RMSNorm, RoPE, SwiGLU, grouped-query attention) at two widths; the vocabulary is
# kept small so that the blocks, not the logits, hold most activation memory.
SHAPES = {
    "small": dict(overrides=dict(num_hidden_layers=8, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512),
                  batch_size=4, seq_len=256),
    "medium": dict(overrides=dict(num_hidden_layers=12, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512),
                   batch_size=2, seq_len=512),
}
POLICIES = ["none", "every=4", "every=2", "density=0.5", "selective", "full",
            "compile", "every=2+compile", "selective+compile", "full+compile"]
CKPTLAB_SOURCES = ("ckptlab", "ckptlab plan")


def best_per_anchor(df):
    """Per anchor that ran: the fastest ckptlab row at or below its peak, and the paired ratio."""
    ok = df[df["status"] == "ok"]
    ours = ok[ok["source"].isin(CKPTLAB_SOURCES) & (ok.get("gradients") != "wrong")]
    out = []
    for anchor in ok[~ok["source"].isin(CKPTLAB_SOURCES)].itertuples():
        fitting = ours[ours["peak_bytes"] <= anchor.peak_bytes]
        row = {"anchor": anchor.policy, "anchor_peak": anchor.peak_bytes, "anchor_ratio": anchor.time_ratio,
               "anchor_low": anchor.time_ratio_low, "anchor_high": anchor.time_ratio_high,
               "anchor_gradients": getattr(anchor, "gradients", None)}
        if not len(fitting):
            out.append({**row, "ckptlab": None})
            continue
        best = fitting.loc[fitting["time_ratio"].idxmin()]
        ratio, low, high = paired_ratio(best, anchor._asdict())
        out.append({**row, "ckptlab": best["policy"], "ckptlab_peak": best["peak_bytes"],
                    "ckptlab_ratio": best["time_ratio"], "vs_anchor": ratio, "vs_anchor_low": low,
                    "vs_anchor_high": high})
    return out


def print_report(name, df, best) -> None:
    first = df[df["status"] == "ok"].iloc[0]
    print(f"\n## {name}: {first['model']} {SHAPES[name]['overrides']['num_hidden_layers']} layers "
          f"d={SHAPES[name]['overrides']['hidden_size']}, batch {first['batch_size']} x seq {first['seq_len']}, "
          f"{first['dtype']}, {first['device_name']}")
    print(f"{int(first['rounds'])} interleaved rounds, {int(first['threads'])} threads, load "
          f"{first['load_before']:.1f} -> {first['load_after']:.1f}{' (busy)' if first['busy'] else ''}; "
          f"time ratios to `none`, 95% intervals\n")
    print("| configuration | source | peak | step ms | time ratio [95% CI] | gradients |")
    print("|---|---|---|---|---|---|")
    for r in df.itertuples():
        if r.status != "ok":
            print(f"| {r.policy} | {r.source} | - | - | {r.status}: {str(r.message)[:80]} | - |")
            continue
        print(f"| {r.policy} | {r.source} | {format_bytes(r.peak_bytes)} | {r.step_ms:.0f} | "
              f"{r.time_ratio:.3f} [{r.time_ratio_low:.3f}, {r.time_ratio_high:.3f}] | "
              f"{getattr(r, 'gradients', None) or '-'} |")
    print("\n| anchor | its peak | its time ratio | best ckptlab at or below that peak | its peak | "
          "ckptlab time / anchor time [95% CI] |")
    print("|---|---|---|---|---|---|")
    for b in best:
        anchor = (f"| {b['anchor']} | {format_bytes(b['anchor_peak'])} | "
                  f"{b['anchor_ratio']:.3f} [{b['anchor_low']:.3f}, {b['anchor_high']:.3f}] |")
        if b["ckptlab"] is None:
            print(anchor + " none fits | - | - |")
            continue
        verdict = ("the anchor's gradients are wrong" if b["anchor_gradients"] == "wrong"
                   else time_verdict(b["vs_anchor_low"], b["vs_anchor_high"]))
        print(anchor + f" {b['ckptlab']} | {format_bytes(b['ckptlab_peak'])} | {b['vs_anchor']:.3f} "
                       f"[{b['vs_anchor_low']:.3f}, {b['vs_anchor_high']:.3f}] ({verdict}) |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small,medium", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--seq", type=int, default=None, help="override every shape's sequence length")
    parser.add_argument("--max-seconds", type=float, default=120, help="timing budget per shape")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 is steadiest on a shared machine)")
    parser.add_argument("--out", default=None, help="folder: one compare table per shape")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in names:
        if name not in SHAPES:
            parser.error(f"--shapes: {name!r} is invalid: allowed are {', '.join(SHAPES)}")
    torch.set_num_threads(args.threads)
    for name in names:
        shape = SHAPES[name]
        workload = get_workload("hf-llama-tiny", **shape["overrides"])
        t0 = time.perf_counter()
        df = compare(workload, shape["batch_size"], args.seq or shape["seq_len"], POLICIES, anchors=True, verify=True,
                     max_seconds=args.max_seconds, out=Path(args.out) / name if args.out else None)
        print_report(name, df, best_per_anchor(df))
        print(f"\n({time.perf_counter() - t0:.0f} s for this shape)")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
