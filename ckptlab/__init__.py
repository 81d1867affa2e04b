"""ckptlab: measure what activation checkpointing saves and costs, and choose what to recompute.

The package is layered in the order of the flow (docs/design.md); this module only re-exports.
"""

import sys

from .apps import notebooks
from .checkpoint.blocks import CheckpointHandle, find_blocks, find_stacks
from .checkpoint.wrap import apply_checkpointing
from .core.meta import __version__
from .core.policy import Policy, parse_policy
from .core.units import format_bytes, parse_bytes
from .probe.compare import compare
from .probe.estimate import Prediction, closed_form, llama7b_shape, predict, predict_fits
from .probe.measure import measure
from .probe.memory import MemoryReport, track_memory
from .probe.plan import Plan, plan_budget, profile_blocks
from .probe.timing import time_interleaved, time_steps
from .probe.verify import compare_gradients
from .report import analysis, plots
from .report.sweeps import equal_batch_sweep, sweep
from .run import store
from .run.config import SweepConfig
from .run.store import RunLockedError, load_run
from .workloads.base import Workload
from .workloads.registry import get_workload

# The short public paths users and notebooks import (`ckptlab.analysis`, `ckptlab.plots`,
# `ckptlab.store`, `ckptlab.notebooks`) name the layered modules themselves: one module object
# under two names, so attributes and monkeypatches are shared.
for _alias, _module in {"analysis": analysis, "plots": plots, "store": store, "notebooks": notebooks}.items():
    sys.modules[f"{__name__}.{_alias}"] = _module

__all__ = [
    "CheckpointHandle", "MemoryReport", "Plan", "Policy", "Prediction", "RunLockedError", "SweepConfig", "Workload", "__version__",
    "apply_checkpointing", "closed_form", "compare", "compare_gradients", "equal_batch_sweep", "find_blocks",
    "find_stacks", "format_bytes",
    "get_workload", "llama7b_shape", "load_run", "measure", "parse_bytes", "parse_policy", "plan_budget",
    "predict", "profile_blocks", "sweep", "time_interleaved", "time_steps", "track_memory", "predict_fits",
]
