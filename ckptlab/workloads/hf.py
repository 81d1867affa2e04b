"""Hugging Face transformers in ckptlab: workloads built from configs with random weights (no
downloads). transformers' own checkpointing as policies lives in ckptlab.checkpoint.hf.

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
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import WORKLOAD_FACTORIES, Workload

try:
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the hf-* workloads need transformers: pip install 'ckptlab[hf]'"
    ) from exc


# ----------------------------------------------------------------------------- workloads

_TINY_GPT2 = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
TINY_LLAMA = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
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
    "hf-llama-tiny": (LlamaConfig, LlamaForCausalLM, "causal", dict(TINY_LLAMA, bos_token_id=None, eos_token_id=None)),
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


__all__ = ["HF_PRESETS", "HFWorkload", "MASK_FRACTION", "TINY_LLAMA", "get_hf_workload"]
