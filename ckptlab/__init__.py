"""ckptlab: measure what activation checkpointing saves and costs, and choose what to recompute."""

from .blocks import find_blocks, find_stacks
from .estimate import Prediction, closed_form, predict, what_fits
from .measure import measure
from .memory import MemoryReport, format_bytes, parse_bytes, track_memory
from .models import Workload, get_workload
from .plan import Plan, plan_budget, profile_blocks
from .policy import Policy, parse_policy
from .store import RunLockedError, load_run
from .sweep import equal_batch_sweep, make_grid, sweep
from .timing import time_steps
from .verify import compare_gradients
from .wrap import CheckpointHandle, apply_checkpointing

__version__ = "0.1.0"

__all__ = [
    "CheckpointHandle", "MemoryReport", "Policy", "Workload", "apply_checkpointing", "compare_gradients",
    "find_blocks", "find_stacks",
    "format_bytes", "get_workload", "measure", "parse_bytes", "parse_policy", "time_steps",
    "track_memory", "sweep", "equal_batch_sweep", "make_grid", "load_run", "RunLockedError",
    "Prediction", "predict", "closed_form", "what_fits", "Plan", "plan_budget", "profile_blocks",
]
