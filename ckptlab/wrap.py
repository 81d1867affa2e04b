"""Finding a model's repeated blocks and applying a checkpoint policy to them, reversibly.

Checkpointing is applied by giving each chosen block an instance-level `forward` that runs the
original forward under `torch.utils.checkpoint.checkpoint`. Nothing is re-parented, so
`state_dict` keys, hooks and `named_modules` stay exactly as they were, and `remove()` (or leaving
the `with` block) deletes the instance attribute to restore the class's forward.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .policy import Policy, parse_policy


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


def apply_checkpointing(
    model: nn.Module,
    policy: str | Policy,
    blocks: Sequence[nn.Module] | None = None,
    *,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    context_fn: Callable | None = None,
) -> CheckpointHandle:
    """Checkpoint the blocks that `policy` selects, in place. Returns a handle that removes it.

    Applying again to the same blocks first removes the earlier policy: checkpoints never nest.
    Non-reentrant by default: it supports keyword arguments, inputs that do not require grad
    (frozen bases) and early stop. RNG state is preserved so dropout masks match on recompute.
    `determinism_check`, `debug`, `early_stop` and `context_fn` pass through to PyTorch.
    """
    policy = parse_policy(policy)
    blocks = list(blocks) if blocks is not None else find_blocks(model)
    regions = policy.regions(len(blocks))  # raises before the model is touched
    if use_reentrant and context_fn is not None:
        raise ValueError("context_fn is invalid with use_reentrant=True: PyTorch supports it only non-reentrant")
    for block in blocks:
        previous = getattr(block.__dict__.get("forward"), "_ckptlab_handle", None)
        if previous is not None:
            previous.remove()
    handle = CheckpointHandle(policy, blocks, regions)
    options = dict(use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)
    if not use_reentrant:
        options.update(determinism_check=determinism_check, debug=debug)
        if context_fn is not None:
            options["context_fn"] = context_fn
    for start, stop in regions:
        _patch_region(handle, blocks[start:stop], options, early_stop)
    return handle


def _patch_region(handle: CheckpointHandle, region: list[nn.Module], options: dict, early_stop: bool) -> None:
    """One checkpoint region. A single block recomputes itself. A segment (several consecutive
    blocks) is one region: its first block runs the whole segment under one checkpoint and returns
    the segment's output; the following blocks hand that output back unchanged. This needs the
    model to call the blocks in order, feeding each one's output to the next, as every
    transformer layer loop does; anything else is detected and refused."""
    originals = [block.forward for block in region]  # bound class methods
    stash: list = []

    def run_region(*args, **kwargs):
        out = None
        for i, forward in enumerate(originals):
            # Counted before running: early stop ends a recompute inside the block.
            handle._region_block_runs += 1
            out = forward(*args, **kwargs) if i == 0 else forward(_hidden(out), *args[1:], **kwargs)
        return out

    def region_forward(*args, **kwargs):
        if torch.is_grad_enabled():
            handle._forward_block_runs += len(region)
            with set_checkpoint_early_stop(early_stop):
                out = checkpoint(run_region, *args, **options, **kwargs)
        else:  # inference: nothing is saved, so there is nothing to recompute
            with _paused(handle):
                out = run_region(*args, **kwargs)
        if len(region) > 1:
            stash[:] = [out, 1]
        return out

    def follower_forward(hidden, *args, **kwargs):
        if not stash or _hidden(stash[0]) is not hidden:
            raise RuntimeError(
                "segments policy: blocks were not called in order with each block's output fed to "
                "the next; use a per-block policy (full, density, every, layers) for this model"
            )
        out = stash[0]
        stash[1] += 1
        if stash[1] == len(region):
            stash.clear()
        return out

    region_forward._ckptlab_handle = handle
    region[0].forward = region_forward
    for block in region[1:]:
        follower_forward_for_block = _tag(follower_forward, handle)
        block.forward = follower_forward_for_block


def _tag(fn: Callable, handle: CheckpointHandle) -> Callable:
    def tagged(*args, **kwargs):
        return fn(*args, **kwargs)
    tagged._ckptlab_handle = handle
    return tagged


def _hidden(out):
    """The hidden-state tensor of a block's output: the tensor itself, or the first element of
    the tuple that older Hugging Face layers return."""
    return out if isinstance(out, torch.Tensor) else out[0]


@contextlib.contextmanager
def _paused(handle: CheckpointHandle):
    runs = handle._region_block_runs
    try:
        yield
    finally:
        handle._region_block_runs = runs
