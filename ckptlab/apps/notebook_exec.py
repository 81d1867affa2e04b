"""One notebook execution: papermill in its own process and kernel, into a run folder with its
run.json (parameters, status, the reason of a failure, the environment)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..run.provenance import environment

ROOT = Path(__file__).resolve().parents[2]   # the repository (or site-packages) holding ckptlab/


@dataclass
class NotebookRun:
    notebook: str
    run_dir: Path
    status: str          # ok | failed | timeout
    seconds: float
    error: str = ""


def execute(path: Path, run_dir: Path, values: dict, param_set: str, timeout_s: float) -> NotebookRun:
    parameters = {**values, "run_dir": relative(run_dir)}
    started = time.time()
    meta = {"notebook": path.stem, "param_set": param_set, "parameters": parameters,
            "started_at": now(), "finished_at": None, "status": "running", "error": ""}
    write_json(run_dir / "run.json", meta)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(parameters, f)
        params_file = f.name
    # Paths relative to the repository (papermill records them in the executed notebook).
    command = [sys.executable, "-m", "papermill", relative(path), relative(run_dir / path.name), "-f", params_file,
               "--cwd", ".", "-k", "python3", "--log-level", "ERROR", "--no-progress-bar"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        status, error = ("ok", "") if proc.returncode == 0 else ("failed", _papermill_error(proc.stderr))
    except subprocess.TimeoutExpired:
        status, error = "timeout", f"did not finish within {timeout_s:.0f} s"
    finally:
        Path(params_file).unlink(missing_ok=True)
    device = parameters.get("device", "cpu")
    meta.update(finished_at=now(), status=status, error=error,
                seconds=round(time.time() - started, 1), environment=environment(device if status == "ok" else "cpu"))
    write_json(run_dir / "run.json", meta)
    return NotebookRun(path.stem, run_dir, status, time.time() - started, error)


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
    except ValueError:
        return str(path)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")



__all__ = ["ROOT", "NotebookRun", "execute", "now", "relative", "write_json"]
