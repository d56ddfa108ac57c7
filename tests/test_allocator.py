"""Hand-worked traces through the CUDACachingAllocator rules (`trainmem_nb.engine.allocator`; the line
numbers are the CCA copy its docstring names).

Every expected number is derived in the comment above its assertion from the C++ rules:
round_size (CCA:2585), get_pool (CCA:3060), get_allocation_size (CCA:3115), get_free_block
(CCA:3125), should_split (CCA:3095), alloc_found_block (CCA:1654), free_block (CCA:2949),
alloc_block (CCA:3258), release_available_cached_blocks (CCA:3371), release_cached_blocks
(CCA:3428), garbage_collect_cached_blocks (CCA:3194), the expandable-segment functions
(CCA:2799-2946, 3536-3631).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess

import pytest

import trainmem_nb.engine.allocator as ca
from trainmem_nb.engine.allocator import CachingAllocator, parse_alloc_conf
from trainmem_nb.engine.allocator.report import selfcheck as _selfcheck

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def blocks(alloc: CachingAllocator) -> list:
    """[(segment total, [(block size, state), ...]), ...] in address order."""
    return [(s["total_size"], [(b["size"], b["state"][0:8]) for b in s["blocks"]])
            for s in alloc.snapshot()]


def check(alloc: CachingAllocator) -> None:
    _selfcheck(alloc)
    snap = alloc.snapshot()
    assert sum(s["total_size"] for s in snap) == alloc.reserved_bytes
    assert sum(s["allocated_size"] for s in snap) == alloc.allocated_bytes


# ------------------------------------------------------------------------------------ split
def test_split_of_a_new_20mib_segment():
    a = CachingAllocator()
    h = a.malloc(3 * MiB)
    # round_size(3 MiB) = 3 MiB (multiple of 512); 3 MiB > kSmallSize -> large pool; nothing
    # cached -> alloc_block with get_allocation_size: 1 MiB < 3 MiB < kMinLargeAlloc (10 MiB)
    # -> kLargeBuffer = 20 MiB. should_split (large): 3 MiB < max_split (unlimited) and
    # remaining 17 MiB > kSmallSize -> split: a 3 MiB block + a 17 MiB cached remainder.
    assert a.reserved_bytes == 20 * MiB
    assert a.allocated_bytes == 3 * MiB
    assert blocks(a) == [(20 * MiB, [(3 * MiB, "active_a"), (17 * MiB, "inactive")])]
    # the new remainder of an unsplit block: inactive_split += 1, inactive_split_bytes += 17 MiB
    assert (a.inactive_split, a.inactive_split_bytes) == (1, 17 * MiB)
    assert a.largest_free_block() == 17 * MiB
    a.free(h)
    # free_block merges 3 + 17 MiB back to one unsplit block: inactive_split back to 0
    assert blocks(a) == [(20 * MiB, [(20 * MiB, "inactive")])]
    assert (a.inactive_split, a.inactive_split_bytes, a.allocated_bytes) == (0, 0, 0)
    assert a.reserved_bytes == 20 * MiB     # cached, not returned to the driver
    check(a)


# ------------------------------------------------------------------------- reuse of a block
def test_reuse_of_a_freed_block_counts_the_block_size():
    a = CachingAllocator()
    h = a.malloc(12 * MiB)
    # >= kMinLargeAlloc: segment = 12 MiB rounded up to kRoundLarge (2 MiB) = 12 MiB, remaining 0
    assert (a.reserved_bytes, a.allocated_bytes) == (12 * MiB, 12 * MiB)
    a.free(h)
    assert (a.reserved_bytes, a.allocated_bytes) == (12 * MiB, 0)
    h2 = a.malloc(11 * MiB)
    # best fit: lower_bound(11 MiB) finds the cached 12 MiB block; remaining 1 MiB is not
    # > kSmallSize -> no split -> the whole 12 MiB block is handed out. memory_allocated
    # counts block sizes (CCA:1729 allocated_bytes.increase(block->size)): 12 MiB, not 11.
    assert (a.reserved_bytes, a.allocated_bytes) == (12 * MiB, 12 * MiB)
    assert a.requested_bytes == 11 * MiB
    assert a.num_device_alloc == 1
    assert blocks(a) == [(12 * MiB, [(12 * MiB, "active_a")])]
    a.free(h2)
    check(a)


# ------------------------------------------------------------------ max_split_size / oversize
def test_oversize_block_not_split_and_not_used_for_small_requests():
    a = CachingAllocator("max_split_size_mb:64")
    h = a.malloc(100 * MiB)                  # segment 100 MiB (2 MiB multiple)
    a.free(h)
    h = a.malloc(90 * MiB)
    # 90 MiB >= max_split (64 MiB): the cached 100 MiB block is allowed because
    # 100 < 90 + max_non_split_rounding (default = large_segment_size 20 MiB) = 110 MiB.
    # should_split: size < max_split is false -> not split; allocated = 100 MiB.
    assert (a.reserved_bytes, a.allocated_bytes) == (100 * MiB, 100 * MiB)
    assert blocks(a) == [(100 * MiB, [(100 * MiB, "active_a")])]
    a.free(h)
    h = a.malloc(30 * MiB)
    # 30 MiB < max_split and the only cached block (100 MiB) >= max_split -> get_free_block
    # refuses it ("Do not return an oversized block for a large request", CCA:3171-3174):
    # a new 30 MiB segment. reserved 100 + 30.
    assert (a.reserved_bytes, a.allocated_bytes) == (130 * MiB, 30 * MiB)
    a.free(h)
    h = a.malloc(75 * MiB)
    # 75 MiB >= max_split; lower_bound(75 MiB) = the 100 MiB block, but 100 >= 75 + 20 = 95
    # (CCA:3175-3179) -> refused; new segment 75 MiB -> rounded to 76 MiB. reserved 206 MiB.
    assert (a.reserved_bytes, a.allocated_bytes) == (206 * MiB, 76 * MiB)
    a.free(h)
    check(a)


def test_release_available_cached_blocks_frees_only_what_is_needed():
    a = CachingAllocator("max_split_size_mb:64", capacity=250 * MiB)
    x, y = a.malloc(100 * MiB), a.malloc(130 * MiB)
    a.free(x)
    a.free(y)
    assert a.reserved_bytes == 230 * MiB
    h = a.malloc(110 * MiB)
    # get_free_block: lower_bound(110) = 130 MiB block, 130 >= 110 + 20 -> refused.
    # alloc_block: 230 + 110 > 250 -> cudaMalloc fails. release_available_cached_blocks:
    # key = max(110, max_split) = 110 MiB -> lower_bound = the 130 MiB block -> cudaFree it
    # (reserved 100) -> retry alloc_block: 100 + 110 <= 250 -> new 110 MiB segment.
    # The 100 MiB block stays cached (release_cached_blocks, which would free it, never ran).
    assert (a.reserved_bytes, a.allocated_bytes) == (210 * MiB, 110 * MiB)
    assert a.num_alloc_retries == 0          # only the final release_cached_blocks retry counts
    assert blocks(a) == [(100 * MiB, [(100 * MiB, "inactive")]), (110 * MiB, [(110 * MiB, "active_a")])]
    a.free(h)
    check(a)


# --------------------------------------------------------- a 20 MiB segment shared by 1-10 MiB
def test_20mib_segment_shared_by_medium_requests():
    a = CachingAllocator()
    h1 = a.malloc(4 * MiB)   # new 20 MiB segment, split: 4 | 16 free
    h2 = a.malloc(6 * MiB)   # best fit = the 16 MiB remainder, remaining 10 > 1 MiB: 4 | 6 | 10
    h3 = a.malloc(8 * MiB)   # the 10 MiB remainder, remaining 2 MiB > 1 MiB: 4 | 6 | 8 | 2
    assert (a.reserved_bytes, a.allocated_bytes) == (20 * MiB, 18 * MiB)
    h4 = a.malloc(3 * MiB // 2)
    # 1.5 MiB: best fit = the 2 MiB remainder; remaining 0.5 MiB is not > kSmallSize -> no
    # split, the block is 2 MiB: allocated 18 + 2 = 20 MiB, still one segment.
    assert (a.reserved_bytes, a.allocated_bytes) == (20 * MiB, 20 * MiB)
    assert blocks(a) == [(20 * MiB, [(4 * MiB, "active_a"), (6 * MiB, "active_a"),
                                     (8 * MiB, "active_a"), (2 * MiB, "active_a")])]
    h5 = a.malloc(3 * MiB)
    # nothing cached -> another 20 MiB segment (3 | 17)
    assert (a.reserved_bytes, a.allocated_bytes) == (40 * MiB, 23 * MiB)
    for h in (h1, h2, h3, h4, h5):
        a.free(h)
    check(a)


# ------------------------------------------------------------ small requests, 2 MiB segments
def test_small_requests_share_a_2mib_segment():
    a = CachingAllocator()
    h1 = a.malloc(1000)          # round_size -> 1024; <= 1 MiB -> small pool; segment 2 MiB
    h2 = a.malloc(300)           # < kMinBlockSize -> 512, taken from the 2 MiB - 1024 remainder
    h3 = a.malloc(1 * MiB)       # exactly kSmallSize: still small; remainder 2 MiB - 1536
    # small pool splits whenever remaining >= 512: 1024 | 512 | 1 MiB | 1047040 free
    assert a.reserved_bytes == 2 * MiB
    assert a.allocated_bytes == 1024 + 512 + MiB
    assert blocks(a) == [(2 * MiB, [(1024, "active_a"), (512, "active_a"), (MiB, "active_a"),
                                    (2 * MiB - 1536 - MiB, "inactive")])]
    h4 = a.malloc(1 * MiB)
    # the 1047040-byte remainder is < 1 MiB -> a second 2 MiB small segment
    assert a.reserved_bytes == 4 * MiB
    # a large request never uses the small pool: 1 MiB + 1 -> 1 MiB + 512, large, 20 MiB segment
    h5 = a.malloc(MiB + 1)
    assert a.reserved_bytes == 24 * MiB
    for h in (h1, h2, h3, h4, h5):
        a.free(h)
    check(a)


# --------------------------------------------------------------- 2 MiB rounding above 10 MiB
def test_2mib_rounding_of_a_large_request():
    a = CachingAllocator()
    a.malloc(10 * MiB + 1)
    # round_size: 10 MiB + 1 -> 10 MiB + 512. get_allocation_size: not < kMinLargeAlloc ->
    # kRoundLarge * ceil((10 MiB + 512) / 2 MiB) = 12 MiB. remaining 2 MiB - 512 > 1 MiB -> split.
    assert (a.reserved_bytes, a.allocated_bytes) == (12 * MiB, 10 * MiB + 512)
    assert blocks(a) == [(12 * MiB, [(10 * MiB + 512, "active_a"), (2 * MiB - 512, "inactive")])]
    b = CachingAllocator()
    b.malloc(10 * MiB)
    # exactly kMinLargeAlloc: a 10 MiB segment (2 MiB multiple), not a 20 MiB one
    assert b.reserved_bytes == 10 * MiB
    c = CachingAllocator()
    c.malloc(10 * MiB - 512)
    # just under kMinLargeAlloc: kLargeBuffer (20 MiB)
    assert c.reserved_bytes == 20 * MiB
    assert [ca.get_allocation_size(ca.round_size(s)) for s in (MiB, MiB + 1, 21 * MiB + 1)] == \
        [2 * MiB, 20 * MiB, 22 * MiB]
    check(a)


# --------------------------------------------------------------------------- merge on free
def test_block_merging_on_free():
    a = CachingAllocator()
    x, y, z = a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(4 * MiB)   # 4 | 4 | 4 | 8 free
    a.free(x)          # x's neighbours: none before, y allocated -> no merge: 4f | 4 | 4 | 8f
    a.free(z)          # z merges with the 8 MiB free block after it: 4f | 4 | 12f
    assert blocks(a) == [(20 * MiB, [(4 * MiB, "inactive"), (4 * MiB, "active_a"), (12 * MiB, "inactive")])]
    assert (a.inactive_split, a.inactive_split_bytes) == (2, 16 * MiB)
    a.empty_cache()    # the segment is split (has an allocated block) -> nothing released
    assert a.reserved_bytes == 20 * MiB
    a.free(y)          # y merges with both neighbours: one unsplit 20 MiB block
    assert blocks(a) == [(20 * MiB, [(20 * MiB, "inactive")])]
    assert (a.inactive_split, a.inactive_split_bytes) == (0, 0)
    a.empty_cache()    # release_blocks: unsplit -> cudaFree
    assert a.reserved_bytes == 0 and a.snapshot() == []
    assert a.peak_reserved == 20 * MiB          # the peak survives empty_cache
    check(a)


# ------------------------------------------------------------------ roundup_power2_divisions
def test_roundup_power2_divisions():
    cfg = parse_alloc_conf("roundup_power2_divisions:4")
    # 5 MiB + 1: interval [4 MiB, 8 MiB) in 4 steps of 1 MiB -> 6 MiB (roundup_power2_next_division)
    assert ca.round_size(5 * MiB + 1, cfg) == 6 * MiB
    # 70 MiB + 1: [64, 128) MiB in steps of 16 MiB -> 80 MiB (default rounding: 70 MiB + 512)
    assert ca.round_size(70 * MiB + 1, cfg) == 80 * MiB
    # powers of two are kept; 1200 B is not > 512 * 4 -> plain 512 rounding = 1536
    assert ca.round_size(64 * MiB, cfg) == 64 * MiB
    assert ca.round_size(1200, cfg) == 1536
    # 3000 B > 2048: [2048, 4096) in steps of 512 -> 3072
    assert ca.round_size(3000, cfg) == 3072
    a = CachingAllocator(cfg)
    h = a.malloc(70 * MiB + 1)
    # the rounded size drives both the block (80 MiB) and the new segment (80 MiB, 2 MiB multiple)
    assert (a.reserved_bytes, a.allocated_bytes) == (80 * MiB, 80 * MiB)
    a.free(h)
    b = CachingAllocator()
    b.malloc(70 * MiB + 1)
    assert (b.reserved_bytes, b.allocated_bytes) == (72 * MiB, 70 * MiB + 512)
    # per-interval form: [64:8, >:2]: sizes below 128 MiB use 8 divisions, above use 2
    cfg2 = parse_alloc_conf("roundup_power2_divisions:[64:8,>:2]")
    assert ca.round_size(70 * MiB + 1, cfg2) == 72 * MiB        # steps of 64/8 = 8 MiB
    assert ca.round_size(130 * MiB, cfg2) == 192 * MiB          # [128, 256) in 2 steps of 64 MiB
    assert ca.roundup_power2_next_division(1200, 4) == 1280     # the C++ comment's own example
    check(a)


# --------------------------------------------------------------- garbage_collection_threshold
def _gc_trace(alloc: CachingAllocator) -> None:
    x = alloc.malloc(30 * MiB)
    alloc.free(x)
    y = alloc.malloc(40 * MiB)
    alloc.free(y)
    alloc.malloc(50 * MiB)


def test_garbage_collection_threshold_frees_old_cached_blocks():
    # capacity 200 MiB, fraction 0.5 -> allowed_memory_maximum 100 MiB; GC threshold 0.5 -> 50 MiB
    a = CachingAllocator("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
                         capacity=200 * MiB)
    _gc_trace(a)
    # large-pool get_free_block calls: malloc 30 (#1, miss -> GC: 0 <= 50 no-op -> 30 MiB seg),
    # free -> gc_count_base 1; malloc 40 (#2, 30 < 40 miss -> GC: 30 <= 50 no-op -> seg),
    # free -> base 2; malloc 50 (#3, miss) -> GC: 70 > 50, target 20 MiB; unsplit cached
    # blocks: 30 MiB age 3-1=2, 40 MiB age 3-2=1 -> average 1.5 -> frees the 30 MiB block
    # (age 2 >= 1.5), reclaimed 30 >= 20 stops. alloc_block: 40 + 50 <= 100 -> 50 MiB segment.
    assert a.reserved_bytes == 90 * MiB
    assert blocks(a) == [(40 * MiB, [(40 * MiB, "inactive")]), (50 * MiB, [(50 * MiB, "active_a")])]
    assert a.num_alloc_retries == 0
    # without the threshold: alloc_block fails (70 + 50 > 100), release_cached_blocks frees
    # both cached blocks, the retry succeeds: reserved 50 MiB, one retry
    b = CachingAllocator("per_process_memory_fraction:0.5", capacity=200 * MiB)
    _gc_trace(b)
    assert b.reserved_bytes == 50 * MiB and b.num_alloc_retries == 1
    # and GC without a memory fraction is inert (CCA:1465-1470 needs allowed_memory_maximum)
    c = CachingAllocator("garbage_collection_threshold:0.5")
    _gc_trace(c)
    assert c.reserved_bytes == 120 * MiB
    check(a)


# ------------------------------------------------------------------- OOM from fragmentation
def _fragmented(capacity: int) -> CachingAllocator:
    a = CachingAllocator(capacity=capacity)
    holes = []
    for _ in range(3):
        # one 20 MiB segment: 8 MiB (split, 12 left) | 4 MiB (split, 8 left) | 8 MiB (remaining
        # 0 -> no split): the segment is full
        a.malloc(8 * MiB)
        holes.append(a.malloc(4 * MiB))
        a.malloc(8 * MiB)
    assert a.reserved_bytes == 60 * MiB and a.allocated_bytes == 60 * MiB
    for h in holes:
        a.free(h)          # three 4 MiB holes between allocated blocks: cannot merge
    return a


def test_oom_with_enough_free_bytes_but_no_large_enough_block():
    a = _fragmented(capacity=60 * MiB)
    assert a.free_cached_bytes() == 12 * MiB and a.largest_free_block() == 4 * MiB
    with pytest.raises(ca.AllocatorOOM) as ex:
        a.malloc(6 * MiB)
    # get_free_block: no cached block >= 6 MiB. alloc_block needs a 20 MiB segment: 60 + 20 >
    # 60. release_available_cached_blocks: max_split unlimited -> false. release_cached_blocks:
    # the holes are in split segments -> nothing freed; the retry fails -> OOM.
    info = ex.value.info
    assert info["fragmentation"] is True
    assert info["total_free"] == 12 * MiB and info["largest_free_block"] == 4 * MiB
    assert info["alloc_size"] == 20 * MiB and info["rounded"] == 6 * MiB
    assert "fragmentation" in info["verdict"] and "largest free block is 4194304" in info["verdict"]
    assert a.num_alloc_retries == 1 and a.num_ooms == 1
    assert a.reserved_bytes == 60 * MiB           # nothing could be released
    # a request larger than all free memory is a plain shortage
    with pytest.raises(ca.AllocatorOOM) as ex2:
        a.malloc(16 * MiB)
    assert ex2.value.info["fragmentation"] is False
    assert ex2.value.info["verdict"].startswith("not enough memory")
    # the same pressure with room for one more segment succeeds
    b = _fragmented(capacity=80 * MiB)
    b.malloc(6 * MiB)
    assert b.reserved_bytes == 80 * MiB
    check(a)


def test_replay_reports_oom_and_stops():
    ev, st = ca.build_trace([("malloc", "a", 50 * MiB), ("malloc", "b", 20 * MiB), ("free", "a")])
    r = CachingAllocator(capacity=64 * MiB).replay(ev, st)
    assert r.oom is not None and r.oom["event_index"] == 1 and r.oom["requested"] == 20 * MiB
    assert r.reserved == (50 * MiB,)


# --------------------------------------------------------------------- expandable segments
def test_expandable_segment_grows_in_place():
    a = CachingAllocator("expandable_segments:True", capacity=1 * GiB)
    h1 = a.malloc(30 * MiB)
    # large pool: no cached block -> alloc_block -> try_allocate_expandable_block:
    # find_expandable_block creates one segment of VA (pages of large_segment_size = 20 MiB,
    # max_handles = ceil(1.125 GiB / 20 MiB) = 58) and maps pages [0, ceil(30/20)) = 40 MiB.
    # should_split with expandable segments: remaining 10 MiB >= 512 -> split.
    assert (a.reserved_bytes, a.allocated_bytes) == (40 * MiB, 30 * MiB)
    h2 = a.malloc(15 * MiB)
    # get_free_block: the free 10 MiB block is < 15 MiB -> miss. find_expandable_block: the
    # unmapped tail's prev is the free 10 MiB block -> candidate; map_block(tail, 5 MiB) maps
    # one more 20 MiB page (reserved 60) and merges it with the 10 MiB block -> 30 MiB, split
    # into 15 allocated + 15 free. Same segment, no new cudaMalloc.
    assert (a.reserved_bytes, a.allocated_bytes) == (60 * MiB, 45 * MiB)
    snap = a.snapshot()
    assert len(snap) == 1 and snap[0]["is_expandable"]
    assert [(b["size"], b["state"]) for b in snap[0]["blocks"]] == [
        (30 * MiB, "active_allocated"), (15 * MiB, "active_allocated"), (15 * MiB, "inactive")]
    assert len(a._expandable) == 1 and not a._segments
    # freeing does not unmap: reserved stays 60 MiB
    a.free(h2)                                # merges: 30 alloc | 30 free (offsets 30..60 MiB)
    assert a.reserved_bytes == 60 * MiB
    # empty_cache -> release_blocks -> unmap_block: only whole free pages: [ceil(30/20), 60/20)
    # = page 2 (40..60 MiB) is unmapped; 30..40 MiB stays mapped as a free block
    a.empty_cache()
    assert a.reserved_bytes == 40 * MiB
    assert [(b["size"], b["state"]) for b in a.snapshot()[0]["blocks"]] == [
        (30 * MiB, "active_allocated"), (10 * MiB, "inactive")]
    a.free(h1)
    a.empty_cache()                           # everything unmapped -> segment released
    assert a.reserved_bytes == 0 and a.snapshot() == [] and not a._expandable
    # the same two requests without expandable segments: 30 MiB + 16 MiB segments (2 MiB rounding)
    b = CachingAllocator()
    b.malloc(30 * MiB)
    b.malloc(15 * MiB)
    assert b.reserved_bytes == 46 * MiB and len(b.snapshot()) == 2
    check(a)


def test_expandable_small_pool_pages_are_2mib():
    a = CachingAllocator("expandable_segments:True", capacity=1 * GiB)
    a.malloc(600 * KiB)        # small pool, page = kSmallBuffer 2 MiB: map 1 page
    assert a.reserved_bytes == 2 * MiB
    a.malloc(1 * MiB)          # fits the free 2 MiB - 600 KiB = 1448 KiB remainder
    assert a.reserved_bytes == 2 * MiB
    a.malloc(1 * MiB)          # remainder 424 KiB + one more 2 MiB page, in place
    assert a.reserved_bytes == 4 * MiB
    assert a.allocated_bytes == 600 * KiB + 2 * MiB
    assert len(a.snapshot()) == 1
    check(a)


# ------------------------------------------------------------------------------ streams
def test_two_streams_do_not_share_blocks():
    a = CachingAllocator()
    h = a.malloc(4 * MiB, stream=0)
    a.free(h)                                  # a free 20 MiB block, owned by stream 0
    h1 = a.malloc(4 * MiB, stream=1)
    # get_free_block stops at the first block of another stream (CCA:3135): new segment
    assert a.reserved_bytes == 40 * MiB
    h0 = a.malloc(4 * MiB, stream=0)           # stream 0 reuses its own cached block
    assert a.reserved_bytes == 40 * MiB
    assert sorted(s["stream"] for s in a.snapshot()) == [0, 1]
    a.free(h0)
    a.free(h1)
    check(a)


def test_record_stream_defers_the_free():
    a = CachingAllocator()
    h = a.malloc(4 * MiB, stream=0)            # 4 | 16 free
    a.record_stream(h, 1)
    a.free(h)
    # stream_uses not empty -> insert_events: allocated drops now, the block stays out of the
    # pool (event_count > 0) and is not merged
    assert a.allocated_bytes == 0 and a.active_bytes == 4 * MiB
    assert blocks(a) == [(20 * MiB, [(4 * MiB, "active_a"), (16 * MiB, "inactive")])]
    assert a.snapshot()[0]["blocks"][0]["state"] == "active_awaiting_free"
    g = a.malloc(18 * MiB, stream=0)
    # the 16 MiB free block is too small and the 4 MiB is still pending (not merged into a
    # 20 MiB block) -> new segment of 18 MiB (>= 10 MiB: 2 MiB rounding) -> 38 MiB
    assert a.reserved_bytes == 38 * MiB
    a.free(g)
    a.synchronize()                            # events complete: 4 merges with 16 -> 20 free
    assert blocks(a)[0] == (20 * MiB, [(20 * MiB, "inactive")])
    # with event_lag=0 the next malloc's process_events frees it first, so it is reused
    b = CachingAllocator(event_lag=0)
    h = b.malloc(4 * MiB)
    b.record_stream(h, 1)
    b.free(h)
    b.malloc(18 * MiB)
    assert b.reserved_bytes == 20 * MiB
    # uses on the allocation stream itself are ignored (CCA:2092-2096)
    c = CachingAllocator()
    h = c.malloc(4 * MiB, stream=3)
    c.record_stream(h, 3)
    c.free(h)
    assert c.active_bytes == 0
    check(a)


# ------------------------------------------------------------------------- config parsing
def test_parse_example_from_the_docs():
    c = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128,"
                         "roundup_power2_divisions:4,garbage_collection_threshold:0.8")
    assert c.expandable_segments is True
    assert c.max_split_size == 128 * MiB
    assert c.roundup_power2_divisions == (4,) * 16
    assert c.garbage_collection_threshold == 0.8
    assert c.max_non_split_rounding_size == 20 * MiB and c.large_segment_size == 20 * MiB
    assert parse_alloc_conf(None) == ca.AllocatorConfig() == parse_alloc_conf(" ")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_split_size = 1          # frozen


# Values printed by torch 2.13.0's own libc10.so parser (tools/cfgprobe.cpp, see RULES.md)
TORCH_213_DIVISIONS = {
    "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]": (8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 4, 1, 1, 1, 1, 1),
    "roundup_power2_divisions:[1:2,4:8]": (2, 0, 8) + (0,) * 13,
    "roundup_power2_divisions:[>:2]": (0,) + (2,) * 15,
    "roundup_power2_divisions:[2048:2]": (2,) * 12 + (0,) * 4,
    "roundup_power2_divisions:4": (4,) * 16,
}


@pytest.mark.parametrize("env", sorted(TORCH_213_DIVISIONS))
def test_roundup_table_matches_torch_2_13(env):
    assert parse_alloc_conf(env).roundup_power2_divisions == TORCH_213_DIVISIONS[env]


def test_large_segment_size_sets_the_minimums():
    c = parse_alloc_conf("large_segment_size_mb:64")
    assert c.large_segment_size == 64 * MiB and c.max_non_split_rounding_size == 64 * MiB
    with pytest.raises(ValueError, match="max_split_size_mb too small, must be >= 64"):
        parse_alloc_conf("max_split_size_mb:40,large_segment_size_mb:64")
    a = CachingAllocator(c)
    a.malloc(3 * MiB)                          # 1-10 MiB requests get large_segment_size segments
    assert a.reserved_bytes == 64 * MiB


def test_unknown_key_is_rejected_with_the_valid_keys():
    with pytest.raises(ValueError) as ex:
        parse_alloc_conf("max_split_size_mb:128,expandable_segment:True")
    msg = str(ex.value)
    assert "'expandable_segment'" in msg
    for k in ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
              "garbage_collection_threshold", "per_process_memory_fraction", "backend"):
        assert k in msg


@pytest.mark.parametrize("env, match", [
    ("max_split_size_mb:19", "too small, must be >= 20"),
    ("max_non_split_rounding_mb:10", "too small, must be >= 20"),
    ("max_split_size_mb:abc", "non-negative integer"),
    ("max_split_size_mb:-5", "non-negative integer"),
    ("garbage_collection_threshold:1.0", r"\(0.0, 1.0\)"),
    ("garbage_collection_threshold:0", r"\(0.0, 1.0\)"),
    ("garbage_collection_threshold:x", "expects a number"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:0", "power of 2"),
    ("roundup_power2_divisions:[64:3]", "power of 2 or 0"),
    ("roundup_power2_divisions:[3:2]", "intervals have to be power of 2"),
    ("expandable_segments:true", "'True' or 'False'"),
    ("expandable_segments:1", "'True' or 'False'"),
    ("per_process_memory_fraction:1.5", r"\[0.0, 1.0\]"),
    ("large_segment_size_mb:10", "must be > 10"),
    ("backend:foo", "Unknown allocator backend"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("pinned_num_register_threads:3", "power of 2"),
    ("max_split_size_mb", "expected ':'"),
    ("max_split_size_mb:128;expandable_segments:True", "non-negative integer"),
    ("max_split_size_mb:128 expandable_segments:True", "non-negative integer"),
    ("max_split_size_mb:128,roundup_power2_divisions:[64:8", "',' or ']'"),
])
def test_bad_values_are_rejected(env, match):
    with pytest.raises(ValueError, match=match):
        parse_alloc_conf(env)


def test_pinned_and_locking_keys_are_accepted():
    c = parse_alloc_conf("release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,"
                         "pinned_num_register_threads:8,pinned_use_background_threads:True,"
                         "graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:False,"
                         "backend:native, expandable_segments : False")
    assert c.pinned_num_register_threads == 8 and c.release_lock_on_cudamalloc is True
    assert c.expandable_segments is False


def test_cfgprobe_against_torch_2_13_binary(tmp_path):
    """Optional: compile tools/cfgprobe.cpp against the installed torch and compare parsers."""
    torch = pytest.importorskip("torch")
    gxx = shutil.which("g++")
    probe_src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "allocator_cfgprobe.cpp")
    if gxx is None or not os.path.exists(probe_src):
        pytest.skip("needs g++ and tools/cfgprobe.cpp")
    tdir = os.path.dirname(torch.__file__)
    exe = tmp_path / "cfgprobe"
    r = subprocess.run([gxx, "-std=c++17", "-O0", f"-I{tdir}/include", probe_src, f"-L{tdir}/lib",
                        "-lc10", f"-Wl,-rpath,{tdir}/lib", "-o", str(exe)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip("could not build the probe: " + r.stderr[-300:])
    envs = [*list(TORCH_213_DIVISIONS), "max_split_size_mb:128", "garbage_collection_threshold:0.8", "max_non_split_rounding_mb:40", "expandable_segments:True", "large_segment_size_mb:64"]
    for env in envs:      # one process per string: the C++ singleton keeps some fields between parses
        out = subprocess.run([str(exe), env], capture_output=True, text=True, check=False).stdout.strip()
        assert out.startswith("OK|"), out
        f = dict(kv.split("=") for kv in out.split("|")[2:])
        c = parse_alloc_conf(env)
        assert int(f["large"]) == c.large_segment_size
        assert int(f["msplit"]) == c.max_split_size
        assert int(f["nsr"]) == c.max_non_split_rounding_size
        assert float(f["gc"]) == c.garbage_collection_threshold
        assert bool(int(f["es"])) == c.expandable_segments
        assert tuple(int(x) for x in f["div"].split(",")) == c.roundup_power2_divisions
    for env in ("max_split_size_mb:19", "garbage_collection_threshold:1.0", "roundup_power2_divisions:3",
                "expandable_segments:true", "roundup_power2_divisions:[64:3]", "large_segment_size_mb:10"):
        out = subprocess.run([str(exe), env], capture_output=True, text=True, check=False).stdout
        assert out.startswith("ERR|"), out
        with pytest.raises(ValueError):
            parse_alloc_conf(env)


# ------------------------------------------------------------------------------- misc API
def test_zero_size_and_double_free():
    a = CachingAllocator()
    assert a.malloc(0) is None and a.reserved_bytes == 0
    a.free(None)
    h = a.malloc(512)
    a.free(h)
    with pytest.raises(ValueError):
        a.free(h)


def test_replay_timeline_and_peaks():
    ev, _ = ca.build_trace([("malloc", "a", 3 * MiB), ("malloc", "b", 30 * MiB), ("free", "b"),
                            ("free", "a"), ("malloc", "c", 1000)])
    r = ca.simulate(ev)
    # 3 MiB -> 20 MiB segment; 30 MiB -> 30 MiB segment; frees keep the cache; 1000 B -> small 2 MiB
    assert r.reserved == (20 * MiB, 50 * MiB, 50 * MiB, 50 * MiB, 52 * MiB)
    assert r.allocated == (3 * MiB, 33 * MiB, 3 * MiB, 0, 1024)
    assert (r.peak_reserved, r.peak_allocated, r.peak_reserved_event) == (52 * MiB, 33 * MiB, 4)
    assert ca.simulate(list(ev)) is r          # memoised
    assert r.at_peak == {"event_index": 4, "reserved": 52 * MiB, "allocated": 1024,
                         "fragmentation": 1 - 1024 / (52 * MiB)}
    assert r.fragmentation[1] == 1 - 33 / 50
    assert r.final["largest_free_block"] == 30 * MiB


def test_memory_stats_keys_are_torch_keys():
    a = CachingAllocator()
    a.malloc(5 * MiB)
    st = a.memory_stats()
    assert st["reserved_bytes.all.current"] == 20 * MiB == st["reserved_bytes.all.peak"]
    assert st["allocated_bytes.all.current"] == 5 * MiB


def test_snapshot_shape_matches_torch_docs():
    """torch.cuda.memory._snapshot's docstring (torch 2.13) lists the Segment/Block fields."""
    torch = pytest.importorskip("torch")
    import inspect
    doc = inspect.getdoc(torch.cuda.memory._snapshot)
    a = CachingAllocator()
    h = a.malloc(5 * MiB)
    a.record_stream(h, 7)
    a.free(h)
    a.malloc(100)
    seg = a.snapshot()[0]
    for key in ("address", "total_size", "stream", "segment_type", "allocated_size", "active_size", "blocks"):
        assert f"{key}:" in doc and key in seg
    for key in ("size", "requested_size", "address", "state"):
        assert f"{key}:" in doc and key in seg["blocks"][0]
    states = {b["state"] for s in a.snapshot() for b in s["blocks"]}
    assert states <= {"active_allocated", "active_awaiting_free", "inactive"}
    assert all(f'"{s}"' in doc for s in states)
    assert {s["segment_type"] for s in a.snapshot()} == {"small", "large"}
    memdoc = inspect.getdoc(torch.cuda.memory_stats)
    for k in a.memory_stats():
        stem = k.split(".")[0]
        assert stem in memdoc, k


