"""Predicting a training step's memory without allocating it.

`predict()` runs the same training step that `measure()` runs (model code, checkpoint wrappers,
optimizer, live-tensor tracker) under fake tensors (`fake_step`), so the predicted peak is what a
real CPU run would measure, for shapes far beyond this machine. With `device="cuda"` it predicts
the step as a CUDA card runs it: CUDA's kernels, autocast and optimizer, the cuBLAS workspaces and
the caching allocator (allocated, reserved), and on a card (`core.cards`) the device bytes and the
margin left (`fake_step`, `cuda_device`). What it cannot know is in docs/design.md, note "What a
fake step cannot know". `predict_fits()` answers "the largest batch / sequence per policy on a
card" from predictions.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterable, Optional, Sequence

from ..core.cards import DEFAULT_CARDS, Card, fits, margin_left, parse_capacity
from ..core.cards import card as find_card
from ..core.dtypes import DTYPES
from ..core.loop import Loop, as_loop
from ..core.policy import Policy, parse_policies
from ..core.validate import choice, integer
from ..core.workers import shared
from ..workloads.base import Workload
from ..workloads.registry import as_workload, get_workload
from . import answers
from .batch_line import batch_lines, lines_enabled, on_line
from .compose import fast_memory
from .cuda_device import parse_alloc_conf
from .cuda_semantics import ATTENTION_BACKENDS, check_backend_available, priority
from .fake_mode import kernel_failures_unlogged
from .fake_step import DEVICES, Prediction, as_card, fake_memory, gc_paused
from .torch_versions import check_torch_version, torch_rules

TRACES = ("fast", "full")   # predict's ways to trace a step: composed where it can be, or every block
# torch.utils.checkpoint's refusal of a recompute that runs an op its forward did not (its
# _CachedTorchDispatchMode at v2.13.0)
SAC_RECOMPUTE_MISMATCH = "encountered during backward but not found in storage"
SAC_MUTATED = "cached during selective activation checkpoint has been mutated"


def selective_failure(exc: BaseException) -> Optional[str]:
    """Why torch's selective checkpointing refused a step, in words, or None for another error."""
    text = str(exc)
    if SAC_RECOMPUTE_MISMATCH in text:
        return (f"{text.split(' This can happen')[0].rstrip('.')}: an op the forward did not run (a weight's cast that "
                "autocast's cache served) runs in the recompute, as in pytorch/pytorch#193338 (a weight used twice "
                "under autocast; dtype='bf16-weights', without autocast, steps)")
    if SAC_MUTATED in text:
        return ("a tensor it keeps (a matmul's output) is changed in place later in the block (an in-place "
                "activation such as nn.ReLU(inplace=True)), which torch refuses")
    return None
GROUPED_MM_BF16_ONLY = "Expected inputs of BF16 type"   # torch's fake kernel of _grouped_mm (MoE experts)


