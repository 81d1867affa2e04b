"""Applying a checkpoint policy to a model's repeated blocks (found by `workloads.stacks`), reversibly.

Checkpointing is applied by giving each chosen block an instance-level `forward` that runs the
original forward under `torch.utils.checkpoint.checkpoint`. Nothing is re-parented, so
`state_dict` keys, hooks and `named_modules` stay exactly as they were, and `remove()` (or leaving
the `with` block) deletes the instance attribute to restore the class's forward.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from ..core.policy import Policy, as_policy
from ..workloads.stacks import find_stacks
from .blocks import (
    CheckpointHandle,
    hidden_state,
    refuse_foreign_checkpointing,
    remove_earlier_policies,
    split_at_stacks,
)


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
    offload_hooks: Callable | None = None,
) -> CheckpointHandle:
    """Checkpoint the blocks that `policy` selects, in place. Returns a handle that removes it.

    Applying again to the same blocks first removes the earlier policy: checkpoints never nest.
    Non-reentrant by default: it supports keyword arguments, inputs that do not require grad
    (frozen bases) and early stop. RNG state is preserved so dropout masks match on recompute.
    `determinism_check`, `debug`, `early_stop` and `context_fn` pass through to PyTorch.
    `offload_hooks()` makes the saved-tensor hooks a `+offload` policy runs each block under
    (default: `save_on_cpu`); a prediction for CUDA passes its model of them.
    """
    policy = as_policy(policy)
    if use_reentrant and context_fn is not None:
        raise ValueError("context_fn is invalid with use_reentrant=True: PyTorch supports it only non-reentrant")
    options = dict(use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)
    if not use_reentrant:
        options.update(determinism_check=determinism_check, debug=debug)
        if context_fn is not None:
            options["context_fn"] = context_fn
    if policy.mechanism == "transformers":  # transformers' own checkpointing: ckptlab.checkpoint.hf applies it
        # In-function: transformers is an optional, heavy dependency (extra ckptlab[hf]).
        from .hf import apply_hf_checkpointing  # noqa: PLC0415 - needs transformers, the hf extra
        return apply_hf_checkpointing(model, policy, blocks, options, early_stop)
    refuse_foreign_checkpointing(model, policy)
    stacks = find_stacks(model) if blocks is None else []
    blocks = list(blocks) if blocks is not None else [b for s in stacks for b in s.blocks]
    regions = split_at_stacks(policy.regions(len(blocks)), stacks)  # raises before the model is touched
    remove_earlier_policies(blocks)
    modes = policy.modes(len(blocks)) if policy.kind in ("selective", "plan") else None
    if modes and "selective" in modes:
        if use_reentrant:
            raise ValueError(f"policy={policy} is invalid with use_reentrant=True: selective "
                             "checkpointing needs non-reentrant checkpoint")
        if context_fn is not None:
            raise ValueError(f"context_fn is invalid with policy={policy}: the policy sets its own")
    handle = CheckpointHandle(policy, blocks, regions, stacks)
    for start, stop in regions:
        mode = modes[start] if modes else "full"
        region_options = options
        if mode == "selective":
            region_options = {**options, "context_fn": selective_context_fn(policy.selective_variant)}
        _patch_region(handle, blocks[start:stop], region_options, early_stop)
    if policy.offload:
        _patch_offload(handle, blocks, offload_hooks)
    return handle


# --------------------------------------------------------------------------- selective (op-level)

def _sdpa_ops() -> set:
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


def _matmul_ops() -> set:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def matmul_and_attention_ops() -> set:
    """What selective checkpointing saves by default, as PyTorch's docs do: matmul and attention outputs."""
    return _sdpa_ops() | _matmul_ops()