# --------------------------------------------------------------- randomized consistency
CONFIGS = ["", "max_split_size_mb:64", "roundup_power2_divisions:[1:2,64:8,>:4]",
           "expandable_segments:True", "expandable_segments:True,max_split_size_mb:100",
           "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
           "large_segment_size_mb:32,max_non_split_rounding_mb:64,max_split_size_mb:96"]


def _random_ops(rng: random.Random, n: int) -> list:
    ops, live, k = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            r = rng.random()
            size = (rng.randrange(1, 4096) if r < 0.2 else rng.randrange(4096, 2 * MiB) if r < 0.5
                    else rng.randrange(2 * MiB, 24 * MiB) if r < 0.85 else rng.randrange(24 * MiB, 200 * MiB))
            ops.append(("malloc", k, size, rng.choice((0, 0, 0, 1))))
            live.append(k)
            k += 1
    return ops


@pytest.mark.parametrize("cfg", CONFIGS)
def test_random_traces_keep_invariants(cfg):
    rng = random.Random(sum(map(ord, cfg)))
    for _trial in range(40):
        caps = (400 * MiB, 1 * GiB) if "fraction" in cfg else (None, 400 * MiB, 1 * GiB)
        a = CachingAllocator(cfg, capacity=rng.choice(caps))
        live = {}
        for op in _random_ops(rng, 120):
            try:
                if op[0] == "malloc":
                    live[op[1]] = a.malloc(op[2], op[3])
                    if rng.random() < 0.05:
                        a.record_stream(live[op[1]], 5)
                elif op[1] in live:           # (not there if its malloc ran out of memory)
                    a.free(live.pop(op[1]))
            except ca.AllocatorOOM as ex:
                assert ex.info["reserved"] == a.reserved_bytes
            if rng.random() < 0.03:
                a.empty_cache()
            if rng.random() < 0.05:
                a.synchronize()
            check(a)
            assert a.peak_reserved >= a.reserved_bytes and a.peak_allocated >= a.allocated_bytes
        for h in live.values():
            a.free(h)
        a.synchronize()
        a.empty_cache()
        check(a)
        # everything freed -> every segment is one unsplit block -> empty_cache releases all
        assert a.reserved_bytes == 0 and a.allocated_bytes == 0 and a.active_bytes == 0
        assert a.requested_bytes == 0 and a.inactive_split_bytes == 0 and a.snapshot() == []


