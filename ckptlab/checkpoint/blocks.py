"""The handle a checkpoint policy leaves on a model's repeated blocks (found by
`workloads.stacks`: every stack of them, in run order)."""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..core.policy import Policy
from ..workloads.stacks import BlockStack, describe_stacks


class CheckpointHandle:
    """What `apply_checkpointing` returns: the applied plan, recompute counters, and `remove()`.

    Usable as a context manager: checkpointing is removed when the `with` block ends.
    """

    def __init__(self, policy: Policy, blocks: Sequence[nn.Module], regions: list[tuple[int, int]],
                 stacks: Sequence[BlockStack] = ()):
        self.policy = policy
        self.blocks = list(blocks)
        self.regions = regions
        self.stacks = list(stacks)   # the stacks the blocks were found in (empty: blocks given)
        self._forward_block_runs = 0  # block forwards that ran inside checkpoint during forward
        self._region_block_runs = 0   # block forwards run by checkpointed regions, recomputes too
        self.removed = False

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
    def stacks_found(self) -> str:
        """'encoder.block[6] + decoder.block[6]', or 'given[N]' for blocks passed explicitly."""
        return describe_stacks(self.stacks) if self.stacks else f"given[{self.n_blocks}]"

    @property
    def recompute_count(self) -> int:
        """Block forwards that ran during backward (recomputation) since the last reset."""
        return self._region_block_runs - self._forward_block_runs

    def reset_counts(self) -> None:
        self._forward_block_runs = self._region_block_runs = 0

    def count_forward(self, blocks: int = 1) -> None:
        """`blocks` block forwards are about to run inside a checkpoint in the forward pass."""
        self._forward_block_runs += blocks

    def count_region_run(self) -> None:
        """A checkpointed block's forward is about to run: in forward, or recomputed in backward."""
        self._region_block_runs += 1

    @contextlib.contextmanager
    def counting_paused(self):
        """Block forwards run inside (inference: nothing is saved) are not counted as recomputes."""
        runs = self._region_block_runs
        try:
            yield
        finally:
            self._region_block_runs = runs

    def remove(self) -> None:
        if self.removed:
            return
        self.unmark_blocks()
        self.removed = True

    def mark(self, forward: Callable) -> Callable:
        """`forward`, tagged as this handle's: `handle_of` finds the handle on a module whose
        instance `forward` it is."""
        forward._ckptlab_handle = self
        return forward

    def unmark_blocks(self) -> None:
        """Take this handle's forwards off its blocks: their class's forward runs again."""
        for block in self.blocks:
            if handle_of(block) is self:
                del block.forward

    def __enter__(self) -> "CheckpointHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return (f"CheckpointHandle(policy={str(self.policy)!r}, checkpointed={self.checkpointed_blocks}, "
                f"n_blocks={self.n_blocks}, {state})")


def handle_of(module: nn.Module) -> CheckpointHandle | None:
    """The handle of the policy whose forward `module` carries (ckptlab's or hf's), or None."""
    return getattr(module.__dict__.get("forward"), "_ckptlab_handle", None)


def remove_earlier_policies(blocks: Sequence[nn.Module]) -> None:
    """Checkpoints never nest: remove whatever ckptlab (or hf) policy these blocks carry."""
    for block in blocks:
        previous = handle_of(block)
        if previous is not None:
            previous.remove()


def refuse_foreign_checkpointing(model: nn.Module, policy: Policy) -> None:
    """ValueError when transformers' own checkpointing is on in `model` and ckptlab did not put
    it there (`gradient_checkpointing_enable()`, `TrainingArguments(gradient_checkpointing=True)`,
    peft's `prepare_model_for_kbit_training` on a quantized model): a ckptlab policy would nest
    inside it, every layer recomputed twice, and `none` would not be none. transformers marks the
    layers it checkpoints with `gradient_checkpointing = True` (and their parent models too: only
    the innermost marked modules are its layers)."""
    marked = [(name, m) for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    layers = [name for name, m in marked
              if not any(other is not m and getattr(other, "gradient_checkpointing", False) is True
                         for other in m.modules())
              and handle_of(m) is None]
    if layers:
        shown = ", ".join(layers[:2]) + (f", ... ({len(layers)} layers)" if len(layers) > 2 else "")
        raise ValueError(
            f"policy={policy} is invalid for this model: transformers' own checkpointing is already on ({shown}), "
            "set by gradient_checkpointing_enable(), TrainingArguments(gradient_checkpointing=True) or peft's "
            "prepare_model_for_kbit_training; ckptlab's policy would nest inside it (every layer recomputed twice). "
            "Turn it off (model.gradient_checkpointing_disable(), or prepare_model_for_kbit_training(..., "
            "use_gradient_checkpointing=False)), or measure transformers' own with policy=hf")


def split_at_stacks(regions: list[tuple[int, int]], stacks: Sequence[BlockStack]) -> list[tuple[int, int]]:
    """Regions cut where one stack ends and the next begins: a segment runs its blocks one into
    the next, which the last encoder block and the first decoder block do not."""
    starts, n = set(), 0
    for stack in stacks:
        starts.add(n)
        n += len(stack.blocks)
    out = []
    for start, stop in regions:
        cuts = [start] + [i for i in range(start + 1, stop) if i in starts] + [stop]
        out.extend(zip(cuts[:-1], cuts[1:]))
    return out


def hidden_state(out):
    """The hidden-state tensor of a block's output: the tensor itself, or the first element of
    the tuple that older Hugging Face layers return."""
    return out if isinstance(out, torch.Tensor) else out[0]


__all__ = ["CheckpointHandle", "handle_of", "hidden_state", "refuse_foreign_checkpointing", "remove_earlier_policies",
           "split_at_stacks"]