def selective_policy_fn(variant: str = "mm") -> Callable:
    """A `create_selective_checkpoint_contexts` policy for one checkpoint call.

    mm:   keep every matmul output and every fused-attention output, recompute the rest
          (pointwise ops, norms, dropout: cheap to recompute, as large as the matmul outputs);
    alt:  keep attention and every other matmul (the 2nd, 4th, ... of the block), as torchtitan's
          op-level selective AC does, trading recompute of half the matmuls for memory;
    attn: keep only attention outputs: those of sdpa's fused kernels. Attention that runs as
          plain matmuls and a softmax (sdpa's math path, which a CPU takes with dropout; a model's
          own attention) keeps nothing: then it recomputes what `full` does.
    Random ops (dropout) are recomputed under checkpoint's preserved RNG state, so masks match.
    """
    if variant not in ("mm", "alt", "attn"):
        raise ValueError(f"selective variant {variant!r} is invalid: allowed are mm, alt, attn")
    sdpa, matmuls = _sdpa_ops(), _matmul_ops()
    counter = [0]

    def policy_fn(ctx, op, *args, **kwargs):
        if op in sdpa:
            return CheckpointPolicy.MUST_SAVE
        if op in matmuls and variant != "attn":
            counter[0] += 1
            if variant == "mm" or counter[0] % 2 == 0:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


def selective_context_fn(variant: str = "mm") -> Callable:
    """`context_fn` for `torch.utils.checkpoint.checkpoint`: a fresh policy (and matmul counter)
    per checkpoint call."""

    def context_fn():
        return create_selective_checkpoint_contexts(selective_policy_fn(variant))

    return context_fn


# --------------------------------------------------------------------------- offload

def _patch_offload(handle: CheckpointHandle, blocks: list[nn.Module], hooks: Callable | None = None) -> None:
    """Run every block's forward (checkpointed or not) under `save_on_cpu`: tensors autograd
    saves inside a block go to host memory (pinned when the block's parameters are on CUDA) and
    come back in backward. On CPU `save_on_cpu` hands the same tensor back (`tensor.cpu()` of a
    CPU tensor is itself), so memory and results are unchanged; `measure` says so in the record."""
    for block in blocks:
        inner = block.forward  # the checkpointing patch or the class's bound forward
        first = next(block.parameters(), None)
        pin = first is not None and first.device.type == "cuda"
        make_hooks = hooks or functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=pin)

        def offload_forward(*args, _inner=inner, _hooks=make_hooks, **kwargs):
            with _hooks():
                return _inner(*args, **kwargs)

        block.forward = handle.mark(offload_forward)


@dataclass
class _SegmentRun:
    """A segment's output, held for its following blocks to hand back, and what they must match."""

    output: object
    other_args: tuple         # the first block's arguments besides the hidden state
    kwargs: dict
    blocks_done: int = 1


