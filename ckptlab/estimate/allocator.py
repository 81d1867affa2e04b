"""A replay of PyTorch's CUDA caching allocator: what a step's allocations reserve on a GPU.

A fake step knows every tensor's bytes and when it is freed; a GPU holds more than that. The
caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.x, default settings) rounds each
request, serves it from a cached free block when one fits, and otherwise asks the driver for a
new segment, which it keeps until `empty_cache()`. `replay_allocations` runs a step's trace of
allocations and frees through the same rules and reports the three numbers torch would:
`max_memory_allocated` (rounded block sizes), `max_memory_reserved` (segments held) and the
requested-bytes peak (raw sizes).

The rules, with the names of the .cpp:
- round_size: a request is rounded up to a multiple of 512 B (kMinBlockSize), at least 512 B.
- get_pool: rounded sizes up to 1 MiB (kSmallSize) use the small pool, larger ones the large pool;
  a block of one pool never serves the other.
- get_allocation_size: a new segment is 2 MiB (kSmallBuffer) for the small pool, 20 MiB
  (kLargeBuffer) for a request under 10 MiB (kMinLargeAlloc), else the request rounded up to
  2 MiB (kRoundLarge).
- get_free_block: best fit, the smallest cached free block at least the size; among equal sizes
  the lowest address (BlockComparatorSize).
- should_split: the rest of the block becomes a free block if it is at least 512 B (small pool)
  or more than 1 MiB (large pool); otherwise the whole block is handed out and counted allocated.
- free_block / try_merge_blocks: a freed block merges with its free neighbours of the same segment.
- Segments are never released during a step: the replay has no `empty_cache()` and no memory
  limit, so it never takes the allocator's free-the-cache-and-retry path. It says what a step
  reserves when it fits; under memory pressure the real allocator would release cached segments
  and retry before it ran out of memory.

Not modelled: one stream only (no cross-stream `record_stream` delays), default settings
(`max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold` unset), no
CUDA graph pools. Segment addresses are unknown on a CPU; new segments are placed at increasing
addresses, so best fit breaks ties towards the oldest segment.

`expandable_segments=True` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), as modelled here:
each pool owns one segment that grows by mapping pages, 2 MiB for the small pool and 20 MiB for
the large pool (ExpandableSegment's segment_size). A request that no free block fits extends
the free block at the segment's end (if any) by as many whole pages as it lacks
(try_allocate_expandable_block). Best fit is the same, except that it prefers a fitting block
not at the segment's end over the one that is (get_free_block's expandable_size). Splitting
keeps any rest of at least 512 B in both pools, and freed blocks merge across what would have
been separate segments. Reserved is the pages mapped; `segments` counts the pools in use.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Iterable

MiB = 2**20
MIN_BLOCK_BYTES = 512                  # kMinBlockSize: every size is rounded to a multiple of it
SMALL_REQUEST_BYTES = 1 * MiB          # kSmallSize: largest "small" allocation
SMALL_SEGMENT_BYTES = 2 * MiB          # kSmallBuffer: small allocations are packed in 2 MiB segments
LARGE_SEGMENT_BYTES = 20 * MiB         # kLargeBuffer: requests under 10 MiB share 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * MiB       # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MiB            # kRoundLarge: larger requests get their size rounded to 2 MiB
EXPANDABLE_PAGE_BYTES = {True: SMALL_SEGMENT_BYTES, False: LARGE_SEGMENT_BYTES}  # per pool (small?)


@dataclass(frozen=True)
class AllocEvent:
    """One event of a step's trace, in order: "alloc" or "free" of the allocation `key` (a free
    names the key of its alloc and repeats its requested bytes)."""
    action: str
    key: int
    size_bytes: int


@dataclass(frozen=True)
class AllocatorReplay:
    """What the caching allocator would report for the trace, peaks since the step began."""
    peak_allocated_bytes: int               # torch.cuda.max_memory_allocated: rounded block sizes
    peak_reserved_bytes: int                # torch.cuda.max_memory_reserved: segments held
    peak_requested_bytes: int               # memory_stats()["requested_bytes.all.peak"]: raw sizes
    segments: int                           # segments held at the end
    reserved_at_peak_allocated_bytes: int   # reserved when allocated peaked
    fragmentation_bytes: int                # peak reserved minus peak allocated
    end_allocated_bytes: int
    end_reserved_bytes: int
    segment_allocs: int                     # cudaMalloc calls (or page mappings) during the step
    expandable_segments: bool


def round_size(size_bytes: int) -> int:
    """round_size: the block size a request is given, a multiple of 512 B and at least 512 B."""
    return max(MIN_BLOCK_BYTES, -(-size_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(rounded_bytes: int) -> int:
    """get_allocation_size: the bytes of the new segment a block of this size would open."""
    if rounded_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-rounded_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Block:
    """A run of bytes inside one segment, linked to its neighbours there (prev, next)."""
    __slots__ = ("addr", "size", "allocated", "prev", "next", "requested")

    def __init__(self, addr: int, size: int, prev=None, next=None):
        self.addr, self.size, self.allocated, self.prev, self.next, self.requested = addr, size, False, prev, next, 0


class _Allocator:
    """The allocator's state on one stream: its pools of free blocks, the live blocks, the counters."""

    def __init__(self, expandable: bool):
        self.expandable = expandable
        self.free = {True: [], False: []}     # per pool (small?): sorted (size, addr) of free blocks
        self.blocks = {}                      # (small?, addr) -> free block, to find it from its key
        self.live = {}                        # allocation key -> allocated block, its pool
        self.tail = {True: None, False: None}  # expandable: the last mapped block of each pool's segment
        self.next_addr = 0
        self.allocated = self.reserved = self.requested = 0
        self.segments = self.segment_allocs = 0
        self.reset_peaks()

    def reset_peaks(self):
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested
        self.reserved_at_peak_allocated = self.reserved
        self.segment_allocs = 0

    def _take(self, small: bool, block: _Block):
        free = self.free[small]
        del free[bisect_left(free, (block.size, block.addr))]
        del self.blocks[(small, block.addr)]

    def _put(self, small: bool, block: _Block):
        insort(self.free[small], (block.size, block.addr))
        self.blocks[(small, block.addr)] = block

    def _best_fit(self, small: bool, size: int):
        free = self.free[small]
        i = bisect_left(free, (size, -1))
        if i == len(free):
            return None
        block = self.blocks[(small, free[i][1])]
        if self.expandable and block is self.tail[small] and i + 1 < len(free):
            block = self.blocks[(small, free[i + 1][1])]  # the block at the end can grow: keep it
        self._take(small, block)
        return block

    def _new_segment(self, small: bool, size: int) -> _Block:
        self.segment_allocs += 1
        if not self.expandable:
            grow = segment_size(size)
            block = _Block(self.next_addr, grow)
            self.next_addr += grow
            self.segments += 1
            self.reserved += grow
            return block
        page = EXPANDABLE_PAGE_BYTES[small]
        last = self.tail[small]
        if last is None:
            self.segments += 1
        extend = last if last is not None and not last.allocated else None
        missing = size - (extend.size if extend else 0)
        grow = -(-missing // page) * page
        self.reserved += grow
        if extend:
            self._take(small, extend)
            extend.size += grow
            return extend
        start = last.addr + last.size if last else (1 << 62 if small else 1 << 61)  # away from other segments
        block = _Block(start, grow, prev=last)
        if last:
            last.next = block
        self.tail[small] = block
        return block

    def malloc(self, key: int, requested: int):
        size = round_size(requested)
        small = size <= SMALL_REQUEST_BYTES
        block = self._best_fit(small, size) or self._new_segment(small, size)
        rest = block.size - size
        should_split = rest >= MIN_BLOCK_BYTES if small or self.expandable else rest > SMALL_REQUEST_BYTES
        if should_split:
            remaining = _Block(block.addr + size, rest, prev=block, next=block.next)
            if block.next:
                block.next.prev = remaining
            block.next, block.size = remaining, size
            if self.tail[small] is block:
                self.tail[small] = remaining
            self._put(small, remaining)
        block.allocated, block.requested = True, requested
        self.live[key] = (block, small)
        self.allocated += block.size
        self.requested += requested
        if self.allocated > self.peak_allocated:
            self.peak_allocated, self.reserved_at_peak_allocated = self.allocated, self.reserved
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_requested = max(self.peak_requested, self.requested)

    def release(self, key: int):
        block, small = self.live.pop(key)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._take(small, neighbour)
                if neighbour is block.prev:
                    block.addr, block.prev = neighbour.addr, neighbour.prev
                    if block.prev:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next:
                        block.next.prev = block
                block.size += neighbour.size
                if self.tail[small] is neighbour:
                    self.tail[small] = block
        self._put(small, block)


def replay_allocations(events: Iterable[AllocEvent], expandable_segments: bool = False,
                       initial_events: Iterable[AllocEvent] = ()) -> AllocatorReplay:
    """Replay a step's allocations and frees through the caching allocator's rules.

    `initial_events` are replayed first (what is already on the device when the step starts, and
    the cache a previous step left); the peaks are then reset, as `torch.cuda.reset_peak_memory_stats()`
    does, so they are the step's own. Zero-byte allocations never reach the allocator. ValueError
    for an action other than "alloc"/"free", a negative size, a key allocated twice, or a free of a
    key that is not allocated (or with other bytes than its alloc)."""
    state = _Allocator(bool(expandable_segments))
    zero_sized: set[int] = set()
    for trace in (initial_events, None, events):
        if trace is None:
            state.reset_peaks()
            continue
        for event in trace:
            _replay_one(state, event, zero_sized)
    return AllocatorReplay(
        peak_allocated_bytes=state.peak_allocated, peak_reserved_bytes=state.peak_reserved,
        peak_requested_bytes=state.peak_requested, segments=state.segments,
        reserved_at_peak_allocated_bytes=state.reserved_at_peak_allocated,
        fragmentation_bytes=state.peak_reserved - state.peak_allocated,
        end_allocated_bytes=state.allocated, end_reserved_bytes=state.reserved,
        segment_allocs=state.segment_allocs, expandable_segments=state.expandable)


def _replay_one(state: _Allocator, event: AllocEvent, zero_sized: set[int]):
    action, key, size = event.action, event.key, event.size_bytes
    if size < 0:
        raise ValueError(f"size_bytes={size} of {event} is invalid: allowed is a size of 0 bytes or more")
    if action == "alloc":
        if key in state.live or key in zero_sized:
            raise ValueError(f"key={key} is invalid in {event}: allowed is a key that is not allocated")
        if size == 0:
            zero_sized.add(key)
        else:
            state.malloc(key, size)
    elif action == "free":
        if key in zero_sized and size == 0:
            zero_sized.discard(key)
        elif key in state.live and state.live[key][0].requested == size:
            state.release(key)
        else:
            raise ValueError(f"key={key} is invalid in {event}: allowed is the key of a live allocation, "
                             "with the bytes of its alloc")
    else:
        raise ValueError(f"action={action!r} is invalid in {event}: allowed are 'alloc', 'free'")


__all__ = ["AllocEvent", "AllocatorReplay", "replay_allocations", "round_size", "segment_size"]