@gc_paused()
def predict_policy(
    workload: Workload | str,
    batch_size: int,
    seq_len: int,
    policy: Policy,
    dtype: str = "fp32",
    loop: Loop | str | None = None,
    device: str = "cpu",
    card: Optional[str | Card] = None,
    attention: Optional[str] = None,
    *,
    torch_version: Optional[str] = None,
    alloc_conf: Optional[str] = None,
    trace: str = "fast",
) -> Prediction:
    """Predict `measure(workload, batch_size, seq_len, policy, dtype=dtype)`'s memory columns
    without allocating: peak bytes (total, by category, phase) and saved-activation bytes.

    `device="cpu"` (default) predicts the step on a CPU, exact to the byte. `device="cuda"`
    predicts it as a CUDA card runs it: peak_bytes is the allocator's allocated peak,
    reserved_bytes its reserved peak, and with `card` (a name of `ckptlab.cards()`, default:
    none, an sm80 card without a context) device_bytes and margin_bytes. `attention` forces
    scaled-dot-product attention's CUDA backend (flash, efficient, math or cudnn; default:
    PyTorch's choice, named in `attention_backend`). `torch_version` ("2.4" .. "2.13", default the
    installed torch's major.minor) is the torch release whose CUDA rules the step follows (SDPA's
    priority, grouped-query attention, cuBLASLt's workspace, autocast's lists:
    `estimate.torch_versions`); the prediction records it. `loop` (`core.loop.Loop` or its text,
    default adamw) is the training loop, as `measure(..., loop=...)` runs it (`probe.step.training_step`).
    On "cuda" the allocator replays the loop's first two steps (the first creates the optimizer
    state) and each peak is the worse of them (`worse_step`: the step that reached the reserved
    peak); `alloc_conf` is the PYTORCH_CUDA_ALLOC_CONF it runs with (`"expandable_segments:True"`;
    default: none). On a card, `fit` is "yes" (device bytes + the card's margin within its usable
    bytes), "with cache flushes" (not so, but the allocator, releasing its cached segments and
    retrying at the card's limit, runs both steps: `cache_flushes` per step) or "no";
    `margin_bytes` = usable - margin - device bytes.

    The policy is concrete: `ckptlab.predict` resolves a `budget=` to its plan first.
    Policies that compile cannot be predicted (the compiler's partitioner decides inside the graph):
    ValueError. Offload on "cuda" moves what the blocks save to pinned host memory (`host_bytes`),
    as on a GPU; on "cpu" it is a no-op, predicted as its base policy, and `note` says so.
    
    `trace="fast"` (default) traces a few of each stack's repeated blocks and composes the step
    from them (`estimate.compose`), where the step allows it, else the whole step; `"full"`
    traces every block. Both give the same prediction; `Prediction.trace` says which answered.
    A prediction for a workload made from a spec is kept on disk, and the same question asked
    again is answered from there (`estimate.answers`: `answered_from_cache`; `CKPTLAB_CACHE=off`
    turns it off).
    """
    choice("trace", trace, TRACES)
    workload, policy, loop = check_prediction(workload, batch_size, seq_len, policy, dtype, loop, device, card,
                                              attention, torch_version=torch_version, alloc_conf=alloc_conf)
    if policy.kind == "budget":
        raise ValueError(f"policy={policy} is invalid here: this predicts a concrete policy; ckptlab.predict "
                         "resolves a budget to its plan first")
    t0 = time.perf_counter()
    on_card = as_card(card)
    kept_as = answers.key(workload, batch_size, seq_len, policy, dtype, loop, device, on_card, attention, torch_version,
                          alloc_conf, trace)
    kept = answers.fetch(kept_as) if kept_as else None
    if kept is not None:
        return dataclasses.replace(kept, predict_s=time.perf_counter() - t0, answered_from_cache=True)
    note = "offload predicted as its base policy (no-op on CPU)" if policy.offload and device == "cpu" else ""
    trace_step = fast_memory if trace == "fast" else fake_memory
    try:
        with kernel_failures_unlogged():
            fake = trace_step(workload, batch_size, seq_len, policy, dtype, loop, device, on_card, attention,
                              torch_version=torch_version, alloc_conf=alloc_conf)
    except RuntimeError as exc:
        if GROUPED_MM_BF16_ONLY in str(exc):
            raise ValueError(
                f"dtype={dtype!r} cannot be predicted for model={workload.label!r}: its experts run torch's grouped_mm, "
                "whose fake kernel takes bf16 inputs only (torch/_meta_registrations.py _meta_grouped_mm_common at "
                "v2.13.0), where the CPU's takes fp32 too; predict it with dtype='bf16-weights', or measure "
                "it") from None
        why = selective_failure(exc)
        if why is None:
            raise
        raise ValueError(f"policy={policy} with dtype={dtype!r} cannot be predicted for model={workload.label!r} on "
                         f"{device}: its step fails in torch's selective checkpointing: {why}; allowed is another "
                         "policy") from None
    report, handle = fake.report, fake.handle
    peak, by_category, cuda = report.peak_bytes, dict(report.peak_by_category), {}
    if fake.device is not None:
        dm = fake.device
        by_category.update(workspaces=dm.workspace_bytes, rounding=dm.rounding_bytes,
                           fragmentation=dm.reserved_bytes - dm.allocated_bytes)
        peak = dm.allocated_bytes
        cuda = {"reserved_bytes": dm.reserved_bytes, "device_bytes": dm.device_bytes,
                "attention_backend": fake.attention_backend, "host_bytes": dm.host_bytes,
                "torch_version": torch_rules(torch_version).version, "worse_step": dm.worse_step,
                "alloc_conf": alloc_conf}
        if on_card is not None:
            cuda.update(card=on_card.name, margin_bytes=margin_left(on_card, dm.device_bytes), fit=dm.fit,
                        cache_flushes=dm.cache_flushes)
    prediction = Prediction(
        model=workload.label, batch_size=batch_size, seq_len=seq_len, policy=str(policy), dtype=dtype,
        loop=loop, n_blocks=handle.n_blocks, effective_density=handle.effective_density,
        peak_bytes=peak, peak_by_category=by_category,
        peak_phase=report.peak_phase, saved_activation_bytes=report.saved_activation_bytes or 0,
        predict_s=time.perf_counter() - t0, note=note,
        peak_in_blocks_by_category=dict(report.peak_in_blocks_by_category), peak_block=report.peak_block,
        recompute_count=fake.recompute_count, block_calls_in_backward=report.block_calls_in_backward,
        device=device, attention=attention, trace=fake.trace, **{**report.param_bytes, **cuda},
    )
    if kept_as is not None and not on_line(prediction.trace):   # a line's answer holds inside a batch search only
        answers.keep(kept_as, prediction)
    return prediction


