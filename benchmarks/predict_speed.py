"""Prediction speed: the full trace against the fast path (a few blocks traced, the step composed),
in one run, with the two predictions checked identical.

  1. one prediction per model and sequence length, on an RTX 4090 (CUDA semantics and the
     allocator replay): gpt2-small, hf-llama-1b, hf-llama-7b+lora=16 (bf16 weights), at s2048 and
     s8192 (gpt2-small at its 1024 positions), policy none, and the 7B at s2048 with a plan (a run
     of full, then keep, as the planner makes them) and with 8 gradient-accumulation passes (the
     fast path traces three, composed; the full trace every pass on every block), each path timed
     two ways:
     - first: the model's first prediction in the process (it is built under fake tensors, its
       policy applied and its optimizer warmed up: `estimate.fake_step.PreparedStep`);
     - prepared: a prediction at a sequence length not predicted before in the process, the model
       prepared by an earlier prediction (a table's search, a widget's change);
     the seconds, the full / fast ratio of each, and whether every field of the two paths'
     records is the same; and the seconds of the same question asked again, answered from the
     predictions kept on disk (a folder of the run's own: the run otherwise keeps nothing);
  2. predict_fits over 3 policies and the default cards for hf-llama-7b+lora=16 (bf16 weights, s2048:
     batches of tens) and gpt2-small (fp32, s1024: batches of hundreds), fast path: every
     prediction traced, then the batch searches on batch lines (`estimate.batch_line`), in this
     process and with 2 worker processes (the rows checked equal; with --full-fits, the full trace
     too: minutes), and how many predictions each table traced, took from lines and took from the
     step traced for another card of the same kernels (`compose.from_alike_card`);
  3. `explain` of the 7B LoRA at s2048 on an RTX 4090 (every lever predicted, its plans made), from
     no prepared model, `--repeats` times;
  4. the 7B LoRA at s8192 on the fast path, under torch's FakeTensorMode and ckptlab's
     (`estimate.fake_mode`: the same dispatch cache, cheaper keys, views made from the C++
     kernel's strides), first and prepared as in 1
     (an even number of rounds), each round from an empty dispatch cache, and whether every
     record is the other mode's;
  5. a `ckptlab predict` command (the 7B LoRA's four rows: s2048 and s8192, none and full, on an
     RTX 4090) in a new process, asked once and then again (its rows kept on disk: a folder of the
     run's own), the seconds of each from the process's start, imports included.

Imports and first-call caches are paid before anything is timed (a gpt-tiny prediction, and an
hf-llama-tiny one, which builds transformers' table of checkpoint conversions, made once per
process at its first model). The report says how fast the machine ran a plain Python loop at the
start and the end of the run (`python_loop_s`), a reading to set beside another run's: machines
here differ by 2-3x from one day to the next. Each
path runs `--repeats` rounds, in turns, each round from no prepared model. Timings on a shared
machine are noisy: compare the ratios of one run.

    python benchmarks/predict_speed.py [--quick] [--full-fits] [--out results/predict_speed]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from unittest import mock

from ckptlab import explain, get_workload, predict, predict_fits
from ckptlab.core.cards import DEFAULT_CARDS, parse_capacity
from ckptlab.estimate import answers, batch_line, fake_mode
from ckptlab.estimate import predict as predict_module
from ckptlab.estimate.batch_line import on_line
from ckptlab.estimate.compose import from_alike_card
from ckptlab.estimate.fake_step import clear_prepared

CARD = "rtx4090"
PLAN_7B = "plan=k" + "f" * 5 + "k" * 25 + "f"   # the planner's plan for a 7B LoRA at s2048 on an RTX 4090's capacity
CASES = [  # (model, its overrides, sequence lengths, dtype, policy, training loop)
    ("gpt2-small", {}, [1024], "bf16", "none", "adamw"),
    ("hf-llama-1b", {}, [2048, 8192], "bf16", "none", "adamw"),
    ("hf-llama-7b+lora=16", {}, [2048, 8192], "bf16-weights", "none", "adamw"),
    ("hf-llama-7b+lora=16", {}, [2048], "bf16-weights", PLAN_7B, "adamw"),
    ("hf-llama-7b+lora=16", {}, [2048], "bf16-weights", "none", "adamw,accum=8"),   # 8 passes: 3 traced
]
FITS = [("hf-llama-7b+lora=16", {}, ["none", "selective", "full"], "bf16-weights", list(DEFAULT_CARDS)),
        ("gpt2-small", {}, ["none", "selective", "full"], "fp32", list(DEFAULT_CARDS))]
QUICK_CASES = [("gpt-tiny", {"n_layer": 12}, [64], "fp32", "plan=kffkkkkkkkkf", "adamw")]
# an RTX 4090 with 64 MiB usable, no context nor margin: searches of tens of batch sizes through the allocator
QUICK_FITS = [("gpt-tiny", {"n_layer": 8}, ["full"], "bf16", [parse_capacity("rtx4090", usable_bytes="64MiB", context_bytes=0, required_margin_bytes=0)])]
FITS_SEQ = 2048   # the batch search's sequence length (or the model's limit)
EXPLAIN = ("hf-llama-7b+lora=16", {}, 1, 2048, "bf16-weights")   # (model, overrides, batch, seq, dtype) on CARD
# What the fast path aims at, on 2 idle cores: the 7B LoRA at s8192 on CARD, policy none, predicted
# within GOAL_PREDICTION_S and GOAL_RATIO times faster than the full trace (first and prepared),
# and its table (FITS' first) within GOAL_TABLE_S. The report says which the run meets.
GOAL_MODEL, GOAL_SEQ = "hf-llama-7b+lora=16", 8192
GOAL_PREDICTION_S = 1.0
GOAL_RATIO = 5.0
GOAL_TABLE_S = 20.0
FAKE_MODES = ("hf-llama-7b+lora=16", {}, 8192, "bf16-weights", "none", "adamw")   # as CASES' rows, one length
QUICK_FAKE_MODES = ("gpt-tiny", {"n_layer": 12}, 64, "fp32", "none", "adamw")
QUICK_EXPLAIN = ("gpt-tiny", {"n_layer": 2}, 2, 16, "fp32")
COMMAND = ["predict", "--model", "hf-llama-7b+lora=16", "--batch", "1", "--seq", "2048,8192", "--policy", "none,full",
           "--dtype", "bf16-weights", "--card", CARD]
QUICK_COMMAND = ["predict", "--model", "gpt-tiny", "--set", "n_layer=2", "--batch", "2", "--seq", "16,32", "--policy",
                 "none,full"]


def python_loop_s(additions: int = 10**7) -> float:
    """CPU seconds of a Python loop of `additions` integer additions: this machine's speed at
    plain Python, to read the run's seconds beside another run's."""
    t0 = time.process_time()
    total = 0
    for i in range(additions):
        total += i
    return time.process_time() - t0


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def same_prediction(fast, full) -> list[str]:
    """The fields in which two predictions differ, wall time and path aside."""
    a, b = dataclasses.asdict(fast), dataclasses.asdict(full)
    return [k for k in a if k not in ("predict_s", "trace", "answered_from_cache") and a[k] != b[k]]


def compared(seconds: dict, slower: str, faster: str) -> dict:
    """Of seconds {(way, "first" or "prepared"): each round's}: for first and prepared, the median
    seconds of each way, the median of the rounds' ratios (slower / faster), and each round's."""
    out = {}
    for when in ("first", "prepared"):
        one, other = seconds[(slower, when)], seconds[(faster, when)]
        out.update({f"{when}_{slower}_s": median(one), f"{when}_{faster}_s": median(other),
                    f"{when}_ratio": median(a / b for a, b in zip(one, other)),
                    f"{when}_rounds_{slower}_s": one, f"{when}_rounds_{faster}_s": other})
    return out


def one_prediction(model: str, overrides: dict, seq: int, dtype: str, policy: str, loop: str, repeats: int) -> dict:
    """Both paths, `repeats` rounds of each in turn (the first path of a round alternates), each
    round from no prepared model: the first prediction at `seq`, then one at a sequence length
    new to the process (`seq` - 8 x the round's number, in turn). The medians of their seconds,
    the median of the rounds' ratios."""
    workload = get_workload(model, **overrides)
    options = dict(dtype=dtype, loop=loop, card=CARD, device="cuda")
    seconds = {(trace, when): [] for trace in ("fast", "full") for when in ("first", "prepared")}
    predictions = {}
    for r in range(repeats):
        for trace in ("fast", "full") if r % 2 == 0 else ("full", "fast"):
            clear_prepared()
            predictions[trace], s = timed(lambda: predict(workload, 1, seq, policy, **options, trace=trace))
            seconds[(trace, "first")].append(s)
            _, s = timed(lambda: predict(workload, 1, seq - 8 * (r + 1), policy, **options, trace=trace))
            seconds[(trace, "prepared")].append(s)
    with tempfile.TemporaryDirectory() as folder, mock.patch.dict(os.environ, {"CKPTLAB_CACHE": folder}):
        predict(workload, 1, seq, policy, **options)   # made and kept on disk
        clear_prepared()
        kept, kept_s = timed(lambda: predict(workload, 1, seq, policy, **options))
    if not kept.answered_from_cache or same_prediction(kept, predictions["fast"]):
        raise SystemExit(f"{model} s{seq}: the prediction kept on disk was not the one answered again")
    clear_prepared()
    fast, full = predictions["fast"], predictions["full"]
    result = {"model": workload.label, "seq_len": seq, "dtype": dtype, "card": CARD, "policy": policy, "loop": loop,
              "fast_trace": fast.trace, "identical": not same_prediction(fast, full),
              "differing_fields": same_prediction(fast, full), "peak_bytes": fast.peak_bytes,
              "device_bytes": fast.device_bytes, "kept_s": kept_s}
    return {**result, **compared(seconds, "full", "fast")}


def fake_modes(model: str, overrides: dict, seq: int, dtype: str, policy: str, loop: str, repeats: int) -> dict:
    """The fast path under torch's FakeTensorMode (`fake_mode.RetypingFakeMode`) and ckptlab's
    (`FakeMode`: cheaper keys, its own views), in turns as
    `one_prediction`'s (an even number of rounds, at least `repeats`, so that each mode goes first
    as often), each from no prepared model and an empty dispatch cache (which the two modes share,
    under keys of their own): the medians of their seconds, the median of the rounds' ratios, and
    whether every prediction of the one mode is the other's at the same shape."""
    workload = get_workload(model, **overrides)
    options = dict(dtype=dtype, loop=loop, card=CARD, device="cuda", trace="fast")
    seconds = {(mode, when): [] for mode in ("torch", "ckptlab") for when in ("first", "prepared")}
    predictions = {}
    for r in range(repeats + repeats % 2):
        for mode in ("torch", "ckptlab") if r % 2 == 0 else ("ckptlab", "torch"):
            clear_prepared()
            fake_mode.clear_dispatch_caches()
            with mock.patch.object(fake_mode, "_keys_as_expected", lambda: mode == "ckptlab"):
                if type(fake_mode.new_fake_mode()) is not (fake_mode.FakeMode if mode == "ckptlab" else fake_mode.RetypingFakeMode):
                    raise SystemExit(f"the predictions of {mode}'s rounds would not run in {mode}'s fake mode")
                for when, at in (("first", seq), ("prepared", seq - 8 * (r + 1))):
                    predictions[(mode, r, when)], s = timed(lambda: predict(workload, 1, at, policy, **options))
                    seconds[(mode, when)].append(s)
    clear_prepared()
    if any(p.answered_from_cache for p in predictions.values()):
        raise SystemExit("a fake mode's prediction was answered from the predictions kept on disk, not made")
    result = {"model": workload.label, "seq_len": seq, "dtype": dtype, "card": CARD, "policy": policy, "loop": loop,
              "rounds": repeats + repeats % 2,
              "identical": not any(same_prediction(p, predictions[("torch", *at)])
                                   for (mode, *at), p in predictions.items() if mode == "ckptlab")}
    return {**result, **compared(seconds, "torch", "ckptlab")}


def counting_predictions(fn):
    """(fn(), how many predictions it traced, how many it took from batch lines, how many from the
    step traced for another card)."""
    original, traces = predict_module.predict_policy, []

    def counted(*args, **kwargs):
        prediction = original(*args, **kwargs)
        traces.append(prediction.trace)
        return prediction

    predict_module.predict_policy = counted
    try:
        result = fn()
    finally:
        predict_module.predict_policy = original
    from_lines = sum(1 for t in traces if on_line(t))
    from_cards = sum(1 for t in traces if from_alike_card(t))
    return result, len(traces) - from_lines - from_cards, from_lines, from_cards


def fits_table(model: str, overrides: dict, policies: list[str], dtype: str, capacities: list[str], trace: str,
               workers: int = 1, lines: bool = True) -> dict:
    """The table's seconds and rows; with one worker, how many predictions it traced and took from
    batch lines and from other cards' steps (those of worker processes are not counted here).
    Without `lines`, no line is ever long enough to stand in for a trace: every prediction is traced."""
    workload = get_workload(model, **overrides)
    seq = min(FITS_SEQ, workload.max_seq_len or FITS_SEQ)
    clear_prepared()
    with contextlib.nullcontext() if lines else mock.patch.object(batch_line, "MIN_TRACED", sys.maxsize):
        (made, seconds) = timed(lambda: counting_predictions(lambda: predict_fits(
            workload, policies, capacities, seq_len=seq, dtype=dtype, trace=trace, workers=workers)))
    clear_prepared()
    rows, traced, from_lines, from_cards = made
    return {"traced": traced if workers == 1 else None, "from_lines": from_lines if workers == 1 else None,
            "from_cards": from_cards if workers == 1 else None,
            "model": workload.label, "policies": policies, "cards": [parse_capacity(c).name for c in capacities], "dtype": dtype, "seq_len": seq,
            "trace": trace, "lines": lines, "workers": workers, "seconds": seconds, "rows": rows}


def explained(model: str, overrides: dict, batch: int, seq: int, dtype: str, repeats: int) -> dict:
    """`explain`'s seconds, each from no prepared model, and how many levers it predicted."""
    workload = get_workload(model, **overrides)
    seconds = []
    for _ in range(repeats):
        clear_prepared()
        explanation, s = timed(lambda: explain(workload, batch, seq, "none", dtype=dtype, card=CARD, progress=False))
        seconds.append(s)
    clear_prepared()
    return {"model": workload.label, "batch_size": batch, "seq_len": seq, "dtype": dtype, "card": CARD,
            "levers": len(explanation.levers), "seconds": median(seconds), "rounds_s": seconds}


def command_asked_twice(command: list[str]) -> dict:
    """The seconds of `ckptlab <command>` in a new process, asked once and then again, its rows
    kept in a folder of this run's own (`estimate.answers.spec_key`)."""
    seconds, answered = [], []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(2):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "ckptlab.apps.cli", *command, "--format", "json"],
                                  capture_output=True, text=True, env={**os.environ, "CKPTLAB_CACHE": folder})
            seconds.append(time.perf_counter() - start)
            if done.returncode:
                raise SystemExit(f"ckptlab {' '.join(command)} failed: {done.stderr.strip()}")
            answered.append([row["answered_from_cache"] for row in json.loads(done.stdout)])
    if any(answered[0]) or not all(answered[1]):
        raise SystemExit(f"ckptlab {' '.join(command)}: asked first, rows came from the kept answers, or asked "
                         "again, rows were predicted again")
    return {"command": "ckptlab " + " ".join(command), "rows": len(answered[1]), "first_s": seconds[0],
            "again_s": seconds[1]}


