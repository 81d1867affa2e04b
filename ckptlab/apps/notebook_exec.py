"""One notebook execution: papermill in its own process and kernel, into a run folder with its
run.json (parameters, status, the reason of a failure, the environment)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..core.children import die_with_parent
from ..run.provenance import environment
from ..workloads.specs import project_relative

ROOT = Path(__file__).resolve().parents[2]   # the repository (or site-packages) holding ckptlab/


@dataclass
class NotebookRun:
    notebook: str
    run_dir: Path
    status: str          # ok | failed | timeout
    seconds: float
    error: str = ""


MODEL_PARAMETERS = ("model", "fits_model")
# papermill's command line, started without one import: nbformat's validator imports jsonschema,
# whose format checkers compile an RFC 3987 grammar (rfc3987-syntax, an Earley parser) when it is
# installed -- 1.2 of papermill's 1.5 s of imports, in every notebook's run. Without it jsonschema
# leaves the "iri" formats unchecked, which no notebook schema uses.
PAPERMILL = "import sys; sys.modules['rfc3987_syntax'] = None; from papermill.cli import papermill; papermill()"


def execute(path: Path, run_dir: Path, values: dict, param_set: str, timeout_s: float) -> NotebookRun:
    # The kernel runs in the repository: a model file the user named from their own folder is
    # handed to it as the same file seen from there (run.json keeps the spec as given).
    specs = {k: project_relative(values[k], ROOT) for k in MODEL_PARAMETERS if isinstance(values.get(k), str)}
    parameters = {**values, **specs, "run_dir": relative(run_dir)}
    # What is recorded names the folder relative to the output folder (out/<notebook>/<run name>).
    recorded = f"{run_dir.parent.name}/{run_dir.name}"
    started = time.time()
    meta = {"notebook": path.stem, "param_set": param_set, "parameters": {**values, "run_dir": recorded},
            "started_at": now(), "finished_at": None, "status": "running", "error": ""}
    write_json(run_dir / "run.json", meta)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(parameters, f)
        params_file = f.name
    executed = run_dir / path.name
    command = [sys.executable, "-c", PAPERMILL, relative(path), relative(executed), "-f", params_file,
               "--cwd", ".", "-k", "python3", "--log-level", "ERROR", "--no-progress-bar"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                              preexec_fn=die_with_parent())
        status, error = ("ok", "") if proc.returncode == 0 else ("failed", _papermill_error(proc.stderr))
    except subprocess.TimeoutExpired:
        status, error = "timeout", f"did not finish within {timeout_s:.0f} s"
    finally:
        Path(params_file).unlink(missing_ok=True)
    replacements = {relative(run_dir): recorded, str(run_dir.resolve()): recorded}
    if Path(relative(path)).is_absolute():  # a notebook from outside the repository: its name only
        replacements[relative(path)] = path.name
    if executed.exists():
        _rewrite_paths(executed, replacements)
    device = parameters.get("device", "cpu")
    error = shorten_paths(error, replacements)
    meta.update(finished_at=now(), status=status, error=error,
                seconds=round(time.time() - started, 1), environment=environment(device if status == "ok" else "cpu"))
    write_json(run_dir / "run.json", meta)
    return NotebookRun(path.stem, run_dir, status, time.time() - started, error)


def shorten_paths(text: str, replacements: dict[str, str] | None = None) -> str:
    """`text` without this machine's paths: each key of `replacements` becomes its value, then the
    repository, the Python installation (site-packages, the standard library) and the home folder
    become repository-relative, `<site-packages>`, `<python>` and `~` — so a stored traceback says
    `<site-packages>/torch/nn/modules/module.py`, not where this machine keeps it."""
    prefixes = dict(replacements or {})
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib"):
        prefixes.setdefault(paths[key], "<site-packages>")
    prefixes.setdefault(paths["stdlib"], "<python>/lib")
    prefixes.setdefault(str(ROOT) + "/", "")
    prefixes.setdefault(sys.prefix, "<python>")
    prefixes.setdefault(sys.base_prefix, "<python>")
    prefixes.setdefault(str(Path.home()), "~")
    for old in sorted(prefixes, key=len, reverse=True):  # the most specific path first
        if old and old not in ("/", "~"):
            text = text.replace(old, prefixes[old])
    return text


def _rewrite_paths(notebook: Path, replacements: dict[str, str]) -> None:
    """Shorten the paths in every string of an executed notebook (papermill's metadata, the
    injected parameters, outputs, tracebacks); see `shorten_paths`."""
    def walk(node):
        if isinstance(node, str):
            return shorten_paths(node, replacements)
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):  # embedded images are data, not text: left as they are
            return {k: v if k.startswith("image/") else walk(v) for k, v in node.items()}
        return node

    book = json.loads(notebook.read_text(encoding="utf-8"))
    tmp = notebook.with_suffix(".tmp")
    tmp.write_text(json.dumps(walk(book), indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(notebook)


def _papermill_error(stderr: str) -> str:
    """The exception line papermill prints, or the last line (a dead kernel says so there)."""
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Dead" in line:
            return line[:500]
    return lines[-1][:500] if lines else "papermill failed without a message"


def relative(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:  # outside the repository: absolute, since papermill runs from the repository
        return str(Path(path).resolve())


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


__all__ = ["ROOT", "NotebookRun", "execute", "now", "relative", "shorten_paths", "write_json"]
