"""The caching-allocator replay on short traces whose peaks are derived by hand, in each test's
comments, from the rules of c10/cuda/CUDACachingAllocator.cpp (see ckptlab/estimate/allocator.py)."""

import random
import time

import pytest

from ckptlab.estimate.allocator import AllocEvent, replay_allocations, round_size, segment_size

KiB, MiB = 2**10, 2**20


def trace(*steps):
    """("a", key, bytes) allocates, ("f", key) frees: the events, with each free's bytes."""
    sizes, events = {}, []
    for step in steps:
        if step[0] == "a":
            sizes[step[1]] = step[2]
            events.append(AllocEvent("alloc", step[1], step[2]))
        else:
            events.append(AllocEvent("free", step[1], sizes[step[1]]))
    return events


def test_rounding_and_segment_sizes_follow_the_constants():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(1 * MiB) == 2 * MiB          # <= kSmallSize: a small 2 MiB segment
    assert segment_size(1 * MiB + 512) == 20 * MiB   # large, under 10 MiB: a shared 20 MiB segment
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB        # from 10 MiB on: rounded up to 2 MiB
    assert segment_size(11 * MiB + 512) == 12 * MiB


def test_small_requests_split_one_2mib_segment():
    # 1000 B rounds to 1024 B (a multiple of 512). The first opens a 2 MiB small segment and is
    # split off it (the rest, 2 MiB - 1 KiB, is >= 512 B); the next three are carved from the rest.
    r = replay_allocations(trace(*[("a", k, 1000) for k in range(4)]))
    assert r.peak_allocated_bytes == 4 * KiB
    assert r.peak_requested_bytes == 4000
    assert r.peak_reserved_bytes == 2 * MiB and r.segments == 1
    assert r.fragmentation_bytes == 2 * MiB - 4 * KiB


def test_the_small_pool_ends_at_1mib():
    # Two 1 MiB requests fill one 2 MiB small segment; the third opens a second: 4 MiB reserved.
    small = replay_allocations(trace(("a", 1, MiB), ("a", 2, MiB), ("a", 3, MiB)))
    assert (small.peak_reserved_bytes, small.segments) == (4 * MiB, 2)
    # 1 MiB + 1 B rounds to 1 MiB + 512 B: large pool, a 20 MiB segment; the rest (19 MiB - 512 B)
    # is more than 1 MiB, so it is split off: allocated is the rounded size only.
    large = replay_allocations(trace(("a", 1, MiB + 1)))
    assert large.peak_reserved_bytes == 20 * MiB
    assert large.peak_allocated_bytes == MiB + 512


def test_medium_requests_share_a_20mib_segment():
    # 3 MiB (large pool, under 10 MiB): a 20 MiB segment, split (17 MiB left > 1 MiB); the second
    # 3 MiB is best fit from that rest (14 MiB left): still one segment.
    r = replay_allocations(trace(("a", 1, 3 * MiB), ("a", 2, 3 * MiB)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.segments) == (6 * MiB, 20 * MiB, 1)


def test_oversize_requests_round_to_2mib_and_an_unsplit_rest_counts_as_allocated():
    # 11 MiB + 1 B rounds to 11 MiB + 512 B; from 10 MiB on the segment is that size rounded up to
    # 2 MiB: 12 MiB. The rest, 1 MiB - 512 B, is not more than 1 MiB: not split, so the whole
    # 12 MiB block is allocated (max_memory_allocated counts block sizes).
    r = replay_allocations(trace(("a", 1, 11 * MiB + 1)))
    assert r.peak_reserved_bytes == r.peak_allocated_bytes == 12 * MiB
    assert r.peak_requested_bytes == 11 * MiB + 1
    # 19.5 MiB: a 20 MiB segment, the 0.5 MiB rest stays with it.
    assert replay_allocations(trace(("a", 1, 19 * MiB + 512 * KiB))).peak_allocated_bytes == 20 * MiB


def test_a_freed_segment_is_reused_by_best_fit():
    # A takes a 12 MiB segment; freed, it stays cached. B (8 MiB) would open a 20 MiB segment, but
    # the free 12 MiB block fits: split (4 MiB rest > 1 MiB). Reserved stays 12 MiB.
    r = replay_allocations(trace(("a", 1, 12 * MiB), ("f", 1), ("a", 2, 8 * MiB)))
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.segments) == (12 * MiB, 12 * MiB, 1)
    assert r.end_allocated_bytes == 8 * MiB and r.segment_allocs == 1


