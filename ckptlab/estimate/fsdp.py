"""FSDP2's per-rank peak, modelled from one prediction of the unsharded step: parameters (frozen
ones too: `fully_shard` shards every parameter of a unit), gradients and optimizer state divided
over the ranks, activations and temporaries as they are
(each rank keeps its own batch), plus the largest unit's parameters gathered at once. The units
are those `measure_sharded` makes: one per block, the rest of the model as the root."""

from __future__ import annotations

import math

from ..workloads.base import Workload
from ..workloads.stacks import find_blocks
from .fake_step import Prediction


def fsdp_units(workload: Workload) -> list[int]:
    """Parameter bytes of each FSDP2 unit as `measure_sharded` shards the model: one unit per
    block, the root holding the rest (embeddings, final norm, head)."""
    model = workload.build("meta")
    blocks = find_blocks(model)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    units = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks]
    root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
    return units + [root]


def fsdp_peak(pred: Prediction, units: list[int], ranks: int) -> int:
    """The per-rank peak of FSDP2 over `ranks` ranks, modelled (module docstring); on a card, in
    its device bytes."""
    by = pred.peak_by_category
    sharded = by["parameters"] + by.get("frozen_parameters", 0) + by["gradients"] + by["optimizer_state"]
    return pred.held_bytes - sharded + math.ceil(sharded / ranks) + max(units)


__all__ = ["fsdp_peak", "fsdp_units"]
