"""A replay of PyTorch's CUDA caching allocator: what a step's allocations reserve on a GPU.

A fake step knows every tensor's bytes and when it is freed; a GPU holds more than that. The
caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.x, default settings) rounds each
request, serves it from a cached free block when one fits, and otherwise asks the driver for a
new segment, which it keeps until `empty_cache()`. `replay_allocations` runs a step's trace of
allocations and frees through the same rules and reports the three numbers torch would:
`max_memory_allocated` (rounded block sizes), `max_memory_reserved` (segments held) and the
requested-bytes peak (raw sizes).

The rules, with the names and lines of the .cpp at v2.6.0 (constants at :51, :121-128):
- round_size (:2063): a request is rounded up to a multiple of 512 B (kMinBlockSize), at least 512 B.
- get_pool (:2507): rounded sizes up to 1 MiB (kSmallSize) use the small pool, larger ones the
  large pool; a block of one pool never serves the other.
- get_allocation_size (:2550): a new segment is 2 MiB (kSmallBuffer) for the small pool, 20 MiB
  (kLargeBuffer) for a request under 10 MiB (kMinLargeAlloc), else the request rounded up to
  2 MiB (kRoundLarge).
- get_free_block (:2560): best fit, the smallest cached free block at least the size; among equal
  sizes the lowest address (BlockComparatorSize, :723).
- should_split (:2540): the rest of the block becomes a free block if it is at least 512 B (small
  pool) or more than 1 MiB (large pool); otherwise the whole block is handed out and counted allocated.
- free_block (:2397) / try_merge_blocks (:2474): a freed block merges with its free neighbours of
  the same segment.
- Without a limit, segments are never released during a step: the replay has no `empty_cache()`.
  With `limit_bytes` (what the allocator may reserve on a card) it takes malloc's path under
  memory pressure (`DeviceCachingAllocator::malloc`, :1234-1242, the `block_found = alloc_block(...) ||
  (release_available_cached_blocks(...) && alloc_block(...)) || (release_cached_blocks(...) &&
  alloc_block(..., true, ...))` chain): a new segment that would pass the limit fails;
  `release_available_cached_blocks` (:2811-2815) returns false at once with the default
  max_split_size (its first test); `release_cached_blocks` (:2859) -> `release_blocks` (:3045-3068)
  frees every wholly free segment of both pools (a free block with no prev and no next:
  `release_block`, :2923); the allocation is tried once more (a "cache flush", `num_alloc_retries`,
  :2705), and if that fails too the step runs out of
  memory. The retry does not search the cached blocks again, as malloc does not.

Not modelled: one stream only (no cross-stream `record_stream` delays), default settings
(`max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold` unset), no
CUDA graph pools. Segment addresses are unknown on a CPU; new segments are placed at increasing
addresses, so best fit breaks ties towards the oldest segment.

`expandable_segments=True` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), as modelled here:
each pool owns one segment (one stream) whose address space is reserved once and backed by pages
as needed: 2 MiB pages for the small pool, 20 MiB for the large pool (`find_expandable_block`,
:2239: `segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer`, :2272). When no free block
fits, the allocator maps pages at the lowest address where free and unmapped space together fit
the request (`find_expandable_block`, `try_allocate_expandable_block` :2363, `map_block` :2295:
the range is rounded out to whole pages, `ExpandableSegment::map`). Best fit is the same, except that a
block followed by unmapped space counts as its size plus that space, and the search moves on to
the next larger block while that one's such size is smaller (`get_free_block`'s
`expandable_size`, :2580-2589). Splitting keeps any rest of at least 512 B in both pools
(`should_split`, :2542-2543).
Blocks merge only with neighbours of the same mapped state (`try_merge_blocks`). Under a limit,
`release_cached_blocks` unmaps every whole page inside a free block (`release_blocks` ->
`unmap_block` :2974 -> `ExpandableSegment::unmap`), and the segment goes once nothing of it is
mapped (`release_expandable_segment`, :2907). Reserved is the pages mapped; `segments` counts the pools in use.
The segment's address space (1 1/8 of the card's memory) is taken as unbounded.

Source: c10/cuda/CUDACachingAllocator.cpp at v2.6.0 (its release tarball), by function and line;
the rules were first read at pytorch/pytorch commit 001074d25084, a snapshot of main newer than
v2.9, and are the same in both. No difference between torch versions is modelled here.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, replace
from typing import Iterable, NamedTuple

MiB = 2**20
MIN_BLOCK_BYTES = 512                  # kMinBlockSize: every size is rounded to a multiple of it
SMALL_REQUEST_BYTES = 1 * MiB          # kSmallSize: largest "small" allocation
SMALL_SEGMENT_BYTES = 2 * MiB          # kSmallBuffer: small allocations are packed in 2 MiB segments
LARGE_SEGMENT_BYTES = 20 * MiB         # kLargeBuffer: requests under 10 MiB share 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * MiB       # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MiB            # kRoundLarge: larger requests get their size rounded to 2 MiB
EXPANDABLE_PAGE_BYTES = {True: SMALL_SEGMENT_BYTES, False: LARGE_SEGMENT_BYTES}  # per pool (small?)


class AllocEvent(NamedTuple):
    """One event of a step's trace, in order: "alloc" or "free" of the allocation `key` (a free
    names the key of its alloc and repeats its requested bytes). A tuple: a step's trace holds
    tens of thousands."""
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
    limit_bytes: int | None = None          # what the allocator could reserve (None: no limit)
    cache_flushes: int = 0                  # release_cached_blocks + retry during the step (num_alloc_retries)
    out_of_memory: bool = False             # the retry failed too: the step stops there (peaks so far)


class OutOfMemory(Exception):
    """malloc's last retry failed: torch.cuda.OutOfMemoryError."""


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


