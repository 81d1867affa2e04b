"""`ckptlab` command line. Each subcommand is a thin layer over a library function.

    ckptlab measure --model gpt-tiny --batch 4 --seq 64 --policy none,density=0.5,full
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import dataclasses
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import yaml

from ..core.cards import DEFAULT_CARDS, card, cards, parse_capacity
from ..core.dtypes import DTYPE_HELP, DTYPES
from ..core.loop import DEFAULT_LOOP, ZERO_GRADS, Loop, as_loop
from ..core.meta import __version__
from ..core.optimizers import OPTIMIZER_HELP
from ..core.parsing import attribute_docs, split_list, yaml_mapping
from ..core.policy import COMPOSITIONS, KINDS, Policy, parse_policies, policy_label
from ..core.units import format_bytes, format_count, parse_bytes
from ..core.validate import choice, integer, integer_list, nearest, number, output_folder, run_name
from ..estimate import answers
from ..estimate.closed_form import closed_form
from ..estimate.compose import fallback_reason
from ..estimate.cuda_device import ALLOC_CONFS
from ..estimate.cuda_semantics import ATTENTION_BACKENDS
from ..estimate.fake_step import parameter_count
from ..estimate.predict import TRACES, check_device, implied_device, predict_fits
from ..estimate.torch_versions import TORCH_VERSIONS, default_torch_version
from ..plan.budget import plan_budget, predict
from ..probe.measure import check_policy_applies
from ..probe.timing import check_timing_options
from ..report.analysis import format_summary
from ..report.explain import explain
from ..report.tables import format_table
from ..run.compare import compare, measure_together
from ..run.compiled_plan import plan_compiled
from ..run.config import SweepConfig
from ..run.progress import progress_bar
from ..run.store import RunLockedError
from ..run.sweep import sweep
from ..workloads.models import PRESETS
from ..workloads.registry import get_workload
from .notebooks import find_notebook, notebook_parameters, run_notebooks

# The hf-* presets live in ckptlab.workloads.hf, which needs transformers; listed here so that --help
# neither imports transformers nor needs it (a test keeps the two lists equal).
HF_PRESET_NAMES = ("hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny", "hf-gpt2", "hf-llama-1b", "hf-llama-7b")

# The policy vocabulary, one example each, from the table of kinds (each parses: tests/test_cli.py).
POLICY_EXAMPLES = [(k.example, k.meaning) for k in KINDS.values()] + list(COMPOSITIONS)

EXIT_CODES = [
    (0, "ok"),
    (1, "a measured failure (a cell or notebook ended in error)"),
    (2, "usage error: bad input, nothing was run"),
    (3, "the run folder is in use by another sweep"),
]

FORMATS = ("table", "json", "csv")


def help_epilog() -> str:
    """What --help ends with: the model presets, the policy vocabulary, the exit codes."""
    width = max(len(example) for example, _ in POLICY_EXAMPLES)
    lines = ["model presets (--model):", "  " + ", ".join(PRESETS),
             "  " + ", ".join(HF_PRESET_NAMES) + " (need: pip install 'ckptlab[hf]')",
             "  or a spec: hf:<model_type>, hf:path/config.json, path/to/file.py:factory, package.module:factory", "",
             "policies (--policy, comma-separated):"]
    lines += [f"  {example:<{width}}  {meaning}" for example, meaning in POLICY_EXAMPLES]
    lines += ["", "exit codes:"] + [f"  {code}  {meaning}" for code, meaning in EXIT_CODES]
    return "\n".join(lines)


def int_list(flag: str, text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: a non-empty list of integers >= 1 (ValueError naming `flag` otherwise)."""
    try:
        return integer_list(flag, split_list(text), 1)
    except ValueError:
        raise ValueError(f"{flag}={text!r} is invalid: allowed is a comma-separated list of integers >= 1, "
                         "e.g. 1,2,4") from None


def policy_list(text: str) -> list[Policy]:
    """--policy 'none,density=0.5' -> the policies, each parsed once; empty is refused."""
    return parse_policies(text, "--policy")


def _num(fmt: str):
    return lambda v: "-" if v is None else format(v, fmt)


def _plain(value):
    """A record value as JSON/CSV takes it: numpy scalars as Python numbers, NaN as null."""
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def print_rows(rows: list[dict], columns: list, fmt: str, heading: str = "") -> None:
    """Rows as a text table under `heading` (table), or every field of every row, for scripts:
    a JSON list (json) or CSV with a header (csv); no heading then."""
    if fmt == "table":
        if heading:
            print(heading)
        print(format_table(rows, columns))
    elif fmt == "json":
        print(json.dumps([{k: _plain(v) for k, v in r.items()} for r in rows], indent=1, default=str))
    else:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(sys.stdout, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else _plain(v) for k, v in r.items()})


MEASURE_COLUMNS = [
    ("policy", "policy", policy_label),
    ("density", "effective_density", _num(".2f")),
    ("batch", "batch_size", str),
    ("seq", "seq_len", str),
    ("peak", "peak_bytes", format_bytes),
    ("activations@peak", "peak_activations_bytes", format_bytes),
    ("saved by forward", "saved_activation_bytes", format_bytes),
    ("recomputed blocks", "recompute_count", str),
    ("step ms [95% CI]", "step_text", str),
    ("overhead [95% CI]", "overhead_text", str),
    ("tokens/s", "tokens_per_s", _num(",.0f")),
    ("status", "status", str),
]


def measure_columns(loop: Loop) -> list:
    """MEASURE_COLUMNS for `loop`: with accumulation, the recompute count is of the optimizer step,
    every micro-batch's together, and its header says so."""
    if loop.accum_steps == 1:
        return MEASURE_COLUMNS
    header = f"recomputed blocks/step ({loop.accum_steps} micro-batches)"
    return [(header, key, fmt) if key == "recompute_count" else (label, key, fmt) for label, key, fmt in MEASURE_COLUMNS]


