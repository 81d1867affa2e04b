"""transformers' own activation checkpointing as ckptlab policies (hf, hf:every_n_layers=K,
hf:offload), on the same axes as ckptlab's wrappers. Needs the optional extra `ckptlab[hf]`.

    hf                   model.activation_checkpointing_enable() (`gradient_checkpointing_enable()`
                         before transformers 5.x), non-reentrant: every layer recomputes
    hf:every_n_layers=K  the same with every_n_layers=K: transformers checkpoints layers 0, K, 2K...
    hf:offload           the same with offload=True: the checkpoint inputs go to pinned host memory

What the installed transformers supports is feature-detected (`hf_capabilities`); an unsupported
option raises ValueError saying so. The handle reports the layers transformers actually marked,
so records carry the true effective density.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from ..core.extras import missing_extra
from ..core.policy import Policy
from ..workloads.base import base_model
from ..workloads.hf import TINY_LLAMA
from .blocks import CheckpointHandle, remove_earlier_policies

try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
except ImportError:
    raise missing_extra("transformers", "the hf policies") from None

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # transformers < 4.52 marks layers only by a `gradient_checkpointing` attribute
    GradientCheckpointingLayer = None


# transformers 5.x renamed gradient_checkpointing_* to activation_checkpointing_*, and its new
# methods still call a model class's override of an old one, which then warns: a message for the
# model's author, not for someone measuring it.
RENAMED_WARNING = r"`gradient_checkpointing_(enable|disable)` is deprecated"


def checkpointing_methods(model: nn.Module) -> tuple[Callable, Callable, str]:
    """(enable, disable, name of the checkpoint-kwargs argument): the 5.x names where present,
    called without transformers' rename warning."""
    if hasattr(model, "activation_checkpointing_enable"):
        return (_without_rename_warning(model.activation_checkpointing_enable),
                _without_rename_warning(model.activation_checkpointing_disable), "activation_checkpointing_kwargs")
    return model.gradient_checkpointing_enable, model.gradient_checkpointing_disable, "gradient_checkpointing_kwargs"


def _without_rename_warning(method: Callable) -> Callable:
    @functools.wraps(method)
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=RENAMED_WARNING, category=FutureWarning)
            return method(*args, **kwargs)
    return call


def hf_capabilities(model: nn.Module | None = None) -> dict[str, bool]:
    """Which options the installed transformers' checkpointing entry point accepts:
    {"hf": ..., "every_n_layers": ..., "offload": ...}. Without a model, a tiny one is asked."""
    if model is None:
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1}))
    if not isinstance(model, PreTrainedModel):
        return {"hf": False, "every_n_layers": False, "offload": False}
    params = inspect.signature(checkpointing_methods(model)[0]).parameters
    return {"hf": bool(model.supports_gradient_checkpointing),
            "every_n_layers": "every_n_layers" in params, "offload": "offload" in params}


def hf_layers(model: nn.Module) -> list[nn.Module]:
    """The layers transformers checkpoints, in the order it counts them for every_n_layers."""
    if GradientCheckpointingLayer is not None:
        return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing") and not isinstance(m, PreTrainedModel)]


class HFCheckpointHandle(CheckpointHandle):
    """A CheckpointHandle for transformers' own checkpointing: `remove()` disables it again (and
    removes the input-embedding hooks it added); recomputes are counted like ckptlab's."""

    def __init__(self, policy: Policy, model: nn.Module, layers: list[nn.Module], disable: Callable,
                 hooks_before: list):
        marked = [(i, i + 1) for i, layer in enumerate(layers) if layer.gradient_checkpointing]
        super().__init__(policy, layers, marked)
        self.model = model
        self._disable = disable
        self._hooks_before = hooks_before

    def remove(self) -> None:
        if self.removed:
            return
        self._disable()
        self.unmark_blocks()
        # transformers' enable hooks the input embeddings so their output requires grad (for
        # reentrant checkpointing); its disable leaves those hooks in place: take ours out.
        for hook in getattr(self.model, "_require_grads_hooks", None) or []:
            if hook not in self._hooks_before:
                hook.remove()
        if hasattr(self.model, "_require_grads_hooks"):
            self.model._require_grads_hooks = list(self._hooks_before)
        self.removed = True


