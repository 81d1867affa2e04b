"""Any Hugging Face transformers architecture as a workload: random weights, no downloads.

    hf:<model_type>        that model type's config with tiny defaults (TINY, TINY_DROPOUT: 2
                           blocks, width 32, dropout 0.1) under your overrides
                           (`--set num_hidden_layers=8`)
    hf:path/config.json    a local config file (overrides on top; no tiny defaults)
    hf:org/name            the config.json of a model in the local Hugging Face cache
    hf-gpt2-tiny, ...      short names for fixed configs (HF_PRESETS; hf-llama-7b: Llama-2-7B's shape,
                           positions for 32k tokens)

The task, the batch and the loss follow the architecture: docs/design.md, note "A transformers
model as a workload".
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.extras import missing_extra
from .base import Workload
from .specs import check_blocks, file_hash, one_line

try:
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto
except ImportError:
    raise missing_extra("transformers", "the hf workloads") from None


# Standard config names; a config that calls them otherwise maps them (T5: d_model, num_layers).
TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
TINY_DROPOUT = dict(attention_dropout=0.1, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                    hidden_dropout=0.1, dropout_rate=0.1, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
# Fields a model type needs beyond the standard names to be tiny (its defaults are full size);
# multi-stage vision models take only these (their num_hidden_layers means stages).
TINY_BY_TYPE = {
    "t5": dict(d_ff=64, d_kv=8),   # the decoder gets num_layers blocks too
    "gptj": dict(rotary_dim=4),    # rotates part of each 8-wide head (its default, 64, is a full-size head's)
    "vit": dict(image_size=32, patch_size=8, num_labels=10),
    "swin": dict(image_size=32, patch_size=2, embed_dim=8, depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2],
                 window_size=2, num_labels=10),
    "convnext": dict(image_size=32, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 2, 1], num_stages=4, num_labels=10),
    "resnet": dict(embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[2, 2, 2, 2], layer_type="basic",
                   num_labels=10),
}
MULTI_STAGE = ("swin", "convnext", "resnet")

TINY_GPT2 = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                 resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
TINY_LLAMA = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, attention_dropout=0.1)
TINY_BERT = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1)
LLAMA_3_2_1B = dict(
    num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, high_freq_factor=4.0,
                         low_freq_factor=1.0, original_max_position_embeddings=8192),
)
# Llama-2-7B's shape with positions for 32k tokens (as long-context fine-tunes extend it): what
# "a 7B model with LoRA on an RTX 4090" (a "24 GB" card) means, for prediction.
LLAMA_7B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2)

# short name -> (model type, config fields). GPT-2's default bos/eos ids (50256) lie outside a
# tiny vocabulary, which transformers warns about: they are unset (no generation).
HF_PRESETS: dict[str, tuple[str, dict]] = {
    "hf-gpt2-tiny": ("gpt2", dict(TINY_GPT2, bos_token_id=None, eos_token_id=None)),
    "hf-llama-tiny": ("llama", dict(TINY_LLAMA, bos_token_id=None, eos_token_id=None)),
    "hf-bert-tiny": ("bert", TINY_BERT),
    "hf-gpt2": ("gpt2", {}),
    "hf-llama-1b": ("llama", LLAMA_3_2_1B),
    "hf-llama-7b": ("llama", LLAMA_7B),
}

TASKS = {   # task -> transformers' auto-model mapping that names the model class, in order of preference
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
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
            return self.new_model()

    @property
    def max_seq_len(self) -> int | None:
        if self.task == "image":
            return None
        return getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None)

    @property
    def task(self) -> str:
        return self.make_model.task


class _ModelClass:
    """make_model for an HF workload: the task's model class for the config (picklable, named)."""

    def __init__(self, model_cls: type, task: str):
        self.model_cls, self.task = model_cls, task

    def __call__(self, config) -> nn.Module:
        return self.model_cls(config)


def get_hf_workload(spec: str, seed: int = 0, **overrides) -> HFWorkload:
    """The workload `spec` names (module docstring); `overrides` replace config fields.
    Raises ValueError, before building anything, for an unknown type, a missing file or cache
    entry, or an override the config does not have."""
    source_hash = None
    if spec in HF_PRESETS:
        model_type, fields = HF_PRESETS[spec]
    elif spec.startswith("hf:") and len(spec) > 3:
        target = spec[3:]
        if target in CONFIG_MAPPING:
            model_type, fields = target, _tiny_fields(target)
        elif target.endswith(".json") or Path(target).exists():
            path = Path(target) if target.endswith(".json") else Path(target) / "config.json"
            if not path.is_file():
                raise ValueError(f"model={spec!r} is invalid: config file {str(path)!r} does not exist")
            model_type, fields = _read_config(spec, path)
            source_hash = file_hash(path)
        elif "/" in target:
            path = _cached_config(spec, target)
            model_type, fields = _read_config(spec, path)
            source_hash = file_hash(path)
        else:
            close = sorted(t for t in CONFIG_MAPPING if t.startswith(target[:2]))[:8]
            raise ValueError(f"model={spec!r} is invalid: {target!r} is not a model type of transformers "
                             f"{transformers.__version__} (similar: {', '.join(close) or 'none'}); allowed are "
                             "hf:<model_type>, hf:path/config.json, hf:org/name (local cache)")
    else:
        raise ValueError(f"model={spec!r} is invalid: allowed presets are {', '.join(HF_PRESETS)}, or the specs "
                         "hf:<model_type>, hf:path/config.json and hf:org/name")
    config = _config(spec, model_type, fields, overrides)
    task, model_cls = _task(spec, model_type)
    batch, loss = {"seq2seq": (_seq2seq_batch, seq2seq_loss), "masked": (_masked_batch, masked_loss),
                   "causal": (_causal_batch, causal_loss), "image": (_image_batch, image_loss)}[task]
    workload = HFWorkload(spec, config, _ModelClass(model_cls, task), batch, loss, seed, spec=spec,
                          spec_hash=source_hash, overrides=dict(overrides))
    if spec not in HF_PRESETS or overrides:
        check_blocks(workload)
    return workload


