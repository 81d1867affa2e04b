"""A composed step's events as a line in the batch size, for searches over batch sizes.

At one sequence length, a step at batch size b >= 2 runs the same operations in the same order at
every b; only the bytes of its tensors change, and each tensor's bytes are a product of its
dimensions, of which the batch is at most one: bytes = c0 + c1 * b. So the composed events
(`compose`) of two traced batch sizes give every field that differs between them as a line, and
the events at any other batch size follow, to the byte, without tracing it. The allocator replay,
the counts and the report then run on those events as on traced ones.

A line is used only once a third traced batch size lands on it (every field of every event
equal to the line's). A tensor whose bytes grow faster than the batch (b x b, say: every
product of dimensions with nonnegative coefficients is convex in b) misses the line at any third
point, and the line is dropped. What three points cannot rule out is a choice that jumps at some
batch size: of the CUDA rules modelled, flash attention's split of the keys (without dropout)
and the memory-efficient backward's read it, and are settled from a batch size that the step
records (`CudaSemantics.settled_from_batch`): a line starts there. A search that uses lines still traces its answer's bounds
(`predict.predict_fits`).

Lines are used only inside `batch_lines()`; outside it every prediction is traced.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

MIN_TRACED = 3   # batch sizes traced on a line before it stands in for a trace
SMALLEST_BATCH = 2   # at batch 1 a tensor's batch dimension has no stride that matters: some copies
                     # (`contiguous`, `reshape`) of larger batches are views there, off the line
ON_LINE = "composed, on its batch line"   # how a prediction's `trace` begins when its line made it

_enabled = False


def on_line(trace: str) -> bool:
    """Whether a prediction with this `trace` was made from its batch line, not traced."""
    return trace.startswith(ON_LINE)


def lines_enabled() -> bool:
    """Whether predictions may come from batch lines here (inside `batch_lines()`)."""
    return _enabled


@contextlib.contextmanager
def batch_lines():
    """Within: a composed prediction at a batch size may come from its line (module docstring)."""
    global _enabled
    before, _enabled = _enabled, True
    try:
        yield
    finally:
        _enabled = before


@dataclass
class ComposedStep:
    """What a composed prediction is made from, besides the card: the events and what the step
    that made them knew (`compose.composed_memory`)."""

    events: list[tuple]
    param_bytes: dict
    recompute_count: int
    workspaces: list[int]            # the cuBLAS workspaces the step used (CUDA)
    loop_order: object               # `cuda_device.LoopOrder` of the events (CUDA), else None
    attention_backend: Optional[str]
    settled_from_batch: int = 1      # the batch size from which the kernels' choices stay (`CudaSemantics`)

    def same_but_events(self, other: "ComposedStep") -> bool:
        return self.known() == other.known()

    def known(self) -> tuple:
        """Everything but the events, in the order of the fields."""
        return (self.param_bytes, self.recompute_count, self.workspaces, self.loop_order, self.attention_backend,
                self.settled_from_batch)


@dataclass
class BatchLine:
    """The composed steps traced at one sequence length and set of kernels: the first two by
    batch size (the line), and the batch sizes traced since, each found on it."""

    traced: dict[int, ComposedStep] = field(default_factory=dict)
    on_line: list[int] = field(default_factory=list)
    broken: bool = False   # a traced step left the line: never extrapolated

    def add(self, batch_size: int, step: ComposedStep) -> None:
        """A traced step at `batch_size` (only within `batch_lines()`: lines are for searches)."""
        if (not _enabled or self.broken or batch_size < max(SMALLEST_BATCH, step.settled_from_batch)
                or batch_size in self.traced or batch_size in self.on_line):
            return
        if self.traced and not next(iter(self.traced.values())).same_but_events(step):
            self.broken = True
        elif len(self.traced) < 2:
            self.traced[batch_size] = step
        elif self._at(batch_size) == step.events:
            self.on_line.append(batch_size)
        else:
            self.broken = True

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes traced on the line."""
        return sorted([*self.traced, *self.on_line])

    def step_at(self, batch_size: int) -> Optional[ComposedStep]:
        """The step at `batch_size` from the line, where a line with MIN_TRACED points holds and
        gives whole bytes there; else None."""
        if not _enabled or self.broken or len(self.traced) + len(self.on_line) < MIN_TRACED:
            return None
        first = next(iter(self.traced.values()))
        if batch_size < max(SMALLEST_BATCH, first.settled_from_batch):
            return None
        events = self._at(batch_size)
        if events is None:
            return None
        return ComposedStep(events, *first.known())

    def _at(self, batch_size: int) -> Optional[list[tuple]]:
        """The events at `batch_size` on the line through the first two traced steps: a field that
        differs between them is c0 + c1 * b; None where the two differ otherwise (in their
        length, an event's kind, a field that is not an integer) or a field is not whole there or
        changes its sign (a size, or a release's negative size, cannot)."""
        (b1, one), (b2, two) = list(self.traced.items())[:2]
        if len(one.events) != len(two.events):
            return None
        span, offset = b2 - b1, batch_size - b1
        out = []
        for e1, e2 in zip(one.events, two.events):
            if e1 == e2:
                out.append(e1)
                continue
            if len(e1) != len(e2):
                return None
            fields = []
            for f1, f2 in zip(e1, e2):
                if f1 == f2:
                    fields.append(f1)
                elif type(f1) is int and type(f2) is int:
                    whole, rest = divmod(f1 * span + offset * (f2 - f1), span)
                    if rest or (whole > 0) != (f1 > 0) or (whole < 0) != (f1 < 0):   # bytes keep their sign
                        return None
                    fields.append(whole)
                else:
                    return None
            out.append(tuple(fields))
        return out