def cmd_measure(args: argparse.Namespace) -> int:
    policies = policy_list(args.policy)
    batches, seqs = int_list("--batch", args.batch), int_list("--seq", args.seq)
    workload = get_workload(args.model, **_model_overrides(args.set))
    for policy in policies:  # every policy before the first measurement
        check_policy_applies(workload, policy)
    check_timing_options(0.02, args.max_seconds)
    choice("dtype", args.dtype, DTYPES)
    loop = loop_from_arguments(args, dtype=args.dtype)
    limit = parse_bytes(args.memory_limit)
    rows = []
    for batch in batches:
        for seq in seqs:
            rows += measure_together(workload, batch, seq, policies, device=args.device, dtype=args.dtype,
                                     loop=loop, memory_limit_bytes=limit, steps=args.steps, warmup=args.warmup,
                                     max_seconds=args.max_seconds, progress=True)
    for r in rows:
        r["step_text"] = "-" if r["step_ms"] is None else f"{r['step_ms']:.1f} [{r['step_ms_low']:.1f}, {r['step_ms_high']:.1f}]"
        r["overhead_text"] = "-" if r["time_ratio"] is None else (
            f"{r['time_ratio'] - 1:+.0%} [{r['time_ratio_low'] - 1:+.0%}, {r['time_ratio_high'] - 1:+.0%}]"
            + (" *" if r["significant"] else ""))
    timed = next((r for r in rows if r["rounds"]), rows[0])
    print_rows(rows, measure_columns(loop), args.format,
               f"{args.model} on {rows[0]['device_name']} ({rows[0]['device']}, {args.dtype}, loop {loop}): "
               f"policies of one shape timed together, {timed['rounds']} interleaved rounds, {timed['threads']} threads; "
               f"medians with 95% intervals; overhead vs {policies[0]} (* = the interval excludes 0)")
    if timed["busy"] and args.format == "table":
        print(f"busy machine: load {timed['load_before']:.1f} -> {timed['load_after']:.1f}, more than the CPU cores")
    failed = [r for r in rows if r["status"] == "error"]
    for r in failed:
        print(f"error in {r['policy']} b={r['batch_size']} s={r['seq_len']}: {r['message']}", file=sys.stderr)
    return 1 if failed else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    config = config_from_arguments(SweepConfig, args)
    try:
        df = sweep(config)
    except RunLockedError as exc:  # another sweep is writing there: refuse, do not interleave
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if not args.no_plots:
        from ..report.plots import redraw_all  # noqa: PLC0415 - matplotlib is heavy; only figures need it
        redraw_all(config.out)
    print(format_summary(df))
    print(f"run folder: {config.out} (loop {config.loop}, accum_steps {','.join(map(str, config.accum_steps))})")
    return 1 if (df["status"] == "error").any() else 0


def add_config_arguments(p: argparse.ArgumentParser, config_class) -> None:
    """--config FILE.yaml, and one flag per field of the dataclass `config_class` that names one
    in its metadata; the help is the field's docstring. A flag not given leaves the file's value,
    else the field's default (or the command line's own default, `cli_default`)."""
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="a YAML file of the fields below (model, batch_sizes, ...); flags override it")
    docs = attribute_docs(config_class)
    for f in dataclasses.fields(config_class):
        flag = f.metadata.get("flag")
        if not flag:
            continue
        default = f.metadata.get("cli_default", f.default_factory() if callable(f.default_factory) else f.default)
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        text = docs[f.name] + ("" if default in (None, {}) else f" (default: {shown})")
        kind = _argument_kind(f)
        if kind == "bool":
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=text.replace("%", "%%"))
        elif kind == "pairs":
            p.add_argument(flag, dest=f.name, action="append", default=None, metavar="KEY=VALUE",
                           help=text.replace("%", "%%"))
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=text.replace("%", "%%"))


def config_from_arguments(config_class, args: argparse.Namespace):
    """The dataclass from --config's file and the flags given (ValueError otherwise). An error
    names a value the file gave by its key there: the flag not typed leaves `args.flags`."""
    from_file = dict(yaml_mapping("--config", args.config)) if args.config else {}
    values, typed = dict(from_file), set(loop_flags_given(args))
    for f in dataclasses.fields(config_class):
        flag, raw = f.metadata.get("flag"), getattr(args, f.name, None)
        if not flag:
            continue
        if raw is not None:
            values[f.name] = _argument_value(_argument_kind(f), flag, raw)
            typed.add(flag)
        elif "cli_default" in f.metadata and f.name not in values:
            values[f.name] = f.metadata["cli_default"]
    file_flags = {f.metadata.get("flag") for f in dataclasses.fields(config_class) if f.name in from_file}
    if "loop" in from_file:
        file_flags |= set(LOOP_FLAGS)
    args.flags = {name: flag for name, flag in args.flags.items() if flag not in file_flags - typed}
    if "loop" in {f.name for f in dataclasses.fields(config_class)}:   # its flags are the loop's (`add_loop_arguments`)
        values["loop"] = loop_from_arguments(args, values.get("loop"))
    return config_class.from_dict(values, source=f"--config={args.config!r}" if args.config else "arguments")


def _argument_kind(f: dataclasses.Field) -> str:
    """How a field's flag is read, from its annotation (text under `from __future__ import annotations`)."""
    kinds = {"list[int]": "ints", "list[str]": "strs", "dict": "pairs", "bool": "bool", "Optional[bool]": "bool",
             "int": "int", "Optional[int]": "int", "float": "float", "Optional[float]": "float"}
    return kinds.get(str(f.type), "str")


def _argument_value(kind: str, flag: str, raw):
    if kind == "ints":
        return int_list(flag, raw)
    if kind == "strs":
        items = split_list(raw, flag)
        if not items:
            raise ValueError(f"{flag}={raw!r} is invalid: allowed is a comma-separated list, e.g. a,b")
        return items
    if kind == "pairs":
        return _model_overrides(raw)
    if kind in ("int", "float"):
        try:
            return int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ValueError(f"{flag}={raw!r} is invalid: allowed is {'an integer' if kind == 'int' else 'a number'}") from None
    return raw