def goals(result: dict) -> list[tuple[str, str, str]]:
    """(goal, what the run measured, met) for each goal that the run measured (none with --quick)."""
    rows = []
    row = next((r for r in result["predictions"] if r["model"] == GOAL_MODEL and r["seq_len"] == GOAL_SEQ
                and r["policy"] == "none" and r["loop"] == "adamw"), None)
    if row is not None:
        seconds = [row["first_fast_s"], row["prepared_fast_s"]]
        ratios = [row["first_ratio"], row["prepared_ratio"]]
        rows.append((f"a {GOAL_MODEL} prediction at s{GOAL_SEQ} on {CARD} within {GOAL_PREDICTION_S:g} s "
                     "(first / prepared)", " / ".join(f"{s:.2f} s" for s in seconds),
                     " / ".join("yes" if s <= GOAL_PREDICTION_S else "no" for s in seconds)))
        rows.append((f"the fast path {GOAL_RATIO:g}x faster than the full trace (first / prepared)",
                     " / ".join(f"{r:.1f}x" for r in ratios),
                     " / ".join("yes" if r >= GOAL_RATIO else "no" for r in ratios)))
    tables = [f for f in result["fits"] if f["model"] == GOAL_MODEL and f["trace"] == "fast"]
    if tables:
        fastest = min(tables, key=lambda f: f["seconds"])
        rows.append((f"its table ({len(fastest['policies'])} policies x {len(fastest['cards'])} cards) within "
                     f"{GOAL_TABLE_S:g} s", f"{fastest['seconds']:.1f} s ({fastest['workers']} worker(s))",
                     "yes" if fastest["seconds"] <= GOAL_TABLE_S else "no"))
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Prediction speed: full trace vs fast path ({result['machine']})", "",
             f"One run, {result['repeats']} rounds of each path (medians; full / fast is the median of the rounds' "
             "ratios). *First*: the model's first prediction in the process (built under fake tensors, policy "
             "applied, optimizer warmed up); *prepared*: a prediction at a sequence length new to the process, the "
             "model prepared by an earlier one; *asked again*: the same question in a process that has not "
             "prepared the model, answered from the predictions kept on disk (`estimate.answers`). Load average (1, 5, 15 min) at the end: "
             f"{', '.join(f'{x:.1f}' for x in result['load_average'])}. This machine ran 10^7 additions in a "
             f"Python loop in {result['python_loop_s'][0]:.2f} s of CPU at the start and "
             f"{result['python_loop_s'][1]:.2f} s at the end (`python_loop_s`: a reading to set beside another "
             "run's; the predictions also build and drop many objects, which this loop does not). "
             "The machine may be shared: compare ratios.", "",
             "| model | seq | dtype | policy | loop | first: full s | fast s | full / fast | prepared: full s | fast s "
             "| full / fast | fast path | identical | asked again: s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["predictions"]:
        lines.append(f"| {r['model']} | {r['seq_len']} | {r['dtype']} | {r['policy']} | {r['loop']} | {r['first_full_s']:.2f} | "
                     f"{r['first_fast_s']:.2f} | "
                     f"{r['first_ratio']:.1f}x | {r['prepared_full_s']:.2f} | {r['prepared_fast_s']:.2f} | "
                     f"{r['prepared_ratio']:.1f}x | {r['fast_trace']} | {'yes' if r['identical'] else 'NO'} | "
                     f"{r['kept_s']:.3f} |")
    lines += ["", "| predict_fits | seq | policies | cards | trace | batch lines | workers | traced | from lines "
              "| from other cards | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in result["fits"]:
        counted = (f"{f['traced']} | {f['from_lines']} | {f['from_cards']}" if f["traced"] is not None
                   else "in workers | in workers | in workers")
        lines.append(f"| {f['model']} | {f['seq_len']} | {', '.join(f['policies'])} | {', '.join(f['cards'])} | "
                     f"{f['trace']} | {'yes' if f['lines'] else 'no'} | {f['workers']} | {counted} | "
                     f"{f['seconds']:.1f} |")
    e = result["explain"]
    lines += ["", "| explain | batch | seq | dtype | card | levers | seconds (median) |", "|---|---|---|---|---|---|---|",
              f"| {e['model']} | {e['batch_size']} | {e['seq_len']} | {e['dtype']} | {e['card']} | {e['levers']} | "
              f"{e['seconds']:.1f} |"]
    m = result["fake_modes"]
    lines += ["", "| fast path, fake mode | seq | policy | first: torch's s | ckptlab's s | torch's / ckptlab's "
              "| prepared: torch's s | ckptlab's s | torch's / ckptlab's | identical |", "|---|---|---|---|---|---|---|---|---|---|",
              f"| {m['model']} | {m['seq_len']} | {m['policy']} | {m['first_torch_s']:.2f} | {m['first_ckptlab_s']:.2f} | "
              f"{m['first_ratio']:.2f}x | {m['prepared_torch_s']:.2f} | {m['prepared_ckptlab_s']:.2f} | "
              f"{m['prepared_ratio']:.2f}x | {'yes' if m['identical'] else 'NO'} |"]
    c = result["command"]
    lines += ["", "| command (new process) | rows | first s | asked again s |", "|---|---|---|---|",
              f"| `{c['command']}` | {c['rows']} | {c['first_s']:.1f} | {c['again_s']:.1f} |"]
    met = goals(result)
    if met:
        lines += ["", "| goal | this run | met |", "|---|---|---|"] + [f"| {g} | {m} | {y} |" for g, m, y in met]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny only, its table on batch lines only (a smoke run)")
    parser.add_argument("--full-fits", action="store_true", help="time predict_fits on the full trace too (minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each path per prediction (default 3)")
    parser.add_argument("--out", default="results/predict_speed", help="folder for predict_speed.json and .md")
    args = parser.parse_args(argv)
    cases, fits = (QUICK_CASES, QUICK_FITS) if args.quick else (CASES, FITS)
    predictions = []
    loop_before = python_loop_s()
    predict(get_workload("gpt-tiny"), 1, 16, "none", card=CARD, device="cuda")   # imports, first-call caches
    if not args.quick:
        predict(get_workload("hf-llama-tiny"), 1, 16, "none", card=CARD, device="cuda")
    for model, overrides, seqs, dtype, policy, loop in cases:
        for seq in seqs:
            predictions.append(one_prediction(model, overrides, seq, dtype, policy, loop, args.repeats))
            r = predictions[-1]
            print(f"{r['model']} s{seq} {dtype} {policy} {loop}: first: full {r['first_full_s']:.2f} s, fast {r['first_fast_s']:.2f} s "
                  f"({r['first_ratio']:.1f}x); prepared: full {r['prepared_full_s']:.2f} s, fast "
                  f"{r['prepared_fast_s']:.2f} s ({r['prepared_ratio']:.1f}x); {r['fast_trace']}, identical: "
                  f"{r['identical']}", flush=True)
    tables = []
    for table in fits:
        these = [fits_table(*table, trace="fast", lines=False)] if not args.quick else []   # --quick: lines only
        these += [fits_table(*table, trace="fast"), fits_table(*table, trace="fast", workers=2)]
        if args.full_fits:
            these.append(fits_table(*table, trace="full"))
        if any(t["rows"] != these[0]["rows"] for t in these[1:]):
            raise SystemExit(f"predict_fits of {table[0]} answered other rows on batch lines, in workers or traced in full")
        for f in these:
            print(f"predict_fits {f['model']} x {len(f['policies'])} policies x {len(f['cards'])} cards, {f['trace']}, "
                  f"batch lines {'yes' if f['lines'] else 'no'}, {f['workers']} worker(s): "
                  + (f"{f['traced']} traced, {f['from_lines']} from lines, {f['from_cards']} from other cards' steps, "
                     if f["traced"] is not None else "")
                  + f"{f['seconds']:.1f} s", flush=True)
        tables += these
    explanation = explained(*(QUICK_EXPLAIN if args.quick else EXPLAIN), args.repeats)
    print(f"explain {explanation['model']} s{explanation['seq_len']} on {CARD}: {explanation['levers']} levers, "
          f"{explanation['seconds']:.1f} s", flush=True)
    modes = fake_modes(*(QUICK_FAKE_MODES if args.quick else FAKE_MODES), args.repeats)
    print(f"fake mode, {modes['model']} s{modes['seq_len']}: first: torch's {modes['first_torch_s']:.2f} s, ckptlab's "
          f"{modes['first_ckptlab_s']:.2f} s ({modes['first_ratio']:.2f}x); prepared: torch's "
          f"{modes['prepared_torch_s']:.2f} s, ckptlab's {modes['prepared_ckptlab_s']:.2f} s "
          f"({modes['prepared_ratio']:.2f}x); identical: {modes['identical']}", flush=True)
    if not modes["identical"]:
        raise SystemExit("the fast path predicted otherwise in torch's FakeTensorMode than in ckptlab's")
    command = command_asked_twice(QUICK_COMMAND if args.quick else COMMAND)
    print(f"{command['command']}: {command['first_s']:.1f} s, asked again {command['again_s']:.1f} s", flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "repeats": args.repeats,
              "load_average": os.getloadavg(), "python_loop_s": [loop_before, python_loop_s()],
              "predictions": predictions, "fits": tables, "explain": explanation, "fake_modes": modes,
              "command": command}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predict_speed.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "predict_speed.md").write_text(markdown(result))
    print(f"wrote {out / 'predict_speed.json'} and {out / 'predict_speed.md'}")


if __name__ == "__main__":
    with answers.off():   # every timed prediction is made, none taken from the answers kept on disk
        main()
