"""The papermill batch runner and the helpers notebooks call.

    ckptlab notebooks run                       # every notebook, parameter set "default"
    ckptlab notebooks run 02 -p steps 5         # one notebook, one parameter overridden
    ckptlab notebooks params 02_density_sweep   # its parameters: types, defaults, help

Each run writes `results/<notebook>/<param-set>/`: the executed notebook, `run.json` (parameters,
environment, status), and whatever the notebook saves there (records, figures, `headline.json`).
`results/README.md` is regenerated after every batch: one row per run folder.

Parameters are checked before anything runs — papermill only warns about unknown names — and a
failing notebook (an exception, a dead kernel, a timeout) is reported while the batch goes on.

The notebooks ship with the source repository, not with the installed package: running or
listing them needs a clone (`git clone ...; make run`). An installed ckptlab says so in one
line, and anything it writes by default goes under the working directory's results/.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..core import validate
from ..core.cards import parse_capacity
from ..core.dtypes import DTYPES
from ..core.extras import require
from ..core.loop import parse_loop
from ..core.parsing import yaml_mapping
from ..core.policy import parse_policy
from ..core.units import size_bytes
from ..core.validate import choice, integer, no_credential, non_empty, number
from ..probe.measure import check_policy_applies
from ..probe.step import resolve_device
from ..run.store import check_replaceable, fresh_run_folder, read_meta
from ..workloads.registry import get_workload
from .notebook_exec import ROOT, NotebookRun, execute, relative

NOTEBOOKS = ROOT / "notebooks"
PARAMS = NOTEBOOKS / "params"
IN_CLONE = NOTEBOOKS.is_dir() and (ROOT / "pyproject.toml").is_file()  # not site-packages
# In a clone: the repository's results/; installed: results/ under the working directory (never
# inside site-packages).
RESULTS = ROOT / "results" if IN_CLONE else Path("results")
NEED_A_CLONE = ("the notebooks ship with the source repository, not with the installed package: "
                "clone the repository and run them there (make run)")


# ----------------------------------------------------------------------------- inside notebooks

def run_folder(run_dir: Optional[str], notebook: str) -> Path:
    """The folder a notebook writes to: `run_dir` when the runner passes one, else a scratch
    folder (git-ignored) for interactive sessions. Created if missing."""
    path = Path(run_dir) if run_dir else RESULTS / "_scratch" / notebook
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_headline(run_dir: Path, **numbers) -> dict:
    """The few numbers a notebook's run is summarised by in results/README.md."""
    (Path(run_dir) / "headline.json").write_text(json.dumps(numbers, indent=1, default=str) + "\n")
    return numbers


# ----------------------------------------------------------------------------- parameters

def list_notebooks() -> list[Path]:
    if not IN_CLONE:
        raise ValueError(NEED_A_CLONE)
    return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def find_notebook(name: str) -> Path:
    """A notebook by its number ('7', '07'), its name with or without the number ('lora',
    '10_lora', '10_lora.ipynb') or a path to any notebook -> its path."""
    if Path(name).suffix == ".ipynb" and Path(name).is_file():
        return Path(name)
    stem, notebooks = Path(name).stem, list_notebooks()
    matches = [p for p in notebooks if stem == p.stem or stem == p.stem.partition("_")[2] or _same_number(stem, p)]
    if len(matches) != 1:
        guess = validate.nearest(stem, [p.stem for p in notebooks] + [p.stem.partition("_")[2] for p in notebooks])
        hint = f" (did you mean {guess}?)" if guess else ""
        raise ValueError(f"notebook={name!r} is invalid{hint}: allowed are a number 1-{len(notebooks)}, a name "
                         f"({', '.join(p.stem for p in notebooks)}) or a path to a .ipynb file")
    return matches[0]


def _same_number(stem: str, notebook: Path) -> bool:
    number = notebook.stem.partition("_")[0]
    return stem.isdigit() and number.isdigit() and int(stem) == int(number)


@dataclass
class Parameter:
    name: str
    type: str
    default: str
    help: str


def notebook_parameters(path: Path) -> dict[str, Parameter]:
    """The cell tagged `parameters`, read as `name: type = value  # help` lines. Parsed with `ast`
    rather than papermill's inspector, whose regex drops any line holding two '=' (such as
    `policy: str = "density=0.5"`)."""
    nbformat = require("nbformat", "reading a notebook's parameters")  # the notebooks extra
    book = nbformat.read(str(path), as_version=4)
    cells = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"notebook {path.stem} must have exactly one cell tagged 'parameters', found {len(cells)}")
    source = cells[0].source
    lines = source.splitlines()
    params = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            raise ValueError(f"notebook {path.stem}: parameters cell line {node.lineno} is not `name: type = value`")
        line = lines[node.lineno - 1]
        comment = line[node.end_col_offset:].strip() if node.end_lineno == node.lineno else ""
        params[node.target.id] = Parameter(node.target.id, ast.unparse(node.annotation),
                                           ast.unparse(node.value), comment.lstrip("#").strip())
    return params


