"""A sweep's configuration: one dataclass, each field documented where it is declared.

    config = SweepConfig(model="gpt-tiny", batch_sizes=[1, 2, 4], policies=["none", "full"],
                         out="results/my-sweep")
    config = SweepConfig.from_yaml("sweep.yaml")     # the same names as keys
    ckptlab sweep --config sweep.yaml --batch 8      # the command line: flags override the file

Creating a SweepConfig checks every value before anything runs or is written (ValueError
naming the field, the value and what is allowed) and normalizes it: axes sorted without
repeats, policies in their canonical spelling, the memory limit in bytes, the device resolved
("cuda" -> "cuda:0"), `isolate` and `out` given their defaults, `model_hash` computed. The model
is built on the meta device only (to check the policies fit it): no memory, no time.

The field docstrings are also the command line's help (`ckptlab sweep --help`), read by
`core.parsing.attribute_docs`; each field's flag is in its metadata.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..core.dtypes import DTYPES
from ..core.loop import DEFAULT_LOOP, Loop, as_loop
from ..core.parsing import yaml_mapping
from ..core.policy import Policy, parse_policies
from ..core.units import parse_bytes
from ..core.validate import choice, integer, integer_list, no_credential, non_empty, number, output_folder
from ..probe.measure import check_policy_applies
from ..probe.step import resolve_device
from ..probe.timing import check_timing_options
from ..workloads.base import Workload
from ..workloads.registry import get_workload

EXECUTORS = ("local", "submitit")
CLUSTERS = ("slurm", "local", "debug")


def option(default, flag: str, **metadata):
    """A field with its command-line flag (a list or dict default is copied per instance)."""
    metadata = {"flag": flag, **metadata}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class SweepConfig:
    """Everything one sweep needs: the grid (batch sizes x sequence lengths x policies x dtypes x
    accumulation steps, for one model on one device), how each cell is timed, the run folder,
    and how cells run (in this process, one process each, or as submitit jobs)."""

    # ------------------------------------------------------------------ the grid
    model: str = option("gpt-tiny", "--model")
    """The workload: a preset (gpt-tiny, hf-llama-tiny, ...), hf:<model_type>,
    hf:path/config.json, hf:org/name (local cache), path/to/file.py:factory or
    package.module:factory."""
    model_overrides: dict = option({}, "--set")
    """Keyword overrides of the workload (a config field, or a keyword of your factory), e.g.
    {"n_layer": 8}; on the command line KEY=VALUE, repeated."""
    batch_sizes: list[int] = option([1, 2, 4], "--batch")
    """Micro-batch sizes."""
    seq_lens: list[int] = option([64], "--seq")
    """Sequence lengths (at most the model's context length)."""
    policies: list[str] = option(["none", "density=0.5", "full"], "--policy")
    """Checkpointing policies, e.g. none, density=0.5, full, selective, budget=0.5 (the
    vocabulary: ckptlab --help)."""
    dtypes: list[str] = option(["fp32"], "--dtype")
    """fp32, bf16 (autocast), bf16-weights, fp16-weights (pure: model and batch cast, no autocast)."""
    accum_steps: list[int] = option([1], "--accum")
    """Gradient-accumulation steps, the grid's axis of the loop's accum_steps: the effective batch
    is batch x accum."""
    device: str = option("cpu", "--device")
    """cpu, cuda or cuda:N."""
    memory_limit: Optional[int | str] = option(None, "--memory-limit")
    """A memory limit such as 2GiB (emulated on CPU); a cell above it is recorded as oom.
    Stored in bytes."""
    loop: Loop | str = DEFAULT_LOOP
    """The training loop of every cell (`core.loop`: its text, e.g. adamw-fused,holds-output, or a
    Loop) but its accumulation, which is `accum_steps`'. On the command line its flags, as on
    `measure`: --optimizer, --holds-output, --zero-grad, --clip-grad-norm, --grad-scaler."""
    seed: int = option(0, "--seed")
    """Seed of the model's weights and of the batches."""
    nproc: int = option(1, "--nproc")
    """Ranks per cell: more than 1 measures each cell sharded with FSDP2 (gloo on CPU, NCCL on
    CUDA); records gain world_size and peak_bytes_per_rank."""
    model_hash: Optional[str] = None
    """Content hash of the file a spec's model is defined in (None for presets), computed on
    creation. A configuration restored from a run (an isolated cell, a job) carries the hash the
    sweep started with, and a model file that changed since is refused."""

    # ------------------------------------------------------------------ timing
    steps: int = option(3, "--steps")
    """Minimum timing rounds per cell group (the policies of one batch, seq, dtype and accum are
    timed together, interleaved)."""
    warmup: int = option(1, "--warmup")
    """Untimed warm-up rounds."""
    target_ci: float = option(0.02, "--target-ci")
    """Stop timing a group once every 95% interval is within this relative half-width (0.02:
    ±2%)."""
    max_seconds: float = option(5.0, "--max-seconds")
    """... or after this many seconds of timing rounds per group; the interval reached is
    recorded."""

    # ------------------------------------------------------------------ the run folder
    out: Optional[Path] = option(None, "--out")
    """The run folder (records.jsonl, run.json, figures/); default results/sweep-<timestamp>."""
    resume: bool = option(True, "--resume", cli_default=False)
    """Add the cells missing from an existing run folder; off, a folder that holds records is
    refused."""
    progress: bool = option(True, "--progress")
    """A progress bar on a terminal (none when stderr is piped), and the summary printed at the end."""

    # ------------------------------------------------------------------ how cells run
    isolate: Optional[bool] = option(None, "--isolate")
    """One fresh process per cell, so no allocator state carries over (default: on for CUDA,
    off for CPU)."""
    infer_oom: bool = option(True, "--infer-oom")
    """Once a batch of a (seq, dtype, accum, policy) group ran out of memory, record its larger
    batches as oom (inferred) without running them."""
    cell_timeout_s: Optional[float] = option(None, "--cell-timeout")
    """Stop an isolated cell after this many seconds and record it as an error (default 3600)."""
    executor: str = option("local", "--executor")
    """local (this process, or one subprocess per cell) or submitit (cells as jobs)."""
    cluster: Optional[str] = option(None, "--cluster")
    """submitit: slurm, local (jobs as local processes) or debug (in this process); default
    SLURM where srun is found, else local."""
    slurm_partition: Optional[str] = option(None, "--slurm-partition")
    """submitit on SLURM: the partition."""
    slurm_gpus_per_job: Optional[int] = option(None, "--slurm-gpus")
    """submitit on SLURM: GPUs per job (default: nproc on CUDA, 0 on CPU)."""
    slurm_time_min: int = option(60, "--slurm-time")
    """submitit: time limit per job, minutes."""
    slurm_account: Optional[str] = option(None, "--slurm-account")
    """submitit on SLURM: the account."""
    cells_per_job: int = option(1, "--cells-per-job")
    """submitit: cells measured by one job."""
    submitit_folder: Optional[Path] = option(None, "--submitit-folder")
    """submitit: the jobs' files (default <out>/submitit)."""

    def workload(self) -> Workload:
        """The sweep's model, refused when its file changed since the run started (`model_hash`)."""
        workload = get_workload(self.model, seed=self.seed, **self.model_overrides)
        if self.model_hash is not None and self.model_hash != workload.spec_hash:
            raise ValueError(f"model={self.model!r} is invalid for this run: its file changed (content hash "
                             f"{workload.spec_hash}, the run started with {self.model_hash}); measure the "
                             "changed model into another out= folder")
        return workload

    def __post_init__(self):
        self.model_overrides = dict(self.model_overrides or {})
        no_credential("model_overrides", self.model_overrides)
        integer("seed", self.seed, 0)
        workload = self.workload()
        self.model_hash = workload.spec_hash
        self.batch_sizes = sorted(set(integer_list("batch_sizes", self.batch_sizes, 1)))
        self.seq_lens = sorted(set(integer_list("seq_lens", self.seq_lens, 1)))
        self.accum_steps = sorted(set(integer_list("accum_steps", self.accum_steps, 1)))
        for s in self.seq_lens:
            try:
                workload.check_shape(1, s)
            except ValueError as exc:
                raise ValueError(f"seq_lens: {exc}") from None
        parsed = parse_policies(self.policies, "policies")
        for policy in parsed:
            check_policy_applies(workload, policy)
        self.policies = [str(p) for p in parsed]  # canonical text: cells, records and run.json
        self._parsed = {str(p): p for p in parsed}
        self.dtypes = [choice("dtypes", d, list(DTYPES)) for d in dict.fromkeys(non_empty("dtypes", self.dtypes))]
        self.loop = as_loop(self.loop)
        if self.loop.accum_steps != 1:
            raise ValueError(f"loop={str(self.loop)!r} is invalid in a sweep: its accumulation is the grid's axis; "
                             f"allowed is accum_steps=[{self.loop.accum_steps}] and a loop without accum=")
        for dtype in self.dtypes:
            self.loop.check_dtype(dtype)
        self.device = str(resolve_device(self.device))
        self.memory_limit = parse_bytes(self.memory_limit)
        integer("nproc", self.nproc, 1)
        integer("steps", self.steps, 1)
        integer("warmup", self.warmup, 0)
        check_timing_options(self.target_ci, self.max_seconds)
        self.target_ci, self.max_seconds = float(self.target_ci), float(self.max_seconds)

        self.out = output_folder("out", Path("results") / dt.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")
                                 if self.out is None else self.out)
        for name in ("resume", "progress", "infer_oom") + (() if self.isolate is None else ("isolate",)):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: allowed are True, False")
        if self.isolate is None:
            self.isolate = self.device.startswith("cuda")
        if self.cell_timeout_s is not None:
            self.cell_timeout_s = number("cell_timeout_s", self.cell_timeout_s, 0, low_open=True)

        choice("executor", self.executor, EXECUTORS)
        if self.submitit_folder is not None:
            self.submitit_folder = output_folder("submitit_folder", self.submitit_folder)
        if self.executor == "submitit":
            self.job_options()

    def cell_loop(self, cell: dict) -> Loop:
        """The loop of one cell: `loop` with the cell's accumulation."""
        return dataclasses.replace(self.loop, accum_steps=cell["accum_steps"])

    def policy(self, text: str) -> Policy:
        """The parsed Policy of one of `policies` (a cell's `policy` text)."""
        return self._parsed[text]

    def job_options(self) -> "JobOptions":
        """The submitit options, checked (executor="submitit")."""
        return job_options(self.out, self.submitit_folder, self.cluster, self.slurm_partition, self.slurm_gpus_per_job,
                           self.slurm_time_min, self.slurm_account, self.cells_per_job, self.device, self.nproc)

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "SweepConfig":
        """From a mapping of field names (a YAML file, a saved run); an unknown name is refused."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in values if k not in names]
        if unknown:
            raise ValueError(f"{source}: {unknown[0]!r} is invalid: allowed are {', '.join(names)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "SweepConfig":
        """From a YAML file of field names and values (plain YAML: no tags)."""
        return cls.from_dict(yaml_mapping("config", path), source=f"config={str(path)!r}")

    def to_dict(self) -> dict:
        """Every field as JSON takes it (paths as text): what an isolated cell or a job is handed."""
        return {f.name: str(getattr(self, f.name)) if isinstance(getattr(self, f.name), (Path, Loop))
                else copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def cells(self) -> list[dict]:
        """Every cell, in run order (batch innermost, ascending)."""
        return [dict(seq_len=seq, dtype=dtype, accum_steps=accum, policy=policy, batch_size=batch)
                for seq in self.seq_lens for dtype in self.dtypes for accum in self.accum_steps
                for policy in self.policies for batch in self.batch_sizes]


@dataclass
class JobOptions:
    """How cells (or notebooks) become submitit jobs. `cluster`: "slurm", "local" (each job a
    local subprocess: tests, laptops), "debug" (in this process), or None: SLURM when `srun` is
    on PATH, else local."""

    folder: Path
    cluster: Optional[str] = None
    slurm_partition: Optional[str] = None
    slurm_gpus_per_job: int = 0
    slurm_time_min: int = 60
    slurm_account: Optional[str] = None
    cells_per_job: int = 1
    max_jobs: Optional[int] = None   # jobs at once: SLURM array parallelism; local default = cores
    poll_s: float = 0.5


def job_options(out: Path, folder=None, cluster=None, slurm_partition=None, slurm_gpus_per_job=None,
                slurm_time_min=60, slurm_account=None, cells_per_job=1, device="cpu", nproc=1) -> JobOptions:
    """Validate the submitit options (ValueError naming the parameter) before anything runs."""
    if cluster is not None and cluster not in CLUSTERS:
        raise ValueError(f"cluster={cluster!r} is invalid: allowed are {', '.join(CLUSTERS)} or None (auto)")
    integer("cells_per_job", cells_per_job, 1)
    integer("slurm_time_min", slurm_time_min, 1)
    if slurm_gpus_per_job is None:   # one GPU per rank on CUDA, none on CPU
        slurm_gpus_per_job = nproc if str(device).startswith("cuda") else 0
    integer("slurm_gpus_per_job", slurm_gpus_per_job, 0)
    try:
        import submitit  # noqa: F401, PLC0415 - submitit is the cluster extra
    except ImportError:
        raise ValueError("executor='submitit' needs submitit: pip install 'ckptlab[cluster]'") from None
    return JobOptions(Path(folder) if folder is not None else Path(out) / "submitit", cluster, slurm_partition,
                      slurm_gpus_per_job, slurm_time_min, slurm_account, cells_per_job)


# The fields that must match when a sweep resumes into an existing run folder: mixing cells
# measured under different settings in one table would make every comparison in it wrong.
RESUME_MUST_MATCH = ("model", "model_hash", "model_overrides", "seed", "device", "steps", "warmup", "memory_limit",
                     "loop", "nproc")


__all__ = ["CLUSTERS", "EXECUTORS", "JobOptions", "RESUME_MUST_MATCH", "SweepConfig", "job_options"]