def test_best_fit_takes_the_smallest_block_that_fits():
    # Free blocks of 12 and 16 MiB (two segments); a 12 MiB request takes the 12 MiB one exactly,
    # so a following 16 MiB request still finds the 16 MiB block: 28 MiB reserved, no third segment.
    r = replay_allocations(trace(("a", 1, 16 * MiB), ("a", 2, 12 * MiB), ("f", 1), ("f", 2),
                                 ("a", 3, 12 * MiB), ("a", 4, 16 * MiB)))
    assert (r.peak_reserved_bytes, r.segments) == (28 * MiB, 2)


def test_fragmentation_reserved_above_allocated():
    # A and B take 12 MiB segments each. A is freed, but its 12 MiB cannot serve C (16 MiB) and
    # cannot merge with B's segment: C opens a third segment. Allocated peaks at B + C = 28 MiB,
    # reserved at 12 + 12 + 16 = 40 MiB: 12 MiB reserved and free.
    r = replay_allocations(trace(("a", 1, 12 * MiB), ("a", 2, 12 * MiB), ("f", 1), ("a", 3, 16 * MiB)))
    assert r.peak_allocated_bytes == 28 * MiB
    assert r.peak_reserved_bytes == 40 * MiB
    assert r.fragmentation_bytes == 12 * MiB
    assert r.reserved_at_peak_allocated_bytes == 40 * MiB


def test_freed_neighbours_merge_within_a_segment():
    # Three 3 MiB blocks from one 20 MiB segment, all freed: they merge with the 11 MiB rest back
    # into one 20 MiB block, which then serves a 15 MiB request: no second segment.
    r = replay_allocations(trace(("a", 1, 3 * MiB), ("a", 2, 3 * MiB), ("a", 3, 3 * MiB),
                                 ("f", 2), ("f", 1), ("f", 3), ("a", 4, 15 * MiB)))
    assert (r.peak_reserved_bytes, r.segments, r.end_allocated_bytes) == (20 * MiB, 1, 15 * MiB)


def test_expandable_segments_merge_what_separate_segments_cannot():
    # Default: A and B take 12 MiB segments; both freed, they cannot merge (separate segments),
    # so C (24 MiB) opens a third: 48 MiB reserved.
    events = trace(("a", 1, 12 * MiB), ("a", 2, 12 * MiB), ("f", 1), ("f", 2), ("a", 3, 24 * MiB))
    assert replay_allocations(events).peak_reserved_bytes == 48 * MiB
    # Expandable: one large-pool segment mapped in 20 MiB pages. A maps 20 MiB (8 MiB free at the
    # end); B lacks 4 MiB, so the end grows by one page: 40 MiB, 16 MiB free at the end. Freed, A,
    # B and the end merge into one 40 MiB block, which serves C: 40 MiB reserved, one segment.
    r = replay_allocations(events, expandable_segments=True)
    assert (r.peak_reserved_bytes, r.segments, r.expandable_segments) == (40 * MiB, 1, True)
    assert r.peak_allocated_bytes == 24 * MiB


def test_expandable_segments_split_any_rest_of_512_bytes():
    # A free 12 MiB block serving 11 MiB leaves 1 MiB: by default not split (not more than 1 MiB),
    # so 12 MiB is allocated; with expandable segments any rest of 512 B or more is split off.
    events = trace(("a", 1, 12 * MiB), ("f", 1), ("a", 2, 11 * MiB))
    assert replay_allocations(events).end_allocated_bytes == 12 * MiB
    # Expandable: A maps one 20 MiB page (8 MiB rest split off); freed, it merges back to 20 MiB,
    # and 11 MiB is split from it.
    assert replay_allocations(events, expandable_segments=True).end_allocated_bytes == 11 * MiB


