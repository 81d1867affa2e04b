"""ckptlab against the knobs users would use instead, on transformers Llama shapes (CPU).

For each shape, `ckptlab.compare(..., anchors=True)` measures ckptlab's uniform policies, the
anchors (per-block torch.utils.checkpoint, torch.compile with activation_memory_budget 0, 0.25,
0.5 and 0.75, transformers' own checkpointing full / every_n_layers=2 / 4, SAC through
transformers' context_fn), and at each anchor's measured peak the planner's eager plan and the
compiled plan chosen from measured costs (`ckptlab.plan.compiled`), all timed together. Then, per
anchor, the fastest ckptlab configuration (policy or plan) whose measured peak is at or below the
anchor's, and its time against the anchor's: the paired per-round ratio with its 95% interval and
verdict. ckptlab's policies run eager and compiled (`P+compile`); every row's gradients are
verified against the eager un-checkpointed model (`verify=True`), a row whose gradients are wrong
is never a candidate, and an anchor whose gradients are wrong is reported as such.

Each shape comes as its authors configure Llama, attention dropout 0.0 (`small-nodrop`,
`medium-nodrop`), and with attention dropout 0.1 (`small`, `medium`), where every compile budget
below 1 redraws dropout masks in backward and its gradients are wrong. `tiny` is the smallest
setting, eager only (three policies, two anchors, no compilation): seconds, for the tests.
With --out, each shape writes DIR/<shape>/ compare.csv, compare.json, report.md, report.json (one
entry per anchor) and the compare figure. `--confirm` then times each anchor against the row its
report chose, in new rounds that choose nothing (confirm.json, confirm.md).

    python benchmarks/frontier.py --shapes small-nodrop --max-seconds 300 --out results/frontier
    python benchmarks/frontier.py --shapes medium-nodrop --max-seconds 240 --out results/frontier
    python benchmarks/frontier.py --shapes small-nodrop --confirm --max-seconds 300 --out results/frontier

On a quiet 2-core CPU (load about 1), one thread, compiled rows and gradient checks included:
`small` took 399 s (18 rounds) and `medium` 1267 s (5 rounds, one step of `none` 4.4 s) before
the compile anchors at four budgets and the compiled plans were added. A loaded machine (load
7-11) made the same steps up to 7x slower and left 5 rounds with intervals of up to ±50%; at load
7-15, `small-nodrop --compile-points-only` (about 16 models compiled, each twice) ran over an hour.
`medium-nodrop --compile-points-only --max-seconds 240` took 2711 s at load 1.3-1.9 (5 rounds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from ckptlab import compare, get_workload
from ckptlab.core.units import format_bytes
from ckptlab.plan.compiled import uniform_policy
from ckptlab.probe.timing import paired_ratio, time_verdict
from ckptlab.probe.verify import WRONG
from ckptlab.report.plots import compare_plot
from ckptlab.run.anchors import COMPILE_ANCHOR_BUDGETS

# Llama blocks (RMSNorm, RoPE, SwiGLU, grouped-query attention) at two widths; the vocabulary is
# kept small so that the blocks, not the logits, hold most activation memory.
SMALL = dict(num_hidden_layers=8, hidden_size=256, intermediate_size=688, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512)
MEDIUM = dict(num_hidden_layers=12, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512)
TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64, attention_dropout=0.0)
SHAPES = {
    "small": dict(overrides=dict(SMALL, attention_dropout=0.1), batch_size=4, seq_len=256),
    "medium": dict(overrides=dict(MEDIUM, attention_dropout=0.1), batch_size=2, seq_len=512),
    "small-nodrop": dict(overrides=dict(SMALL, attention_dropout=0.0), batch_size=4, seq_len=256),
    "medium-nodrop": dict(overrides=dict(MEDIUM, attention_dropout=0.0), batch_size=2, seq_len=512),
    "tiny": dict(overrides=TINY, batch_size=2, seq_len=16, compiled=False,
                 anchors=["torch.utils.checkpoint per block", "transformers + torch SAC (context_fn)"]),
}
COMPILED_OPTIONS = "ksf025"   # a compiled plan's per-block options: keep, selective, full, budgets 0, 0.2, 0.5
POLICIES = ["none", "every=4", "every=2", "selective", "full",
            "compile", "every=2+compile", "selective+compile", "full+compile"]
EAGER_POLICIES = ["none", "selective", "full"]
COMPILE_POINT_POLICIES = ["none", "selective", "full", "compile", "selective+compile", "full+compile"]
CKPTLAB_SOURCES = ("ckptlab", "ckptlab plan")
COMPILE_ANCHORS = [f"torch.compile activation_memory_budget={b}" for b in COMPILE_ANCHOR_BUDGETS]


def best_per_anchor(df) -> list[dict]:
    """Per anchor that ran: the fastest ckptlab row with right gradients at or below its peak,
    and its time over the anchor's, paired round by round, with the 95% interval's verdict."""
    ok = df[df["status"] == "ok"]
    ours = ok[ok["source"].isin(CKPTLAB_SOURCES) & (ok["gradients"] != WRONG)]
    out = []
    for anchor in ok[~ok["source"].isin(CKPTLAB_SOURCES)].to_dict("records"):
        entry = {"anchor": anchor["policy"], "anchor_peak_bytes": int(anchor["peak_bytes"]),
                 "anchor_time_ratio": [anchor["time_ratio"], anchor["time_ratio_low"], anchor["time_ratio_high"]],
                 "anchor_gradients": anchor["gradients"], "ckptlab": None}
        fitting = ours[ours["peak_bytes"] <= anchor["peak_bytes"]]
        if len(fitting):
            best = fitting.loc[fitting["time_ratio"].idxmin()]
            ratio, low, high = paired_ratio(best, anchor)
            entry.update(ckptlab=best["policy"], ckptlab_source=best["source"],
                         ckptlab_compiled="+compile" in best["policy"], ckptlab_peak_bytes=int(best["peak_bytes"]),
                         ckptlab_gradients=best["gradients"],
                         ckptlab_time_ratio=[best["time_ratio"], best["time_ratio_low"], best["time_ratio_high"]],
                         vs_anchor=ratio, vs_anchor_low=low, vs_anchor_high=high, verdict=time_verdict(low, high))
        out.append(entry)
    return out


def pair(df, name: str, versus: str, question: str) -> dict | None:
    """`name`'s time over `versus`'s, paired round by round, with both peaks; None unless both ran."""
    rows = df[df["status"] == "ok"].set_index("policy", drop=False)
    if name not in rows.index or versus not in rows.index:
        return None
    a, b = rows.loc[name], rows.loc[versus]
    ratio, low, high = paired_ratio(a, b)
    return {"question": question, "row": name, "versus": versus, "row_peak_bytes": int(a["peak_bytes"]),
            "versus_peak_bytes": int(b["peak_bytes"]), "row_gradients": a["gradients"],
            "versus_gradients": b["gradients"], "ratio": ratio, "low": low, "high": high,
            "verdict": time_verdict(low, high)}


def findings(df) -> list[dict]:
    """What wins, measured in one comparison: compiling the head, embeddings and loss with the
    blocks (one graph) against compiling block by block; the compiled plan at each torch.compile
    anchor's peak against the eager plan there; each compiled plan against the fastest uniform
    compiled plan (one option for every block) at or below its peak."""
    n = int(df["n_blocks"].dropna().iloc[0])
    out = [pair(df, "compile", str(uniform_policy("k", n)), "one graph (head and embeddings compiled too) vs block by "
                "block, budget 1"),
           pair(df, f"torch.compile activation_memory_budget={0.5}", str(uniform_policy("5", n)),
                "one graph vs block by block, budget 0.5"),
           pair(df, f"torch.compile activation_memory_budget={0.0}", str(uniform_policy("0", n)),
                "one graph vs block by block, budget 0")]
    ok = df[(df["status"] == "ok") & (df["gradients"] != WRONG)]
    uniform = ok[ok["policy"].str.fullmatch(r"plan=(.)\1*\+compile")]
    for plan in ok[ok["plan_cost_basis"].notna()].to_dict("records") if "plan_cost_basis" in ok else []:
        for anchor in str(plan.get("plan_at_peak_of") or "").split("; "):
            eager = ok[(ok["source"] == "ckptlab plan") & ~ok["policy"].str.contains("compile", regex=False)
                       & ok["plan_at_peak_of"].fillna("").str.contains(anchor, regex=False)] if anchor else ok.iloc[:0]
            if len(eager):
                out.append(pair(df, plan["policy"], eager["policy"].iloc[0], f"compiled plan vs eager plan at {anchor}'s peak"))
        rivals = uniform[(uniform["peak_bytes"] <= plan["peak_bytes"]) & (uniform["policy"] != plan["policy"])]
        if len(rivals):
            best = rivals.loc[rivals["time_ratio"].idxmin(), "policy"]
            out.append(pair(df, plan["policy"], best, "compiled plan vs the fastest uniform compiled plan at or below its peak"))
    return [f for f in out if f is not None]


def goal(best: list[dict]) -> dict:
    """At every torch.compile budget point's peak, is ckptlab's best no slower (the interval says
    so), and at least once faster? Each point's verdict, and whether the goal is reached."""
    points = {b["anchor"]: b.get("verdict", "none fits") for b in best if b["anchor"] in COMPILE_ANCHORS}
    reached = (len(points) == len(COMPILE_ANCHORS) and all(v in ("faster", "no difference") for v in points.values())
               and "faster" in points.values())
    return {"compile_points": points, "reached": reached}