def apply_hf_checkpointing(model: nn.Module, policy: Policy, blocks: Sequence[nn.Module] | None,
                           checkpoint_options: dict, early_stop: bool = True) -> HFCheckpointHandle:
    """Turn on transformers' own checkpointing as `policy` (hf, hf:every_n_layers=K, hf:offload)
    says. Called by `ckptlab.apply_checkpointing`, with the `torch.utils.checkpoint` keyword
    arguments it built from its options; raises ValueError,
    before touching the model, for a non-transformers model or an option this transformers lacks."""
    version = f"transformers {transformers.__version__}"
    model = base_model(model)   # a LoRA fine-tune: transformers' checkpointing is its base model's
    if policy.mechanism != "transformers":
        raise ValueError(f"policy={str(policy)!r} is invalid here: apply_hf_checkpointing takes hf policies only")
    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"policy={str(policy)!r} is invalid for a model of type {type(model).__name__}: the hf policies "
            "need a transformers PreTrainedModel; ckptlab's own policies (full, density=D, ...) work on any model"
        )
    if blocks is not None:
        raise ValueError(f"blocks=... is invalid with policy={str(policy)!r}: transformers chooses its own layers")
    if policy.offload:
        raise ValueError(f"policy={str(policy)!r} is invalid: the hf policies do not compose with +offload; "
                         "use hf:offload (transformers' own offload)")
    caps = hf_capabilities(model)
    if not caps["hf"]:
        raise ValueError(f"policy={str(policy)!r} is invalid: {type(model).__name__} does not support "
                         f"activation checkpointing in {version}")
    options = {}
    if policy.kind == "hf:every_n_layers":
        if not caps["every_n_layers"]:
            raise ValueError(f"policy={str(policy)!r} is not supported by {version}: its checkpointing has no "
                             "every_n_layers option; allowed here: hf, or ckptlab's every=K / density=D")
        options["every_n_layers"] = policy.value
    if policy.kind == "hf:offload":
        if not caps["offload"]:
            raise ValueError(f"policy={str(policy)!r} is not supported by {version}: its checkpointing has no "
                             "offload option; allowed here: hf and the other policies")
        if not torch.accelerator.is_available():
            raise ValueError(
                f"policy={str(policy)!r} is invalid on this machine: {version} offloads with "
                "save_on_cpu(pin_memory=True), and PyTorch has no pinned-memory allocator without an "
                "accelerator (on CPU the activations already live in host memory); run it on a GPU"
            )
        options["offload"] = True
    layers = hf_layers(model)
    if not layers:
        raise ValueError(f"policy={str(policy)!r} is invalid: {type(model).__name__} has no checkpointable layers")
    remove_earlier_policies(layers)
    enable, disable, kwargs_name = checkpointing_methods(model)
    hooks_before = list(getattr(model, "_require_grads_hooks", None) or [])
    enable(**{kwargs_name: checkpoint_options}, **options)
    handle = HFCheckpointHandle(policy, model, layers, disable, hooks_before)
    for layer in layers:
        _count_recomputes(layer, handle, early_stop)
    return handle


def _count_recomputes(layer: nn.Module, handle: HFCheckpointHandle, early_stop: bool) -> None:
    """Wrap the layer's checkpoint function to count forward and recompute runs, and tag the layer
    with an instance `forward` that just calls the class's (where transformers' checkpointing
    lives), so applying any other policy finds this handle and removes it first."""
    hf_checkpoint = layer._gradient_checkpointing_func

    def counted_checkpoint(function, *args, **kwargs):
        handle.count_forward()

        def run(*a, **k):
            handle.count_region_run()
            return function(*a, **k)

        with set_checkpoint_early_stop(early_stop):
            return hf_checkpoint(run, *args, **kwargs)

    layer._gradient_checkpointing_func = counted_checkpoint
    class_forward = type(layer).forward.__get__(layer)

    def forward(*args, **kwargs):
        return class_forward(*args, **kwargs)

    layer.forward = handle.mark(forward)


__all__ = ["HFCheckpointHandle", "apply_hf_checkpointing", "checkpointing_methods", "hf_capabilities", "hf_layers"]
