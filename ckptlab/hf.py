"""Hugging Face transformers in ckptlab: workloads built from configs with random weights (no
downloads), and transformers' own activation checkpointing as policies on the same axes.

Workloads (`get_workload(name, **config_overrides)`; needs the optional extra `ckptlab[hf]`):

    hf-gpt2-tiny    GPT-2: learned positions, fused qkv, GELU MLP; 4 blocks, d=32, vocab 128
    hf-llama-tiny   Llama: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention (4 query heads
                    sharing 2 key/value heads); 4 blocks, d=32, vocab 128
    hf-bert-tiny    BERT encoder with a masked-LM head, 15% of positions masked; 4 blocks, d=32
    hf-gpt2         the GPT-2 124M shape: 12 blocks, d=768, 12 heads, vocab 50257
    hf-llama-1b     the Llama-3.2-1B shape: 16 blocks, d=2048, 32 query / 8 key-value heads,
                    SwiGLU 8192, vocab 128256, tied embeddings, llama3 RoPE (theta 500000)

The tiny presets keep dropout on (0.1) so gradient-equality tests can fail; `use_cache=False`
everywhere (training needs no KV cache, and transformers would warn every step under
checkpointing). The loss is computed here from the logits (next-token or masked-token cross
entropy), not by transformers' loss machinery.

Policies (parsed by `ckptlab.policy`, applied here; `apply_checkpointing` dispatches):

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
import torch.nn.functional as F
from torch.utils.checkpoint import set_checkpoint_early_stop

from .models import WORKLOAD_FACTORIES, Workload
from .policy import Policy, parse_policy
from .wrap import CheckpointHandle, remove_earlier_policies

try:
    import transformers
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, PreTrainedModel)
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the hf-* workloads and hf policies need transformers: pip install 'ckptlab[hf]'"
    ) from exc

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # transformers < 4.52 marks layers only by a `gradient_checkpointing` attribute
    GradientCheckpointingLayer = None


# ----------------------------------------------------------------------------- workloads

_TINY_GPT2 = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
_TINY_LLAMA = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                   attention_dropout=0.1)
_TINY_BERT = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.1,
                  attention_probs_dropout_prob=0.1)
_LLAMA_3_2_1B = dict(
    num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, high_freq_factor=4.0,
                         low_freq_factor=1.0, original_max_position_embeddings=8192),
)

# name -> (config class, model class, task, config fields). GPT-2's default bos/eos ids (50256)
# lie outside a tiny vocabulary, which transformers warns about: they are unset (no generation).
HF_PRESETS: dict[str, tuple[type, type, str, dict]] = {
    "hf-gpt2-tiny": (GPT2Config, GPT2LMHeadModel, "causal", dict(_TINY_GPT2, bos_token_id=None, eos_token_id=None)),
    "hf-llama-tiny": (LlamaConfig, LlamaForCausalLM, "causal", dict(_TINY_LLAMA, bos_token_id=None, eos_token_id=None)),
    "hf-bert-tiny": (BertConfig, BertForMaskedLM, "masked", _TINY_BERT),
    "hf-gpt2": (GPT2Config, GPT2LMHeadModel, "causal", {}),
    "hf-llama-1b": (LlamaConfig, LlamaForCausalLM, "causal", _LLAMA_3_2_1B),
}

MASK_FRACTION = 0.15  # masked-LM: share of positions predicted (at least one per sequence)


class HFWorkload(Workload):
    """A Workload whose model is a transformers model built from `config` with random weights.

    The model is constructed directly on the target device (a 1B-parameter shape never
    materializes on the host first; `n_params` builds on the meta device for free).
    """

    def build(self, device: str | torch.device = "cpu") -> nn.Module:
        torch.manual_seed(self.seed)
        with torch.device(device):
            return self.make_model(self.config)

    @property
    def max_seq_len(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None)


def get_hf_workload(name: str, seed: int = 0, **overrides) -> Workload:
    """An hf-* workload; `overrides` replace config fields (e.g. num_hidden_layers=8)."""
    if name not in HF_PRESETS:
        raise ValueError(f"model={name!r} is invalid: allowed Hugging Face presets are {', '.join(HF_PRESETS)}")
    config_cls, model_cls, task, fields = HF_PRESETS[name]
    defaults = config_cls()
    unknown = sorted(k for k in overrides if not hasattr(defaults, k))
    if unknown:
        raise ValueError(
            f"override {unknown[0]}={overrides[unknown[0]]!r} is invalid for model={name!r}: "
            f"allowed overrides are fields of transformers.{config_cls.__name__}"
        )
    config = config_cls(**{**fields, **overrides, "use_cache": False})
    if config.num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers={config.num_hidden_layers} is invalid: allowed is an integer >= 1")
    if task == "causal":
        return HFWorkload(name, config, model_cls, _causal_batch, _causal_loss, seed)
    return HFWorkload(name, config, model_cls, _masked_batch, _masked_loss, seed)


def _causal_batch(config, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _causal_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    input_ids, targets = batch
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _masked_batch(config, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    tokens = torch.randint(2, config.vocab_size, (batch_size, seq_len), generator=gen)
    masked = torch.rand(batch_size, seq_len, generator=gen) < MASK_FRACTION
    masked[:, 0] = True
    mask_token = 1  # ids 0 (padding) and 1 (mask) never occur as real tokens here
    return tokens.masked_fill(masked, mask_token), tokens.masked_fill(~masked, -100)


def _masked_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    input_ids, labels = batch
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


WORKLOAD_FACTORIES.update(dict.fromkeys(HF_PRESETS, get_hf_workload))


# ----------------------------------------------------------------------------- hf policies

def checkpointing_methods(model: nn.Module) -> tuple[Callable, Callable, str]:
    """(enable, disable, name of the checkpoint-kwargs argument): the 5.x names where present."""
    if hasattr(model, "activation_checkpointing_enable"):
        return (model.activation_checkpointing_enable, model.activation_checkpointing_disable,
                "activation_checkpointing_kwargs")
    return model.gradient_checkpointing_enable, model.gradient_checkpointing_disable, "gradient_checkpointing_kwargs"


def hf_capabilities(model: nn.Module | None = None) -> dict[str, bool]:
    """Which options the installed transformers' checkpointing entry point accepts:
    {"hf": ..., "every_n_layers": ..., "offload": ...}. Without a model, a tiny one is asked."""
    if model is None:
        model = LlamaForCausalLM(LlamaConfig(**{**_TINY_LLAMA, "num_hidden_layers": 1}))
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
        if self._removed:
            return
        self._disable()
        for block in self.blocks:
            if getattr(block.__dict__.get("forward"), "_ckptlab_handle", None) is self:
                del block.forward
        # transformers' enable hooks the input embeddings so their output requires grad (for
        # reentrant checkpointing); its disable leaves those hooks in place: take ours out.
        for hook in getattr(self.model, "_require_grads_hooks", None) or []:
            if hook not in self._hooks_before:
                hook.remove()
        if hasattr(self.model, "_require_grads_hooks"):
            self.model._require_grads_hooks = list(self._hooks_before)
        self._removed = True


def apply_hf_checkpointing(model: nn.Module, policy: str | Policy, blocks: Sequence[nn.Module] | None,
                           checkpoint_options: dict, early_stop: bool = True) -> HFCheckpointHandle:
    """Turn on transformers' own checkpointing as `policy` (hf, hf:every_n_layers=K, hf:offload)
    says. Called by `ckptlab.apply_checkpointing`, with the `torch.utils.checkpoint` keyword
    arguments it built from its options; raises ValueError,
    before touching the model, for a non-transformers model or an option this transformers lacks."""
    policy = parse_policy(policy)
    version = f"transformers {transformers.__version__}"
    if not policy.kind.startswith("hf"):
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_* are deprecated in 5.x
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
        handle._forward_block_runs += 1

        def run(*a, **k):
            handle._region_block_runs += 1
            return function(*a, **k)

        with set_checkpoint_early_stop(early_stop):
            return hf_checkpoint(run, *args, **kwargs)

    layer._gradient_checkpointing_func = counted_checkpoint
    class_forward = type(layer).forward.__get__(layer)

    def forward(*args, **kwargs):
        return class_forward(*args, **kwargs)

    forward._ckptlab_handle = handle
    layer.forward = forward


__all__ = ["HF_PRESETS", "HFCheckpointHandle", "HFWorkload", "apply_hf_checkpointing", "checkpointing_methods",
           "get_hf_workload",
           "hf_capabilities", "hf_layers"]