@pytest.mark.parametrize("cfg", ["", "roundup_power2_divisions:4"])
def test_fast_replay_equals_method_replay(cfg):
    rng = random.Random(7)
    for _trial in range(30):
        ops = _random_ops(rng, 300)
        ev, st = ca.build_trace(ops)
        cap = rng.choice((None, 600 * MiB))
        a, b = CachingAllocator(cfg, capacity=cap), CachingAllocator(cfg, capacity=cap)
        res = []
        for alloc, fn in ((a, a._replay_fast), (b, b._replay_generic)):
            h, rt, at = [], [], []
            try:
                fn(ev, st, True, h, rt, at)
                err = None
            except ca.AllocatorOOM as ex:
                err = ex.info["message"]
            res.append((tuple(rt), tuple(at), err, alloc.snapshot(), alloc.stats()))
        assert res[0] == res[1]


def test_warm_replay_memo_matches_simulation():
    trace = synthetic_step(1500, seed=3)
    a, b = CachingAllocator(), CachingAllocator()
    r1 = a.replay(trace)
    r2 = a.replay(trace)            # the second replay reaches the steady state
    r3 = a.replay(trace)            # memo hit
    assert a._memo
    for _ in range(3):
        rb = b.replay(trace, memo=False)
    assert (r3.reserved, r3.allocated, r3.replay_peak_reserved) == (rb.reserved, rb.allocated,
                                                                     rb.replay_peak_reserved)
    assert a.stats() == b.stats() and a.snapshot() == b.snapshot()
    assert r1.peak_reserved == r2.peak_reserved == r3.peak_reserved
    # a trace that leaves an allocation alive is never short-circuited
    ev = (*trace, 5 * MiB)
    n0 = a.reserved_bytes
    a.replay(ev)
    a.replay(ev)
    assert a.allocated_bytes == 2 * 5 * MiB and a.reserved_bytes >= n0


