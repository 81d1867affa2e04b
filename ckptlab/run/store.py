"""The results store: one folder per run.

    results/<run-name>/
        records.jsonl   one JSON line per finished cell, appended, flushed and fsynced
        run.json        the grid, versions, device, start/end times (rewritten atomically)
        figures/        PNG + SVG, redrawable from the two files above (`plots.redraw_all`)
        .lock           held (flock) while a sweep writes here

Crash safety: a record is on disk before the next cell starts, so a SIGKILL at any moment loses
at most the cell in flight. A kill in the middle of a write leaves a torn last line; readers skip
it with a warning, and the next writer cuts it off before appending.

Concurrency: a second sweep on a folder that is in use is *refused* (`RunLockedError`), never
interleaved. The lock is `fcntl.flock` on `.lock`, which the kernel releases when the holder
dies, so a killed sweep never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import warnings
from pathlib import Path

import pandas as pd

from ..core.records import FIELDS
from ..core.validate import made_folder, output_folder

RECORDS = "records.jsonl"
META = "run.json"
LOCK = ".lock"


RUN_MARKER = ".ckptlab-run"   # in every run folder ckptlab made to be replaced; only those ever are


def check_replaceable(run_dir: Path) -> None:
    """A run folder may be created, or replaced when ckptlab made it (it holds RUN_MARKER);
    any other folder at that place is the user's and is never touched."""
    output_folder("run folder", run_dir)
    if run_dir.is_symlink() or (run_dir.exists() and not (run_dir / RUN_MARKER).is_file()):
        raise ValueError(f"run folder {str(run_dir)!r} is invalid: it exists and was not made by ckptlab "
                         f"(no {RUN_MARKER} file in it), so it is never replaced; allowed is another "
                         "--name or --out, or move that folder away yourself")


def fresh_run_folder(run_dir: Path) -> Path:
    """An empty run folder marked as ckptlab's: a new run under the same name replaces the old one."""
    check_replaceable(run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / RUN_MARKER).write_text("Made by ckptlab, which replaces this folder when the same run (a notebook, "
                                      "a Trainer run) is made again under the same name.\n")
    return run_dir


class RunLockedError(RuntimeError):
    """Another process is writing to this run folder."""


def read_records(run_dir: str | Path) -> list[dict]:
    """Every complete record in `run_dir/records.jsonl`, in the order written.

    A line that is not valid JSON (a torn write from a killed sweep) is skipped with a warning;
    it never stops the rest from loading.
    """
    path = Path(run_dir) / RECORDS
    if not path.exists():
        return []
    records = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            where = "last line (torn write)" if number >= len(lines) - 1 else f"line {number}"
            warnings.warn(f"{path.name}: ignoring unreadable {where} in run {Path(run_dir).name!r}",
                          RuntimeWarning, stacklevel=2)
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            warnings.warn(f"{path.name}: ignoring line {number} in run {Path(run_dir).name!r}: a JSON "
                          f"{type(record).__name__}, not a record (an object)", RuntimeWarning, stacklevel=2)
    return records


def read_meta(run_dir: str | Path) -> dict:
    """run.json as a dict ({} when there is none); ValueError naming the file when it is not a
    JSON object (torn or edited by hand)."""
    path = Path(run_dir) / META
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is invalid: not readable as JSON ({exc}); allowed is the run.json a sweep "
                         "writes: restore it, or move the run folder away") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is invalid: a JSON {type(meta).__name__}, not an object; allowed is the "
                         "run.json a sweep writes")
    return meta


def load_run(run_dir: str | Path):
    """A run folder -> pandas.DataFrame, one row per cell; the run's metadata in `df.attrs["run"]`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run_dir={str(run_dir)!r} is invalid: no such run folder")
    if not (run_dir / META).exists():
        warnings.warn(f"run folder {run_dir.name!r} has no {META}: its grid and environment are unknown",
                      RuntimeWarning, stacklevel=2)
    records = read_records(run_dir)
    # Every column of the record schema, even for records written before a column existed (a
    # resumed folder mixes them): analysis and plots can rely on the names.
    df = pd.DataFrame(records).reindex(columns=list(dict.fromkeys([*FIELDS, *(k for r in records for k in r)])))
    df.attrs["run"] = read_meta(run_dir)
    return df


class RunWriter:
    """Exclusive writer for one run folder. Use as a context manager:

        with RunWriter("results/x") as w:
            w.append(record)
    """

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self._lock_file = None
        self._records = None

    def __enter__(self) -> "RunWriter":
        made_folder("out", self.dir)
        self._lock_file = open(self.dir / LOCK, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise RunLockedError(
                f"run folder {self.dir.name!r} is in use by another sweep; wait for it to finish "
                f"or choose another out= folder") from None
        self._repair_torn_tail()
        self._records = open(self.dir / RECORDS, "a", encoding="utf-8")
        return self

    def __exit__(self, *exc) -> None:
        if self._records is not None:
            self._records.close()
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def _repair_torn_tail(self) -> None:
        # A killed writer may leave a partial last line; appending after it would glue the next
        # record onto it, so cut the file back to its last complete line.
        path = self.dir / RECORDS
        if not path.exists() or path.stat().st_size == 0:
            return
        data = path.read_bytes()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        warnings.warn(f"{RECORDS}: dropping a torn last line ({len(data) - keep} bytes) in run "
                      f"{self.dir.name!r}", RuntimeWarning, stacklevel=3)
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())

    def append(self, record: dict) -> None:
        """Write one record as one line and make it durable before returning."""
        self._records.write(json.dumps(record, default=str) + "\n")
        self._records.flush()
        os.fsync(self._records.fileno())

    def write_meta(self, meta: dict) -> None:
        """Replace run.json atomically (write a temp file, fsync, rename)."""
        tmp = self.dir / (META + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / META)


__all__ = ["LOCK", "META", "RECORDS", "RunLockedError", "RunWriter", "load_run", "read_meta", "read_records"]