def check_prediction(workload: Workload | str, batch_size: int, seq_len: int, policy: Policy, dtype: str = "fp32",
                     loop: Loop | str | None = None, device: str = "cpu", card: Optional[str | Card] = None,
                     attention: Optional[str] = None, *, torch_version: Optional[str] = None,
                     alloc_conf: Optional[str] = None) -> tuple[Workload, Policy, Loop]:
    """Check every input of `predict_policy` (ValueError naming the first bad one): (workload,
    policy, loop)."""
    workload = as_workload(workload)
    workload.check_shape(batch_size, seq_len)
    choice("dtype", dtype, list(DTYPES))
    loop = as_loop(loop)
    loop.check_dtype(dtype)
    check_device(device, card, attention, torch_version=torch_version, alloc_conf=alloc_conf)
    if not policy.predictable:
        raise ValueError(f"policy={policy} cannot be predicted: torch.compile's partitioner decides "
                         "what to save inside the compiled graph; measure it instead")
    return workload, policy, loop


def implied_device(device: Optional[str], card: Optional[str | Card] = None) -> str:
    """The device a prediction is for: as given, else "cuda" on a card, else "cpu"."""
    if device is not None:
        return device
    return "cuda" if card is not None else "cpu"


def check_device(device: str, card: Optional[str | Card] = None, attention: Optional[str] = None, *,
                 torch_version: Optional[str] = None, alloc_conf: Optional[str] = None) -> None:
    """Check what a prediction is for (ValueError naming the first bad one): a device of DEVICES,
    a card of `ckptlab.cards()`, an attention backend that the torch version has, a torch version
    modelled and an allocator option (`cuda_device.ALLOC_CONFS`), the last four only for "cuda"."""
    choice("device", device, DEVICES)
    check_torch_version(torch_version)
    parse_alloc_conf(alloc_conf)
    given = {"card": card, "attention": attention, "torch_version": torch_version, "alloc_conf": alloc_conf}
    if device != "cuda" and any(v is not None for v in given.values()):
        name, value = next((k, v) for k, v in given.items() if v is not None)
        raise ValueError(f"{name}={value!r} is invalid with device={device!r}: a card, an attention backend, a torch "
                         "version and an allocator option are CUDA's model (a CPU prediction runs the installed "
                         "torch); allowed is device='cuda'")
    if isinstance(card, str):
        find_card(card)
    if isinstance(card, Card) and card.arch is None:
        raise ValueError(f"card={card.name!r} is invalid: a size is not a card; allowed is a card of ckptlab.cards()")
    if attention is not None:
        choice("attention", attention, ATTENTION_BACKENDS)
        check_backend_available(attention, torch_rules(torch_version))


def llama7b_shape(**overrides) -> Workload:
    """A GPT with Llama-7B's shape (32 blocks, width 4096, 32 heads, vocab 32000, 4096 positions,
    no dropout): 6.7B parameters. A GELU MLP of 4h stands in for SwiGLU's 3 matrices of 11008.
    The preset `llama7b-shape`, so predictions and records name it as such."""
    return get_workload("llama7b-shape", **overrides)


