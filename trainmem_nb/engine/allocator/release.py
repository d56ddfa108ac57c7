"""Giving memory back to the device: release_block, release_cached_blocks (``empty_cache``), the
oversize-block release before a retry, and ``garbage_collection_threshold``'s aged-block collection.
Functions of a `CachingAllocator`; its methods delegate here."""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from ...spec.alloc_conf import _KEY_SHIFT, SIZE_MAX
from .blocks import _GCB, _NEXT, _PREV, _S_ADDR, _S_ES, _SEG, _SIZE, _STATE, FREE, UNMAPPED, _Pool

if TYPE_CHECKING:
    from .caching import CachingAllocator


def _release_block(a: CachingAllocator, b: list) -> None:
    """CCA:3489-3534 release_block: cudaFree of a whole (unsplit) segment."""
    a._remove(b)
    seg = b[_SEG]
    del a._segments[seg[_S_ADDR]]
    a.reserved_bytes -= b[_SIZE]                    # CCA:3522
    a.num_segments -= 1
    a.num_device_free += 1
    b[_STATE] = -1


def _release_cached_blocks(a: CachingAllocator) -> None:
    """CCA:3428-3471 release_cached_blocks (default pool, no capture underway)."""
    a.synchronize()                                 # CCA:3437 synchronize_and_free_events
    for d in (a._large_pools, a._small_pools):   # CCA:3440-3441 large, then small
        for stream in sorted(d):
            a._release_blocks(d[stream])


def _release_blocks(a: CachingAllocator, pool: _Pool) -> None:
    """CCA:3607-3631 release_blocks: cudaFree unsplit segments, unmap free expandable pages."""
    to_unmap = []
    for b in list(pool.vals):
        if b[_SEG][_S_ES] is not None:                 # CCA:3616-3620
            to_unmap.append(b)
        elif b[_PREV] is None and b[_NEXT] is None:    # CCA:3621-3623
            a._release_block(b)
    for b in to_unmap:                                 # CCA:3625-3630
        if b[_STATE] not in (FREE, UNMAPPED):
            continue
        a._unmap_block(b)
        if b[_PREV] is None and b[_NEXT] is None and b[_STATE] == UNMAPPED:
            a._release_expandable_segment(b)


def _release_available_cached_blocks(a: CachingAllocator, pool: _Pool, rs: int) -> bool:
    """CCA:3371-3416: free oversize (>= max_split_size) cached blocks, only enough for rs."""
    ms = a._max_split
    if ms == SIZE_MAX:                                 # CCA:3374-3376
        return False
    key_size = max(rs, ms)                   # CCA:3382-3384
    keys, vals = pool.keys, pool.vals
    i = bisect_left(keys, key_size << _KEY_SHIFT)
    if i == len(keys) or vals[i][_SEG][_S_ES] is not None:   # CCA:3386-3387
        if i == 0:                                     # CCA:3390-3391
            return False
        released = 0
        i -= 1                                         # CCA:3393
        while released < key_size and vals[i][_SIZE] >= ms:   # CCA:3395-3397
            cur = vals[i]
            first = i == 0
            if not first:
                i -= 1
            if cur[_SEG][_S_ES] is None:               # CCA:3403-3406
                released += cur[_SIZE]
                a._release_block(cur)
            if first:
                break
        if released < key_size:                        # CCA:3411-3412
            return False
    else:
        a._release_block(vals[i])                   # CCA:3414
    return True


def _garbage_collect(a: CachingAllocator) -> None:
    """CCA:3194-3251 garbage_collect_cached_blocks (large pool only, unsplit blocks)."""
    assert a._allowed is not None
    gc_threshold = int(a._gc_thr * a._allowed)   # CCA:3200-3202
    if a.reserved_bytes <= gc_threshold:            # CCA:3204-3206
        return
    target = a.reserved_bytes - gc_threshold
    reclaimed = 0
    calls = a._gc_calls[0]
    blocks = [b for s in sorted(a._large_pools) for b in a._large_pools[s].vals]
    total_age = 0
    count = 0
    for b in blocks:                                   # CCA:3212-3219 (expandable included)
        if b[_PREV] is None and b[_NEXT] is None:
            total_age += calls - b[_GCB]
            count += 1
    if count == 0:                                     # CCA:3221-3223
        return
    freed = True
    while reclaimed < target and freed and count > 0:  # CCA:3227-3228
        age_threshold = total_age / count              # CCA:3230-3231
        freed = False
        blocks = [b for s in sorted(a._large_pools) for b in a._large_pools[s].vals]
        for b in blocks:                               # CCA:3237-3249
            if (b[_PREV] is None and b[_NEXT] is None and b[_SEG][_S_ES] is None
                    and (calls - b[_GCB]) >= age_threshold):
                freed = True
                reclaimed += b[_SIZE]
                total_age -= calls - b[_GCB]
                count -= 1
                a._release_block(b)
