"""Explorer latency on a card: the seconds from a widget change to the redrawn view, when the
explorer predicts for a GPU card (`Explorer(card=...)`).

The explorer is built for hf-llama-7b+lora=16 in bf16 weights on an RTX 4090 (batch 1, seq 2048,
policy none) and shown once (the first view prepares the fake model); then its widgets change one
at a time, as a user's would: seq 2048 -> 4096 -> 8192, batch 1 -> 2, policy none -> full (none's
prediction kept), seq 8192 -> 4096 (both policies predicted at a new shape), card RTX 4090 ->
A100-40 (both predicted for the A100 from the steps traced for the RTX 4090, whose questions
about the card it answers alike: `CudaSemantics.ask`). Each
change is timed from setting the widget's value to the end of its callback (the predictions, the
summary and the figure drawn), with the seconds of the predictions it made beside it. `--quick`
does the same with gpt-tiny (a smoke run).

    python benchmarks/explorer_latency.py [--quick] [--out results/explorer_latency]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import time
from pathlib import Path
from statistics import median

from ckptlab.apps.explorer import Explorer
from ckptlab.estimate import answers

START = dict(model="hf-llama-7b+lora=16", dtype="bf16-weights", card="rtx4090", batch_size=1, seq_len=2048,
             policy="none")
CHANGES = [("seq_len", 4096), ("seq_len", 8192), ("batch_size", 2), ("policy_choice", "full"), ("seq_len", 4096),
           ("card", "a100-40")]   # the same kernels as the RTX 4090's: its steps are taken, replayed for the A100
QUICK_START = dict(START, model="gpt-tiny", dtype="fp32", seq_len=64)
QUICK_CHANGES = [("seq_len", 128), ("seq_len", 256), ("batch_size", 2), ("policy_choice", "full"), ("seq_len", 128),
                 ("card", "a100-40")]


def quietly(fn):
    """(fn()'s wall seconds, its CPU seconds, what it printed): the view prints its summary; the
    benchmark prints its own lines. On a shared machine the wall time grows with the load, the
    CPU time much less."""
    printed = io.StringIO()
    t0, cpu0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(printed):
        fn()
    return time.perf_counter() - t0, time.process_time() - cpu0, printed.getvalue()


def view_row(explorer: Explorer, seen: list, what: str, seconds: float, cpu_s: float, printed: str) -> dict:
    """One timed step: its seconds, and per prediction shown its policy, its own seconds, whether
    this step made it (else the explorer kept it from an earlier step) and its answer."""
    if "error:" in printed:
        raise RuntimeError(f"{what}: the explorer showed an error:\n{printed}")
    c = explorer.config
    predictions = [{"policy": p.policy, "predict_s": p.predict_s, "made_now": not any(p is s for s in seen),
                    "fit": p.fit, "device_bytes": p.device_bytes} for p in explorer.predictions]
    seen.extend(explorer.predictions)
    return {"change": what, "seconds": seconds, "cpu_s": cpu_s, "batch_size": c["batch_size"], "seq_len": c["seq_len"],
            "policy": c["policy"], "predictions": predictions}


def measure_latency(start: dict, changes: list) -> dict:
    explorer = Explorer(**start)
    seen: list = []
    first = view_row(explorer, seen, "first view", *quietly(lambda: explorer.show(interactive=True)))
    rows = []
    for name, value in changes:
        control = explorer._widgets[name]
        what = f"{name.removesuffix('_choice')} {control.value} -> {value}"
        rows.append(view_row(explorer, seen, what, *quietly(lambda: setattr(control, "value", value))))
    return {"model": explorer.config["model"], "dtype": start["dtype"], "card": start["card"], "first": first,
            "changes": rows, "median_s": median(r["seconds"] for r in rows),
            "median_cpu_s": median(r["cpu_s"] for r in rows)}


def markdown(result: dict) -> str:
    lines = [f"# Explorer latency: {result['model']} ({result['dtype']}) on {result['card']} ({result['machine']})", "",
             "Seconds from a widget change to the redrawn view (predictions, summary, figure), wall and CPU; "
             "beside them each prediction shown, its own seconds, and `kept` where the explorer had made it "
             f"before. Load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in result['load_average'])}.",
             "", "| change | seconds | CPU seconds | predictions |", "|---|---|---|---|"]
    for r in [result["first"], *result["changes"]]:
        shown = ", ".join(f"{p['policy']} {p['predict_s']:.2f} s" + ("" if p["made_now"] else " (kept)")
                          for p in r["predictions"])
        lines.append(f"| {r['change']} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | {shown} |")
    lines += ["", f"Median of the changes: {result['median_s']:.2f} s ({result['median_cpu_s']:.2f} s of CPU)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny (a smoke run)")
    parser.add_argument("--out", default="results/explorer_latency", help="folder for latency.json and .md")
    args = parser.parse_args(argv)
    result = measure_latency(*((QUICK_START, QUICK_CHANGES) if args.quick else (START, CHANGES)))
    result.update(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                  load_average=os.getloadavg())
    for r in [result["first"], *result["changes"]]:
        made = ", ".join(f"{p['policy']} {p['predict_s']:.2f} s" for p in r["predictions"] if p["made_now"])
        print(f"{r['change']:>22}: {r['seconds']:.2f} s, {r['cpu_s']:.2f} s CPU  (predicted: {made or 'nothing new'})",
              flush=True)
    print(f"median change: {result['median_s']:.2f} s, {result['median_cpu_s']:.2f} s CPU ({result['model']} "
          f"{result['dtype']} on {result['card']}; load average {result['load_average'][0]:.1f} on "
          f"{os.cpu_count()} CPUs)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latency.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "latency.md").write_text(markdown(result))
    print(f"wrote {out / 'latency.json'} and {out / 'latency.md'}")


if __name__ == "__main__":
    with answers.off():   # every timed prediction is made, none taken from the answers kept on disk
        main()
