"""One way to name a workload: `get_workload(spec, **overrides)`, the one place a model name
becomes a workload (the design's "workload spec")."""

from __future__ import annotations

from ..core.validate import nearest
from .base import Workload
from .lora import LORA_OVERRIDES, is_lora_spec, lora_workload, split_lora_spec
from .models import PRESETS, build_preset
from .specs import load_code_workload

SPEC_FORMS = ("hf:<model_type>", "hf:path/config.json", "hf:org/name", "path/to/file.py:factory",
              "package.module:factory", "<hf spec>+lora=R")


def get_workload(name: str, seed: int = 0, **overrides) -> Workload:
    """A workload by spec:

        gpt-tiny, gpt2-small, mlp-chain    built-in presets; overrides are config fields (n_layer=8)
        hf-gpt2-tiny, hf-llama-tiny, ...   short names for Hugging Face configs (ckptlab[hf])
        hf:<model_type>, hf:path/config.json, hf:org/name
                                           any transformers architecture, random weights, offline
                                           (`workloads.hf`)
        path/to/file.py:factory, package.module:factory
                                           your own: factory(**overrides) returns a Workload
                                           (`workloads.specs`)
        <transformers spec>+lora, +lora=R  its LoRA fine-tune (peft), rank R (`workloads.lora`)
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"model={name!r} is invalid: allowed presets are {', '.join(PRESETS)} and the hf-* "
                         f"presets; or a spec: {', '.join(SPEC_FORMS)}")
    if is_lora_spec(name):
        base, rank = split_lora_spec(name)
        lora = {k: overrides.pop(k) for k in LORA_OVERRIDES if k in overrides}
        return lora_workload(get_workload(base, seed=seed, **overrides), name, rank, **lora)
    if name.startswith(("hf:", "hf-")):
        # In-function: transformers is an optional, heavy dependency (extra ckptlab[hf]).
        from .hf import get_hf_workload  # noqa: PLC0415 - needs transformers, the hf extra
        return get_hf_workload(name, seed=seed, **overrides)
    if ":" in name:
        return load_code_workload(name, seed=seed, **overrides)
    if name not in PRESETS:
        raise ValueError(f"model={name!r} is invalid{_nearest(name)}: allowed presets are {', '.join(PRESETS)} and "
                         f"the hf-* presets; or a spec: {', '.join(SPEC_FORMS)}")
    return build_preset(name, seed, **overrides)


def _nearest(name: str) -> str:
    """What a name that is no preset most likely meant, in words ("" when nothing is close)."""
    if name.endswith(".py"):
        return f" (a model file is named with its factory: {name}:factory)"
    close = nearest(name, PRESETS)
    return f" (did you mean {close}?)" if close else ""


def as_workload(workload: Workload | str) -> Workload:
    """A Workload as given, or the one a spec names."""
    return get_workload(workload) if isinstance(workload, str) else workload


__all__ = ["SPEC_FORMS", "as_workload", "get_workload"]