def _tiny_fields(model_type: str) -> dict:
    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    fields = {}
    generic = {} if model_type in MULTI_STAGE else {**TINY, **TINY_DROPOUT}
    for key, value in generic.items():
        if hasattr(default, key):
            fields[config_cls.attribute_map.get(key, key)] = value
    fields.update(TINY_BY_TYPE.get(model_type, {}))
    vocab = fields.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(default, key, None)
        if vocab is not None and isinstance(value, int) and value >= vocab:
            fields[key] = None   # a special token outside the tiny vocabulary
    return fields


def _config(spec: str, model_type: str, fields: dict, overrides: dict):
    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    unknown = sorted(k for k in overrides if not hasattr(default, k))
    if unknown:
        raise ValueError(
            f"override {unknown[0]}={overrides[unknown[0]]!r} is invalid for model={spec!r}: "
            f"allowed overrides are fields of transformers.{config_cls.__name__}"
        )
    named = {config_cls.attribute_map.get(k, k): v for k, v in overrides.items()}
    try:
        config = config_cls(**{**fields, **named, "use_cache": False})
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise huggingface_hub's own errors
        raise ValueError(f"model={spec!r} is invalid with overrides {overrides}: "
                         f"transformers.{config_cls.__name__} refused them: {one_line(exc)}") from None
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise ValueError(f"num_hidden_layers={layers} is invalid: allowed is an integer >= 1")
    return config


def _task(spec: str, model_type: str) -> tuple[str, type]:
    for task, mapping in TASKS.items():
        name = getattr(modeling_auto, mapping).get(model_type)
        if isinstance(name, tuple):   # several classes for the task (DeiT's with a teacher): the plain one first
            name = name[0]
        if name:
            return task, getattr(transformers, name)
    raise ValueError(f"model={spec!r} is invalid: model type {model_type!r} has no causal-LM, masked-LM, "
                     "encoder-decoder LM or image-classification model in transformers; wrap it in "
                     "Workload.custom(...) with your own batch and loss")


def _read_config(spec: str, path: Path) -> tuple[str, dict]:
    try:
        fields = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model={spec!r} is invalid: {path.name} is not a JSON config ({exc})") from None
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model={spec!r} is invalid: {path.name} has model_type={model_type!r}, which "
                         f"transformers {transformers.__version__} does not know")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map"):
        fields.pop(key, None)
    return model_type, fields


def _cached_config(spec: str, repo_id: str) -> Path:
    from huggingface_hub import constants, try_to_load_from_cache  # noqa: PLC0415 - installed with transformers

    path = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(path, str):
        raise ValueError(f"model={spec!r} is invalid: no config.json for {repo_id!r} in the local Hugging Face "
                         f"cache ({constants.HF_HUB_CACHE}); ckptlab never downloads: fetch it once with "
                         f"`hf download {repo_id} config.json`, or pass hf:path/to/config.json")
    return Path(path)


# ----------------------------------------------------------------------------- batches and losses

def _causal_batch(config, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def causal_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Next-token cross entropy on the logits (fp32)."""
    input_ids, targets = batch
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _masked_batch(config, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    tokens = torch.randint(2, config.vocab_size, (batch_size, seq_len), generator=gen)
    masked = torch.rand(batch_size, seq_len, generator=gen) < MASK_FRACTION
    masked[:, 0] = True
    mask_token = 1  # ids 0 (padding) and 1 (mask) never occur as real tokens here
    return tokens.masked_fill(masked, mask_token), tokens.masked_fill(~masked, -100)


def masked_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Masked-token cross entropy on the logits (fp32), over the masked positions."""
    input_ids, labels = batch
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def _seq2seq_batch(config, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    inputs = torch.randint(2, config.vocab_size, (batch_size, seq_len), generator=gen)
    target = torch.randint(2, config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    target[:, 0] = getattr(config, "decoder_start_token_id", None) or getattr(config, "pad_token_id", None) or 0
    return inputs, target[:, :-1].contiguous(), target[:, 1:].contiguous()


def seq2seq_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Decoder next-token cross entropy on the logits (fp32), the encoder reading input_ids."""
    input_ids, decoder_input_ids, labels = batch
    logits = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _image_batch(config, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    pixels = torch.randn(batch_size, getattr(config, "num_channels", 3), seq_len, seq_len, generator=gen)
    labels = torch.randint(0, config.num_labels, (batch_size,), generator=gen)
    return pixels, labels


def image_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Class cross entropy on the logits (fp32); images of another side than the config's
    image_size interpolate the position embeddings (models that have them)."""
    pixels, labels = batch
    kwargs = {}
    if getattr(model.config, "image_size", pixels.shape[-1]) != pixels.shape[-1] and \
            "interpolate_pos_encoding" in _forward_parameters(type(model)):
        kwargs["interpolate_pos_encoding"] = True
    logits = model(pixel_values=pixels, **kwargs).logits
    return F.cross_entropy(logits.float(), labels)


def _forward_parameters(model_cls: type) -> set:
    return set(inspect.signature(model_cls.forward).parameters)


__all__ = ["HF_PRESETS", "HFWorkload", "MASK_FRACTION", "TINY", "TINY_LLAMA", "causal_loss", "get_hf_workload", "image_loss",
           "masked_loss", "seq2seq_loss"]