def test_expandable_best_fit_keeps_the_growable_end():
    # Expandable small pool, 2 MiB pages. A (1 MiB) maps a page, 1 MiB left at the end; B (512 KiB)
    # takes half of it, 512 KiB left at the end. A is freed: free blocks are the end's 512 KiB and
    # A's 1 MiB. C (512 KiB) fits the end exactly, but best fit skips the block that can grow when
    # another fits (get_free_block's expandable_size): C splits A's block. D (1 MiB) then fits no
    # free block and grows the end by a page: 4 MiB reserved. A plain best fit would have put C at
    # the end and D in A's block: 2 MiB.
    r = replay_allocations(trace(("a", 1, MiB), ("a", 2, 512 * KiB), ("f", 1), ("a", 3, 512 * KiB),
                                 ("a", 4, MiB)), expandable_segments=True)
    assert (r.peak_reserved_bytes, r.end_allocated_bytes) == (4 * MiB, 2 * MiB)


def test_initial_events_shape_the_cache_and_the_peaks_are_the_steps():
    # Before the step: P (12 MiB) lives, T (8 MiB) came and went, leaving its 20 MiB segment
    # cached. The step allocates 8 MiB again: best fit reuses T's segment. Peaks are reset at the
    # step's start, so allocated peaks at 12 + 8 MiB and reserved stays 12 + 20 MiB.
    before = trace(("a", 1, 12 * MiB), ("a", 2, 8 * MiB), ("f", 2))
    r = replay_allocations(trace(("a", 3, 8 * MiB)), initial_events=before)
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.segment_allocs) == (20 * MiB, 32 * MiB, 0)


