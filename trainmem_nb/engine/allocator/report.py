"""What the caching allocator reports: its statistics (torch.cuda.memory_stats keys), cached free
blocks (cacheInfo), a ``_snapshot()``-shaped segment list, the out-of-memory verdict, and the
consistency checks the tests run. Functions of a `CachingAllocator`; its methods delegate here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...spec.alloc_conf import _KEY_SHIFT
from .blocks import (
    _ADDR,
    _NEXT,
    _PREV,
    _REQ,
    _S_ADDR,
    _S_ES,
    _S_HEAD,
    _S_SIZE,
    _S_SMALL,
    _S_STREAM,
    _SEG,
    _SIZE,
    _STATE,
    ALLOC,
    FREE,
    PENDING,
    UNMAPPED,
    AllocatorOOM,
)

if TYPE_CHECKING:
    from .caching import CachingAllocator


def largest_free_block(a: CachingAllocator) -> int:
    """cacheInfo (CCA:2151-2166): largest cached (mapped, free) block in any pool."""
    m = 0
    for d in (a._large_pools, a._small_pools):
        for p in d.values():
            if p.keys:
                s = p.vals[-1][_SIZE]
                m = max(m, s)
    return m


def free_cached_bytes(a: CachingAllocator) -> int:
    """Bytes in cached free blocks (reserved - allocated - awaiting-free blocks)."""
    return sum(b[_SIZE] for d in (a._large_pools, a._small_pools)
               for p in d.values() for b in p.vals)


def stats(a: CachingAllocator) -> dict:
    """Counters and gauges of this allocator, with the largest free block and fragmentation."""
    r, used = a.reserved_bytes, a.allocated_bytes
    return {
        "allocated_bytes": used, "peak_allocated": a.peak_allocated,
        "reserved_bytes": r, "peak_reserved": a.peak_reserved,
        "active_bytes": a.active_bytes, "peak_active": a.peak_active,
        "requested_bytes": a.requested_bytes,
        "inactive_split_bytes": a.inactive_split_bytes, "inactive_split": a.inactive_split,
        "largest_free_block": largest_free_block(a), "free_cached_bytes": free_cached_bytes(a),
        "fragmentation": (1.0 - used / r) if r else 0.0,
        "segments": a.num_segments, "num_alloc_retries": a.num_alloc_retries,
        "num_ooms": a.num_ooms, "num_device_alloc": a.num_device_alloc,
        "num_device_free": a.num_device_free, "num_sync_all_streams": a.num_sync_all_streams,
    }


def memory_stats(a: CachingAllocator) -> dict:
    """The torch.cuda.memory_stats() keys this model tracks (aggregate pool only)."""
    return {
        "allocated_bytes.all.current": a.allocated_bytes, "allocated_bytes.all.peak": a.peak_allocated,
        "reserved_bytes.all.current": a.reserved_bytes, "reserved_bytes.all.peak": a.peak_reserved,
        "active_bytes.all.current": a.active_bytes, "active_bytes.all.peak": a.peak_active,
        "requested_bytes.all.current": a.requested_bytes,
        "inactive_split_bytes.all.current": a.inactive_split_bytes,
        "inactive_split.all.current": a.inactive_split, "segment.all.current": a.num_segments,
        "num_alloc_retries": a.num_alloc_retries, "num_ooms": a.num_ooms,
        "num_device_alloc": a.num_device_alloc, "num_device_free": a.num_device_free,
        "num_sync_all_streams": a.num_sync_all_streams,
    }


def snapshot(a: CachingAllocator) -> list:
    """Segments shaped like torch.cuda.memory._snapshot()['segments'] (CCA:2465-2548): one
    entry per cudaMalloc segment, and for expandable segments one per contiguous mapped range."""
    out = []
    heads = [s[_S_HEAD] for s in a._segments.values()]
    heads += [es_rec[_S_HEAD] for es_rec in a._expandable]
    for head in heads:
        b = head
        while b is not None:
            if b[_STATE] == UNMAPPED:                  # CCA:2490 skip; unmapped splits ranges
                b = b[_NEXT]
                continue
            seg = b[_SEG]
            rec: dict = {"address": b[_ADDR], "total_size": 0, "stream": seg[_S_STREAM],
                         "segment_type": "small" if seg[_S_SMALL] else "large",
                         "allocated_size": 0, "active_size": 0, "requested_size": 0,
                         "is_expandable": seg[_S_ES] is not None, "blocks": []}
            while b is not None and b[_STATE] != UNMAPPED:
                st = b[_STATE]
                state = ("active_allocated" if st == ALLOC else
                         "active_awaiting_free" if st == PENDING else "inactive")
                rec["blocks"].append({"address": b[_ADDR], "size": b[_SIZE],
                                      "requested_size": b[_REQ], "state": state})
                rec["total_size"] += b[_SIZE]
                if st == ALLOC:
                    rec["allocated_size"] += b[_SIZE]
                if st != FREE:
                    rec["active_size"] += b[_SIZE]
                    rec["requested_size"] += b[_REQ]
                b = b[_NEXT]
            out.append(rec)
    out.sort(key=lambda r: r["address"])
    return out


def raise_oom(a: CachingAllocator, orig: int, rs: int, alloc_size: int, stream: int) -> None:
    """CCA:1492-1613: no block after all retries -> OutOfMemoryError, with a verdict."""
    a.num_ooms += 1
    cap = a.capacity
    limit = a._allowed if a._allowed is not None else cap
    device_free = (limit - a.reserved_bytes) if limit is not None else None
    largest = largest_free_block(a)
    cached_free = free_cached_bytes(a)
    # what the request needs: a free cached block of rs bytes in its pool, or a new segment
    # of alloc_size bytes (expandable: enough pages of free VA next to free blocks)
    total_free = cached_free + (device_free or 0)
    if total_free >= rs and largest < rs:
        verdict = (f"fragmentation: {total_free} bytes are free in total ({cached_free} cached in "
                   f"partly-used segments + {device_free} never reserved) which is >= the {rs} "
                   f"bytes requested, but the largest free block is {largest} bytes and a new "
                   f"segment needs {alloc_size} bytes")
    else:
        verdict = (f"not enough memory: {total_free} bytes free in total ({cached_free} cached + "
                   f"{device_free} never reserved) for a {rs}-byte block / {alloc_size}-byte segment")
    msg = (f"CUDA out of memory (model). Tried to allocate {alloc_size} bytes "
           f"(request {orig} bytes, rounded {rs}); reserved {a.reserved_bytes}, allocated "
           f"{a.allocated_bytes}, capacity {cap}; largest free block {largest}. {verdict}")
    info = {"requested": orig, "rounded": rs, "alloc_size": alloc_size, "stream": stream,
            "reserved": a.reserved_bytes, "allocated": a.allocated_bytes, "capacity": cap,
            "allowed": a._allowed, "device_free": device_free, "largest_free_block": largest,
            "free_cached_bytes": cached_free, "total_free": total_free,
            "fragmentation": total_free >= rs and largest < rs, "verdict": verdict, "message": msg}
    a.last_oom = info
    raise AllocatorOOM(info)


def selfcheck(alloc: CachingAllocator) -> None:
    """Consistency checks used by the tests: segment sums, pool contents, linked lists."""
    reserved = 0
    for seg in alloc._segments.values():
        b, tot, prev = seg[_S_HEAD], 0, None
        assert b[_PREV] is None
        while b is not None:
            assert b[_PREV] is prev
            assert b[_ADDR] == seg[_S_ADDR] + tot, "blocks not contiguous"
            tot += b[_SIZE]
            prev, b = b, b[_NEXT]
        assert tot == seg[_S_SIZE]
        reserved += tot
    for seg in alloc._expandable:
        b, tot = seg[_S_HEAD], 0
        es = seg[_S_ES]
        while b is not None:
            assert b[_ADDR] == seg[_S_ADDR] + tot
            if b[_STATE] != UNMAPPED:
                reserved += b[_SIZE]
            tot += b[_SIZE]
            b = b[_NEXT]
        assert tot == es.va_size
        assert sum(es.mapped) * es.page >= 0
    assert reserved == alloc.reserved_bytes, (reserved, alloc.reserved_bytes)
    for d in (alloc._large_pools, alloc._small_pools):
        for p in d.values():
            assert p.keys == sorted(p.keys)
            for k, b in zip(p.keys, p.vals, strict=True):
                assert b[_STATE] == FREE and k == (b[_SIZE] << _KEY_SHIFT) | b[_ADDR]
                for nb in (b[_PREV], b[_NEXT]):
                    assert nb is None or nb[_STATE] != FREE, "two adjacent free blocks not merged"
