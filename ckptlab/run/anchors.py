"""The knobs a user would reach for instead of ckptlab, each applied through its own framework's
API, as contenders of a comparison (`run.compare`, docs/design.md, note "Anchors"): per-block
`torch.utils.checkpoint`, torch.compile's `activation_memory_budget`, and for a transformers model
its own gradient checkpointing (every layer, every n layers, with torch's selective context).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..checkpoint.compiled import Compiled, compile_with_budget
from ..checkpoint.wrap import matmul_and_attention_ops
from ..core.policy import Policy
from ..core.validate import choice
from ..workloads.base import Workload, is_transformers_model
from ..workloads.stacks import find_blocks

COMPILE_ANCHOR_BUDGETS = (0.0, 0.25, 0.5, 0.75)   # torch.compile's activation_memory_budget, one anchor each


@dataclass
class Contender:
    """One row of a comparison (`run.compare`), an anchor or not: a label, where it comes from,
    and how to apply it to a model (`apply(model, record) -> (model to run, compiled?, handle or
    None)`, as `probe.measure.prepare_step` takes it; None for a ckptlab policy, resolved when it is measured). `ckptlab_policy` is the
    ckptlab Policy a row applies (None for an anchor)."""

    policy: str
    source: str
    apply: Optional[Callable] = None
    anchor: bool = False
    ckptlab_policy: Optional[Policy] = None

    @property
    def compiled_budget(self) -> bool:
        """`budget=B+compile`: resolved to a compiled plan from measured costs, after the others."""
        p = self.ckptlab_policy
        return self.apply is None and p is not None and p.kind == "budget" and p.compiled


def anchor_configs(workload: Workload) -> list[Contender]:
    """The knobs a user would use instead of ckptlab, for this workload (docs/design.md, note "Anchors")."""
    contenders = [
        Contender("torch.utils.checkpoint per block", "torch.utils.checkpoint", _per_block_checkpoint, anchor=True),
    ] + [Contender(f"torch.compile activation_memory_budget={budget}", "torch.compile", _compiled(budget), anchor=True)
         for budget in COMPILE_ANCHOR_BUDGETS]
    if is_transformers_model(workload.build("meta")):
        contenders += [
            Contender("transformers checkpointing (every layer)", "transformers", _transformers_checkpointing(), anchor=True),
            Contender("transformers every_n_layers=2", "transformers", _transformers_checkpointing(every_n_layers=2),
                   anchor=True),
            Contender("transformers every_n_layers=4", "transformers", _transformers_checkpointing(every_n_layers=4),
                   anchor=True),
            Contender("transformers + torch SAC (context_fn)", "transformers + torch SAC",
                   _transformers_checkpointing(selective=True), anchor=True),
        ]
    return contenders


def chosen_anchors(workload: Workload, anchors: bool | Sequence[str]) -> list[Contender]:
    """`anchor_configs(workload)` for anchors=True, none for False, or the ones a list names
    (ValueError naming one that is not an anchor of this workload)."""
    if isinstance(anchors, bool):
        return anchor_configs(workload) if anchors else []
    anchors = [anchors] if isinstance(anchors, str) else list(anchors)
    available = anchor_configs(workload)
    labels = [c.policy for c in available]
    for label in anchors:
        choice("anchors", label, labels)
    return [c for c in available if c.policy in anchors]


def _per_block_checkpoint(model, record):
    blocks = find_blocks(model)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    _checkpointed(record, len(blocks), range(len(blocks)))
    return model, False, None


def _compiled(budget: float):
    def apply(model, record):
        record["note"] = "torch.compile: peak from the profiler's allocator events"
        compiled = Compiled()
        return compile_with_budget(model, budget, compiled), compiled, None
    return apply


def _transformers_checkpointing(every_n_layers: Optional[int] = None, selective: bool = False):
    def apply(model, record):
        from ..checkpoint.hf import checkpointing_methods, hf_capabilities, hf_layers  # noqa: PLC0415 - the hf extra

        enable, _, kwargs_name = checkpointing_methods(model)
        options = {}
        if every_n_layers is not None:
            if not hf_capabilities(model)["every_n_layers"]:
                raise ValueError("every_n_layers is not supported by the installed transformers")
            options["every_n_layers"] = every_n_layers
        checkpoint_kwargs = {"use_reentrant": False}
        if selective:
            checkpoint_kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, list(matmul_and_attention_ops()))
        enable(**{kwargs_name: checkpoint_kwargs}, **options)
        layers = hf_layers(model)
        _checkpointed(record, len(layers), [i for i, layer in enumerate(layers) if layer.gradient_checkpointing])
        return model, False, None
    return apply


def _checkpointed(record: dict, n_blocks: int, blocks) -> None:
    blocks = list(blocks)
    record.update(n_blocks=n_blocks, effective_density=len(blocks) / n_blocks,
                  checkpointed_blocks=",".join(map(str, blocks)))


__all__ = ["COMPILE_ANCHOR_BUDGETS", "Contender", "anchor_configs", "chosen_anchors"]