def test_zero_byte_allocations_never_reach_the_allocator():
    r = replay_allocations(trace(("a", 1, 0), ("f", 1)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.segments) == (0, 0, 0)


@pytest.mark.parametrize("events, match", [
    ([AllocEvent("malloc", 1, 8)], r"action='malloc' is invalid .* allowed are 'alloc', 'free'"),
    ([AllocEvent("free", 1, 8)], r"key=1 is invalid .* allowed is the key of a live allocation"),
    ([AllocEvent("alloc", 1, 8), AllocEvent("alloc", 1, 8)], r"key=1 is invalid .* not allocated"),
    ([AllocEvent("alloc", 1, 8), AllocEvent("free", 1, 16)], r"key=1 is invalid .* with the bytes of its alloc"),
    ([AllocEvent("alloc", 1, -1)], r"size_bytes=-1 .* is invalid"),
])
def test_a_bad_trace_is_one_line_naming_the_event(events, match):
    with pytest.raises(ValueError, match=match):
        replay_allocations(events)


def test_a_long_random_trace_keeps_the_allocators_invariants():
    # 20,000 events of mixed sizes (mostly small, some medium and large), freed in random order.
    rng = random.Random(0)
    sizes = [rng.choice([rng.randint(1, 4096), rng.randint(1, MiB), rng.randint(MiB, 30 * MiB)]) for _ in range(10_000)]
    live, events = [], []
    for key, size in enumerate(sizes):
        events.append(AllocEvent("alloc", key, size))
        live.append((key, size))
        if len(live) > 50 and rng.random() < 0.9:
            k, s = live.pop(rng.randrange(len(live)))
            events.append(AllocEvent("free", k, s))
    events += [AllocEvent("free", k, s) for k, s in live]
    t0 = time.perf_counter()
    r = replay_allocations(events)
    assert time.perf_counter() - t0 < 5
    assert r.end_allocated_bytes == 0
    assert r.peak_requested_bytes <= r.peak_allocated_bytes <= r.reserved_at_peak_allocated_bytes <= r.peak_reserved_bytes
    assert r.end_reserved_bytes == r.peak_reserved_bytes  # nothing is released during a step
    e = replay_allocations(events, expandable_segments=True)
    assert e.end_allocated_bytes == 0 and e.segments == 2 and e.peak_allocated_bytes <= e.peak_reserved_bytes


# Under a limit: DeviceCachingAllocator::malloc (CUDACachingAllocator.cpp:1234-1242 at v2.6.0):
# alloc_block fails past the limit; release_available_cached_blocks returns false at once with the
# default max_split_size (:2814-2815); release_cached_blocks frees every wholly free segment
# (:3045-3068 release_blocks); alloc_block is retried (:2705).

def test_a_reserved_peak_over_the_limit_runs_with_a_cache_flush():
    # A (8 MiB) opens a 20 MiB segment (kLargeBuffer: under 10 MiB) and is freed: 20 MiB cached.
    # B (12 MiB, >= 10 MiB) fits in no free block of 12 MiB... it does: best fit takes A's 20 MiB
    # block (rest 8 MiB > 1 MiB is split). So use C (24 MiB): no cached block fits, a new segment
    # of 24 MiB (rounded to 2 MiB). Without a limit reserved is 20 + 24 = 44 MiB; allocated peaks
    # at 24 MiB. Under a 30 MiB limit 20 + 24 > 30: the flush frees A's wholly free 20 MiB segment,
    # the retry takes 24 MiB: one flush, reserved peak 24 MiB.
    events = trace(("a", 1, 8 * MiB), ("f", 1), ("a", 2, 24 * MiB))
    free = replay_allocations(events)
    assert (free.peak_reserved_bytes, free.peak_allocated_bytes, free.cache_flushes) == (44 * MiB, 24 * MiB, 0)
    limited = replay_allocations(events, limit_bytes=30 * MiB)
    assert (limited.peak_reserved_bytes, limited.cache_flushes, limited.out_of_memory) == (24 * MiB, 1, False)
    assert limited.segments == 1


def test_a_split_segment_is_not_released_so_the_retry_runs_out_of_memory():
    # A (8 MiB) and K (8 MiB) share one 20 MiB segment (K split from A's rest); A is freed, K lives:
    # the segment is split (prev/next set), so release_blocks keeps it. C (24 MiB) needs a new
    # 24 MiB segment: 20 + 24 = 44 MiB > a 40 MiB limit; after the flush still 44 > 40: out of memory.
    events = trace(("a", 1, 8 * MiB), ("a", 2, 8 * MiB), ("f", 1), ("a", 3, 24 * MiB))
    limited = replay_allocations(events, limit_bytes=40 * MiB)
    assert (limited.cache_flushes, limited.out_of_memory, limited.peak_reserved_bytes) == (1, True, 20 * MiB)
    assert not replay_allocations(events, limit_bytes=44 * MiB).out_of_memory


def test_expandable_segments_unmap_free_pages_under_the_limit():
    # Expandable (large pool, 20 MiB pages): A (30 MiB) maps 2 pages = 40 MiB; B (8 MiB) takes 8 MiB
    # of the 10 MiB rest (the end block: find it by best fit: 10 MiB >= 8 MiB). A is freed: blocks
    # [A 30 MiB free][B 8 MiB][2 MiB free]. C (50 MiB) fits no free block; the lowest address with
    # room is the 2 MiB free block before the unmapped space: 48 MiB more, mapped in 3 pages
    # (60 MiB): 100 MiB reserved. Under a 70 MiB limit: 40 + 60 > 70, so release_cached_blocks
    # unmaps the whole pages inside free blocks: A's block spans [0, 30 MiB), page 0 ([0, 20))
    # is wholly inside: 20 MiB unmapped, 20 MiB left mapped. The retry maps the lowest room again:
    # the unmapped page 0 plus A's free 10 MiB is 30 MiB < 50; after B, 2 MiB + unmapped space:
    # 3 pages: 20 + 60 = 80 MiB > 70: out of memory. With a 80 MiB limit it runs with one flush.
    events = trace(("a", 1, 30 * MiB), ("a", 2, 8 * MiB), ("f", 1), ("a", 3, 50 * MiB))
    free = replay_allocations(events, expandable_segments=True)
    assert free.peak_reserved_bytes == 100 * MiB
    assert replay_allocations(events, expandable_segments=True, limit_bytes=70 * MiB).out_of_memory
    limited = replay_allocations(events, expandable_segments=True, limit_bytes=80 * MiB)
    assert (limited.cache_flushes, limited.out_of_memory, limited.end_reserved_bytes) == (1, False, 80 * MiB)


def test_the_first_step_puts_the_optimizer_state_into_the_activations_cache():
    # The tracked step starts from P (a 24 MiB parameter) and S (16 MiB of optimizer state); its
    # forward allocates X (40 MiB, an activation) and backward frees it and allocates G (24 MiB,
    # the gradient); the optimizer phase begins at G's free (zero_grad). Sizes >= 10 MiB get
    # their own segment, rounded to 2 MiB (get_allocation_size); a rest > 1 MiB is split off.
    # From the tidy start (P, S laid out first): 24 + 16, X opens 40, G is split from X's freed
    # 40 MiB: 80 MiB reserved.
    # The loop's first step: P (24), X (40), X freed, G split from X's block ([G 24 | 16 free]),
    # S created at the optimizer phase fills the 16 MiB rest exactly; G freed: [24 free | S 16].
    # 24 + 40 = 64 MiB. Its second step on that layout: X (40) fits no free block (24 MiB): a new
    # 40 MiB segment, 104 MiB reserved; G then reuses the 24 MiB block. The worse step is the second.
    from ckptlab.estimate.allocator import replay_steps
    from ckptlab.estimate.cuda_device import LoopOrder, first_two_steps
    tracked = [("alloc", 1, 24 * MiB), ("alloc", 2, 16 * MiB),
               ("alloc", 3, 40 * MiB), ("free", 3, 40 * MiB), ("alloc", 4, 24 * MiB), ("free", 4, 24 * MiB)]
    initial, first, second = first_two_steps(tracked, 2, LoopOrder(frozenset({2}), optimizer_at=5))
    assert initial == [("alloc", 1, 24 * MiB)]
    assert [e[1] for e in first] == [3, 3, 4, 2, 4]          # S allocated where the optimizer phase begins
    assert [e[0] for e in second] == [e[0] for e in tracked[2:]]

    def events(es):
        return [AllocEvent(*e) for e in es]
    one, two = replay_steps(events(initial), [events(first), events(second)])
    tidy = replay_allocations(events(tracked[2:]), initial_events=events(tracked[:2]))
    assert tidy.peak_reserved_bytes == 80 * MiB
    assert (one.peak_reserved_bytes, two.peak_reserved_bytes) == (64 * MiB, 104 * MiB)


def test_the_first_step_has_no_previous_output_and_the_second_frees_the_firsts():
    # A loop that holds the model's output: the tracked step starts with P (key 1) and the previous
    # output H (key 2, 8 MiB), allocates X (key 3) and its own output O (key 4, 8 MiB), frees H once
    # O exists. The first step has no H: it starts from P alone and frees nothing of the kind; the
    # second step (keys shifted by the largest key + 1 = 5) frees the first step's O in H's place.
    from ckptlab.estimate.cuda_device import LoopOrder, first_two_steps
    tracked = [("alloc", 1, 4 * MiB), ("alloc", 2, 8 * MiB),
               ("alloc", 3, 2 * MiB), ("alloc", 4, 8 * MiB), ("free", 2, 8 * MiB), ("free", 3, 2 * MiB)]
    initial, first, second = first_two_steps(tracked, 2, LoopOrder(frozenset(), optimizer_at=None))
    assert initial == [("alloc", 1, 4 * MiB)]
    assert first == [("alloc", 3, 2 * MiB), ("alloc", 4, 8 * MiB), ("free", 3, 2 * MiB)]
    assert second == [("alloc", 8, 2 * MiB), ("alloc", 9, 8 * MiB), ("free", 4, 8 * MiB), ("free", 8, 2 * MiB)]