def format_compare(df: pd.DataFrame) -> str:
    """The comparison as a text table: peak, step time and time ratio with its interval."""
    def ratio(r):
        if r.get("time_ratio") is None or r["time_ratio"] != r["time_ratio"]:
            return "-"
        mark = " *" if r.get("significant") else ""
        return f"{r['time_ratio']:.3f} [{r['time_ratio_low']:.3f}, {r['time_ratio_high']:.3f}]{mark}"

    def value(fmt):
        return lambda v: "-" if v is None or v != v else format(v, fmt)

    rows = [dict(r, ratio_text=ratio(r)) for r in df.to_dict("records")]
    columns = [("policy", "policy", policy_label), ("source", "source", str),
               ("density", "effective_density", value(".2f")),
               ("peak", "peak_bytes", lambda v: "-" if v is None or v != v else format_bytes(v)),
               ("step ms", "step_ms", value(".1f")), ("time ratio [95% CI]", "ratio_text", str),
               ("status", "status", str)]
    if "gradients" in df:
        columns.insert(-1, ("gradients", "gradients", lambda v: v if isinstance(v, str) else "-"))
        columns.insert(-1, ("max grad rel diff", "max_grad_rel_diff", value(".2g")))
    lines = [format_table(rows, columns)]
    ok = df[df["status"] == "ok"]
    if len(ok):
        first = ok.iloc[0]
        lines.append(f"{int(first['rounds'])} interleaved rounds, {int(first['threads'])} threads, "
                     f"load {first['load_before']:.2f} -> {first['load_after']:.2f}"
                     + (" (busy machine: more load than cores)" if first["busy"] else "")
                     + "; * = the interval excludes 1")
    for r in df[df["status"] != "ok"].to_dict("records"):
        lines.append(f"{r['policy']}: {r['status']}: {r['message']}")
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    if args.threads is not None:
        integer("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    workload = get_workload(args.model, **_model_overrides(args.set))
    loop = loop_from_arguments(args, dtype=args.dtype)
    df = compare(workload, args.batch, args.seq, policy_list(args.policy), dtype=args.dtype, loop=loop, device=args.device,
                 target_ci=args.target_ci, max_seconds=args.max_seconds, anchors=args.anchors, verify=args.verify,
                 out=args.out)
    first = df.iloc[0]
    if args.format == "table":
        print(f"{args.model} b={args.batch} s={args.seq} {args.dtype}, loop {loop} on {first['device_name']} "
              f"({first['device']}); "
              f"time ratios to {df['policy'].iloc[0]}")
        print(format_compare(df))
    else:
        print_rows(df.to_dict("records"), [], args.format)
    if args.out:
        from ..report.plots import compare_plot  # noqa: PLC0415 - matplotlib is heavy; only figures need it
        compare_plot(df, Path(args.out) / "figures" / "compare")
        # json and csv keep stdout to the rows, for scripts
        print(f"table and figure: {args.out}", file=sys.stdout if args.format == "table" else sys.stderr)
    return 1 if ((df["source"] == "ckptlab") & (df["status"] == "error")).any() else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..report.plots import redraw_all  # noqa: PLC0415 - matplotlib is heavy; only figures need it
    for path in redraw_all(args.run_dir):
        print(path)
    return 0


def _literal(text: str):
    """A YAML scalar (or flow list: depths=[1,1,2,1]); 1e-5, which YAML 1.1 reads as text, as a float."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def cmd_notebooks_run(args: argparse.Namespace) -> int:
    output_folder("--out", args.out)
    if args.name is not None:
        run_name("--name", args.name)
    number("--timeout", args.timeout, 0.0, low_open=True)
    overrides = {}
    for key, value in args.param:
        try:
            overrides[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:  # malformed, or a tag such as !!python/object that safe_load refuses
            reason = " ".join(str(getattr(exc, "problem", None) or exc).split())
            raise ValueError(f"-p {key} {value!r} is invalid: {reason}; allowed is a YAML literal "
                             "such as 8, 0.5, full, [1, 2] or null") from None
    runs = run_notebooks(args.names or None, param_set=args.file, overrides=overrides, out=args.out,
                         run_name=args.name, timeout_s=args.timeout, executor=args.executor,
                         job_options=dict(cluster=args.cluster, slurm_partition=args.slurm_partition,
                                          slurm_gpus_per_job=args.slurm_gpus, slurm_time_min=args.slurm_time,
                                          slurm_account=args.slurm_account))
    failed = [r for r in runs if r.status != "ok"]
    print(f"{len(runs) - len(failed)} of {len(runs)} notebooks ran; results index: {args.out}/README.md")
    for r in failed:
        print(f"FAILED {r.notebook} ({r.status}): {r.error}", file=sys.stderr)
    return 1 if failed else 0


def cmd_notebooks_params(args: argparse.Namespace) -> int:
    path = find_notebook(args.name)
    params = list(notebook_parameters(path).values())
    print(f"{path.stem} parameters:")
    print(format_table([vars(p) for p in params],
                       [("name", "name", str), ("type", "type", str), ("default", "default", str), ("help", "help", str)]))
    return 0


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    """--executor local|submitit and the job options (ckptlab.run.config.job_options)."""
    p.add_argument("--executor", choices=("local", "submitit"), default="local",
                   help="local: run here; submitit: one job per cell/chunk/notebook (SLURM, or --cluster local)")
    p.add_argument("--cluster", choices=("slurm", "local", "debug"), default=None,
                   help="submitit cluster (default: SLURM when srun is on PATH, else local processes)")
    p.add_argument("--slurm-partition", default=None, help="SLURM partition")
    p.add_argument("--slurm-gpus", type=int, default=None, help="GPUs per job (sweep default: --nproc on CUDA, else 0)")
    p.add_argument("--slurm-time", type=int, default=60, help="time limit per job, minutes (default 60)")
    p.add_argument("--slurm-account", default=None, help="SLURM account")


def _model_overrides(pairs) -> dict:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set={pair!r} is invalid: allowed is KEY=VALUE, e.g. n_layer=8")
        out[key.strip()] = _literal(value.strip())
    return out


PREDICT_COLUMNS = [
    ("policy", "policy", policy_label),
    ("batch", "batch_size", str),
    ("seq", "seq_len", str),
    ("predicted peak", "predicted_peak_bytes", format_bytes),
    ("activations@peak", "predicted_peak_activations_bytes", format_bytes),
    ("saved by forward", "predicted_saved_activation_bytes", format_bytes),
    ("peak in", "peak_phase", str),
    ("plan", "plan", lambda v: v or ""),
    ("closed form", "closed_form_peak_bytes", format_bytes),
    ("seconds", "predict_s", _num(".1f")),
]


def cuda_predict_columns(card_name: str | None) -> list:
    """PREDICT_COLUMNS for a prediction for CUDA: the allocator's numbers, and on a card its
    device bytes and margin, each labelled with the card they are predicted for."""
    on = f" ({card_name})" if card_name else " (cuda)"
    columns = [c for c in PREDICT_COLUMNS if c[1] not in ("predicted_peak_bytes", "closed_form_peak_bytes")]
    at = [key for _, key, _ in columns].index("predicted_peak_activations_bytes")
    columns[at:at] = [("allocated" + on, "predicted_peak_bytes", format_bytes),
                      ("reserved" + on, "predicted_reserved_bytes", format_bytes)]
    if card_name:
        columns[at + 2:at + 2] = [("device" + on, "predicted_device_bytes", format_bytes),
                                  ("margin left" + on, "margin_bytes", format_bytes),
                                  ("fits", "fit_text", str), ("flushes/step", "cache_flushes", _count),
                                  ("reserved in step", "worse_step", _count)]
    columns.insert(at, ("attention", "attention_backend", str))
    columns.insert(at + 1, ("torch", "torch_version", str))
    return columns


def _count(value) -> str:
    return "-" if value is None else str(value)


def fit_text(row: dict) -> str:
    """A card's "fits" cell: the answer and, where the device bytes pass the card less its margin
    (margin left below 0), by how much."""
    if row["margin_bytes"] >= 0:
        return row["fit"]
    return f"{row['fit']} (over by {format_bytes(-row['margin_bytes'])})"


def margin_note(card_name: str) -> str:
    """What a margin left below 0 means on `card_name`, under a table that has one."""
    c = card(card_name)
    return (f"margin left: the {c.label}'s {format_bytes(c.usable_bytes)} usable less its "
            f"{format_bytes(c.required_margin_bytes)} margin less the device bytes; a row over by some bytes (margin "
            "left below 0) runs only with cache flushes, the allocator releasing its cached segments and retrying "
            "(flushes/step, each a synchronizing cudaFree: slower), or, where that finds no room, not at all (no)")


def device_options(args: argparse.Namespace) -> dict:
    """`predict`'s device, card, attention, torch version and allocator option from --device,
    --card, --attention, --torch-version and --alloc-conf (without --device, a card, or explain's
    --capacity naming one, means CUDA). Checked as `predict` checks them, before any work."""
    capacity = getattr(args, "capacity", None)
    on_card = args.card or (capacity is not None and parse_capacity(capacity).arch)
    device = implied_device(args.device, on_card or None)
    options = {"device": device, "card": args.card, "attention": args.attention, "torch_version": args.torch_version,
               "alloc_conf": args.alloc_conf}
    check_device(**options)
    return options


def predicted_for(options: dict) -> str:
    """What a command's sizes are predicted for, in words."""
    allocator = f", PYTORCH_CUDA_ALLOC_CONF={options['alloc_conf']}" if options.get("alloc_conf") else ""
    if options["card"]:
        return f"predicted for {card(options['card']).describe()}{allocator}"
    if options["device"] == "cuda":
        return f"predicted for CUDA (allocator only, no card){allocator}"
    return "predicted for a CPU"


def fallback_notes(rows: list[dict]) -> list[str]:
    """Under predict's table: why the fast path traced rows in full, one line per reason, naming
    the rows where not all are."""
    rows_by_reason: dict = {}
    for r in rows:
        reason = fallback_reason(r["trace"])
        if reason is not None:
            rows_by_reason.setdefault(reason, []).append(f"{policy_label(r['policy'])} b={r['batch_size']} "
                                                         f"s={r['seq_len']}")
    return [f"traced in full, not composed{'' if len(which) == len(rows) else ' (' + ', '.join(which) + ')'}: "
            f"{reason}" for reason, which in rows_by_reason.items()]


def cmd_predict(args: argparse.Namespace) -> int:
    """Predicted memory per policy without allocating (fake tensors); closed form beside. With
    several cards (--card a,b), a table per card: a card that makes the same kernel choices as one
    before it takes that card's traced steps (`compose.from_alike_card`), its allocator replay its own."""
    cards = [None] if args.card is None else list(dict.fromkeys(
        _listed("--card", args.card, "a card or a comma-separated list of cards (ckptlab cards)")))
    targets = [device_options(argparse.Namespace(**{**vars(args), "card": name})) for name in cards]
    loop = loop_from_arguments(args, dtype=args.dtype)
    overrides = _model_overrides(args.set)
    settings = [(batch, seq, policy) for batch in int_list("--batch", args.batch) for seq in int_list("--seq", args.seq)
                for policy in policy_list(args.policy)]
    tables = []   # (what it is predicted for, its rows)
    workload = None
    with contextlib.closing(progress_bar(len(settings) * len(targets), "predict", "row")) as bar:
        for on in targets:
            # The rows of the same command asked before, kept without building the model (its
            # imports and build are most of a repeated command's seconds); each row is also kept on its own.
            page = answers.spec_key(args.model, overrides, 0, (
                "predict rows", [(b, s, str(p)) for b, s, p in settings], args.dtype, repr(loop), repr(on),
                repr(card(on["card"])) if on["card"] else None, args.trace))
            start = time.perf_counter()
            kept_page = answers.fetch(page) if page else None
            if isinstance(kept_page, tuple) and len(kept_page) == 2:
                n_params, rows = kept_page
                rows = [dict(r, answered_from_cache=True, predict_s=(time.perf_counter() - start) / len(rows))
                        for r in rows]
                bar.update(len(rows))
            else:
                if workload is None:
                    workload = get_workload(args.model, **overrides)
                rows = []
                for batch, seq, policy in settings:
                    rows.append(_predicted_row(workload, batch, seq, policy, args, loop, on))
                    bar.update(1)
                n_params = parameter_count(workload)   # on the model the predictions built
                if page:
                    answers.keep(page, (n_params, rows))
            tables.append((on, rows))
    if args.format != "table":   # every row of every card, for scripts
        print_rows([r for _, rows in tables for r in rows], PREDICT_COLUMNS, args.format)
        return 0
    for i, (on, rows) in enumerate(tables):
        columns = PREDICT_COLUMNS if on["device"] == "cpu" else cuda_predict_columns(on["card"])
        shown = [dict(r, fit_text=fit_text(r)) for r in rows] if on["card"] else rows
        print_rows(shown, columns, "table", ("\n" if i else "") + f"{args.model} ({format_count(n_params)} parameters), "
                   f"{args.dtype}, loop {loop}: {predicted_for(on)}, nothing allocated")
        if on["card"] and any(r["margin_bytes"] < 0 for r in rows):
            print(margin_note(on["card"]))
        for note in fallback_notes(rows):
            print(note)
        kept = sum(1 for r in rows if r["answered_from_cache"])
        if kept:
            print(f"{kept} of {len(rows)} rows answered from the predictions kept in {answers.folder()} (made before by "
                  "this code); CKPTLAB_CACHE=off predicts them again")
    return 0


def _listed(flag: str, text: str, allowed: str) -> list[str]:
    """The items of a comma-separated value; ValueError, naming `flag`, for an empty item or none."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"{flag} {text!r} is invalid: allowed is {allowed}, none empty")
    return items


def _predicted_row(workload, batch: int, seq: int, policy: Policy, args: argparse.Namespace, loop: Loop,
                   on: dict) -> dict:
    """One `predict` row: the prediction's record, and on a CPU the closed form beside it."""
    row = predict(workload, batch, seq, policy, dtype=args.dtype, loop=loop, **on, trace=args.trace).record()
    if on["device"] == "cpu":
        try:
            row.update(closed_form(workload, batch, seq, Policy("plan", row["plan"]) if row["plan"] else policy,
                                   dtype=args.dtype))
        except ValueError:
            pass
    return row


FITS_COLUMNS = [
    ("policy", "policy", policy_label),
    ("capacity", "capacity", str),
    ("largest batch", "max_batch_size", _count),
    ("at seq", "seq_len", str),
    ("batch margin", "batch_margin_bytes", format_bytes),
    ("batch with flushes", "max_batch_size_with_flushes", _count),
    ("longest seq", "max_seq_len", _count),
    ("at batch", "batch_size", str),
    ("seq margin", "seq_margin_bytes", format_bytes),
    ("seq with flushes", "max_seq_len_with_flushes", _count),
]


FITS_SEQ = 2048   # `fits`' sequence length for its batch search, where the model takes one so long


def or_more(row: dict, field: str):
    """A batch the search stopped at (`predict_fits`' `max_batch_searched`): that or more."""
    value = row[field]
    return f"{value} or more" if value is not None and value == row["max_batch_searched"] else value


def cmd_fits(args: argparse.Namespace) -> int:
    """The largest batch and the longest sequence per policy and card, by prediction."""
    loop = loop_from_arguments(args, dtype=args.dtype)
    workload = get_workload(args.model, **_model_overrides(args.set))
    seq = args.seq if args.seq is not None else min(FITS_SEQ, workload.max_seq_len or FITS_SEQ)
    capacities = [parse_capacity(c, "--cards")
                  for c in _listed("--cards", args.cards, "a comma-separated list of cards or sizes")]
    policies = policy_list(args.policy)
    with contextlib.closing(progress_bar(len(policies) * len(capacities), "fits", "row")) as bar:
        rows = predict_fits(workload, policies, capacities, seq_len=seq, batch_size=args.batch, dtype=args.dtype,
                            loop=loop, attention=args.attention, torch_version=args.torch_version,
                            alloc_conf=args.alloc_conf, trace=args.trace, workers=args.workers, progress=bar.update)
    if args.format == "table":
        rows = [dict(r, **{f: or_more(r, f) for f in ("max_batch_size", "max_batch_size_with_flushes")}) for r in rows]
    up_to = f" up to the model's {workload.max_seq_len} positions" if workload.max_seq_len else ""
    longest = " (the model's longest)" if args.seq is None and seq < FITS_SEQ else ""
    print_rows(rows, FITS_COLUMNS, args.format,
               f"{args.model} ({format_count(parameter_count(workload))} parameters), {args.dtype}, loop {loop}: the largest "
               f"batch at seq {seq}{longest} and the longest sequence (of the powers of two{up_to}) at batch {args.batch} that "
               "fit, predicted per card with the margin left (nothing allocated; 0: not even the smallest fits; "
               "with flushes: what runs with the allocator flushing its cache, on a card)")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Choose keep/selective/full per block for a memory budget; print the plan."""
    loop = loop_from_arguments(args, dtype=args.dtype)
    workload = get_workload(args.model, **_model_overrides(args.set))
    if args.compile:
        if loop != Loop():
            raise ValueError(f"the loop {loop} is invalid with --compile: a compiled plan is measured in the loop "
                             f"{Loop()}; allowed is one of the two")
        return _compiled_plan(args, workload)
    on = device_options(args)
    plan = plan_budget(workload, args.batch, args.seq, args.budget, dtype=args.dtype, loop=loop, cost=args.cost, **on)
    if args.format != "table":
        row = {"model": args.model, "batch_size": args.batch, "seq_len": args.seq, "dtype": args.dtype,
               "budget": args.budget, "policy": f"plan={plan.letters}", **plan.record(), **loop.record(),
               "plan_none_peak_bytes": plan.none_peak_bytes, "plan_full_peak_bytes": plan.full_peak_bytes, **on}
        print_rows([row], [], args.format)
        return 0
    print(f"{args.model} b={args.batch} s={args.seq} {args.dtype}, loop {loop}, budget {args.budget}: {predicted_for(on)}")
    print(plan)
    print(f"apply it with: --policy plan={plan.letters}")
    return 0


CARD_COLUMNS = [
    ("card", "name", str),
    ("", "label", str),
    ("usable", "usable_bytes", format_bytes),
    ("context", "context_bytes", format_bytes),
    ("margin", "required_margin_bytes", format_bytes),
    ("budget", "budget_bytes", format_bytes),
    ("arch", "arch", str),
]


def cmd_cards(args: argparse.Namespace) -> int:
    """The cards a capacity may name, by what they offer."""
    rows = [{**dataclasses.asdict(c), "budget_bytes": c.budget_bytes} for c in cards()]
    print_rows(rows, CARD_COLUMNS, args.format, "usable: total_memory as torch reports it; budget: what the "
               "caching allocator may reserve (usable less context and margin)")
    return 0


def _compiled_plan(args: argparse.Namespace, workload) -> int:
    """`plan --compile`: a plan for the compiled model, from measured costs, and measured."""
    if args.threads is not None:
        integer("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    plan = plan_compiled(workload, args.batch, args.seq, args.budget, options=args.options, dtype=args.dtype,
                         max_seconds=args.max_seconds, target_ci=args.target_ci)
    if args.format != "table":
        row = {"model": args.model, "batch_size": args.batch, "seq_len": args.seq, "dtype": args.dtype,
               "budget": args.budget, "policy": plan.policy, "plan": plan.letters,
               "plan_budget_bytes": plan.budget_bytes, "plan_predicted_peak_bytes": plan.predicted_peak_bytes,
               "plan_predicted_step_ms": plan.predicted_step_ms, "peak_bytes": plan.peak_bytes,
               "step_ms": plan.step_ms, "gradients": plan.gradients, "fits": plan.fits}
        print_rows([row], [], args.format)
        return 0 if plan.fits else 1
    first = plan.comparison.iloc[0]
    print(f"{args.model} b={args.batch} s={args.seq} {args.dtype}, budget {args.budget} of the compiled model "
          f"(a fraction is of the compiled all-keep plan's measured peak); {int(first['rounds'])} interleaved "
          f"rounds, load {first['load_before']:.1f} -> {first['load_after']:.1f}"
          + (" (busy: more load than cores)" if first["busy"] else ""))
    print(plan)
    print(f"apply it with: --policy {plan.policy}")
    return 0 if plan.fits else 1


def cmd_explain(args: argparse.Namespace) -> int:
    """Why the peak is what it is, and what each lever would make it; the report or JSON."""

    loop = loop_from_arguments(args, dtype=args.dtype)
    workload = get_workload(args.model, **_model_overrides(args.set))
    explanation = explain(workload, args.batch, args.seq, args.policy, dtype=args.dtype, loop=loop,
                          capacity=args.capacity, measure=args.measure, ranks=args.ranks, **device_options(args))
    if args.figure:
        explanation.figure(args.figure)
    if args.format == "json":
        print(json.dumps(explanation.to_dict(), indent=1))
    else:
        print(explanation)
    return 0


def add_workload_arguments(p: argparse.ArgumentParser, batch: str, seq: str, policy: str, lists: bool = True) -> None:
    """--model, --set, --batch, --seq, --policy, --dtype: what the measuring subcommands other than
    sweep take (a sweep's flags are its SweepConfig's fields)."""
    many = ", comma-separated" if lists else ""
    p.add_argument("--model", default="gpt-tiny",
                   help="a preset (" + ", ".join([*PRESETS, *HF_PRESET_NAMES]) + "), hf:<model_type>, "
                        "hf:path/config.json, hf:org/name (local cache), path/to/file.py:factory or "
                        "package.module:factory (default: gpt-tiny)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="model override (a config field, or a keyword of your factory), e.g. --set n_layer=8")
    p.add_argument("--batch", default=batch, type=str if lists else int,
                   help=f"batch size{'s' if lists else ''}{many} (default: {batch})")
    p.add_argument("--seq", default=seq, type=str if lists else int,
                   help=f"sequence length{'s' if lists else ''}{many} (default: {seq})")
    if policy:
        p.add_argument("--policy", default=policy,
                       help=("policies, comma-separated, e.g. none,density=0.5,full" if "," in policy else
                             "a policy, e.g. full or density=0.5") + f" (the vocabulary: ckptlab --help; default: {policy})")
    p.add_argument("--dtype", default="fp32", help=DTYPE_HELP + " (default: fp32)")


# The loop's flags (`core.loop.Loop`'s fields): flag -> (field, what it reads: "int", "flag" or "text").
LOOP_FLAGS = {"--optimizer": ("optimizer", "text"), "--accum": ("accum_steps", "int"),
              "--holds-output": ("holds_output", "flag"), "--zero-grad": ("zero_grad", "text"),
              "--clip-grad-norm": ("clip_grad_norm", "text"), "--grad-scaler": ("grad_scaler", "flag")}


def add_loop_arguments(p: argparse.ArgumentParser, accum: bool = True) -> None:
    """The training loop's flags, the same on every command (a sweep's --accum is its grid's axis:
    `accum=False`); `loop_from_arguments` makes them one Loop."""
    p.add_argument("--optimizer", default=None, help=OPTIMIZER_HELP + f" (default: {DEFAULT_LOOP})")
    if accum:
        p.add_argument("--accum", default=None, help="gradient-accumulation steps: micro-batches of --batch per "
                                                     "optimizer step (default: 1)")
    p.add_argument("--holds-output", action="store_true", default=None,
                   help="the training loop keeps the model's output alive into the next step's forward, as "
                        "`logits, loss = model(x, y)` at loop scope does (default: the step drops it)")
    p.add_argument("--zero-grad", default=None, metavar="|".join(ZERO_GRADS),
                   help="set_to_none: gradients freed after each step (default); zeros: zero_grad(set_to_none=False), "
                        "gradients zero-filled and kept through the next forward")
    p.add_argument("--clip-grad-norm", default=None, metavar="X",
                   help="clip_grad_norm_ with max norm X between backward and the optimizer step (default: no clipping)")
    p.add_argument("--grad-scaler", action="store_true", default=None,
                   help="fp16's torch.amp.GradScaler: scale the loss, unscale and step (needs --dtype fp16)")


def loop_flags_given(args: argparse.Namespace) -> dict:
    """The loop's flags given (flag -> its text), of `LOOP_FLAGS` (a sweep's --accum is its grid's)."""
    given = {flag: getattr(args, name if name != "accum_steps" else "accum", None)
             for flag, (name, _) in LOOP_FLAGS.items()}
    return {flag: raw for flag, raw in given.items() if raw is not None}


