"""``expandable_segments:True``: segments that grow in place by mapping pages (CCA's ExpandableSegment)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...spec.alloc_conf import _DEFAULT_TOTAL, kSmallBuffer
from .blocks import _ADDR, _NEXT, _POOL, _PREV, _S_ES, _S_HEAD, _SEG, _SIZE, _STATE, FREE, UNMAPPED, _ExpSeg, _Pool

if TYPE_CHECKING:
    from .caching import CachingAllocator


# ---------------------------------------------------------------- expandable segments
def _try_allocate_expandable_block(a: CachingAllocator, pool: _Pool, size: int, stream: int):
    """CCA:2915-2946 try_allocate_expandable_block."""
    c = a._find_expandable_block(pool, size, stream)
    if c[_STATE] == UNMAPPED and not a._map_block(c, min(c[_SIZE], size)):   # CCA:2927-2930
        return None
    while c[_SIZE] < size:                             # CCA:2933-2943
        remaining = size - c[_SIZE]
        nc = c[_NEXT]
        if not a._map_block(nc, min(remaining, nc[_SIZE])):
            return None
        c = nc
    a._remove(c)                                    # CCA:2944 pool->blocks.erase(candidate)
    return c


def _find_expandable_block(a: CachingAllocator, pool: _Pool, size: int, stream: int) -> list:
    """CCA:2799-2844 find_expandable_block: lowest-address unmapped range (plus a free block
    right before it) with room for `size`; otherwise a new segment."""
    def allocatable(x):
        return x is not None and (x[_STATE] == FREE or x[_STATE] == UNMAPPED)
    for u in pool.uvals:                               # CCA:2819-2831
        c = u
        if allocatable(c[_PREV]):                      # CCA:2825-2827
            c = c[_PREV]
        got, x = 0, c
        while got < size and allocatable(x):
            got += x[_SIZE]
            x = x[_NEXT]
        if got >= size:
            return c
    page = kSmallBuffer if pool.small else a._large_seg    # CCA:2832-2834
    total = a.capacity if a.capacity is not None else _DEFAULT_TOTAL
    tmp = _ExpSeg(0, page, total, stream, pool.small)
    base = a._take_va(tmp.va_size)
    tmp.base = base
    seg = [base, tmp.va_size, pool.small, stream, tmp, None]
    cand = [tmp.va_size, base, None, None, UNMAPPED, pool, seg, 0, 0, None]
    seg[_S_HEAD] = cand
    a._expandable.append(seg)
    a._uinsert(cand)                                # CCA:2838-2843
    return cand


def _map_block(a: CachingAllocator, b: list, size: int) -> bool:
    """CCA:2846-2913 map_block (ExpandableSegment::map, CCA:399-494: whole pages)."""
    es = b[_SEG][_S_ES]
    page = es.page
    begin = (b[_ADDR] - es.base) // page               # CCA:400 segmentLeft
    end = (b[_ADDR] + size - es.base + page - 1) // page   # CCA:401 segmentRight
    if begin == end:
        return False
    nbytes = (end - begin) * page
    if a.capacity is not None and a.reserved_bytes + nbytes > a.capacity:
        return False                                   # cuMemCreate OOM -> size 0 (CCA:466-475)
    for j in range(begin, end):
        es.mapped[j] = 1
    a._uremove(b)                                   # CCA:2863-2864
    b[_STATE] = FREE
    if nbytes < b[_SIZE]:                              # CCA:2867-2879 unmapped remainder
        rem = [b[_SIZE] - nbytes, b[_ADDR] + nbytes, b, b[_NEXT], UNMAPPED, b[_POOL], b[_SEG], 0, 0, None]
        if b[_NEXT] is not None:
            b[_NEXT][_PREV] = rem
        b[_NEXT] = rem
        a._uinsert(rem)
        b[_SIZE] = nbytes
    a._try_merge(b, b[_PREV])                       # CCA:2882-2883
    a._try_merge(b, b[_NEXT])
    a._insert(b)                                    # CCA:2885
    r = a.reserved_bytes + nbytes                   # CCA:2888-2892
    a.reserved_bytes = r
    if r > a.peak_reserved:
        a.peak_reserved = r
    a.num_device_alloc += 1
    return True


def _unmap_block(a: CachingAllocator, b: list) -> None:
    """CCA:3536-3606 unmap_block (ExpandableSegment::unmap, CCA:500-509: whole free pages)."""
    es = b[_SEG][_S_ES]
    page = es.page
    begin = (b[_ADDR] - es.base + page - 1) // page    # CCA:501 segmentRight(ptr)
    end = (b[_ADDR] + b[_SIZE] - es.base) // page      # CCA:502 segmentLeft(ptr + size)
    if begin >= end:                                   # CCA:503-505
        return
    a._remove(b)
    ustart = es.base + begin * page
    usize = (end - begin) * page
    before = ustart - b[_ADDR]
    pool, seg = b[_POOL], b[_SEG]
    if before > 0:                                     # CCA:3547-3554 before_free
        bf = [before, b[_ADDR], b[_PREV], b, FREE, pool, seg, 0, 0, None]
        if b[_PREV] is not None:
            b[_PREV][_NEXT] = bf
        else:
            seg[_S_HEAD] = bf
        b[_PREV] = bf
        a._insert(bf)
    after = b[_SIZE] - (before + usize)
    if after > 0:                                      # CCA:3556-3568 after_free
        af = [after, ustart + usize, b, b[_NEXT], FREE, pool, seg, 0, 0, None]
        if b[_NEXT] is not None:
            b[_NEXT][_PREV] = af
        b[_NEXT] = af
        a._insert(af)
    b[_ADDR] = ustart
    b[_SIZE] = usize
    b[_STATE] = UNMAPPED
    for j in range(begin, end):
        es.mapped[j] = 0
    a._try_merge(b, b[_PREV])                       # CCA:3574-3575
    a._try_merge(b, b[_NEXT])
    a._uinsert(b)
    a.reserved_bytes -= usize                       # CCA:3578-3583
    a.num_device_free += 1


def _release_expandable_segment(a: CachingAllocator, b: list) -> None:
    """CCA release_expandable_segment: the whole VA range is one unmapped block again."""
    a._uremove(b)
    seg = b[_SEG]
    a._expandable.remove(seg)
    b[_STATE] = -1