def predict_fits(
    workload: Workload | str,
    policies: Sequence[str],
    capacities: Iterable[str | int | Card] = DEFAULT_CARDS,
    seq_len: int = 2048,
    batch_size: int = 1,
    dtype: str = "bf16",
    loop: Loop | str | None = None,
    max_batch: int = 1024,
    seq_lens: Optional[Sequence[int]] = None,
    device: str = "cpu",
    attention: Optional[str] = None,
    *,
    torch_version: Optional[str] = None,
    alloc_conf: Optional[str] = None,
    trace: str = "fast",
    workers: int = 1,
    progress: Optional[Callable[[int], None]] = None,
) -> list[dict]:
    """For each policy and capacity, by prediction: the largest batch size at `seq_len`, and the
    largest sequence length (of `seq_lens`, default powers of two up to the model's limit) at
    `batch_size`. The peak grows monotonically with batch and sequence, so each is found by
    steps away from a first guess then bisection (`_largest`); each step is one `predict`. 0 means not even the smallest fits;
    `max_batch` is the largest batch tried (`max_batch_searched` in each row), so an answer of that
    size means that or more.
    (`analysis.fits_from_run` answers the same question from a sweep's measured records.)

    A capacity is a card (`rtx4090`, see `ckptlab.cards()`; `core.cards.parse_capacity` changes
    its usable bytes, context or margin) or a size (24GiB). On a card the step is predicted for
    that card (CUDA, with `attention` as in `predict`) and fits when its device bytes plus the
    card's margin are at most its usable bytes. A size is compared with the peak on `device`
    "cpu", with the reserved bytes on "cuda". `batch_margin_bytes` / `seq_margin_bytes` are the
    bytes left at the largest batch / sequence (None where nothing fits); `basis` says what the
    row is predicted for, and the loop's columns (`core.loop.LOOP_COLUMNS`) what loop. `loop` is
    the training loop, and `torch_version` the torch release whose CUDA rules a card's prediction
    follows, and `alloc_conf` its allocator option, as `predict`'s. On a card,
    `max_batch_size_with_flushes` / `max_seq_len_with_flushes` are the largest that run at all
    (`fit` "yes" or "with cache flushes": the allocator releasing its cache and retrying each step).
    `trace` is the way to trace each step, as `predict`'s; on the fast path the batch searches
    step on the composed step's batch line once three batch sizes are traced, and trace their
    answers' bounds (`estimate.batch_line`); a step traced for one card is taken for the others
    that make the same kernel choices (`compose.composed_step`). `workers` > 1 predicts in that
    many processes, this one and `workers` - 1 spawned, each task a policy's rows on the cards
    that rank the attention backends alike (for a workload made from a spec, as its spec makes
    it; one made in Python, cast or given another loss since is predicted here), the spawned taking the longest first (the policies that recompute more
    blocks, then the larger cards) and this process the shortest (benchmarks/predict_speed.py
    times a 7B table both ways). `progress(n)`, if given, is called as rows are done, n at a time
    (a bar's update: the table has a row per policy and capacity).
    """
    workload = as_workload(workload)
    choice("trace", trace, TRACES)
    choice("dtype", dtype, list(DTYPES))
    loop = as_loop(loop)
    loop.check_dtype(dtype)
    check_torch_version(torch_version)
    parse_alloc_conf(alloc_conf)
    caps = [parse_capacity(c, "capacities") for c in capacities]
    choice("device", device, DEVICES)
    limit = workload.max_seq_len or 1 << 20
    seq_lens = sorted(set(seq_lens)) if seq_lens else [2**k for k in range(7, 21) if 2**k <= limit]
    for s in [seq_len, *seq_lens]:
        workload.check_shape(batch_size, s)
    integer("max_batch", max_batch, 1)
    integer("workers", workers, 1)
    options = dict(seq_len=seq_len, batch_size=batch_size, dtype=dtype, loop=loop, max_batch=max_batch,
                   seq_lens=seq_lens, device=device, attention=attention, torch_version=torch_version,
                   alloc_conf=alloc_conf, trace=trace)
    # A task: one policy on the capacities whose predictions are likely to share traces, in the
    # order asked: cards that rank the attention backends alike (most of their steps are traced
    # once for all of them: `compose.composed_step`), or all sizes.
    groups: dict = {}
    for cap in caps:
        groups.setdefault(priority(torch_rules(torch_version), cap.arch) if cap.arch else None, []).append(cap)
    tasks = [(pol, group) for pol in parse_policies(policies) for group in groups.values()]
    # Longest first, so that no worker is left with a long task at the end: a policy that
    # recomputes more blocks fits larger batches, whose searches step further, as do larger cards.
    tasks.sort(key=lambda task: (-_recomputed_share(task[0]), -max(c.usable_bytes for c in task[1])))
    made = (workload.spec, workload.seed, workload.overrides, workload.identity)
    # A worker makes the workload again from its spec: not one cast or given another loss since,
    # nor one whose loss only its object names (another process's object is another).
    in_workers = workers > 1 and workload.spec is not None and workload.weights_dtype is None and \
        workload.loss_pinned and \
        get_workload(workload.spec, seed=workload.seed, **workload.overrides).identity == workload.identity
    done = shared([(made, pol, group, options) for pol, group in tasks], workers if in_workers else 1,
                  lambda task: _fit_rows(workload, *task[1:3], **options), _fit_rows_of_spec,
                  (lambda rows: progress(len(rows))) if progress is not None else None)
    by_cap = {(str(pol), cap.name): row for (pol, _), rows in zip(tasks, done) for cap, row in rows}
    return [by_cap[(str(pol), cap.name)] for pol in parse_policies(policies) for cap in caps]


