"""Cells of a sweep: one (batch, seq, policy, dtype, accum) configuration each, measured in this
process or a fresh one, and the one loop that runs them with out-of-memory inference (once
batch b of a group ran out of memory, larger batches are recorded as `oom`, inferred, unrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional

from ..core.children import child_environment, die_with_parent, exit_when_orphaned
from ..core.records import new_record
from ..plan.budget import measure
from ..probe.distributed import measure_sharded
from ..probe.measure import older_objects_frozen
from .compare import measure_together
from .config import SweepConfig
from .progress import progress_bar
from .provenance import now
from .store import RunWriter

RECORD_PREFIX = "CKPTLAB_RECORD "   # marks the child's result line on stdout (isolated cells)
CELL_TIMEOUT_S = 3600.0             # an isolated cell running longer is stopped and recorded as an error


def cell_id(cell: dict) -> str:
    """Stable key of a cell within a run: 'b=4 s=64 p=density=0.5 dt=fp32 acc=1'."""
    return (f"b={cell['batch_size']} s={cell['seq_len']} p={cell['policy']} "
            f"dt={cell['dtype']} acc={cell['accum_steps']}")


def run_cells(config: SweepConfig, writer: RunWriter, done: list[dict]) -> list[dict]:
    """The local runner: every cell of `config` without a record in `done`, in this process or
    (config.isolate) one fresh process each; each record is appended through `writer` as soon as
    it exists."""
    records = list(done)
    finished = {r.get("cell_id") for r in done}
    cells = config.cells()
    todo = [c for c in cells if cell_id(c) not in finished]
    bar = progress_bar(len(cells), f"sweep {config.model}", "cell", config.progress)
    bar.update(len(cells) - len(todo))

    def measure_one(config: SweepConfig, cell: dict) -> dict:
        bar.set_postfix_str(cell_id(cell), refresh=False)
        return run_isolated(config, cell, config.cell_timeout_s) if config.isolate else run_cell(config, cell)

    def keep(record: dict, cell: dict) -> None:
        record.update(cell_id=cell_id(cell), seed=config.seed,
                      isolated=config.isolate and not record.get("inferred"),
                      inferred=bool(record.get("inferred")), finished_at=now())
        writer.append(record)
        records.append(record)
        bar.update(1)

    oom = OomInference(config, done)
    try:
        with older_objects_frozen(config.device):   # each cell's collection walks what the sweep made
            if not config.isolate and config.nproc == 1:  # in this process: the policies of one shape timed together
                for group in timing_groups(todo):
                    bar.set_postfix_str(cell_id(group[0]), refresh=False)
                    measure_together_cells(config, group, keep, oom)
            else:
                measure_cells(config, todo, measure_one, keep, oom)
    finally:
        bar.close()
    return records


def measure_cells(config: SweepConfig, cells: list[dict], measure_one: Callable[[SweepConfig, dict], dict],
                  keep: Callable[[dict, dict], None], oom: "OomInference") -> None:
    """The one cell loop of every runner (local, isolated, inside a submitit job): each cell in
    order becomes an inferred out-of-memory record or `measure_one(config, cell)`, with its wall
    time, handed to `keep(record, cell)` at once — so a crash later never loses it."""
    for cell in cells:
        t0 = time.perf_counter()
        record = oom.infer(cell) or measure_one(config, cell)
        record["cell_wall_s"] = round(time.perf_counter() - t0, 4)
        keep(record, cell)
        oom.note(record)


def timing_groups(cells: list[dict]) -> list[list[dict]]:
    """The cells that differ only in policy, in grid order, batches ascending within each
    (seq, dtype, accum): they are timed together, and an out-of-memory batch is known before
    larger batches of the same policy come up."""
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["seq_len"], cell["dtype"], cell["accum_steps"], cell["batch_size"]), []).append(cell)
    return list(groups.values())


def measure_together_cells(config: SweepConfig, cells: list[dict], keep: Callable[[dict, dict], None],
                           oom: "OomInference") -> None:
    """The cells of one timing group: inferred out-of-memory records as in `measure_cells`, the
    rest measured in this process and timed together (paired rounds), then each kept."""
    t0 = time.perf_counter()
    inferred = [oom.infer(cell) for cell in cells]
    todo = [cell for cell, record in zip(cells, inferred) if record is None]
    if len(todo) > 1:
        workload = config.workload()
        first = todo[0]
        measured = measure_together(workload, first["batch_size"], first["seq_len"], [config.policy(c["policy"]) for c in todo],
                                    device=config.device, dtype=first["dtype"], loop=config.cell_loop(first),
                                    memory_limit_bytes=config.memory_limit,
                                    steps=config.steps, warmup=config.warmup, target_ci=config.target_ci,
                                    max_seconds=config.max_seconds)
        for cell, record in zip(todo, measured):
            record["policy"] = cell["policy"]  # the grid's spelling of it, as in the cell id
            record.pop("source", None)
    else:
        measured = [run_cell(config, cell) for cell in todo]
    wall = round((time.perf_counter() - t0) / max(1, len(todo)), 4)
    results = iter(measured)
    for cell, record in zip(cells, inferred):
        record = record or next(results)
        record["cell_wall_s"] = wall
        keep(record, cell)
        oom.note(record)


class OomInference:
    """Memory only grows with the batch: once batch b of a (seq, dtype, accum, policy) group
    really ran out of memory, larger batches of that group are recorded as `oom`, inferred,
    without running (when `config.infer_oom`). `records`: what is already known (a resumed run)."""

    def __init__(self, config: SweepConfig, records: Iterable[dict] = ()):
        self.config = config
        self.oom_at: dict[tuple, int] = {}   # group -> smallest batch that really ran out of memory
        for record in records:
            self.note(record)

    @staticmethod
    def group(cell: dict) -> tuple:
        return (cell["seq_len"], cell["dtype"], cell["accum_steps"], cell["policy"])

    def note(self, record: dict) -> None:
        if record.get("status") == "oom" and not record.get("inferred"):
            g = self.group(record)
            self.oom_at[g] = min(self.oom_at.get(g, record["batch_size"]), record["batch_size"])

    def infer(self, cell: dict) -> Optional[dict]:
        """The inferred record for `cell`, or None when it must be measured."""
        oom_batch = self.oom_at.get(self.group(cell))
        if not self.config.infer_oom or oom_batch is None or cell["batch_size"] <= oom_batch:
            return None
        return inferred_oom_record(self.config, cell, oom_batch)


def inferred_oom_record(config: SweepConfig, cell: dict, oom_batch: int) -> dict:
    return new_record(config.model, cell["batch_size"], cell["seq_len"], config.cell_loop(cell), config.nproc,
                      model_hash=config.model_hash, policy=cell["policy"], dtype=cell["dtype"], device=config.device,
                      steps=config.steps, warmup=config.warmup, memory_limit_bytes=config.memory_limit, fits=False,
                      status="oom", inferred=True, message=f"inferred, not run: batch {oom_batch} already ran out of memory")


def run_cell(config: SweepConfig, cell: dict) -> dict:
    """Measure one cell in this process (with nproc > 1: in nproc rank processes it starts)."""
    if config.nproc > 1:
        return measure_sharded(config.model, cell["batch_size"], cell["seq_len"], cell["policy"], nproc=config.nproc,
                               device=config.device, dtype=cell["dtype"], steps=config.steps, warmup=config.warmup,
                               memory_limit=config.memory_limit, loop=config.cell_loop(cell), seed=config.seed,
                               model_overrides=config.model_overrides,
                               target_ci=config.target_ci)
    policy = config.policy(cell["policy"])
    if policy.kind == "budget" and policy.compiled:  # a compiled plan is chosen from measured costs: compare measures them
        return measure_together(config.workload(), cell["batch_size"], cell["seq_len"], [policy],
                                device=config.device, dtype=cell["dtype"], loop=config.cell_loop(cell),
                                memory_limit_bytes=config.memory_limit,
                                steps=config.steps, warmup=config.warmup, target_ci=config.target_ci,
                                max_seconds=config.max_seconds)[0]
    return measure(config.workload(), cell["batch_size"], cell["seq_len"], policy, device=config.device,
                   dtype=cell["dtype"], steps=config.steps, warmup=config.warmup,
                   memory_limit=config.memory_limit, loop=config.cell_loop(cell), target_ci=config.target_ci,
                   max_seconds=config.max_seconds)


def run_isolated(config: SweepConfig, cell: dict, timeout_s: Optional[float] = None) -> dict:
    """Measure one cell in a fresh Python process, so no allocator
    state, cache or leak carries from one cell to the next. A crash or timeout (default
    CELL_TIMEOUT_S) becomes an error record; it never stops the sweep. The child dies with this
    process (`ckptlab.core.children`), so a killed sweep leaves nothing computing behind its lock."""
    timeout_s = CELL_TIMEOUT_S if timeout_s is None else timeout_s
    spec = json.dumps({"config": config.to_dict(), "cell": cell, "parent_pid": os.getpid()})
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=spec, text=True, env=child_environment(),
                              capture_output=True, timeout=timeout_s, preexec_fn=die_with_parent())
    except subprocess.TimeoutExpired:
        return failed_record(config, cell, f"isolated cell timed out after {timeout_s} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RECORD_PREFIX):
            return json.loads(line[len(RECORD_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return failed_record(config, cell, f"isolated cell exited with code {proc.returncode}: {tail}")


def failed_record(config: SweepConfig, cell: dict, message: str) -> dict:
    record = inferred_oom_record(config, cell, 0)
    record.update(fits=None, status="error", inferred=False, message=message)
    return record


_CHILD = "import sys; from ckptlab.run.cells import child_main; sys.exit(child_main())"


def child_main() -> int:
    spec = json.loads(sys.stdin.read())
    exit_when_orphaned(spec["parent_pid"])
    record = run_cell(SweepConfig.from_dict(spec["config"]), spec["cell"])
    sys.stdout.write(RECORD_PREFIX + json.dumps(record, default=str) + "\n")
    sys.stdout.flush()
    return 0


__all__ = ["CELL_TIMEOUT_S", "OomInference", "cell_id", "failed_record", "inferred_oom_record", "measure_cells",
           "measure_together_cells", "run_cell", "run_cells", "run_isolated", "timing_groups"]
