"""The training loop a step runs in, as one value: what the loop around `model(x)` does that
changes a step's memory, beside the model, the batch, the dtype and the checkpoint policy.

    adamw                                         the default: one micro-batch, AdamW as torch picks it
    adamw-fused,accum=2,holds-output              litgpt's pretrain.py
    sgd,zero-grad=zeros,clip=1.0,scaler           fp16 with a grad scaler, gradients zeroed in place

The text is a comma-separated list: an optimizer (`core.optimizers.OPTIMIZERS`, first, default
adamw), then any of `accum=K`, `holds-output`, `zero-grad=zeros|set_to_none`, `clip=X` and
`scaler`, each at most once. `parse_loop` reads it once, where text comes in (the command line,
notebook parameters, a sweep's configuration, the public functions); `str(loop)` spells it
back, the same loop. Every answer names its loop, and a record holds it in `LOOP_COLUMNS`.
What each field does to the step: `probe.step.training_step`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .optimizers import OPTIMIZER_HELP, OPTIMIZERS

ZERO_GRADS = ("set_to_none", "zeros")
DEFAULT_LOOP = "adamw"
LOOP_HELP = ("an optimizer (" + OPTIMIZER_HELP + "), then any of accum=K (K>=1 micro-batches per optimizer "
             "step), holds-output, zero-grad=set_to_none|zeros, clip=X (max gradient norm > 0), scaler "
             "(fp16's GradScaler), comma-separated, e.g. adamw-fused,accum=2,holds-output")


@dataclass(frozen=True)
class Loop:
    """A parsed training loop.

    accum_steps:    micro-batches of `batch_size` whose forward and backward run before the one
                    optimizer step (gradients accumulate; the loss is scaled by 1/accum_steps).
    holds_output:   the loop keeps the model's output alive into the next step's forward, as
                    `logits, loss = model(x, y)` at loop scope does (`probe.step.HeldOutput`).
    optimizer:      a name of `core.optimizers.OPTIMIZERS`: the optimizer and its implementation.
    zero_grad:      "set_to_none" (`zero_grad(set_to_none=True)`: gradients freed after each
                    step) or "zeros" (`zero_grad(set_to_none=False)`: zero-filled in place, so
                    they stay allocated through the next forward).
    clip_grad_norm: the max norm of `torch.nn.utils.clip_grad_norm_` between the backward and the
                    optimizer step (None: no clipping).
    grad_scaler:    fp16's `torch.amp.GradScaler` scales the loss, unscales the gradients and
                    steps the optimizer (dtype fp16 only: `check_dtype`).
    """

    accum_steps: int = 1
    holds_output: bool = False
    optimizer: str = DEFAULT_LOOP
    zero_grad: str = "set_to_none"
    clip_grad_norm: Optional[float] = None
    grad_scaler: bool = False

    def __post_init__(self):
        check_accum_steps(self.accum_steps)
        check_holds_output(self.holds_output)
        check_optimizer(self.optimizer)
        check_zero_grad(self.zero_grad)
        object.__setattr__(self, "clip_grad_norm", check_clip_grad_norm(self.clip_grad_norm))
        check_grad_scaler(self.grad_scaler, self.optimizer)

    def __str__(self) -> str:
        parts = [self.optimizer]
        if self.accum_steps != 1:
            parts.append(f"accum={self.accum_steps}")
        if self.holds_output:
            parts.append("holds-output")
        if self.zero_grad != "set_to_none":
            parts.append(f"zero-grad={self.zero_grad}")
        if self.clip_grad_norm is not None:
            parts.append(f"clip={self.clip_grad_norm!r}")
        if self.grad_scaler:
            parts.append("scaler")
        return ",".join(parts)

    def check_dtype(self, dtype: str) -> None:
        """Refuse a loop that cannot run in `dtype` (a name of `core.dtypes.DTYPES`): the grad
        scaler unscales fp32 gradients of an fp16 autocast step; with fp16 weights the gradients
        are fp16 and `GradScaler.unscale_` refuses them (torch/amp/grad_scaler.py:275, _unscale_grads_, at
        v2.13.0)."""
        if self.grad_scaler and dtype != "fp16":
            raise ValueError(f"grad_scaler=True is invalid with dtype={dtype!r}: the grad scaler is for fp16 autocast; "
                             "allowed is dtype='fp16', or grad_scaler=False")

    def record(self) -> dict:
        """The loop as a record's columns (`LOOP_COLUMNS`): its label and each field."""
        return {"loop": str(self), **dataclasses.asdict(self)}


LOOP_COLUMNS = ("loop", *(f.name for f in dataclasses.fields(Loop)))