def _recomputed_share(policy: Policy) -> float:
    """The share of a model's blocks that `policy` recomputes, to order work by: on a plan's own
    length of blocks, else on 64 (nothing is built to count them: a model that reads tensor data
    while it is built would be built for real); 0 where it cannot say (a budget's plan is made later)."""
    try:
        return policy.effective_density(len(policy.value) if policy.kind == "plan" else 64)
    except ValueError:
        return 0.0


def _fit_rows_of_spec(task: tuple) -> list:
    """`_fit_rows` in a worker process, for the workload its spec makes (the caller's, checked)."""
    (spec, seed, overrides, identity), pol, caps, options = task
    workload = get_workload(spec, seed=seed, **overrides)
    if workload.identity != identity:
        raise RuntimeError(f"model={spec!r} made again in a worker process differs from the caller's")
    return _fit_rows(workload, pol, caps, **options)


def _fit_rows(workload: Workload, pol: Policy, caps: list[Card], *, seq_len: int, batch_size: int, dtype: str,
              loop: Loop, max_batch: int, seq_lens: list[int], device: str, attention: Optional[str],
              torch_version: Optional[str], alloc_conf: Optional[str], trace: str) -> list[tuple[Card, dict]]:
    """predict_fits' rows of one policy on `caps`: [(capacity, row)]."""
    rows = []
    cache: dict[tuple, Prediction] = {}

    def cached(key: tuple, make) -> Prediction:
        """The prediction for key; one made from a batch line is made again, traced, outside a
        batch search."""
        found = cache.get(key)
        if found is None or (on_line(found.trace) and not lines_enabled()):
            cache[key] = found = make()
        return found

    def predicted(b: int, s: int, cap: Card) -> Prediction:
        """The prediction for cap. Cards that run the same kernels (arch, SMs, workspace) share
        one, except for the answer "with cache flushes", which is the card's own limit's."""
        cuda = cap.arch is not None or device == "cuda"
        return cached((b, s, (cap.arch, cap.sm_count, cap.cublas_workspace_bytes) if cap.arch else None),
                      lambda: predict_policy(workload, b, s, pol, dtype=dtype, loop=loop,
                                             device="cuda" if cuda else "cpu", card=cap if cap.arch else None,
                                             attention=attention if cuda else None,
                                             torch_version=torch_version if cuda else None,
                                             alloc_conf=alloc_conf if cuda else None, trace=trace))

    def held(b: int, s: int, cap: Card) -> int:
        """What `fits` compares for cap: on a card its device bytes, reserved + its context."""
        p = predicted(b, s, cap)
        return p.reserved_bytes + cap.context_bytes if cap.arch else p.peak_bytes if device == "cpu" else p.reserved_bytes

    def runs(b: int, s: int, cap: Card) -> bool:
        """On a card: the answer is not "no" (it fits, or runs with cache flushes)."""
        if fits(cap, held(b, s, cap)):
            return True
        p = predicted(b, s, cap)
        if p.card != cap.name or p.card is None:
            p = cached((b, s, cap.name), lambda: predict_policy(
                workload, b, s, pol, dtype=dtype, loop=loop, device="cuda", card=cap, attention=attention,
                torch_version=torch_version, alloc_conf=alloc_conf, trace=trace))
        return p.fit != "no"

    def largest_batch(holds, guess) -> int:
        """`_largest` batch size with holds(b), from guess(): searched on the step's batch lines
        (`estimate.batch_line`), then its answer's bounds (it holds, the next does not) traced;
        where a traced bound disagrees, searched again traced."""
        with batch_lines():
            best = _largest(holds, max_batch, guess())
        if (best == 0 or holds(best)) and (best == max_batch or not holds(best + 1)):
            return best
        return _largest(holds, max_batch, guess())

    for cap in caps:
        best_batch = largest_batch(lambda b, cap=cap: fits(cap, held(b, seq_len, cap)),
                                   lambda cap=cap: _linear_guess(lambda b: held(b, seq_len, cap), cap, max_batch))
        # where the sequence search starts: the tokens of the largest batch at seq_len, or
        # when not even batch 1 fits there, the sequence below it
        best_seq = _largest_of(lambda s, cap=cap: fits(cap, held(batch_size, s, cap)), seq_lens,
                               seq_len * best_batch // batch_size if best_batch else seq_len - 1)
        on_device = "cuda" if cap.arch else device
        flushed = {}
        if cap.arch:
            # the allocated peak is what the allocator needs with its cache released: its line
            # through batch 1 and 2 says where the flushes stop helping
            def allocated_guess(cap=cap, best_batch=best_batch) -> int:
                allocated = _linear_guess(lambda b: predicted(b, seq_len, cap).peak_bytes + cap.context_bytes,
                                          cap, max_batch)
                return max(best_batch, allocated)
            flushed = {"max_batch_size_with_flushes": largest_batch(lambda b, cap=cap: runs(b, seq_len, cap),
                                                                    allocated_guess),
                       "max_seq_len_with_flushes": _largest_of(lambda s, cap=cap: runs(batch_size, s, cap),
                                                               seq_lens, best_seq)}
        rows.append((cap, {
            "model": workload.label, "policy": str(pol), "capacity": cap.name, "capacity_bytes": cap.usable_bytes,
            "dtype": dtype, "seq_len": seq_len, "max_batch_size": best_batch, "max_batch_searched": max_batch,
            "batch_size": batch_size,
            "max_seq_len": best_seq,
            "batch_margin_bytes": margin_left(cap, held(best_batch, seq_len, cap)) if best_batch else None,
            "seq_margin_bytes": margin_left(cap, held(batch_size, best_seq, cap)) if best_seq else None,
            "max_batch_size_with_flushes": None, "max_seq_len_with_flushes": None, **flushed,
            "device": on_device, "required_margin_bytes": cap.required_margin_bytes,
            **loop.record(),
            "torch_version": torch_rules(torch_version).version if on_device == "cuda" else None,
            "alloc_conf": alloc_conf if on_device == "cuda" else None,
            "basis": cap.basis if cap.arch or device == "cpu" else f"predicted for {device}"}))
    return rows


def _linear_guess(held, capacity: Card, upper: int) -> int:
    """Where the batch search starts: the batch at which the bytes held reach the capacity, on the
    line through batch 1 and 2, then once more on the line through batch 1 and that first guess
    (the allocator's rounding makes the bytes grow a little faster than the first line says).
    Only a starting point: `_largest` verifies it."""
    one = held(1)
    left = margin_left(capacity, one)   # bytes to spare before `fits` fails
    if upper < 2 or left < 0:
        return 1
    guess, at = 1, 2
    for _ in range(2):
        per_batch = (held(at) - one) / (at - 1)
        if per_batch <= 0:
            return upper
        guess = max(1, min(upper, 1 + int(left // per_batch)))
        if guess <= 2 or guess == at:
            break
        at = guess
    return guess


def _largest_of(fits, values: Sequence[int], guess: int) -> int:
    """Largest of `values` (ascending) with fits(value), for a monotone predicate (0 if none),
    searched as `_largest` searches, from the largest value at most `guess`."""
    start = sum(1 for v in values if v <= guess)
    at = _largest(lambda i: fits(values[i - 1]), len(values), start) if values else 0
    return values[at - 1] if at else 0


def _largest(fits, upper: int, guess: int = 1) -> int:
    """Largest x in 1..upper with fits(x), for a monotone predicate (0 if none): from `guess`,
    steps of 1, 2, 4, ... away from it until the answer is bracketed, then bisection. A guess
    close to the answer costs a few evaluations; a guess of 1 is the plain doubling search. A
    guess that fits says that 1 fits too, so fits(1) is asked only when it does not."""
    guess = min(max(guess, 1), upper)
    step = 1
    if fits(guess):
        lo = guess
        while lo + step <= upper and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, upper + 1)  # fits(lo), not fits(hi) (or hi beyond the range)
    elif guess == 1 or not fits(1):
        return 0
    else:
        hi = guess
        while hi - step > 1 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def prediction_error(predicted: int, measured: int) -> float:
    """Relative error of a prediction: predicted / measured - 1."""
    return predicted / measured - 1 if measured else math.nan


__all__ = ["TRACES", "check_device", "check_prediction", "implied_device", "llama7b_shape", "predict_fits", "predict_policy",
           "prediction_error"]
