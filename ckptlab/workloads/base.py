"""What ckptlab measures: a Workload is a named model config plus how to feed it and its loss;
`Workload.custom` makes one of your own model."""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..core.validate import integer


@dataclass
class Workload:
    """A named model config plus how to feed it. `build()` gives a fresh, seeded model.

    Built-in workloads come from `get_workload`; your own model from `Workload.custom`.
    `spec` is the string `get_workload` re-creates it from (in isolated cells, jobs and ranks),
    `spec_hash` a content hash of the file that defines it, `overrides` what the spec's factory
    was given. `weights_dtype` (set by `probe.step.with_dtype` for pure bf16/fp16 training) casts
    the model and the batch's floating-point tensors, as loading with `torch_dtype=` does.
    """

    name: str
    config: object
    make_model: Callable[[object], nn.Module]
    make_batch: Callable[[object, int, int, torch.Generator], tuple]
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor]
    seed: int = 0
    block_paths: Optional[tuple[str, ...]] = None   # attribute paths of the block stacks, else found
    seq_len_limit: Optional[int] = None             # else the config's position limit, if any
    spec: Optional[str] = None
    spec_hash: Optional[str] = None
    overrides: dict = dataclasses.field(default_factory=dict)
    weights_dtype: Optional[torch.dtype] = None

    @classmethod
    def custom(cls, name: str, build_model: Callable[[], nn.Module],
               make_batch: Callable[[int, int, torch.Generator], tuple],
               loss: Callable[[nn.Module, tuple], torch.Tensor], *,
               blocks: Union[str, Sequence[str], None] = None, max_seq_len: Optional[int] = None) -> "Workload":
        """Your own model as a workload.

        build_model()                           -> nn.Module, built on the CPU (ckptlab seeds the
                                                   RNG first and moves it to the device)
        make_batch(batch_size, seq_len, generator) -> tuple of tensors (seq_len may mean a length,
                                                   an image side in pixels, ...; draw from generator)
        loss(model, batch)                      -> scalar tensor: your training step's loss
        blocks       attribute path(s) of the repeated-block containers ("encoder.layers", or a
                     list for several stacks) when `find_blocks`' guess is wrong
        max_seq_len  the largest seq_len the model accepts (None: no limit)
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} is invalid: allowed is a non-empty string")
        for arg, fn in (("build_model", build_model), ("make_batch", make_batch), ("loss", loss)):
            if not callable(fn):
                raise ValueError(f"{arg}={fn!r} is invalid: allowed is a callable")
        if isinstance(blocks, str):
            blocks = (blocks,)
        if blocks is not None:
            blocks = tuple(blocks)
            if not blocks or not all(isinstance(b, str) and b for b in blocks):
                raise ValueError(f"blocks={blocks!r} is invalid: allowed is an attribute path such as "
                                 "'encoder.layers' or a non-empty list of them")
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                        or max_seq_len < 1):
            raise ValueError(f"max_seq_len={max_seq_len!r} is invalid: allowed is an integer >= 1 or None")
        return cls(name, None, _CustomModel(build_model), _CustomBatch(make_batch), loss,
                   block_paths=blocks, seq_len_limit=max_seq_len)

    def new_model(self) -> nn.Module:
        """The model as `make_model` builds it, in the current device/fake-tensor context, tagged
        with `block_paths` so that `find_blocks` uses them. The caller seeds the RNG."""
        model = self.make_model(self.config)
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={self.spec or self.name!r} is invalid: its build_model returned "
                             f"{type(model).__name__}, allowed is a torch.nn.Module")
        if self.weights_dtype is not None:
            model = cast_weights(model, self.weights_dtype)
        if self.block_paths is not None:
            model.__dict__[BLOCK_PATHS_ATTRIBUTE] = self.block_paths
        return model

    def build(self, device: str | torch.device = "cpu") -> nn.Module:
        """A fresh model. Weights are drawn on the CPU from the seed, so every device gets the
        same model; on "meta" nothing is allocated (and `.to` would untie shared weights)."""
        if torch.device(device).type == "meta":
            try:
                with torch.device("meta"):
                    return self.new_model()
            except (RuntimeError, TypeError):   # its __init__ reads tensor data (.item(), .numpy()): meta has none
                return self._meta_copy_of_real_model()
        torch.manual_seed(self.seed)
        return self.new_model().to(device)

    def _meta_copy_of_real_model(self) -> nn.Module:
        """Built for real on the CPU, then copied with every parameter and buffer on the meta
        device; shared (tied) weights stay shared."""
        torch.manual_seed(self.seed)
        real = self.new_model()
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for p in real.parameters()}
        memo.update({id(b): torch.empty_like(b, device="meta") for b in real.buffers()})
        return copy.deepcopy(real, memo)

    def batch(self, batch_size: int, seq_len: int, device: str | torch.device = "cpu") -> tuple:
        gen = torch.Generator().manual_seed(self.seed + 1)
        return tuple(t.to(device) for t in self.new_batch(batch_size, seq_len, gen))

    def new_batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
        """`make_batch`'s tensors in the current device/fake-tensor context, floating-point ones
        cast to `weights_dtype` (token ids and labels stay integers)."""
        batch = tuple(self.make_batch(self.config, batch_size, seq_len, gen))
        if self.weights_dtype is None:
            return batch
        return tuple(t.to(self.weights_dtype) if t.is_floating_point() else t for t in batch)

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        return self.loss_fn(model, batch)

    @property
    def loss_name(self) -> str:
        """Which loss a training step computes (plans and records say what they were made for): a
        function by its module and name, a `functools.partial` as its function with the arguments
        it fixes (`ckptlab.workloads.models.chunked_gpt_loss(chunks=8)`)."""
        fn, partial = self._loss_function()[0], self.loss_fn
        fixed = ("(" + ", ".join([*map(repr, partial.args), *(f"{k}={v!r}" for k, v in partial.keywords.items())]) + ")"
                 if isinstance(partial, functools.partial) else "")
        module = getattr(fn, "__module__", None) or "?"
        name = getattr(fn, "__qualname__", type(fn).__name__)
        if module.startswith(SPEC_MODULE_PREFIX) and self.spec:   # defined in a spec's file
            return f"{self.spec.rpartition(':')[0]}:{name}{fixed}"
        return f"{module}.{name}{fixed}"

    @property
    def loss_identity(self) -> tuple:
        """What tells this workload's loss from another's in cache keys: its name (`loss_name`) and
        module, where those and what the keys hold beside pin its code (`loss_pinned`), else also
        the function object itself (its `id`: only caches that keep the workload alive may use it)."""
        return (self.loss_name, getattr(self._loss_function()[0], "__module__", None),
                None if self.loss_pinned else id(self.loss_fn))

    @property
    def loss_pinned(self) -> bool:
        """Whether the loss's name pins its code: a function of ckptlab's own modules, named at
        their top level (their code is in `answers.code_version`), or any function of the spec's
        file (its hash is `spec_hash`; what it calls in other modules of yours is not hashed, as
        for the model's code), a `functools.partial` of one only with numbers, strings, booleans
        and None. Not a function of a notebook, `__main__` or another module, which can
        change under the same name: such a loss's predictions are kept in this process only."""
        fn, fixed = self._loss_function()
        module = getattr(fn, "__module__", None) or ""
        spec_module = self.spec.rpartition(":")[0] if self.spec and ":" in self.spec else None
        in_spec_file = module.startswith(SPEC_MODULE_PREFIX) or (self.spec_hash is not None and module == spec_module)
        ckptlabs = (module.startswith("ckptlab.") and isinstance(fn, types.FunctionType)
                    and "<" not in fn.__qualname__)
        return (in_spec_file or ckptlabs) and all(isinstance(v, (bool, int, float, str, type(None))) for v in fixed)

    def _loss_function(self) -> tuple:
        """(the loss's function, the arguments a partial fixes)."""
        fn = self.loss_fn
        if isinstance(fn, functools.partial):
            return fn.func, (*fn.args, *fn.keywords.values())
        return fn, ()

    @property
    def label(self) -> str:
        """What records call the model: the spec that re-creates it, else its name."""
        return self.spec or self.name

    @property
    def identity(self) -> tuple:
        """Equal for two workloads that build the same model and train it on the same batches and
        loss (cache keys)."""
        custom = id(self.make_model) if self.spec is None and self.config is None else None
        return (self.label, self.spec_hash, repr(self.config), repr(sorted(self.overrides.items())),
                self.seed, self.block_paths, custom, self.weights_dtype, self.loss_identity)

    @property
    def max_seq_len(self) -> int | None:
        if self.seq_len_limit is not None:
            return self.seq_len_limit
        return getattr(self.config, "block_size", None)

    def check_shape(self, batch_size: int, seq_len: int, min_seq_len: int = 1) -> None:
        """ValueError naming the value and what is allowed when the model cannot take this batch shape."""
        integer("batch_size", batch_size, 1)
        integer("seq_len", seq_len, 1)
        limit = self.max_seq_len
        if seq_len < min_seq_len or (limit is not None and seq_len > limit):
            allowed = f"{min_seq_len}..{limit}" if limit is not None else f">= {min_seq_len}"
            raise ValueError(f"seq_len={seq_len} is invalid for model={self.label!r}: allowed is {allowed}")

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.build("meta").parameters())


