"""Workloads: a model, a way to make a batch, and a loss — everything a training step needs.

`get_workload(spec)` is the one place a model name becomes a workload (presets here, Hugging Face
architectures in `hf_models`, your own `file.py:factory` in `specs`); `Workload.custom` wraps a
model of your own. The built-in presets:

    gpt-tiny     4 blocks, d=128, a training step well under a second on a laptop CPU
    gpt2-small   the GPT-2 124M shape: 12 blocks, d=768, 12 heads, vocab 50257, 1024 positions
    mlp-chain    N identical residual MLP blocks whose activation bytes are computable by hand

Every workload is seeded: the same name and overrides give the same weights and the same batch.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F


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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


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

@dataclass
class Workload:
    """A named model config plus how to feed it. `build()` gives a fresh, seeded model.

    Built-in workloads come from `get_workload`; your own model from `Workload.custom`.
    `spec` is the string `get_workload` re-creates it from (in isolated cells, jobs and ranks),
    `spec_hash` a content hash of the file that defines it, `overrides` what the spec's factory
    was given.
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
            except RuntimeError:   # its __init__ reads tensor data (.item()): meta tensors have none
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
        return tuple(t.to(device) for t in self.make_batch(self.config, batch_size, seq_len, gen))

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        return self.loss_fn(model, batch)

    @property
    def loss_name(self) -> str:
        """Which loss a training step computes (plans and records say what they were made for)."""
        fn = self.loss_fn
        module = getattr(fn, "__module__", None) or "?"
        name = getattr(fn, "__qualname__", type(fn).__name__)
        if module.startswith(SPEC_MODULE_PREFIX) and self.spec:   # defined in a spec's file
            return f"{self.spec.rpartition(':')[0]}:{name}"
        return f"{module}.{name}"

    @property
    def label(self) -> str:
        """What records call the model: the spec that re-creates it, else its name."""
        return self.spec or self.name

    @property
    def identity(self) -> tuple:
        """Equal for two workloads that build the same model on the same batches (cache keys)."""
        custom = id(self.make_model) if self.spec is None and self.config is None else None
        return (self.label, self.spec_hash, repr(self.config), repr(sorted(self.overrides.items())),
                self.seed, self.block_paths, custom)

    @property
    def max_seq_len(self) -> int | None:
        if self.seq_len_limit is not None:
            return self.seq_len_limit
        return getattr(self.config, "block_size", None)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.build("meta").parameters())


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


def _gpt_batch(cfg: GPTConfig, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _gpt_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _mlp_batch(cfg: MLPChainConfig, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple:
    return (torch.randn(batch_size, seq_len, cfg.n_embd, generator=gen),)


def _mlp_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    # A loss that saves no extra activation: d(mean(y))/dy is a constant.
    return model(batch[0]).mean()


PRESETS: dict[str, tuple[Callable[..., object], dict]] = {
    "gpt-tiny": (GPTConfig, dict(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=256)),
    "gpt2-small": (GPTConfig, dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)),
    "mlp-chain": (MLPChainConfig, dict(n_layer=8, n_embd=64)),
}


SPEC_FORMS = ("hf:<model_type>", "hf:path/config.json", "hf:org/name", "path/to/file.py:factory",
              "package.module:factory")


def get_workload(name: str, seed: int = 0, **overrides) -> Workload:
    """A workload by spec (the one place a model name becomes a model):

        gpt-tiny, gpt2-small, mlp-chain    built-in presets; overrides are config fields (n_layer=8)
        hf-gpt2-tiny, hf-llama-tiny, ...   short names for Hugging Face configs (ckptlab[hf])
        hf:<model_type>, hf:path/config.json, hf:org/name
                                           any transformers architecture, random weights, offline
                                           (`ckptlab.hf_models`)
        path/to/file.py:factory, package.module:factory
                                           your own: factory(**overrides) returns a Workload
                                           (`ckptlab.specs`)
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"model={name!r} is invalid: allowed is a preset ({', '.join(PRESETS)}) or a spec "
                         f"({', '.join(SPEC_FORMS)})")
    if name.startswith(("hf:", "hf-")):
        from .hf_models import get_hf_workload  # needs the extra ckptlab[hf]
        return get_hf_workload(name, seed=seed, **overrides)
    if ":" in name:
        from .specs import load_code_workload
        return load_code_workload(name, seed=seed, **overrides)
    if name not in PRESETS:
        raise ValueError(f"model={name!r} is invalid: allowed presets are {', '.join(PRESETS)} and the hf-* "
                         f"presets; or a spec: {', '.join(SPEC_FORMS)}")
    config_cls, defaults = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"override {unknown[0]}={overrides[unknown[0]]!r} is invalid for model={name!r}: "
            f"allowed overrides are {', '.join(sorted(fields))}"
        )
    config = config_cls(**{**defaults, **overrides})
    if isinstance(config, GPTConfig) and config.n_embd % config.n_head:
        raise ValueError(f"n_embd={config.n_embd} is invalid: must be divisible by n_head={config.n_head}")
    if config.n_layer < 1:
        raise ValueError(f"n_layer={config.n_layer} is invalid: allowed is an integer >= 1")
    if isinstance(config, GPTConfig):
        return Workload(name, config, GPT, _gpt_batch, _gpt_loss, seed, spec=name, overrides=dict(overrides))
    return Workload(name, config, MLPChain, _mlp_batch, _mlp_loss, seed, spec=name, overrides=dict(overrides))


__all__ = [
    "GPT", "GPTConfig", "MLPChain", "MLPChainConfig", "Workload", "get_workload", "PRESETS", "BLOCK_PATHS_ATTRIBUTE",
    "mlp_chain_activation_bytes",
]