def loop_from_arguments(args: argparse.Namespace, base: Loop | str | None = None, dtype: str | None = None) -> Loop:
    """The one Loop of the loop's flags given, over `base` (a --config file's loop; default: the
    default loop); checked against `dtype` when given. ValueError otherwise (the error path names
    the flags: `flag_message`)."""
    values = dataclasses.asdict(as_loop(base))
    for flag, raw in loop_flags_given(args).items():
        name, kind = LOOP_FLAGS[flag]
        if kind == "int":
            try:
                raw = int(raw)
            except ValueError:
                raise ValueError(f"{flag}={raw!r} is invalid: allowed is an integer >= 1") from None
        values[name] = raw
    loop = Loop(**values)
    if dtype is not None:
        loop.check_dtype(dtype)
    return loop


def add_device_arguments(p: argparse.ArgumentParser, cards: bool = False) -> None:
    """--device, --card, --attention, --torch-version, --alloc-conf: what a prediction is for (predict, plan,
    explain); with `cards`, --card takes a list (predict)."""
    p.add_argument("--device", default=None, help="cpu (exact to the byte) | cuda: predict the step as a CUDA card "
                                                    "runs it (its kernels, autocast, optimizer, cuBLAS workspaces and "
                                                    "caching allocator); default: cuda with a card, else cpu")
    p.add_argument("--card", default=None, help=("cards, comma-separated, a table each" if cards else "a card")
                   + " (`ckptlab cards`): predict for it (implies --device cuda): its device bytes and the margin left")
    add_cuda_rule_arguments(p)


