"""A model's repeated blocks and the handle a checkpoint policy leaves on them."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from ..core.policy import Policy


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the largest ModuleList/Sequential whose children all have one
    type (`blocks`, Hugging Face `model.layers`, `transformer.h`, `encoder.layer`, ...)."""
    best: list[nn.Module] = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and len(children) > len(best):
            best = children
    if not best:
        raise ValueError(
            f"model of type {type(model).__name__} has no repeated blocks: expected an "
            "nn.ModuleList or nn.Sequential of >= 2 modules of one type; pass blocks=[...] explicitly"
        )
    return best


class CheckpointHandle:
    """What `apply_checkpointing` returns: the applied plan, recompute counters, and `remove()`.

    Usable as a context manager: checkpointing is removed when the `with` block ends.
    """

    def __init__(self, policy: Policy, blocks: Sequence[nn.Module], regions: list[tuple[int, int]]):
        self.policy = policy
        self.blocks = list(blocks)
        self.regions = regions
        self._forward_block_runs = 0  # block forwards that ran inside checkpoint during forward
        self._region_block_runs = 0   # block forwards run by checkpointed regions, recomputes too
        self._removed = False

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def checkpointed_blocks(self) -> list[int]:
        return [i for start, stop in self.regions for i in range(start, stop)]

    @property
    def effective_density(self) -> float:
        return len(self.checkpointed_blocks) / self.n_blocks

    @property
    def recompute_count(self) -> int:
        """Block forwards that ran during backward (recomputation) since the last reset."""
        return self._region_block_runs - self._forward_block_runs

    def reset_counts(self) -> None:
        self._forward_block_runs = self._region_block_runs = 0

    def remove(self) -> None:
        if self._removed:
            return
        for block in self.blocks:
            if getattr(block.__dict__.get("forward"), "_ckptlab_handle", None) is self:
                del block.forward
        self._removed = True

    def __enter__(self) -> "CheckpointHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return (f"CheckpointHandle(policy={str(self.policy)!r}, checkpointed={self.checkpointed_blocks}, "
                f"n_blocks={self.n_blocks}, {state})")


def remove_earlier_policies(blocks: Sequence[nn.Module]) -> None:
    """Checkpoints never nest: remove whatever ckptlab (or hf) policy these blocks carry."""
    for block in blocks:
        previous = getattr(block.__dict__.get("forward"), "_ckptlab_handle", None)
        if previous is not None:
            previous.remove()


def hidden_state(out):
    """The hidden-state tensor of a block's output: the tensor itself, or the first element of
    the tuple that older Hugging Face layers return."""
    return out if isinstance(out, torch.Tensor) else out[0]



__all__ = ["CheckpointHandle", "find_blocks", "hidden_state", "remove_earlier_policies"]