def base_model(model: nn.Module) -> nn.Module:
    """The model a peft wrapper (LoRA) holds, else the model itself: transformers' own
    checkpointing and its layers live there."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def is_transformers_model(model: nn.Module) -> bool:
    """Whether `model` (or the model a LoRA wrapper holds) is a transformers PreTrainedModel. Read
    from its classes, so transformers is not imported for a model that is not one."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(base_model(model)).__mro__)


def cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)`, except a peft model's adapters, which stay fp32: peft upcasts them so
    when it wraps a model loaded in bf16/fp16 (`autocast_adapter_dtype=True`, its default), and
    LoRA fine-tuning of a bf16 model trains fp32 adapters over bf16 frozen weights."""
    model = model.to(dtype)
    tuner = getattr(model, "base_model", None)
    if hasattr(model, "peft_config") and hasattr(tuner, "_cast_adapter_dtype"):
        for adapter in model.peft_config:
            tuner._cast_adapter_dtype(adapter_name=adapter, autocast_adapter_dtype=True)
    return model


SPEC_MODULE_PREFIX = "ckptlab_spec_"   # module names of the files that file specs import

# The model attribute (set in its __dict__, so nn.Module sees a plain attribute) through which a
# workload's `blocks=` reaches `find_blocks` wherever the model goes.
BLOCK_PATHS_ATTRIBUTE = "_ckptlab_block_paths"


class _CustomModel:
    """make_model for Workload.custom: the user's build_model takes no config."""

    def __init__(self, build_model: Callable[[], nn.Module]):
        self.build_model = build_model

    def __call__(self, config) -> nn.Module:
        return self.build_model()


class _CustomBatch:
    """make_batch for Workload.custom: the user's make_batch takes no config; its tensors are
    checked so that a wrong return fails here, not deep inside a training step."""

    def __init__(self, make_batch: Callable[[int, int, torch.Generator], tuple]):
        self.make_batch = make_batch

    def __call__(self, config, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
        batch = self.make_batch(batch_size, seq_len, gen)
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise ValueError(f"make_batch returned {type(batch).__name__}: allowed is a tuple of tensors")
        return tuple(batch)


__all__ = ["BLOCK_PATHS_ATTRIBUTE", "SPEC_MODULE_PREFIX", "Workload", "base_model", "cast_weights", "is_transformers_model"]
