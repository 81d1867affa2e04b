"""Prediction speed: the full trace against the fast path (a few blocks traced, the step composed),
in one run, with the two predictions checked identical.

  1. one prediction per model and sequence length, on an RTX 4090 (CUDA semantics and the
     allocator replay): gpt2-small, hf-llama-1b, hf-llama-7b+lora=16 (bf16 weights), at s2048 and
     s8192 (gpt2-small at its 1024 positions), policy none, each path timed two ways:
     - first: the model's first prediction in the process (it is built under fake tensors, its
       policy applied and its optimizer warmed up: `estimate.fake_step.PreparedStep`);
     - prepared: a prediction at a sequence length not predicted before in the process, the model
       prepared by an earlier prediction (a table's search, a widget's change);
     the seconds, the full / fast ratio of each, and whether every field of the two paths'
     records is the same;
  2. predict_fits for hf-llama-7b+lora=16 over 3 policies and the default cards, fast path, in
     this process and with 2 worker processes (the rows checked equal; with --full-fits, the full
     trace too: minutes), and how many predictions the table took.

Imports and first-call caches are paid before anything is timed (a gpt-tiny prediction). Each
path runs `--repeats` rounds, in turns, each round from no prepared model. Timings on a shared
machine are noisy: compare the ratios of one run.

    python benchmarks/predict_speed.py [--quick] [--full-fits] [--out results/predict_speed]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from statistics import median

from ckptlab import get_workload, predict, predict_fits
from ckptlab.core.cards import DEFAULT_CARDS
from ckptlab.estimate import predict as predict_module
from ckptlab.estimate.fake_step import clear_prepared

CARD = "rtx4090"
CASES = [  # (model, its overrides, sequence lengths, dtype)
    ("gpt2-small", {}, [1024], "bf16"),
    ("hf-llama-1b", {}, [2048, 8192], "bf16"),
    ("hf-llama-7b+lora=16", {}, [2048, 8192], "bf16-weights"),
]
FITS = ("hf-llama-7b+lora=16", {}, ["none", "selective", "full"], "bf16-weights", list(DEFAULT_CARDS))
QUICK_CASES = [("gpt-tiny", {"n_layer": 8}, [64], "fp32")]
QUICK_FITS = ("gpt-tiny", {"n_layer": 8}, ["full"], "fp32", ["24MiB"])   # a size: predicted for a CPU
POLICY = "none"
FITS_SEQ = 2048   # the batch search's sequence length (or the model's limit)


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def same_prediction(fast, full) -> list[str]:
    """The fields in which two predictions differ, wall time and path aside."""
    a, b = dataclasses.asdict(fast), dataclasses.asdict(full)
    return [k for k in a if k not in ("predict_s", "trace") and a[k] != b[k]]


def one_prediction(model: str, overrides: dict, seq: int, dtype: str, repeats: int) -> dict:
    """Both paths, `repeats` rounds of each in turn (the first path of a round alternates), each
    round from no prepared model: the first prediction at `seq`, then one at a sequence length
    new to the process (`seq` - 8 x the round's number, in turn). The medians of their seconds,
    the median of the rounds' ratios."""
    workload = get_workload(model, **overrides)
    options = dict(dtype=dtype, card=CARD, device="cuda")
    seconds = {(trace, when): [] for trace in ("fast", "full") for when in ("first", "prepared")}
    predictions = {}
    for r in range(repeats):
        for trace in ("fast", "full") if r % 2 == 0 else ("full", "fast"):
            clear_prepared()
            predictions[trace], s = timed(lambda: predict(workload, 1, seq, POLICY, **options, trace=trace))
            seconds[(trace, "first")].append(s)
            _, s = timed(lambda: predict(workload, 1, seq - 8 * (r + 1), POLICY, **options, trace=trace))
            seconds[(trace, "prepared")].append(s)
    clear_prepared()
    fast, full = predictions["fast"], predictions["full"]
    result = {"model": workload.label, "seq_len": seq, "dtype": dtype, "card": CARD, "policy": POLICY,
              "fast_trace": fast.trace, "identical": not same_prediction(fast, full),
              "differing_fields": same_prediction(fast, full), "peak_bytes": fast.peak_bytes,
              "device_bytes": fast.device_bytes}
    for when in ("first", "prepared"):
        full_s, fast_s = seconds[("full", when)], seconds[("fast", when)]
        result.update({f"{when}_full_s": median(full_s), f"{when}_fast_s": median(fast_s),
                       f"{when}_ratio": median(a / b for a, b in zip(full_s, fast_s)),
                       f"{when}_rounds_full_s": full_s, f"{when}_rounds_fast_s": fast_s})
    return result


def counting_predictions(fn):
    """(fn(), how many predictions it made)."""
    original, calls = predict_module.predict_policy, []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    predict_module.predict_policy = counted
    try:
        return fn(), len(calls)
    finally:
        predict_module.predict_policy = original


def fits_table(model: str, overrides: dict, policies: list[str], dtype: str, capacities: list[str], trace: str,
               workers: int = 1) -> dict:
    """The table's seconds and rows; with one worker, how many predictions it made (those of
    worker processes are not counted here)."""
    workload = get_workload(model, **overrides)
    seq = min(FITS_SEQ, workload.max_seq_len or FITS_SEQ)
    clear_prepared()
    (rows, predictions), seconds = timed(lambda: counting_predictions(
        lambda: predict_fits(workload, policies, capacities, seq_len=seq, dtype=dtype, trace=trace, workers=workers)))
    clear_prepared()
    return {"predictions": predictions if workers == 1 else None, "model": workload.label, "policies": policies,
            "cards": capacities, "dtype": dtype, "trace": trace, "workers": workers, "seconds": seconds, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# Prediction speed: full trace vs fast path ({result['machine']})", "",
             f"One run, {result['repeats']} rounds of each path (medians; full / fast is the median of the rounds' "
             "ratios). *First*: the model's first prediction in the process (built under fake tensors, policy "
             "applied, optimizer warmed up); *prepared*: a prediction at a sequence length new to the process, the "
             "model prepared by an earlier one. Load average (1, 5, 15 min) at the end: "
             f"{', '.join(f'{x:.1f}' for x in result['load_average'])}. The machine may be shared: compare ratios.", "",
             "| model | seq | dtype | first: full s | fast s | full / fast | prepared: full s | fast s | full / fast "
             "| fast path | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["predictions"]:
        lines.append(f"| {r['model']} | {r['seq_len']} | {r['dtype']} | {r['first_full_s']:.2f} | {r['first_fast_s']:.2f} | "
                     f"{r['first_ratio']:.1f}x | {r['prepared_full_s']:.2f} | {r['prepared_fast_s']:.2f} | "
                     f"{r['prepared_ratio']:.1f}x | {r['fast_trace']} | {'yes' if r['identical'] else 'NO'} |")
    lines += ["", "| predict_fits | policies | cards | trace | workers | predictions | seconds |",
              "|---|---|---|---|---|---|---|"]
    for f in result["fits"]:
        lines.append(f"| {f['model']} | {', '.join(f['policies'])} | {', '.join(f['cards'])} | {f['trace']} | "
                     f"{f['workers']} | {f['predictions'] if f['predictions'] is not None else 'in workers'} | "
                     f"{f['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny only (a smoke run)")
    parser.add_argument("--full-fits", action="store_true", help="time predict_fits on the full trace too (minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each path per prediction (default 3)")
    parser.add_argument("--out", default="results/predict_speed", help="folder for predict_speed.json and .md")
    args = parser.parse_args(argv)
    cases, fits = (QUICK_CASES, QUICK_FITS) if args.quick else (CASES, FITS)
    predictions = []
    predict(get_workload("gpt-tiny"), 1, 16, POLICY, card=CARD, device="cuda")   # imports, first-call caches
    for model, overrides, seqs, dtype in cases:
        for seq in seqs:
            predictions.append(one_prediction(model, overrides, seq, dtype, args.repeats))
            r = predictions[-1]
            print(f"{r['model']} s{seq} {dtype}: first: full {r['first_full_s']:.2f} s, fast {r['first_fast_s']:.2f} s "
                  f"({r['first_ratio']:.1f}x); prepared: full {r['prepared_full_s']:.2f} s, fast "
                  f"{r['prepared_fast_s']:.2f} s ({r['prepared_ratio']:.1f}x); {r['fast_trace']}, identical: "
                  f"{r['identical']}", flush=True)
    tables = [fits_table(*fits, trace="fast"), fits_table(*fits, trace="fast", workers=2)]
    if tables[1]["rows"] != tables[0]["rows"]:
        raise SystemExit("predict_fits with 2 workers answered other rows than with 1")
    if args.full_fits:
        tables.append(fits_table(*fits, trace="full"))
    for f in tables:
        print(f"predict_fits {f['model']} x {len(f['policies'])} policies x {len(f['cards'])} cards, {f['trace']}, "
              f"{f['workers']} worker(s): {f['predictions'] or 'their'} predictions, {f['seconds']:.1f} s")
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "repeats": args.repeats,
              "load_average": os.getloadavg(), "predictions": predictions, "fits": tables}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predict_speed.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "predict_speed.md").write_text(markdown(result))
    print(f"wrote {out / 'predict_speed.json'} and {out / 'predict_speed.md'}")


if __name__ == "__main__":
    main()