def check_parameters(path: Path, values: dict) -> None:
    """Unknown names, wrong types, invalid values (the checks `measure`, `sweep` and `predict` apply,
    by parameter name: batch_size=0, an unknown model or policy, a policy that does not fit the
    model) and values that look like credentials (`validate.no_credential`) are errors that say
    what is allowed — all before a kernel starts."""
    params = notebook_parameters(path)
    for name, value in values.items():
        if name not in params:
            valid = ", ".join(f"{p.name}: {p.type}" for p in params.values())
            raise ValueError(f"parameter {name!r} is invalid for notebook {path.stem}: allowed are {valid}")
        if not _matches(params[name].type, value):
            raise ValueError(f"parameter {name}={value!r} is invalid for notebook {path.stem}: "
                             f"allowed is a value of type {params[name].type}")
    checks = _value_checks()
    try:
        for name, value in values.items():
            no_credential(f"parameter {name}", value)
            if name in checks and value is not None:
                checks[name](name, value)
        given = {**{n: ast.literal_eval(p.default) for n, p in params.items()}, **values}
        if "model" in given and ({"model", "policy", "policies", "seq_len", "seq_lens"} & set(values)):
            workload = get_workload(given["model"])
            for seq_len in ([given["seq_len"]] if "seq_len" in given else []) + list(given.get("seq_lens") or []):
                workload.check_shape(1, seq_len)
            for policy in ([given["policy"]] if "policy" in given else []) + list(given.get("policies") or []):
                check_policy_applies(workload, parse_policy(policy))
    except ValueError as exc:
        raise ValueError(f"notebook {path.stem}: {exc}") from None


def _value_checks() -> dict:
    """Parameter name -> the check the library applies to that value (raises ValueError)."""
    def at_least(minimum):
        return lambda name, v: integer(name, v, minimum)

    def each(check, empty_ok=True):   # a list parameter element by element (a scalar of that name as itself)
        def run(name, values):
            if not isinstance(values, (list, tuple)):
                return check(name, values)
            for v in (values if empty_ok else non_empty(name, values)):
                check(name, v)
        return run

    dtype = lambda name, v: choice(name, v, list(DTYPES))  # noqa: E731
    policy = lambda name, v: parse_policy(v)  # noqa: E731
    model = lambda name, v: get_workload(v)  # noqa: E731
    capacity = lambda name, v: parse_capacity(v, name)  # noqa: E731
    return {
        "model": model, "fits_model": model, "device": lambda name, v: resolve_device(v),
        "steps": at_least(1), "warmup": at_least(0), "batch_size": at_least(1), "seq_len": at_least(1),
        "fits_seq_len": at_least(1), "batch_sizes": each(at_least(1), False), "seq_lens": each(at_least(1), False),
        "accum_steps": each(at_least(1)), "loop": lambda name, v: parse_loop(v), "policy": policy, "policies": each(policy, False),
        "densities": each(lambda name, v: number(name, v, 0.0, 1.0), False), "dtype": dtype, "dtypes": each(dtype),
        "memory_limit": size_bytes, "capacity": capacity, "fits_capacities": each(capacity, False),
        "rank": at_least(1), "fits_workers": at_least(1), "fits_seq_lens": each(at_least(1), False), "fits_dtype": dtype,
        "budget_fractions": each(lambda name, v: number(name, v, 0.0, 1.0, low_open=True), False),
    }


def _matches(type_name: str, value) -> bool:
    type_name = type_name.replace(" ", "")
    if type_name.startswith("Optional[") and type_name.endswith("]"):
        return value is None or _matches(type_name[len("Optional["):-1], value)
    if type_name.startswith("List[") and type_name.endswith("]"):
        return isinstance(value, list) and all(_matches(type_name[5:-1], v) for v in value)
    scalar = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "str": lambda v: isinstance(v, str),
              "bool": lambda v: isinstance(v, bool)}
    return scalar[type_name](value) if type_name in scalar else True


def load_param_set(name: str) -> dict[str, dict]:
    """A parameter set: a name in notebooks/params/ or a path to a YAML file, holding
    {notebook stem: {parameter: value}}."""
    path = Path(name) if Path(name).suffix in (".yaml", ".yml") else PARAMS / f"{name}.yaml"
    if not path.exists():
        allowed = ", ".join(sorted(p.stem for p in PARAMS.glob("*.yaml")))
        raise ValueError(f"param_set={name!r} is invalid: allowed are {allowed}, or a path to a .yaml file")
    sets = yaml_mapping("param_set", path)
    if not all(isinstance(v, dict) or v is None for v in sets.values()):
        raise ValueError(f"param_set={name!r} is invalid: {path.name} must hold a mapping "
                         "{notebook: {parameter: value}}")
    known = {p.stem for p in list_notebooks()}
    unknown = sorted(set(sets) - known)
    if unknown:
        raise ValueError(f"param_set={name!r}: notebook {unknown[0]!r} is invalid: allowed are {', '.join(sorted(known))}")
    return sets


