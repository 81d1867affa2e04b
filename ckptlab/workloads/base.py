"""What ckptlab measures: a Workload is a named model config plus how to feed it and its loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn


@dataclass
class Workload:
    """A named model config plus how to feed it. `build()` gives a fresh, seeded model."""

    name: str
    config: object
    make_model: Callable[[object], nn.Module]
    make_batch: Callable[[object, int, int, torch.Generator], tuple]
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor]
    seed: int = 0

    def build(self, device: str | torch.device = "cpu") -> nn.Module:
        """A fresh model. Weights are drawn on the CPU from the seed, so every device gets the
        same model; on "meta" nothing is allocated (and `.to` would untie shared weights)."""
        if torch.device(device).type == "meta":
            with torch.device("meta"):
                return self.make_model(self.config)
        torch.manual_seed(self.seed)
        return self.make_model(self.config).to(device)

    def batch(self, batch_size: int, seq_len: int, device: str | torch.device = "cpu") -> tuple:
        gen = torch.Generator().manual_seed(self.seed + 1)
        return tuple(t.to(device) for t in self.make_batch(self.config, batch_size, seq_len, gen))

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        return self.loss_fn(model, batch)

    @property
    def max_seq_len(self) -> int | None:
        return getattr(self.config, "block_size", None)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.build("meta").parameters())



# Workloads from optional modules: name -> factory(name, seed=..., **overrides). ckptlab's
# Hugging Face module adds the hf-* names when first asked for one, so ckptlab works without transformers.
WORKLOAD_FACTORIES: dict[str, Callable[..., Workload]] = {}


__all__ = ["WORKLOAD_FACTORIES", "Workload"]