def add_cuda_rule_arguments(p: argparse.ArgumentParser) -> None:
    """--attention, --torch-version, --alloc-conf: the rules a prediction for CUDA follows."""
    p.add_argument("--attention", default=None, choices=ATTENTION_BACKENDS,
                   help="force scaled-dot-product attention's CUDA backend (default: PyTorch's choice)")
    p.add_argument("--torch-version", default=None, metavar="X.Y",
                   help=f"the torch release whose CUDA rules the prediction follows ({', '.join(TORCH_VERSIONS)}; "
                        f"default: the installed torch's, {default_torch_version()})")
    p.add_argument("--alloc-conf", default=None, metavar="OPTION",
                   help="PYTORCH_CUDA_ALLOC_CONF the caching allocator is replayed with: "
                        + " or ".join(ALLOC_CONFS) + " (default: none; CUDA only)")


def add_trace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="fast", choices=TRACES,
                   help="fast: trace a few of each stack's blocks and compose the step, where it can be (the "
                        "same prediction); full: trace every block (default: fast; the record's trace says which "
                        "answered)")


def add_format_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table: for reading (default); json, csv: every field of every row, for scripts")


# The flag of each parameter that the library's errors name: where a command has the flag, its
# error path (`flag_message`) says `--torch-version 2.3` where the Python API says torch_version='2.3'.
# A list's name and its items' name share a flag (a sweep's batch_sizes, a cell's batch_size).
PARAMETER_FLAGS = {
    "model": "--model", "batch_size": "--batch", "seq_len": "--seq", "policy": "--policy", "dtype": "--dtype",
    "device": "--device", "card": "--card", "attention": "--attention", "torch_version": "--torch-version",
    "alloc_conf": "--alloc-conf", "trace": "--trace", "budget": "--budget", "cost": "--cost", "options": "--options",
    "capacity": "--capacity", "capacities": "--cards", "workers": "--workers", "ranks": "--ranks", "measure": "--measure", "min_rounds": "--steps", "param_set": "-f",
    **{name: flag for flag, (name, _) in LOOP_FLAGS.items()},
    **{f.name: f.metadata["flag"] for f in dataclasses.fields(SweepConfig) if "flag" in f.metadata},
}

