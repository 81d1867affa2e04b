"""ckptlab: measure what activation checkpointing saves and costs, and choose what to recompute.

The package is layered in the order of the flow (docs/design.md); this module only re-exports.
Experiments, analysis, figures and the explorer load when first used (their names are in
`_LAZY`), so `import ckptlab` loads neither pandas nor a plotting or notebook library.
"""

import importlib
from typing import TYPE_CHECKING

from .checkpoint.blocks import CheckpointHandle
from .checkpoint.wrap import apply_checkpointing
from .core.meta import __version__
from .core.policy import Policy, parse_policy
from .core.units import format_bytes
from .estimate.closed_form import closed_form
from .estimate.fake_step import Prediction
from .estimate.predict import predict_fits
from .plan.budget import Plan, measure, plan_budget, predict
from .probe.memory import MemoryReport, track_memory
from .probe.verify import compare_gradients
from .report.explain import Explanation, explain
from .run.config import SweepConfig
from .workloads.base import Workload
from .workloads.registry import get_workload
from .workloads.stacks import find_blocks

if TYPE_CHECKING:  # what IDEs and type checkers see of the names loaded on first use
    from .apps.explorer import Explorer
    from .core.cards import cards  # noqa: F401 - loaded on first use, outside __all__ (full at 30)
    from .core.loop import Loop  # noqa: F401 - loaded on first use, outside __all__ (full at 30)
    from .report import analysis as analysis
    from .report import plots as plots
    from .report.analysis import add_predictions
    from .run.compare import compare, measure_together
    from .run.store import RunLockedError, load_run
    from .run.sweep import equal_batch_sweep, sweep

# name -> (module, attribute or None for the module itself), imported on first access
_LAZY = {
    "analysis": ("ckptlab.report.analysis", None),
    "plots": ("ckptlab.report.plots", None),
    "Explorer": ("ckptlab.apps.explorer", "Explorer"),
    "add_predictions": ("ckptlab.report.analysis", "add_predictions"),
    "compare": ("ckptlab.run.compare", "compare"),
    "measure_together": ("ckptlab.run.compare", "measure_together"),
    "RunLockedError": ("ckptlab.run.store", "RunLockedError"),
    "load_run": ("ckptlab.run.store", "load_run"),
    "sweep": ("ckptlab.run.sweep", "sweep"),
    "equal_batch_sweep": ("ckptlab.run.sweep", "equal_batch_sweep"),
    "cards": ("ckptlab.core.cards", "cards"),   # not in __all__ (full at 30): ckptlab.cards() still works
    "Loop": ("ckptlab.core.loop", "Loop"),      # likewise; every `loop=` also takes its text
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ckptlab' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointHandle", "Explanation", "Explorer", "MemoryReport", "Plan", "Policy", "Prediction", "RunLockedError", "SweepConfig",
    "Workload", "__version__", "add_predictions", "apply_checkpointing", "closed_form", "compare", "compare_gradients",
    "equal_batch_sweep", "explain", "find_blocks", "format_bytes", "get_workload", "load_run", "measure", "measure_together",
    "parse_policy", "plan_budget", "predict", "predict_fits", "sweep", "track_memory",
]
