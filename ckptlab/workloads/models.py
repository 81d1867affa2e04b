"""Built-in workloads: a model, a way to make a batch, and a loss — everything a training step needs.

    gpt-tiny     4 blocks, d=128, a training step well under a second on a laptop CPU
    gpt2-small   the GPT-2 124M shape: 12 blocks, d=768, 12 heads, vocab 50257, 1024 positions
    llama7b-shape  a GPT with Llama-7B's shape (32 blocks, d=4096, 32 heads, vocab 32000, 4096
                 positions, no dropout; a 4h GELU MLP stands in for SwiGLU): for `predict`, 6.7B parameters
    mlp-chain    N identical residual MLP blocks whose activation bytes are computable by hand

Every workload is seeded: the same name and overrides give the same weights and the same batch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core.validate import integer, number
from .base import Workload

# ----------------------------------------------------------------------------- GPT (nanoGPT-style)

@dataclass
class GPTConfig:
    n_layer: int = 4          # blocks
    n_head: int = 4           # attention heads
    n_embd: int = 128         # model width
    vocab_size: int = 512     # tokens
    block_size: int = 256     # longest sequence (position embeddings)
    dropout: float = 0.1      # >0 so tests prove recompute reproduces dropout masks
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # Fused SDPA keeps no (t x t) score matrix for backward; dropout inside draws from the RNG,
        # which checkpoint's preserved RNG state must replay exactly.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LN transformer block: the unit that checkpointing recomputes."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as in GPT-2 (124M counts it once)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final hidden states, before the head: what a chunked loss feeds the head piece by piece."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(idx))


# ----------------------------------------------------------------------------- MLP chain

@dataclass
class MLPChainConfig:
    n_layer: int = 8     # blocks
    n_embd: int = 64     # width h; each block is x + fc2(relu(fc1(x))) with fc1: h -> 4h


class MLPBlock(nn.Module):
    """x + fc2(relu(fc1(x))). Kept for backward without checkpointing: relu's output (4h per
    token, which fc2 also saves: one storage) and the block's output (h per token, the next block's
    input). fc1's input is the previous block's output, fc1's output is freed by relu."""

    def __init__(self, cfg: MLPChainConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLPChain(nn.Module):
    def __init__(self, cfg: MLPChainConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.Sequential(*(MLPBlock(cfg) for _ in range(cfg.n_layer)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def mlp_chain_activation_bytes(cfg: MLPChainConfig, batch_size: int, seq_len: int,
                               n_checkpointed: int, bytes_per_element: int = 4) -> int:
    """Bytes allocated in forward and alive when it ends, computed by hand (see MLPBlock).

    Blocks 1..N-1 keep their output (h per token): the next block's saved input, or under
    checkpointing the input its recompute starts from. The last block's output is freed, since
    mean() saves nothing. Each un-checkpointed block also keeps relu's output (4h per token).
    The batch existed before forward; the loss is a 0-d tensor."""
    tokens, h = batch_size * seq_len, cfg.n_embd
    block_output = tokens * h * bytes_per_element
    relu_output = tokens * 4 * h * bytes_per_element
    loss = bytes_per_element
    return (cfg.n_layer - 1) * block_output + (cfg.n_layer - n_checkpointed) * relu_output + loss


# ----------------------------------------------------------------------------- workloads


def _gpt_batch(cfg: GPTConfig, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _gpt_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def chunked_gpt_loss(model: nn.Module, batch: tuple, chunks: int) -> torch.Tensor:
    """The GPT loss (mean cross-entropy of the next token), the head and cross-entropy run per
    chunk of tokens, each under checkpoint: one chunk's logits exist at a time, in forward and in
    backward, and the head's matmul runs twice."""
    idx, targets = batch
    hidden = model.hidden(idx).flatten(0, 1)
    targets = targets.reshape(-1)
    total = sum(checkpoint(_summed_cross_entropy, model.lm_head, h, t, use_reentrant=False)
                for h, t in zip(hidden.chunk(chunks), targets.chunk(chunks)))
    return total / targets.numel()


def _summed_cross_entropy(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden), targets, reduction="sum")


def with_chunked_loss(workload: Workload, chunks: int) -> Workload:
    """A GPT workload whose loss is `chunked_gpt_loss` over `chunks` chunks (ValueError for
    another model: ckptlab chunks the loss of its own GPT only)."""
    if not isinstance(workload.config, GPTConfig):
        raise ValueError(f"model={workload.label!r} is invalid for a chunked loss: allowed are the GPT workloads")
    integer("chunks", chunks, 1)
    return dataclasses.replace(workload, loss_fn=functools.partial(chunked_gpt_loss, chunks=chunks))


def _mlp_batch(cfg: MLPChainConfig, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    return (torch.randn(batch_size, seq_len, cfg.n_embd, generator=gen),)


def _mlp_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    # A loss that saves no extra activation: d(mean(y))/dy is a constant.
    return model(batch[0]).mean()


PRESETS: dict[str, tuple[Callable[..., object], dict]] = {
    "gpt-tiny": (GPTConfig, dict(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=256)),
    "gpt2-small": (GPTConfig, dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)),
    "llama7b-shape": (GPTConfig, dict(n_layer=32, n_head=32, n_embd=4096, vocab_size=32000, block_size=4096,
                                      dropout=0.0)),
    "mlp-chain": (MLPChainConfig, dict(n_layer=8, n_embd=64)),
}


def build_preset(name: str, seed: int = 0, **overrides) -> Workload:
    """A built-in preset (one of PRESETS) with config fields overridden."""
    config_cls, defaults = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"override {unknown[0]}={overrides[unknown[0]]!r} is invalid for model={name!r}: "
            f"allowed overrides are {', '.join(sorted(fields))}"
        )
    for key, value in overrides.items():
        _check_override(key, value, getattr(config_cls(), key))
    config = config_cls(**{**defaults, **overrides})
    if isinstance(config, GPTConfig) and config.n_embd % config.n_head:
        raise ValueError(f"n_embd={config.n_embd} is invalid: must be divisible by n_head={config.n_head}")
    if isinstance(config, GPTConfig):
        return Workload(name, config, GPT, _gpt_batch, _gpt_loss, seed, spec=name, overrides=dict(overrides))
    return Workload(name, config, MLPChain, _mlp_batch, _mlp_loss, seed, spec=name, overrides=dict(overrides))


def _check_override(key: str, value, default) -> None:
    """An override has its field's type: sizes are integers >= 1, rates in [0, 1), flags bools."""
    name = f"override {key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is invalid: allowed is true or false")
    elif isinstance(default, int):
        integer(name, value, 1)
    elif isinstance(default, float) and number(name, value, 0.0, 1.0) == 1.0:
        raise ValueError(f"{name}={value!r} is invalid: allowed is a number in [0, 1)")


__all__ = [
    "GPT", "GPTConfig", "MLPChain", "MLPChainConfig", "PRESETS", "build_preset", "chunked_gpt_loss",
    "mlp_chain_activation_bytes", "with_chunked_loss",
]
