"""One way to name a workload: `get_workload(name, **overrides)` dispatches to the built-in
presets or to the Hugging Face ones (optional extra)."""

from __future__ import annotations

from .base import WORKLOAD_FACTORIES, Workload
from .models import PRESETS, build_preset


def get_workload(name: str, seed: int = 0, **overrides) -> Workload:
    """A built-in workload by preset name, with config fields overridden (e.g. n_layer=8)."""
    if name.startswith("hf-") and name not in WORKLOAD_FACTORIES:
        # In-function: transformers is an optional, heavy dependency (extra ckptlab[hf]).
        from . import hf  # noqa: F401, PLC0415 - needs transformers, the hf extra
    if name in WORKLOAD_FACTORIES:
        return WORKLOAD_FACTORIES[name](name, seed=seed, **overrides)
    if name not in PRESETS:
        raise ValueError(f"model={name!r} is invalid: allowed presets are {', '.join([*PRESETS, *WORKLOAD_FACTORIES])}")
    return build_preset(name, seed, **overrides)


__all__ = ["get_workload"]