UNBOUNDED = 1 << 60     # an expandable segment's address space beyond its last mapped page


class _Block:
    """A run of bytes inside one segment, linked to its neighbours there (prev, next); `mapped`
    is False only for an expandable segment's address space without pages."""
    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "requested")

    def __init__(self, addr: int, size: int, prev=None, next=None, mapped: bool = True):
        self.addr, self.size, self.prev, self.next, self.mapped = addr, size, prev, next, mapped
        self.allocated, self.requested = False, 0

    def splice_after(self, size: int, mapped: bool) -> "_Block":
        """Cut this block at `size`: the rest becomes a new block after it, returned."""
        rest = _Block(self.addr + size, self.size - size, prev=self, next=self.next, mapped=mapped)
        if self.next:
            self.next.prev = rest
        self.next, self.size = rest, size
        return rest


class _Allocator:
    """The allocator's state on one stream: its pools of free blocks, the live blocks, the counters."""

    def __init__(self, expandable: bool, limit: int | None):
        self.expandable, self.limit = expandable, limit
        self.free = {True: [], False: []}     # per pool (small?): sorted (size, addr) of free mapped blocks
        self.blocks = {}                      # (small?, addr) -> free block, to find it from its key
        self.live = {}                        # allocation key -> allocated block, its pool
        self.base = {True: None, False: None}  # expandable: each pool's segment's first block
        self.next_addr = 0
        self.allocated = self.reserved = self.requested = 0
        self.segments = 0
        self.reset_peaks()

    def reset_peaks(self):
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested
        self.reserved_at_peak_allocated = self.reserved
        self.segment_allocs = self.flushes = 0

    def _take(self, small: bool, block: _Block):
        free = self.free[small]
        del free[bisect_left(free, (block.size, block.addr))]
        del self.blocks[(small, block.addr)]

    def _put(self, small: bool, block: _Block):
        insort(self.free[small], (block.size, block.addr))
        self.blocks[(small, block.addr)] = block

    def _reserve(self, nbytes: int) -> bool:
        """cudaMalloc / cuMemCreate of nbytes: False when the limit would be passed."""
        if self.limit is not None and self.reserved + nbytes > self.limit:
            return False
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segment_allocs += 1
        return True

    def _best_fit(self, small: bool, size: int):
        """get_free_block: the smallest free block that fits; expandable: moving on to the next
        larger one while its expandable_size is smaller."""
        free = self.free[small]
        i = bisect_left(free, (size, -1))
        if i == len(free):
            return None
        if self.expandable:
            def expandable_size(j):
                b = self.blocks[(small, free[j][1])]
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(free) and expandable_size(i + 1) < expandable_size(i):
                i += 1
        block = self.blocks[(small, free[i][1])]
        self._take(small, block)
        return block

    def _merge(self, small: bool, block: _Block) -> _Block:
        """try_merge_blocks with both neighbours: free ones of the same mapped state join `block`
        (free mapped neighbours leave the free list; `block` is not in it)."""
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
                continue
            if neighbour.mapped:
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
            if self.base[small] is neighbour:
                self.base[small] = block
        return block

    def _new_segment(self, small: bool, size: int):
        """alloc_block: a new segment (or, expandable, newly mapped pages) holding a free block of
        at least `size`; None when the limit is reached."""
        if self.expandable:
            return self._map_expandable(small, size)
        grow = segment_size(size)
        if not self._reserve(grow):
            return None
        block = _Block(self.next_addr, grow)
        self.next_addr += grow
        self.segments += 1
        return block

    def _map_expandable(self, small: bool, size: int):
        """find_expandable_block + try_allocate_expandable_block: the lowest address where free and
        unmapped space together fit `size`, its unmapped part mapped in whole pages."""
        if self.base[small] is None:      # a new segment: all address space, nothing mapped
            self.base[small] = _Block(1 << 62 if small else 1 << 61, UNBOUNDED, mapped=False)
            self.segments += 1

        def allocatable(b):
            return b is not None and not b.allocated

        candidate, b = None, self.base[small]
        while candidate is None:
            if not b.mapped:
                start = b.prev if allocatable(b.prev) else b
                room, run = 0, start
                while room < size and allocatable(run):
                    room, run = room + run.size, run.next
                if room >= size:
                    candidate = start
            b = b.next
        if not candidate.mapped:     # else a free block before unmapped space: mapping next merges it
            candidate = self._map(small, candidate, min(candidate.size, size))
            if candidate is None:
                return None
        while candidate.size < size:
            candidate = self._map(small, candidate.next, min(size - candidate.size, candidate.next.size))
            if candidate is None:
                return None
        return candidate

    def _map(self, small: bool, block: _Block, size: int):
        """map_block: pages for the first `size` bytes of an unmapped block, merged with its free
        mapped neighbours; returned out of the free list (None when the limit is reached)."""
        page = EXPANDABLE_PAGE_BYTES[small]
        grow = -(-size // page) * page
        if not self._reserve(grow):
            return None
        if grow < block.size:
            block.splice_after(grow, mapped=False)
        block.mapped = True
        return self._merge(small, block)

    def _flush(self):
        """release_cached_blocks -> release_blocks on both pools: free the wholly free segments;
        expandable, unmap every whole page inside a free block."""
        self.flushes += 1
        for small in (True, False):
            for _, addr in list(self.free[small]):
                block = self.blocks[(small, addr)]
                if not self.expandable:
                    if block.prev is None and block.next is None:
                        self._take(small, block)
                        self.reserved -= block.size
                        self.segments -= 1
                else:
                    self._unmap(small, block)

    def _unmap(self, small: bool, block: _Block):
        """unmap_block: the pages wholly inside the free block go; the bytes before and after them
        stay free blocks."""
        page, base = EXPANDABLE_PAGE_BYTES[small], self.base[small].addr
        offset = block.addr - base
        begin = -(-offset // page) * page
        end = (offset + block.size) // page * page
        if begin >= end:
            return
        self._take(small, block)
        if begin > offset:                                   # before_free
            before, block = block, block.splice_after(begin - offset, mapped=True)
            self._put(small, before)
        if begin + block.size > end:                         # after_free
            self._put(small, block.splice_after(end - begin, mapped=True))
        block.mapped = False
        self.reserved -= block.size
        block = self._merge(small, block)
        if block.prev is None and block.next is None:       # release_expandable_segment
            self.base[small] = None
            self.segments -= 1

    def malloc(self, key: int, requested: int):
        """DeviceCachingAllocator::malloc: best fit, else a new segment, else (under a limit) the
        cache flush and one retry, else OutOfMemory."""
        size = round_size(requested)
        small = size <= SMALL_REQUEST_BYTES
        block = self._best_fit(small, size) or self._new_segment(small, size)
        if block is None:
            self._flush()
            block = self._new_segment(small, size)
            if block is None:
                raise OutOfMemory(f"{requested} B with {self.reserved} B reserved of {self.limit} B")
        rest = block.size - size
        should_split = rest >= MIN_BLOCK_BYTES if small or self.expandable else rest > SMALL_REQUEST_BYTES
        if should_split:
            self._put(small, block.splice_after(size, mapped=True))
        block.allocated, block.requested = True, requested
        self.live[key] = (block, small)
        self.allocated += block.size
        self.requested += requested
        if self.allocated > self.peak_allocated:
            self.peak_allocated, self.reserved_at_peak_allocated = self.allocated, self.reserved
        self.peak_requested = max(self.peak_requested, self.requested)

    def release(self, key: int):
        """free_block: back to the pool, merged with free neighbours."""
        block, small = self.live.pop(key)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        self._put(small, self._merge(small, block))

    def replay(self) -> AllocatorReplay:
        return AllocatorReplay(
            peak_allocated_bytes=self.peak_allocated, peak_reserved_bytes=self.peak_reserved,
            peak_requested_bytes=self.peak_requested, segments=self.segments,
            reserved_at_peak_allocated_bytes=self.reserved_at_peak_allocated,
            fragmentation_bytes=self.peak_reserved - self.peak_allocated,
            end_allocated_bytes=self.allocated, end_reserved_bytes=self.reserved,
            segment_allocs=self.segment_allocs, expandable_segments=self.expandable,
            limit_bytes=self.limit, cache_flushes=self.flushes)


def replay_allocations(events: Iterable[AllocEvent], expandable_segments: bool = False,
                       initial_events: Iterable[AllocEvent] = (), *, limit_bytes: int | None = None) -> AllocatorReplay:
    """Replay a step's allocations and frees through the caching allocator's rules.

    `initial_events` are replayed first (what is already on the device when the step starts, and
    the cache a previous step left); the peaks are then reset, as `torch.cuda.reset_peak_memory_stats()`
    does, so they are the step's own. `limit_bytes` is what the allocator may reserve: beyond it
    the allocator flushes its cache and retries (module docstring), and `out_of_memory` says the
    retry failed. Zero-byte allocations never reach the allocator. ValueError for an action other
    than "alloc"/"free", a negative size, a key allocated twice, or a free of a key that is not
    allocated (or with other bytes than its alloc)."""
    return replay_steps(initial_events, [events], expandable_segments=expandable_segments, limit_bytes=limit_bytes)[0]


def replay_steps(initial_events: Iterable[AllocEvent], steps: list[Iterable[AllocEvent]], *,
                 expandable_segments: bool = False, limit_bytes: int | None = None) -> list[AllocatorReplay]:
    """Replay `initial_events`, then each step of `steps` in turn on the layout the previous one
    left, the peaks (and flush counts) reset at each step's start: one AllocatorReplay per step.
    A step that runs out of memory under `limit_bytes` is the last one replayed (its peaks are
    those up to the failed allocation); one failing in `initial_events` is reported as the first
    step's."""
    if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                    or limit_bytes < 0):
        raise ValueError(f"limit_bytes={limit_bytes!r} is invalid: allowed is None or a number of bytes >= 0")
    state = _Allocator(bool(expandable_segments), limit_bytes)
    zero_sized: set[int] = set()
    replays = []
    for trace in (initial_events, *steps):
        if trace is not initial_events:
            state.reset_peaks()
        try:
            for event in trace:
                _replay_one(state, event, zero_sized)
        except OutOfMemory:
            return replays + [replace(state.replay(), out_of_memory=True)]
        if trace is not initial_events:
            replays.append(state.replay())
    return replays


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


__all__ = ["AllocEvent", "AllocatorReplay", "replay_allocations", "replay_steps", "round_size", "segment_size"]