def synthetic_step(n_events: int, seed: int = 0) -> tuple:
    """A forward/backward-like trace of n_events events that frees everything it allocates:
    activations kept for backward (freed in reverse order), short-lived temporaries, a few
    large buffers, small (<1 MiB) tensors, gradient buffers."""
    rng = random.Random(seed)
    ev: list = []
    live_acts: list = []
    nid = 0

    def malloc(size: int) -> int:
        nonlocal nid
        ev.append(size)
        nid += 1
        return nid - 1

    def free(i: int) -> None:
        ev.append(~i)

    budget = n_events
    fwd = int(budget * 0.45) // 3
    for _ in range(fwd):                     # forward: keep one activation, use+free a temporary
        kind = rng.random()
        if kind < 0.35:
            s = rng.randrange(4 * 1024, 900 * 1024)            # small pool
        elif kind < 0.75:
            s = rng.randrange(1 * MiB + 1, 10 * MiB)           # 20 MiB segments
        else:
            s = rng.randrange(10 * MiB, 96 * MiB)              # rounded to 2 MiB
        live_acts.append(malloc(s))
        t = malloc(rng.choice((s, s // 2 + 512, 2 * s)))
        free(t)
    grads: list = []
    while live_acts and len(ev) < n_events - 2 * len(grads) - 2 * len(live_acts):
        a = live_acts.pop()                  # backward: gradient temp, free the activation
        g = malloc(rng.randrange(512, 16 * MiB))
        free(a)
        if rng.random() < 0.5:
            grads.append(g)
        else:
            free(g)
    for a in reversed(live_acts):
        free(a)
    for g in grads:
        free(g)
    while len(ev) + 2 <= n_events:           # pad with small malloc/free pairs
        free(malloc(rng.randrange(512, 2 * MiB)))
    return tuple(ev)
