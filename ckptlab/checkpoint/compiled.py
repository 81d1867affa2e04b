"""Compiling a model under a policy: `compile` and `compile:budget=B` (PyTorch's own planner),
`P+compile` (P's checkpoint regions traced into the one compiled graph), and a plan with a
compile budget per block, compiled block by block (one compiled graph holds one budget).

Two traps are closed here:
- dynamo keeps its graphs per code object, and every model of a class, every block and every
  budget adds one; past `recompile_limit` (8) it silently runs the rest eager. `apply_policy`
  raises the limit and makes reaching it an error, and each compiled model counts the graphs its
  own backends compiled (`Compiled.graphs`), so a row shows that it ran compiled.
- inductor draws random numbers its own way; under `eager_random()` it draws them as eager does,
  so a compiled model's gradients can be compared with the eager model's.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..core.policy import Policy
from .blocks import CheckpointHandle
from .wrap import apply_checkpointing

RECOMPILE_LIMIT = 1024   # graphs per code object: every compiled model or block of a run has room


@contextlib.contextmanager
def fresh_compiler_cache(compiles: bool = True):
    """dynamo's cache emptied before and after the `with` block, so no graph of an earlier model
    is reused and none outlives this one (nothing happens when `compiles` is False). dynamo is
    not imported for it: a process that never loaded the compiler has nothing cached."""
    def reset():
        dynamo = sys.modules.get("torch._dynamo")
        if compiles and dynamo is not None:
            dynamo.reset()

    reset()
    try:
        yield
    finally:
        reset()


@dataclass
class Compiled:
    """A compiled model's record: how many graphs its backends compiled (0: it ran eager)."""

    graphs: int = 0


def apply_policy(model: nn.Module, policy: Policy, **apply_options) -> tuple[nn.Module, CheckpointHandle, Compiled | None]:
    """Apply `policy` to `model` in place: checkpointing (`apply_checkpointing`, which takes
    `apply_options`), then compilation when the policy compiles. Returns (the module to run, the
    checkpoint handle, the Compiled record or None when nothing compiles)."""
    handle = apply_checkpointing(model, policy, **apply_options)
    if not policy.compiles:
        return model, handle, None
    compiled = Compiled()
    budgets = policy.compile_budgets(handle.n_blocks)
    if budgets is None:
        budget = policy.value if policy.kind == "compile" and policy.value is not None else 1.0
        return compile_with_budget(model, budget, compiled), handle, compiled
    for block, budget in zip(handle.blocks, budgets):  # regional: each block its own graph and budget
        block.compile(backend=_inductor_with_budget(budget, compiled))
    return model, handle, compiled


def compile_with_budget(model: nn.Module, budget: float, compiled: Compiled | None = None) -> nn.Module:
    """`torch.compile(model)` with PyTorch's `activation_memory_budget` = `budget` in force while
    it compiles (the min-cut partitioner reads it then). Each call gets a backend of its own:
    dynamo hands a second model of the same class the graph it compiled for the first unless
    the backend differs, so two budgets compiled side by side would otherwise share one graph."""
    return torch.compile(model, backend=_inductor_with_budget(budget, compiled or Compiled()))


def _inductor_with_budget(budget: float, compiled: Compiled):
    import torch._functorch.config as functorch_config  # noqa: PLC0415 - the compiler stack is heavy
    from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415 - as above

    _no_silent_eager()

    def inductor_with_budget(graph, example_inputs):
        compiled.graphs += 1
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(graph, example_inputs)

    return inductor_with_budget


# torch logs this reminder (no in-place ops in a region with a context_fn) whenever a selective
# checkpoint compiles; ckptlab's selective policies only choose what to save, and its gradient
# check (`compare --verify`) is what would catch an in-place op. Library noise, kept off the terminal.
CONTEXT_FN_NOTICE = "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile"


def _without_context_fn_notice(record: logging.LogRecord) -> bool:
    return CONTEXT_FN_NOTICE not in record.getMessage()


def _no_silent_eager() -> None:
    """Room for every graph of a run, and an error instead of eager when there is none; the
    context_fn notice filtered out. Set for the process, not in a `with`: dynamo reads the limit
    whenever a compiled frame runs, long after the model was compiled."""
    notices = logging.getLogger("torch._higher_order_ops.wrap")
    if _without_context_fn_notice not in notices.filters:
        notices.addFilter(_without_context_fn_notice)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
    config.fail_on_recompile_limit_hit = True


@contextlib.contextmanager
def eager_random():
    """Inductor draws random numbers (dropout) with eager's generator, in eager's order: compiled
    and eager gradients then agree up to float rounding, unless the compiled graph redraws."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - the compiler stack is heavy

    with inductor_config.patch(fallback_random=True):
        yield


__all__ = ["Compiled", "RECOMPILE_LIMIT", "apply_policy", "compile_with_budget", "eager_random", "fresh_compiler_cache"]