def _recomputing_without_statistics(region: list[nn.Module], run: Callable) -> Callable:
    """`run` for one checkpoint call: its first call the forward, every later one a recompute, in
    which the region's batch norms (training, tracking running statistics) leave those statistics
    as the forward left them: a recompute runs the forward again, and would count the batch twice
    in the running mean and variance and in `num_batches_tracked`. In a recompute each such norm
    updates stand-ins instead, copies of its statistics made here, in the forward (made in the
    recompute they would be ops that selective checkpointing, which replays a recompute's ops by
    position, does not find); its output, from the batch's own statistics, is the forward's."""
    norms = [m for block in region for m in block.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats]
    if not norms:
        return run
    with torch.no_grad():
        stand_ins = [[None if t is None else t.clone() for t in _statistics(m)] for m in norms]
    calls = 0

    def forward_or_recompute(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return run(*args, **kwargs)
        kept = [_statistics(m) for m in norms]
        for m, tensors in zip(norms, stand_ins):
            m.running_mean, m.running_var, m.num_batches_tracked = tensors
        try:
            return run(*args, **kwargs)
        finally:
            for m, tensors in zip(norms, kept):
                m.running_mean, m.running_var, m.num_batches_tracked = tensors

    return forward_or_recompute


def _statistics(norm: nn.Module) -> tuple:
    return norm.running_mean, norm.running_var, norm.num_batches_tracked


def _patch_region(handle: CheckpointHandle, region: list[nn.Module], options: dict, early_stop: bool) -> None:
    """One checkpoint region. A single block recomputes itself. A segment (several consecutive
    blocks) is one region: its first block runs the whole segment under one checkpoint and returns
    the segment's output; the following blocks hand that output back unchanged. This needs the
    model to call the blocks in order, feeding each one's output to the next, as every
    transformer layer loop does; anything else is detected and refused."""
    originals = [block.forward for block in region]  # bound class methods
    stash: list[_SegmentRun] = []   # the segment run in progress, if any

    def run_region(*args, **kwargs):
        out = None
        for i, forward in enumerate(originals):
            # Counted before running: early stop ends a recompute inside the block.
            if not torch.compiler.is_compiling():
                handle.count_region_run()
            out = forward(*args, **kwargs) if i == 0 else forward(hidden_state(out), *args[1:], **kwargs)
        return out

    def region_forward(*args, **kwargs):
        if torch.is_grad_enabled():
            _refuse_traps(region, args, kwargs, options["use_reentrant"])
            # Under torch.compile the checkpoint is traced into the graph, without the recompute
            # counters (Python state a graph cannot hold) or early stop (an option of eager
            # recompute that dynamo does not trace): either would break the graph there.
            compiling = torch.compiler.is_compiling()
            if not compiling:
                handle.count_forward(len(region))
            run = run_region if compiling else _recomputing_without_statistics(region, run_region)
            with contextlib.nullcontext() if compiling else set_checkpoint_early_stop(early_stop):
                if kwargs and options["use_reentrant"]:
                    # Reentrant checkpoint takes no keyword arguments (Hugging Face layers get
                    # masks and RoPE tables so): bind them, as transformers does. No gradient
                    # flows back through a keyword-argument tensor then.
                    out = checkpoint(functools.partial(run, **kwargs), *args, **options)
                else:
                    out = checkpoint(run, *args, **options, **kwargs)
        else:  # inference: nothing is saved, so there is nothing to recompute
            with handle.counting_paused():
                out = run_region(*args, **kwargs)
        if len(region) > 1:
            stash[:] = [_SegmentRun(out, args[1:], kwargs)]
        return out

    def follower_forward(hidden, *args, **kwargs):
        if not stash or hidden_state(stash[0].output) is not hidden:
            raise RuntimeError(
                "segments policy: blocks were not called in order with each block's output fed to "
                "the next; use a per-block policy (full, density, every, layers) for this model"
            )
        run = stash[0]
        if not _same_arguments((args, kwargs), (run.other_args, run.kwargs)):
            # The segment ran this block with the first block's other arguments (T5 hands layer
            # 0's position bias to the later layers): its output would be wrong.
            stash.clear()
            raise RuntimeError(
                "segments policy: a later block of a segment was called with other arguments than the "
                "first (besides the hidden state), so running the segment from the first block's "
                "arguments would change the result; use a per-block policy (full, density, every, "
                "layers) for this model"
            )
        run.blocks_done += 1
        if run.blocks_done == len(region):
            stash.clear()
        return run.output

    region[0].forward = handle.mark(region_forward)
    for block in region[1:]:
        block.forward = handle.mark(functools.partial(follower_forward))


CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")   # transformers' names


def _refuse_traps(region: list[nn.Module], args: tuple, kwargs: dict, use_reentrant: bool) -> None:
    """ValueError, in the forward pass before any backward, for the two ways a checkpointed block
    silently computes something else than the un-checkpointed model (see the LoRA section of the
    docs): a key/value cache handed to the block, and reentrant checkpoint of a block whose inputs
    do not require grad while its parameters do."""
    cache = next((name for name in CACHE_ARGUMENTS if kwargs.get(name) not in (None, False, True)), None)
    if cache is not None:
        raise ValueError(
            f"use_cache=True is invalid under checkpointing: the model hands its blocks a key/value cache "
            f"({cache}=...), and the recompute writes every block's keys and values into it a second time "
            "(selective checkpointing fails, full keeps the cache alive); set model.config.use_cache = False "
            "(or pass use_cache=False), as transformers does under its own checkpointing")
    if not use_reentrant:
        return
    inputs_need_grad = any(a.requires_grad for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor))
    if not inputs_need_grad and any(p.requires_grad for block in region for p in block.parameters()):
        raise ValueError(
            "use_reentrant=True is invalid here: a checkpointed block's inputs do not require grad (a frozen "
            "embedding, as in LoRA fine-tuning), so reentrant checkpoint gives the block's trainable parameters "
            "no gradient (and backward fails when every block is checkpointed); call "
            "model.enable_input_require_grads() first, or use non-reentrant checkpointing (use_reentrant=False, "
            "ckptlab's default)")


def _same_arguments(a, b) -> bool:
    """Same structure, the same objects (tensors by identity, plain values by equality)."""
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(x is y or (isinstance(x, (int, float, str, bool)) and type(x) is type(y) and x == y)
               for x, y in zip(leaves_a, leaves_b))