def report_text(name, df, best) -> str:
    first = df[df["status"] == "ok"].iloc[0]
    overrides = SHAPES[name]["overrides"]
    lines = [f"## {name}: {first['model']} {overrides['num_hidden_layers']} layers d={overrides['hidden_size']}, "
             f"attention dropout {overrides['attention_dropout']}, batch {first['batch_size']} x seq {first['seq_len']}, "
             f"{first['dtype']}, {first['device_name']}",
             f"{int(first['rounds'])} interleaved rounds, {int(first['threads'])} threads, load "
             f"{first['load_before']:.1f} -> {first['load_after']:.1f}{' (busy)' if first['busy'] else ''}; "
             "time ratios to `none`, 95% intervals", "",
             "| configuration | source | peak | step ms | time ratio [95% CI] | gradients |", "|---|---|---|---|---|---|"]
    for r in df.to_dict("records"):
        if r["status"] != "ok":
            lines.append(f"| {r['policy']} | {r['source']} | - | - | {r['status']}: {str(r['message'])[:80]} | - |")
            continue
        lines.append(f"| {r['policy']} | {r['source']} | {format_bytes(r['peak_bytes'])} | {r['step_ms']:.0f} | "
                     f"{r['time_ratio']:.3f} [{r['time_ratio_low']:.3f}, {r['time_ratio_high']:.3f}] | "
                     f"{r['gradients'] or '-'} |")
    lines += ["", "| anchor | its peak | its time ratio | its gradients | best ckptlab at or below that peak | its peak | "
              "its gradients | ckptlab time / anchor time [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for b in best:
        ratio, low, high = b["anchor_time_ratio"]
        anchor = (f"| {b['anchor']} | {format_bytes(b['anchor_peak_bytes'])} | {ratio:.3f} [{low:.3f}, {high:.3f}] | "
                  f"{b['anchor_gradients']} |")
        if b["ckptlab"] is None:
            lines.append(anchor + " none fits | - | - | - |")
            continue
        lines.append(anchor + f" {b['ckptlab']} | {format_bytes(b['ckptlab_peak_bytes'])} | {b['ckptlab_gradients']} | "
                     f"{b['vs_anchor']:.3f} [{b['vs_anchor_low']:.3f}, {b['vs_anchor_high']:.3f}] ({b['verdict']}"
                     f"{'; the anchor' + chr(39) + 's gradients are wrong' if b['anchor_gradients'] == WRONG else ''}) |")
    found = findings(df)
    if found:
        lines += ["", "| what wins | row | its peak | versus | its peak | row time / versus time [95% CI] |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {f['question']} | {f['row']} | {format_bytes(f['row_peak_bytes'])} | {f['versus']} | "
                  f"{format_bytes(f['versus_peak_bytes'])} | {f['ratio']:.3f} [{f['low']:.3f}, {f['high']:.3f}] "
                  f"({f['verdict']}) |" for f in found]
    if SHAPES[name].get("compiled", True):
        reached = goal(best)
        wrong = {b["anchor"] for b in best if b["anchor_gradients"] == WRONG}
        lines += ["", "At torch.compile's budget points: " + "; ".join(
            f"{a.split('=')[-1]}: {v}{' (its gradients are wrong)' if a in wrong else ''}"
            for a, v in reached["compile_points"].items())
            + f". Goal (no slower at every point, faster at one): {'reached' if reached['reached'] else 'NOT reached'}."]
    return "\n".join(lines)


def run_shape(name: str, max_seconds: float, seq, out, compile_points_only: bool = False) -> dict:
    """One shape's comparison, report and files; `compile_points_only`: the torch.compile anchors
    alone, with fewer policies (less than half the configurations, for a busy machine)."""
    shape = SHAPES[name]
    compiled = shape.get("compiled", True)
    workload = get_workload("hf-llama-tiny", **shape["overrides"])
    policies = COMPILE_POINT_POLICIES if compile_points_only else POLICIES if compiled else EAGER_POLICIES
    anchors = COMPILE_ANCHORS if compile_points_only else shape.get("anchors", True)
    folder = Path(out) / name if out else None
    t0 = time.perf_counter()
    df = compare(workload, shape["batch_size"], seq or shape["seq_len"], policies, anchors=anchors, verify=True,
                 compiled_options=COMPILED_OPTIONS if compiled else "", max_seconds=max_seconds, out=folder)
    run = {"seconds": round(time.perf_counter() - t0), "max_seconds": max_seconds,
           "compile_points_only": compile_points_only, "compiled_options": COMPILED_OPTIONS if compiled else ""}
    return write_report(name, df, run, folder)


def write_report(name: str, df, run: dict, folder) -> dict:
    """Print the shape's report; with a folder, write report.md, report.json and the figure there."""
    best = best_per_anchor(df)
    text = report_text(name, df, best)
    took = f"{run['seconds']:.0f} s for this shape" if run["seconds"] is not None else "time not recorded"
    print(text + f"\n\n({took})")
    sys.stdout.flush()
    first = df[df["status"] == "ok"].iloc[0]
    report = {"shape": name, "model": "hf-llama-tiny", "overrides": SHAPES[name]["overrides"],
              "batch_size": int(first["batch_size"]), "seq_len": int(first["seq_len"]), "dtype": first["dtype"],
              "device_name": first["device_name"], "torch": torch.__version__, "rounds": int(first["rounds"]),
              "threads": int(first["threads"]), "load_before": first["load_before"], "load_after": first["load_after"],
              "busy": bool(first["busy"]), **run, "anchors": best, "findings": findings(df),
              **({"goal": goal(best)} if SHAPES[name].get("compiled", True) else {})}
    if folder is not None:
        (folder / "report.json").write_text(json.dumps(report, indent=1, default=_plain) + "\n")
        (folder / "report.md").write_text(text + f"\n\n({took}; `python benchmarks/"
                                          f"frontier.py --shapes {name} --max-seconds {run['max_seconds'] or '?'}"
                                          f"{' --compile-points-only' if run['compile_points_only'] else ''}`, "
                                          f"torch {torch.__version__})\n")
        compare_plot(df, folder / "compare")
    return report


def report_again(name: str, out) -> dict:
    """The report of a shape already measured, from DIR/<shape>/compare.json (and report.json's run
    settings): what `--report-only` does after the code that reads a comparison changed."""
    folder = Path(out) / name
    df = pd.DataFrame(json.loads((folder / "compare.json").read_text()))
    report = folder / "report.json"
    previous = json.loads(report.read_text()) if report.exists() else {}
    run = {k: previous.get(k) for k in ("seconds", "max_seconds", "compile_points_only", "compiled_options")}
    return write_report(name, df, run, folder)


def confirm_shape(name: str, max_seconds: float, out) -> dict:
    """Each anchor against the ckptlab row its report chose, timed again in rounds of their own.
    The report chose the fastest of several point estimates from the rounds it then judges with,
    a selection its interval does not account for; these rounds choose nothing. Reads
    DIR/<shape>/report.json, writes confirm.json and confirm.md beside it."""
    folder = Path(out) / name
    report = json.loads((folder / "report.json").read_text())
    chosen = [a for a in report["anchors"] if a["ckptlab"]]
    workload = get_workload("hf-llama-tiny", **SHAPES[name]["overrides"])
    policies = list(dict.fromkeys(["none"] + [a["ckptlab"] for a in chosen]))
    df = compare(workload, report["batch_size"], report["seq_len"], policies, anchors=[a["anchor"] for a in chosen],
                 compiled_options="", max_seconds=max_seconds)
    rows = df[df["status"] == "ok"].set_index("policy", drop=False)
    entries = []
    for a in chosen:
        entry = {"anchor": a["anchor"], "ckptlab": a["ckptlab"], "first_run": [a["vs_anchor"], a["vs_anchor_low"],
                                                                             a["vs_anchor_high"], a["verdict"]]}
        if a["anchor"] in rows.index and a["ckptlab"] in rows.index:
            mine, theirs = rows.loc[a["ckptlab"]], rows.loc[a["anchor"]]
            ratio, low, high = paired_ratio(mine, theirs)
            entry.update(ckptlab_peak_bytes=int(mine["peak_bytes"]), anchor_peak_bytes=int(theirs["peak_bytes"]),
                         vs_anchor=ratio, vs_anchor_low=low, vs_anchor_high=high, verdict=time_verdict(low, high))
        entries.append(entry)
    first = df[df["status"] == "ok"].iloc[0]
    confirm = {"shape": name, "rounds": int(first["rounds"]), "load_before": first["load_before"],
               "load_after": first["load_after"], "busy": bool(first["busy"]), "max_seconds": max_seconds,
               "anchors": entries, **({"goal": goal(entries)} if SHAPES[name].get("compiled", True) else {})}
    lines = [f"## {name}, confirmed: each anchor against the row the report chose, timed again",
             f"{confirm['rounds']} interleaved rounds, load {first['load_before']:.1f} -> {first['load_after']:.1f}"
             f"{' (busy)' if confirm['busy'] else ''}", "",
             "| anchor | ckptlab row | first run [95% CI] | second run [95% CI] |", "|---|---|---|---|"]
    for e in entries:
        ratio, low, high, verdict = e["first_run"]
        again = (f"{e['vs_anchor']:.3f} [{e['vs_anchor_low']:.3f}, {e['vs_anchor_high']:.3f}] ({e['verdict']})"
                 if "verdict" in e else "did not run")
        lines.append(f"| {e['anchor']} | {e['ckptlab']} | {ratio:.3f} [{low:.3f}, {high:.3f}] ({verdict}) | {again} |")
    if "goal" in confirm:
        lines += ["", "Second run, at torch.compile's budget points: " + "; ".join(
            f"{a.split('=')[-1]}: {v}" for a, v in confirm["goal"]["compile_points"].items())
            + f". Goal: {'reached' if confirm['goal']['reached'] else 'NOT reached'}."]
    text = "\n".join(lines)
    print(text)
    (folder / "confirm.json").write_text(json.dumps(confirm, indent=1, default=_plain) + "\n")
    (folder / "confirm.md").write_text(text + f"\n\n(`python benchmarks/frontier.py --shapes {name} --confirm "
                                       f"--max-seconds {max_seconds} --out DIR`, torch {torch.__version__})\n")
    return confirm


def _plain(value):
    """numpy scalars (pandas hands them out) as Python numbers for json."""
    return value.item() if hasattr(value, "item") else str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small-nodrop,medium-nodrop", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--seq", type=int, default=None, help="override every shape's sequence length")
    parser.add_argument("--max-seconds", type=float, default=120, help="timing budget per shape")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 is steadiest on a shared machine)")
    parser.add_argument("--out", default=None, help="folder: one subfolder per shape (compare table, report.json)")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: rewrite each shape's report from its compare.json in --out")
    parser.add_argument("--confirm", action="store_true",
                        help="time each anchor again against the row its report in --out chose, in rounds of their "
                             "own (the choice is then not in the judging rounds): confirm.json, confirm.md")
    parser.add_argument("--compile-points-only", action="store_true",
                        help="only the torch.compile anchors, with policies none, selective, full and their compiled "
                             "forms: less than half the configurations")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in names:
        if name not in SHAPES:
            parser.error(f"--shapes: {name!r} is invalid: allowed are {', '.join(SHAPES)}")
    torch.set_num_threads(args.threads)
    for flag in ("report_only", "confirm"):
        if getattr(args, flag) and not args.out:
            parser.error(f"--{flag.replace('_', '-')} needs --out, the folder the shapes were measured into")
    for name in names:
        if args.report_only:
            report_again(name, args.out)
        elif args.confirm:
            confirm_shape(name, args.max_seconds, args.out)
        else:
            run_shape(name, args.max_seconds, args.seq, args.out, args.compile_points_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