def check_accum_steps(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"accum_steps={value!r} is invalid: allowed is an integer >= 1 (micro-batches per "
                         "optimizer step)")
    return value


def check_holds_output(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"holds_output={value!r} is invalid: allowed are True, False")
    return value


def check_optimizer(value) -> str:
    if not isinstance(value, str) or value not in OPTIMIZERS:
        raise ValueError(f"optimizer={value!r} is invalid: allowed are {', '.join(OPTIMIZERS)}")
    return value


def check_zero_grad(value) -> str:
    if not isinstance(value, str) or value not in ZERO_GRADS:
        raise ValueError(f"zero_grad={value!r} is invalid: allowed are set_to_none (gradients freed after each "
                         "step), zeros (zero-filled in place, kept)")
    return value


def check_clip_grad_norm(value) -> Optional[float]:
    """None, or a finite max norm > 0, as a float."""
    if value is None:
        return None
    try:
        norm = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        norm = math.nan
    if not (math.isfinite(norm) and norm > 0):
        raise ValueError(f"clip_grad_norm={value!r} is invalid: allowed is a finite max norm > 0, or None (no "
                         "clipping)")
    return norm


def check_grad_scaler(value, optimizer: str = DEFAULT_LOOP) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"grad_scaler={value!r} is invalid: allowed are True, False")
    if value and optimizer == "none":
        raise ValueError("grad_scaler=True is invalid with optimizer='none': the scaler steps an optimizer; "
                         "allowed is an optimizer of " + ", ".join(o for o in OPTIMIZERS if o != "none"))
    return value


FLAGS = {"holds-output": "holds_output", "scaler": "grad_scaler"}          # a word that sets a field to True
KEYS = {"accum": "accum_steps", "zero-grad": "zero_grad", "clip": "clip_grad_norm"}   # key=value


def parse_loop(text: str) -> Loop:
    """A loop's text (module docstring) -> its Loop. Raises ValueError naming the parameter, the
    value and what is allowed."""
    if not isinstance(text, str):
        raise ValueError(f"loop={text!r} is invalid: expected a string, {LOOP_HELP}")
    items = [part.strip() for part in text.lower().split(",")]
    if not items or "" in items:
        raise ValueError(f"loop={text!r} is invalid: an item is empty; allowed is {LOOP_HELP}")
    values: dict = {}
    if "=" not in items[0] and items[0] not in FLAGS:   # the optimizer, checked by Loop
        values["optimizer"] = items.pop(0)
    for item in items:
        key, sep, arg = (part.strip() for part in item.partition("="))
        name = FLAGS.get(key) if not sep else KEYS.get(key)
        if name is None:
            what = f"unknown item {item!r}" if item not in OPTIMIZERS else f"the optimizer {item!r} comes first"
            raise ValueError(f"loop={text!r} is invalid: {what}; allowed is {LOOP_HELP}")
        if name in values:
            raise ValueError(f"loop={text!r} is invalid: {key} is given twice; allowed is each item once")
        values[name] = True if not sep else int(arg) if name == "accum_steps" and arg.isdigit() else arg
    if "accum_steps" in values and isinstance(values["accum_steps"], str):
        raise ValueError(f"accum={values['accum_steps']} is invalid in loop={text!r}: allowed is an integer >= 1")
    return Loop(**values)


def as_loop(value: Loop | str | None) -> Loop:
    """What a public function does with its `loop` argument: a Loop as it is, text parsed, None
    the default loop."""
    if value is None:
        return Loop()
    return value if isinstance(value, Loop) else parse_loop(value)


def loop_of_record(row: dict) -> Loop:
    """The loop a record was made in, from its `LOOP_COLUMNS` (a column a record lacks, or leaves
    empty, takes the field's default: records written before a field existed)."""
    values = {}
    for f in dataclasses.fields(Loop):
        value = row.get(f.name)
        if value is None or value != value:   # missing, None or NaN (a DataFrame's empty cell)
            continue
        values[f.name] = value.item() if hasattr(value, "item") else value
    if "accum_steps" in values:
        values["accum_steps"] = int(values["accum_steps"])
    for name in ("holds_output", "grad_scaler"):
        if name in values:
            values[name] = bool(values[name])
    return Loop(**values)


__all__ = ["DEFAULT_LOOP", "LOOP_COLUMNS", "LOOP_HELP", "Loop", "ZERO_GRADS", "as_loop", "check_accum_steps",
           "check_clip_grad_norm", "check_grad_scaler", "check_holds_output", "check_optimizer", "check_zero_grad",
           "loop_of_record", "parse_loop"]
