"""LoRA fine-tuning of any transformers workload: the spec suffix `+lora` (rank 8) or `+lora=R`.

    hf:llama+lora              hf-llama-tiny+lora=16              hf:path/config.json+lora

The model is the spec's transformers model wrapped by peft (`get_peft_model(model,
LoraConfig(...))`): its weights frozen, rank-R adapters trained beside the target modules. The
targets default to peft's own choice for the architecture (Llama: q_proj, v_proj; GPT-2: c_attn;
BERT: query, value; T5: q, v); overrides (`--set k=v`) beside the base spec's:

    lora_targets   module names, comma-separated ("q_proj,k_proj,v_proj,o_proj")
    lora_alpha     the scaling numerator (default 2 x rank)
    lora_dropout   dropout on the adapters' input (default 0.05)

Batches and loss are the base workload's. With `--dtype bf16-weights` the frozen weights are
bf16 and the adapters stay fp32, as peft keeps them (`workloads.base.cast_weights`).
Needs peft (the `[hf]` extra).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch.nn as nn

from ..core.extras import missing_extra
from .base import Workload

SUFFIX = "+lora"
DEFAULT_RANK = 8
DEFAULT_DROPOUT = 0.05
LORA_OVERRIDES = ("lora_targets", "lora_alpha", "lora_dropout")


def is_lora_spec(spec) -> bool:
    return isinstance(spec, str) and (spec.endswith(SUFFIX) or f"{SUFFIX}=" in spec)


def split_lora_spec(spec: str) -> tuple[str, int]:
    """'hf-llama-tiny+lora=16' -> ('hf-llama-tiny', 16); ValueError for a bad rank or base."""
    base, _, rank_text = spec.rpartition(SUFFIX)
    rank = DEFAULT_RANK
    if rank_text:
        value = rank_text[1:] if rank_text.startswith("=") else None
        if value is None or not value.isdigit() or int(value) < 1:
            raise ValueError(f"model={spec!r} is invalid: allowed LoRA suffixes are {SUFFIX} and {SUFFIX}=R "
                             "with the rank R an integer >= 1, e.g. hf-llama-tiny+lora=16")
        rank = int(value)
    if not base.startswith(("hf:", "hf-")):
        raise ValueError(f"model={spec!r} is invalid: {SUFFIX} applies to transformers workloads (hf:<model_type>, "
                         "hf:path/config.json, hf:org/name, the hf-* presets); wrap your own model with "
                         "peft.get_peft_model in your factory")
    return base, rank


class LoraModel:
    """make_model of a LoRA workload: the base workload's model, wrapped by peft (picklable;
    `task` is the base's)."""

    def __init__(self, base_make_model, rank: int, targets: Optional[list[str]], alpha: float, dropout: float):
        self.base_make_model = base_make_model
        self.rank, self.targets, self.alpha, self.dropout = rank, targets, alpha, dropout

    @property
    def task(self) -> str:
        return self.base_make_model.task

    def __call__(self, config) -> nn.Module:
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - peft is optional (the hf extra)

        lora = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.targets)
        with warnings.catch_warnings():
            # peft reads transformers' deprecated is_gradient_checkpointing: not the user's to fix
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(self.base_make_model(config), lora)


def lora_workload(base: Workload, spec: str, rank: int, lora_targets=None, lora_alpha=None,
                  lora_dropout=DEFAULT_DROPOUT) -> Workload:
    """`base` (a transformers workload) as a LoRA fine-tune named `spec`. Checked before any work:
    peft installed, the targets known for the architecture or given, each target a module name
    of the model, alpha > 0 and dropout in [0, 1)."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS  # noqa: PLC0415 - optional
    except ImportError:
        raise missing_extra("peft", "LoRA workloads (+lora)") from None
    model_type = getattr(base.config, "model_type", None)
    if lora_targets is None:
        targets = DEFAULTS.get(model_type)
        if targets is None:
            raise ValueError(f"model={spec!r} is invalid: peft has no default LoRA target modules for model type "
                             f"{model_type!r}; name them: --set lora_targets=name1,name2")
        targets = list(targets)
    else:
        targets = _names(spec, lora_targets)
    alpha = 2 * rank if lora_alpha is None else lora_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"lora_alpha={lora_alpha!r} is invalid for model={spec!r}: allowed is a number > 0")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout={lora_dropout!r} is invalid for model={spec!r}: allowed is a number in [0, 1)")
    names = _module_names(base)
    missing = [t for t in targets if t not in names]
    if missing:
        linear = sorted({name.rpartition(".")[2] for name, m in base.build("meta").named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ValueError(f"lora_targets={','.join(targets)!r} is invalid for model={spec!r}: no module named "
                         f"{missing[0]!r}; its linear layers are {', '.join(linear)}")
    overrides = {**base.overrides, "lora_targets": ",".join(targets), "lora_alpha": alpha,
                 "lora_dropout": lora_dropout}
    return dataclasses.replace(base, name=spec, spec=spec, overrides=overrides,
                               make_model=LoraModel(base.make_model, rank, targets, alpha, lora_dropout))


def _module_names(base: Workload) -> frozenset[str]:
    """The last parts of the names of `base`'s modules (q_proj, ...), from a build on "meta"; kept
    by spec and overrides for a workload made from a spec (a 7B's build costs 0.02 s, a lot beside
    a prediction a widget asks for)."""
    key = (base.spec, base.spec_hash, repr(sorted(base.overrides.items())))
    found = _MODULE_NAMES.get(key) if base.spec is not None else None
    if found is None:
        found = frozenset(name.rpartition(".")[2] for name, _ in base.build("meta").named_modules())
        if base.spec is not None:
            _MODULE_NAMES[key] = found
    return found


_MODULE_NAMES: dict[tuple, frozenset[str]] = {}   # `_module_names` by spec, file hash and overrides


def _names(spec: str, value) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(i, str) and i.strip() for i in items):
        raise ValueError(f"lora_targets={value!r} is invalid for model={spec!r}: allowed are module names, "
                         "comma-separated, e.g. q_proj,v_proj")
    return [i.strip() for i in items]


__all__ = ["DEFAULT_RANK", "LORA_OVERRIDES", "LoraModel", "is_lora_spec", "lora_workload", "split_lora_spec"]