# ----------------------------------------------------------------------------- the batch runner


def run_notebooks(
    names: Optional[Sequence[str]] = None,
    param_set: str = "default",
    overrides: Optional[dict] = None,
    out: str | Path = RESULTS,
    run_name: Optional[str] = None,
    timeout_s: float = 900,
    executor: str = "local",
    job_options: Optional[dict] = None,
) -> list[NotebookRun]:
    """Execute notebooks headless with papermill, each in its own process and kernel.

    Parameters come from `notebooks/params/<param_set>.yaml`, then `overrides` (applied to every
    selected notebook). All are checked before the first notebook starts. Output goes to
    `<out>/<notebook>/<run_name or param_set>/`. executor="submitit" runs each notebook as a
    job (`ckptlab.run.cluster`; `job_options`: cluster, slurm_partition, slurm_gpus_per_job, ...).
    """
    require("papermill", "running notebooks")
    out = validate.output_folder("out", out)
    timeout_s = number("timeout_s", timeout_s, 0.0, low_open=True)
    paths = [find_notebook(n) for n in names] if names else list_notebooks()
    sets = load_param_set(param_set)
    overrides = dict(overrides or {})
    plan = []
    for path in paths:
        values = {**(sets.get(path.stem) or {}), **overrides}
        check_parameters(path, values)
        plan.append((path, values))
    if run_name is None:
        run_name = Path(param_set).stem if not overrides else f"{Path(param_set).stem}-custom"
    validate.run_name("run_name", run_name)
    for path, _ in plan:  # every folder checked before the first is replaced
        check_replaceable(out / path.stem / run_name)

    if executor != "local":   # each notebook a submitit job, same run folders (ckptlab.run.cluster)
        # In-function: submitit is an optional dependency (extra ckptlab[cluster]).
        from .notebook_jobs import run_notebooks_as_jobs  # noqa: PLC0415 - needs submitit, the cluster extra
        runs = run_notebooks_as_jobs(plan, out, run_name, param_set, timeout_s, executor, **(job_options or {}))
        write_results_index(out)
        return runs
    runs = []
    for i, (path, values) in enumerate(plan, 1):
        run_dir = fresh_run_folder(out / path.stem / run_name)
        print(f"[{i}/{len(plan)}] {path.stem} -> {relative(run_dir)}", flush=True)
        run = execute(path, run_dir, values, param_set, timeout_s)
        runs.append(run)
        print(f"[{i}/{len(plan)}] {path.stem}: {run.status} in {run.seconds:.0f} s"
              + (f" — {run.error}" if run.error else ""), flush=True)
    write_results_index(out)
    return runs


# ----------------------------------------------------------------------------- results/README.md

def write_results_index(out: str | Path = RESULTS) -> Path:
    """One row per run folder holding a run.json from this runner."""
    out = Path(out)
    rows = []
    for meta_path in sorted(out.glob("*/*/run.json")):
        meta = read_meta(meta_path.parent)
        if "notebook" not in meta:
            continue
        run_dir = meta_path.parent
        headline_path = run_dir / "headline.json"
        headline = json.loads(headline_path.read_text()) if headline_path.exists() else {}
        figures = sorted(run_dir.glob("*.png"))  # the notebook's own figures, not its sub-sweeps
        env = meta.get("environment") or {}
        rows.append("| {nb} | {ps} | {date} | {device} | {status} | {head} | {figs} |".format(
            nb=f"[{meta['notebook']}]({run_dir.relative_to(out)}/{meta['notebook']}.ipynb)",
            ps=run_dir.name,
            date=(meta.get("finished_at") or "")[:10],
            device=env.get("device_name", "-"),
            status=meta.get("status", "-"),
            head="<br>".join(f"{k}: {v}" for k, v in headline.items()) or "-",
            figs=" ".join(f"[{p.stem}]({p.relative_to(out)})" for p in figures) or "-",
        ))
    text = ("# Results\n\nGenerated by `ckptlab notebooks run` (`make run`); do not edit by hand. "
            "One row per notebook run folder. A number is measured in that run unless its headline says "
            "\"predicted for <card>\": a fake-tensor prediction of that card's step, nothing allocated.\n\n"
            "| notebook | parameter set | date | device | status | headline | figures |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    path = out / "README.md"
    path.write_text(text)
    return path


__all__ = ["NOTEBOOKS", "PARAMS", "Parameter", "RESULTS", "check_parameters", "find_notebook",
           "list_notebooks", "load_param_set", "notebook_parameters", "run_folder", "run_notebooks",
           "save_headline", "write_results_index"]