# A value as an error shows it: Python's repr of a text or a list, else a word (a trailing colon is the text's).
_VALUE = r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\[[^\]]*\]|[^\s,;)]*[^\s,;):]"""


def flag_message(message: str, flags: dict[str, str]) -> str:
    """An error in the command line's terms: each `name=value` of a parameter of `flags` (a
    command's PARAMETER_FLAGS), and each `--flag=value` of the command line's own checks, as the
    flag and the value one types: torch_version='2.3' -> --torch-version 2.3, grad_scaler=True ->
    --grad-scaler, grad_scaler=False -> no --grad-scaler; and the API's "or None" (the parameter
    left out) -> "or no" and the first flag named."""
    names = "".join("|" + re.escape(name) for name in sorted(flags, key=len, reverse=True))
    pattern = rf"(?<![\w:+=-])(?P<name>--[a-z][a-z0-9-]*{names})=(?P<value>{_VALUE})"
    named = []

    def typed(match: re.Match) -> str:
        named.append(flags.get(match["name"], match["name"]))
        return _typed(named[-1], match["value"])

    text = re.sub(pattern, typed, message)
    return re.sub(r"\bor None\b", f"or no {named[0]}", text) if named else text


def _typed(flag: str, shown: str) -> str:
    """`flag` with a value as an error shows it (repr, or a word), as one types it."""
    value = shown
    if shown[0] in "'\"[" or shown in ("True", "False", "None"):
        try:
            value = ast.literal_eval(shown)
        except (ValueError, SyntaxError):
            pass
    if value is True:
        return flag
    if value is False or value is None:
        return f"no {flag}"
    if isinstance(value, list):
        value = ",".join(map(str, value))
    text = str(value)
    # quoted where a shell needs it, and where it is only punctuation ("--policy ','")
    return f"{flag} {shlex.quote(text) if any(c.isalnum() for c in text) else repr(text)}"


# Where commands name the cards they answer for: predict --card, fits --cards, explain --capacity.
CARD_FLAGS = ("--card", "--cards", "--capacity")


class OneLineParser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown choice, a missing value) in one line and exit 2, as
    ckptlab's checks give theirs; the usage stays one `--help` away. Subcommands inherit it."""

    def error(self, message: str):
        # a number that is not one, said as ckptlab's checks say theirs: --workers two is invalid: ...
        number = re.fullmatch(r"argument (-[-\w]+)(?:/\S+)?: invalid (int|float) value: (.*)", message)
        if number:
            flag, kind, shown = number.groups()
            self.exit(2, f"error: {_typed(flag, shown)} is invalid: allowed is "
                         f"{'an integer' if kind == 'int' else 'a number'}\n")
        self.exit(2, f"error: {self.prog}: {message}\n")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            # an option another command has (--cards is fits', predict's is --card): name the nearest one here
            command = getattr(parsed, "command_prog", self.prog)
            options = getattr(parsed, "command_options", [])
            flag = next((u.split("=")[0] for u in unknown if u.startswith("--")), None)
            close = nearest(flag, options) if flag else None
            if close is None and flag in CARD_FLAGS:   # the cards a command answers for, under its own name
                close = next((f for f in CARD_FLAGS if f in options), None)
            if close:
                self.exit(2, f"error: {command}: {flag} is not an option here: did you mean {close}? "
                             f"({command} --help lists them)\n")
            self.exit(2, f"error: {command}: unrecognized arguments: {' '.join(unknown)} ({command} --help lists "
                         "what it takes)\n")
        return parsed

    def command(self, func) -> None:
        """This (sub)command runs `func`; its errors name the flags it has (PARAMETER_FLAGS), and an
        option it lacks is answered with the nearest one it has."""
        own = {option for action in self._actions for option in action.option_strings}
        self.set_defaults(func=func, flags={name: flag for name, flag in PARAMETER_FLAGS.items() if flag in own},
                          command_prog=self.prog, command_options=sorted(o for o in own if o.startswith("--")))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="ckptlab", description="Measure what activation checkpointing saves and "
                                     "costs in PyTorch, and choose what to recompute.", epilog=help_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ckptlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("measure", help="measure one training step per policy and print a table")
    add_workload_arguments(p, batch="4", seq="64", policy="none,full")
    add_loop_arguments(p)
    add_format_argument(p)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--steps", type=int, default=5, help="minimum interleaved timing rounds (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up rounds")
    p.add_argument("--max-seconds", type=float, default=10, help="timing budget per (batch, seq); stops earlier at ±2%%")
    p.add_argument("--memory-limit", default=None, help="e.g. 24GiB (emulated on CPU)")
    p.command(cmd_measure)

    p = sub.add_parser("sweep", help="measure a grid into a run folder (OOM-safe, resumable); print a summary",
                       description="Lists take comma-separated values (--batch 1,2,4).")
    add_config_arguments(p, SweepConfig)
    add_loop_arguments(p, accum=False)
    p.add_argument("--no-plots", action="store_true", help="skip drawing figures")
    p.command(cmd_sweep)

    p = sub.add_parser("compare", help="policies (and, with --anchors, other frameworks' knobs) timed together, "
                                       "with 95%% intervals")
    add_workload_arguments(p, batch="4", seq="64", policy="none,density=0.5,full", lists=False)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    add_loop_arguments(p)
    p.add_argument("--anchors", action="store_true",
                   help="add torch.utils.checkpoint, torch.compile at memory budgets 0, 0.25, 0.5, 0.75 and "
                        "(transformers models) transformers' own checkpointing, and at each anchor's peak the "
                        "planner's eager plan and the compiled plan (chosen from measured compiled runs)")
    p.add_argument("--verify", action="store_true", help="add each row's gradient verdict against the eager un-checkpointed model (exact | within tolerance | wrong)")
    p.add_argument("--target-ci", type=float, default=0.02, help="stop timing at this interval half-width (0.02: ±2%%)")
    p.add_argument("--max-seconds", type=float, default=120, help="time budget for the timing rounds")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for every configuration (default: PyTorch's; 1 is steadiest on a shared machine)")
    p.add_argument("--out", default=None, help="folder for compare.csv, compare.json and figures/compare.png")
    add_format_argument(p)
    p.command(cmd_compare)

    p = sub.add_parser("predict", help="predict peak memory per policy without allocating (fake tensors), "
                                       "for a CPU or a CUDA card")
    add_workload_arguments(p, batch="4", seq="64", policy="none,selective,full")
    add_loop_arguments(p)
    add_device_arguments(p, cards=True)
    add_trace_argument(p)
    add_format_argument(p)
    p.command(cmd_predict)

    p = sub.add_parser("fits", help="the largest batch and the longest sequence that fit, per policy and card "
                                    "(predicted, nothing allocated)")
    add_workload_arguments(p, batch="1", seq=f"{FITS_SEQ}, or the model's longest where shorter",
                           policy="none,selective,full", lists=False)
    p.set_defaults(seq=None)   # the default's value is known once the model is (cmd_fits)
    p.add_argument("--cards", default=",".join(DEFAULT_CARDS),
                   help="cards (ckptlab cards) or sizes such as 24GiB, comma-separated (default: "
                        f"{','.join(DEFAULT_CARDS)})")
    add_loop_arguments(p)
    add_cuda_rule_arguments(p)
    add_trace_argument(p)
    p.add_argument("--workers", default=1, type=int, help="processes predicting in parallel (default 1)")
    add_format_argument(p)
    p.command(cmd_fits)

    p = sub.add_parser("plan", help="choose keep/selective/full per block to fit a memory budget")
    add_workload_arguments(p, batch="4", seq="64", policy="", lists=False)
    p.add_argument("--budget", required=True, help="a size (6GiB) or a fraction of the no-checkpointing peak (0.5)")
    p.add_argument("--cost", default="auto", help="recompute cost: auto (measured here for a CPU step under 4 GiB, else the roofline, as "
                        "for a card) | measured | roofline")
    add_device_arguments(p)
    add_loop_arguments(p)
    p.add_argument("--compile", action="store_true",
                   help="a plan for the compiled model: per block keep/selective/full or a compile budget, chosen "
                        "from measured uniform compiled plans, then measured (peak, time, gradients); minutes")
    p.add_argument("--options", default="ksf05", help="with --compile: what a block may take: k s f, digits d for "
                   "compile budget d/10 (default ksf05)")
    p.add_argument("--max-seconds", type=float, default=60, help="with --compile: time budget for the timing rounds")
    p.add_argument("--target-ci", type=float, default=0.02, help="with --compile: stop timing at this interval half-width")
    p.add_argument("--threads", type=int, default=None, help="with --compile: CPU threads (default: PyTorch's)")
    add_format_argument(p)
    p.command(cmd_plan)

    p = sub.add_parser("explain", help="why memory did not drop: the peak, what holds it, and what each lever "
                                       "would make it (predicted, nothing allocated)")
    add_workload_arguments(p, batch="4", seq="64", policy="none", lists=False)
    add_loop_arguments(p)
    p.add_argument("--capacity", default=None, help="a card (rtx4090, a100-80, h100-80, ...: `ckptlab cards`) or a "
                                                    "size (24GiB): adds the plan that fits it; the waterfall stops there")
    p.add_argument("--ranks", type=int, default=8, help="world size of the FSDP2 lever (default 8)")
    add_device_arguments(p)
    p.add_argument("--measure", action="store_true", help="also measure the step here, beside the prediction")
    p.add_argument("--figure", default=None, help="save the waterfall figure as FIGURE.png and FIGURE.svg")
    p.add_argument("--format", choices=("table", "json"), default="table",
                   help="table: the report (default); json: every field, for scripts")
    p.command(cmd_explain)

    p = sub.add_parser("cards", help="the cards a capacity may name: usable bytes, context, margin")
    add_format_argument(p)
    p.command(cmd_cards)

    p = sub.add_parser("plot", help="redraw every figure of a run folder from its data")
    p.add_argument("run_dir", help="run folder, e.g. results/my-sweep")
    p.command(cmd_plot)

    p = sub.add_parser("notebooks", help="run the notebooks headless with papermill, or list their parameters")
    nb = p.add_subparsers(dest="notebooks_command", required=True)
    q = nb.add_parser("run", help="execute notebooks into <out>/<notebook>/<name>/ and regenerate <out>/README.md")
    q.add_argument("names", nargs="*", help="notebooks by number or name (default: all)")
    q.add_argument("-f", "--file", default="default",
                   help="parameter set: a name in notebooks/params/ (default, gpu) or a YAML file")
    q.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="override a parameter in every selected notebook (VALUE is YAML: 8, [1,2], none)")
    q.add_argument("--out", default="results", help="results folder (default: results)")
    q.add_argument("--name", default=None, help="run folder name (default: the parameter set's)")
    q.add_argument("--timeout", type=float, default=900, help="seconds per notebook (default 900)")
    add_executor_arguments(q)
    q.command(cmd_notebooks_run)
    q = nb.add_parser("params", help="list a notebook's parameters: types, defaults, help")
    q.add_argument("name", help="notebook by number or name, e.g. 2, 02, density_sweep or 02_density_sweep")
    q.command(cmd_notebooks_params)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # invalid input: one clear line in the command line's terms, no traceback
        print(f"error: {flag_message(str(exc), args.flags)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
