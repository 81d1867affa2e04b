"""A model's stacks of repeated blocks: the units checkpointing recomputes.

A stack is an `nn.ModuleList` or `nn.Sequential` of >= 2 modules of one type (`blocks`, Hugging
Face `model.layers`, `transformer.h`, `encoder.layer`, T5's `encoder.block` and `decoder.block`).
Every stack is found, in the order the modules are registered, which is the order they run in
every model built the usual way (embeddings, encoder, decoder, head):

- a stack inside a chosen stack's blocks is not a stack of its own (a block's sub-layers), except
  one level down when the outer stack holds *stages* (Swin, ConvNeXt, ResNet): each of its
  elements is mostly (>= half of its parameters) a stack of blocks (one block is enough there),
  and those blocks are taken;
- stacks of leaf modules (a Sequential of two Linear) count only when there is nothing else.

A workload built with `blocks=` names its stacks by attribute path instead (`Workload.custom`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from .base import BLOCK_PATHS_ATTRIBUTE

STAGE_SHARE = 0.5   # an element whose inner stacks hold at least this share of its parameters is a stage


@dataclass
class BlockStack:
    """One stack: its attribute path in the model and its blocks, in order."""

    path: str
    blocks: list

    def __str__(self) -> str:
        return f"{self.path or '(model)'}[{len(self.blocks)}]"


def find_stacks(model: nn.Module) -> list[BlockStack]:
    """Every stack of repeated blocks in `model`, in run order (module docstring). Raises
    ValueError saying what the model holds, and how to name the blocks, when there is none."""
    paths = model.__dict__.get(BLOCK_PATHS_ATTRIBUTE)
    if paths is not None:
        return [_stack_at(model, path) for path in paths]
    stacks = _search(model, "", enter_stages=True)
    with_structure = [s for s in stacks if any(next(b.children(), None) is not None for b in s.blocks)]
    stacks = with_structure or stacks
    if not stacks:
        raise ValueError(
            f"model of type {type(model).__name__} has no repeated blocks: expected an nn.ModuleList or "
            f"nn.Sequential of >= 2 modules of one type; it holds {_outline(model)}. Name them with "
            "blocks='path.to.container' (a list for several stacks) in Workload.custom, or pass "
            "blocks=[...] to apply_checkpointing"
        )
    return stacks


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Every repeated block of `model`, all stacks together, in run order (see `find_stacks`)."""
    return [block for stack in find_stacks(model) for block in stack.blocks]


def describe_stacks(stacks: list[BlockStack]) -> str:
    """'encoder.block[6] + decoder.block[6]': what records name."""
    return " + ".join(str(s) for s in stacks)


def _is_stack(module: nn.Module, minimum: int) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    return len(children) >= minimum and len({type(c) for c in children}) == 1 and \
        any(p is not None for p in (next(children[0].children(), None), *children[0].parameters()))


def _search(module: nn.Module, path: str, enter_stages: bool) -> list[BlockStack]:
    # Inside a stage (enter_stages=False) a stack of one block counts: a stage may hold one.
    if _is_stack(module, 2 if enter_stages else 1):
        children = list(module.named_children())
        if enter_stages:
            inner = [_search(child, _join(path, name), enter_stages=False) for name, child in children]
            if all(inner) and all(_share(child, stacks) >= STAGE_SHARE
                                  for (_, child), stacks in zip(children, inner)):
                return [s for stacks in inner for s in stacks]
        return [BlockStack(path, [child for _, child in children])]
    found: list[BlockStack] = []
    seen: set[int] = set()
    for name, child in module.named_children():
        for stack in _search(child, _join(path, name), enter_stages):
            if id(stack.blocks[0]) not in seen:   # a stack registered twice (shared) counts once
                seen.add(id(stack.blocks[0]))
                found.append(stack)
    return found


def _share(module: nn.Module, stacks: list[BlockStack]) -> float:
    total = sum(p.numel() for p in module.parameters())
    inner = sum(p.numel() for s in stacks for b in s.blocks for p in b.parameters())
    return inner / total if total else 1.0


def _stack_at(model: nn.Module, path: str) -> BlockStack:
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"blocks={path!r} is invalid: {type(model).__name__} has no submodule {path!r}; "
                         f"it holds {_outline(model)}") from None
    children = list(container.children())
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(children) < 1:
        raise ValueError(f"blocks={path!r} is invalid: it is a {type(container).__name__}, allowed is the "
                         "nn.ModuleList or nn.Sequential that holds the blocks")
    return BlockStack(path, children)


def _outline(model: nn.Module) -> str:
    parts = []
    for name, child in model.named_children():
        kinds = sorted({type(c).__name__ for c in child.children()})
        inside = f" of {', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''}" if kinds else ""
        entries = [m for m in child._modules.values() if m is not None]
        if len({id(m) for m in entries}) == 1 and len(entries) > 1:   # children() yields a module once
            inside = f" of one {type(entries[0]).__name__}, {len(entries)} times: a shared block, not blocks of their own"
        parts.append(f"{name} ({type(child).__name__}{inside})")
    return ", ".join(parts) or "no submodules"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


__all__ = ["BlockStack", "describe_stacks", "find_blocks", "find_stacks"]
