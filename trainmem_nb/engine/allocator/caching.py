"""``DeviceCachingAllocator`` (c10/cuda/CUDACachingAllocator.cpp, torch 2.13) for one device: malloc,
free, best fit, splitting, merging, the retry and garbage-collection paths, statistics and snapshots.
Expandable segments live in `trainmem_nb.engine.allocator.expandable`, trace replay in
`trainmem_nb.engine.allocator.replay`."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...spec.alloc_conf import (
    _ADDR_ALIGN,
    _ADDR_BASE,
    _KEY_SHIFT,
    SIZE_MAX,
    AllocatorConfig,
    get_allocation_size,
    kMinBlockSize,
    kSmallSize,
    parse_alloc_conf,
    round_size,
)
from . import expandable as _expandable
from . import release as _release
from . import replay as _replay
from . import report as _report
from .blocks import (
    _ADDR,
    _GCB,
    _NEXT,
    _POOL,
    _PREV,
    _REQ,
    _S_ES,
    _S_HEAD,
    _SEG,
    _SIZE,
    _STATE,
    _USES,
    ALLOC,
    FREE,
    PENDING,
    UNMAPPED,
    _Pool,
)

if TYPE_CHECKING:
    from .replay import ReplayResult


class CachingAllocator:
    """DeviceCachingAllocator for one device.

    ``capacity``: device memory in bytes available to this process (None = unlimited). A new
    cudaMalloc / cuMemCreate that would take reserved bytes above it fails like the driver would.
    ``event_lag``: after a ``free`` of a block that ``record_stream`` marked as used on another
    stream, how many later ``malloc`` calls still see its stream events outstanding (0 = the next
    malloc's process_events frees it); ``None`` (default) = only ``synchronize()``,
    ``empty_cache()`` or the out-of-memory retry path free it, the conservative reading.
    """

    def __init__(self, config: AllocatorConfig | str | None = None, capacity: int | None = None,
                 event_lag: int | None = None):
        if config is None or isinstance(config, str):
            config = parse_alloc_conf(config)
        self.config = config
        self.capacity = capacity
        self.event_lag = event_lag
        c = config
        self._max_split = c.max_split_size
        self._max_nsr = c.max_non_split_rounding_size
        self._large_seg = c.large_segment_size
        self._div = c.roundup_power2_divisions
        self._rp2 = any(d > 1 for d in c.roundup_power2_divisions)
        self._es = bool(c.expandable_segments)            # CCA:1444-1445 is_expandable_segments_active
        # CCA:1297 + CCA:2114-2125: allowed_memory_maximum set iff memory fraction < 1
        self._allowed: int | None = None
        self.set_memory_fraction(c.per_process_memory_fraction)
        self._gc_thr = c.garbage_collection_threshold
        self._small_pools: dict = {}
        self._large_pools: dict = {}
        self._gc_calls = [0, 0]                            # get_free_blocks_call_count: [large, small]
        self._next_addr = _ADDR_BASE
        self._segments: dict = {}                          # address -> segment record (cudaMalloc)
        self._expandable: list = []                        # live ExpandableSegment records
        self._pending: list = []                           # [due_malloc_count or None, block]
        self._nmalloc = 0
        # statistics (aggregate StatType::AGGREGATE, CachingDeviceAllocator.h DeviceStats)
        self.allocated_bytes = 0
        self.peak_allocated = 0
        self.reserved_bytes = 0
        self.peak_reserved = 0
        self.active_bytes = 0
        self.peak_active = 0
        self.requested_bytes = 0
        self.inactive_split_bytes = 0
        self.inactive_split = 0
        self.num_segments = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_sync_all_streams = 0
        self.last_oom: dict | None = None
        self._memo: dict = {}
        self._replay_pos = -1

    # ---------------------------------------------------------------- configuration knobs
    def set_memory_fraction(self, fraction: float) -> None:
        """torch.cuda.set_per_process_memory_fraction (CCA:2114-2125)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"invalid fraction: {fraction}. Please set within [0, 1].")
        self._allowed = None
        if fraction < 1.0:                                 # CCA:2121-2124
            if self.capacity is None:
                raise ValueError("a memory fraction < 1 needs the device capacity")
            self._allowed = int(fraction * self.capacity)

    @property
    def _gc_on(self) -> bool:
        # CCA:1465-1469 / CCA:3128-3133: GC (and its age counters) only with a memory fraction set
        return self._allowed is not None and self._gc_thr > 0.0

    # ---------------------------------------------------------------- pools
    def _pool(self, small: bool, stream: int) -> _Pool:
        d = self._small_pools if small else self._large_pools
        p = d.get(stream)
        if p is None:
            p = d[stream] = _Pool(small, stream)
        return p

    def _insert(self, b: list) -> None:
        # BlockPool::insert_into_blocks (CCA:260-264): sets gc_count_base
        p = b[_POOL]
        k = (b[_SIZE] << _KEY_SHIFT) | b[_ADDR]
        keys = p.keys
        i = bisect_left(keys, k)
        keys.insert(i, k)
        p.vals.insert(i, b)
        b[_GCB] = self._gc_calls[p.small]
        b[_STATE] = FREE

    def _remove(self, b: list) -> None:
        p = b[_POOL]
        i = bisect_left(p.keys, (b[_SIZE] << _KEY_SHIFT) | b[_ADDR])
        del p.keys[i]
        del p.vals[i]

    def _uinsert(self, b: list) -> None:
        p = b[_POOL]
        i = bisect_left(p.ukeys, b[_ADDR])
        p.ukeys.insert(i, b[_ADDR])
        p.uvals.insert(i, b)
        b[_STATE] = UNMAPPED

    def _uremove(self, b: list) -> None:
        p = b[_POOL]
        i = bisect_left(p.ukeys, b[_ADDR])
        del p.ukeys[i]
        del p.uvals[i]

    # ---------------------------------------------------------------- public API
    def malloc(self, size: int, stream: int = 0) -> list | None:
        """DeviceCachingAllocator::malloc (CCA:1413-1619). Returns a handle (None for size 0:
        NativeCachingAllocator::allocate skips size-0 requests)."""
        if size <= 0:
            if size == 0:
                return None
            raise ValueError("negative size")
        if self._pending:                                  # CCA:1431 process_events
            self._process_events()
        self._nmalloc += 1
        # CCA:1438 round_size
        if size < 512:
            rs = 512
        elif self._rp2:
            rs = round_size(size, self.config)
        else:
            rs = (size + 511) & -512
        # CCA:1439 get_pool: <= kSmallSize -> small pool (CCA:3080-3084)
        small = rs <= kSmallSize
        d = self._small_pools if small else self._large_pools
        pool = d.get(stream)
        if pool is None:
            pool = d[stream] = _Pool(small, stream)
        es = self._es
        # ---- CCA:1456-1458 get_free_block (fast path inlined when no knob changes it)
        if self._allowed is None and not es and self._max_split == SIZE_MAX:
            keys = pool.keys
            i = bisect_left(keys, rs << _KEY_SHIFT)        # CCA:3134 lower_bound(search_key)
            if i < len(keys):
                b = pool.vals[i]
                if b[_SEG][_S_ES] is None:
                    del keys[i]
                    del pool.vals[i]
                else:
                    b = self._get_free_block(pool, rs)
            else:
                b = None
        else:
            b = self._get_free_block(pool, rs)
        if b is None:
            b = self._malloc_slow(pool, rs, size, stream)
        # ---- CCA:1615-1618 should_split (CCA:3095-3113) + alloc_found_block (CCA:1654-1751)
        bsize = b[_SIZE]
        remaining = bsize - rs
        # CCA:3107-3108 (small pool, expandable segments) and CCA:3110-3111 (large pool)
        split = remaining >= kMinBlockSize if small or es else rs < self._max_split and remaining > kSmallSize
        seg = b[_SEG]
        already_split = b[_PREV] is not None or b[_NEXT] is not None
        if split:                                          # CCA:1671-1700
            prev = b[_PREV]
            nb = [rs, b[_ADDR], prev, b, ALLOC, pool, seg, size, 0, None]
            if prev is not None:
                prev[_NEXT] = nb
            else:
                seg[_S_HEAD] = nb
            b[_PREV] = nb
            b[_ADDR] += rs                                 # CCA:1683 remaining->ptr += size
            b[_SIZE] = remaining                           # CCA:1684 remaining->size -= size
            # CCA:1686 pool->insert_into_blocks(remaining)
            k = (remaining << _KEY_SHIFT) | b[_ADDR]
            keys = pool.keys
            i = bisect_left(keys, k)
            keys.insert(i, k)
            pool.vals.insert(i, b)
            b[_GCB] = self._gc_calls[small]
            b[_STATE] = FREE
            if seg[_S_ES] is None:                         # CCA:1689-1700 inactive_split stats
                if already_split:
                    self.inactive_split_bytes -= rs
                else:
                    self.inactive_split_bytes += remaining
                    self.inactive_split += 1
            b = nb
        else:
            if already_split and seg[_S_ES] is None:       # CCA:1702-1708
                self.inactive_split_bytes -= bsize
                self.inactive_split -= 1
            b[_STATE] = ALLOC
            b[_REQ] = size                                 # CCA:1711 requested_size = orig_size
        # CCA:1727-1733 stats: allocated_bytes / active_bytes / requested_bytes use block->size
        bs = b[_SIZE]
        a = self.allocated_bytes + bs
        self.allocated_bytes = a
        if a > self.peak_allocated:
            self.peak_allocated = a
        a = self.active_bytes + bs
        self.active_bytes = a
        if a > self.peak_active:
            self.peak_active = a
        self.requested_bytes += size
        return b

    def free(self, b: list | None) -> None:
        """DeviceCachingAllocator::free (CCA:1980-2042)."""
        if b is None:
            return
        if b[_STATE] != ALLOC:
            raise ValueError("free of a handle that is not allocated (double free?)")
        self.allocated_bytes -= b[_SIZE]                   # CCA:1993-1996 allocated_bytes.decrease
        if b[_USES]:                                       # CCA:2016-2032 used on other streams
            b[_STATE] = PENDING                            # insert_events: event_count > 0
            b[_USES] = None
            lag = self.event_lag
            self._pending.append([None if lag is None else self._nmalloc + lag, b])
            return
        self._free_block(b)                                # CCA:2034

    def record_stream(self, b: list, stream: int) -> None:
        """recordStream (CCA:2090-2102): uses on the allocation stream are ignored."""
        if b is None:
            return
        if b[_STATE] != ALLOC:
            raise ValueError("record_stream on a handle that is not allocated")
        if stream == b[_POOL].stream:                      # CCA:2092-2096
            return
        if b[_USES] is None:
            b[_USES] = {stream}
        else:
            b[_USES].add(stream)                           # CCA:2097

    def synchronize(self) -> None:
        """All outstanding stream events complete (synchronize_and_free_events, CCA:3639-3681)."""
        self.num_sync_all_streams += 1
        pend, self._pending = self._pending, []
        for _, b in pend:
            self._free_block(b)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache -> emptyCache -> release_cached_blocks (CCA:2144-2148, 3428-3477)."""
        self._release_cached_blocks()

    # ---------------------------------------------------------------- statistics (report.py)
    def largest_free_block(self) -> int:
        """cacheInfo (CCA:2151-2166): largest cached (mapped, free) block in any pool."""
        return _report.largest_free_block(self)

    def free_cached_bytes(self) -> int:
        """Bytes in cached free blocks (reserved - allocated - awaiting-free blocks)."""
        return _report.free_cached_bytes(self)

    def stats(self) -> dict:
        """Counters and gauges of this allocator, with the largest free block and fragmentation."""
        return _report.stats(self)

    def memory_stats(self) -> dict:
        """The torch.cuda.memory_stats() keys this model tracks (aggregate pool only)."""
        return _report.memory_stats(self)

    def snapshot(self) -> list:
        """Segments shaped like torch.cuda.memory._snapshot()['segments'] (CCA:2465-2548)."""
        return _report.snapshot(self)

    # ---------------------------------------------------------------- get_free_block
    def _get_free_block(self, pool: _Pool, size: int) -> list | None:
        """CCA:3125-3183 get_free_block."""
        if self._allowed is not None and self._gc_thr > 0.0:   # CCA:3128-3133
            self._gc_calls[pool.small] += 1
        keys, vals = pool.keys, pool.vals
        n = len(keys)
        i = bisect_left(keys, size << _KEY_SHIFT)          # CCA:3134 lower_bound
        if i == n:                                         # CCA:3135-3136
            return None
        b = vals[i]
        if b[_SEG][_S_ES] is not None:                     # CCA:3138
            if self._es:                                   # CCA:3139-3154 best fit by expandable size
                nxt = b[_NEXT]
                esz = b[_SIZE] + (nxt[_SIZE] if nxt is not None and nxt[_STATE] == UNMAPPED else 0)
                j = i + 1
                while b[_SEG][_S_ES] is not None and j < n:
                    c = vals[j]
                    cn = c[_NEXT]
                    csz = c[_SIZE] + (cn[_SIZE] if cn is not None and cn[_STATE] == UNMAPPED else 0)
                    if not csz < esz:
                        break
                    i, b, esz = j, c, csz
                    j += 1
            else:                                          # CCA:3155-3168 skip expandable blocks
                i += 1
                while i < n and vals[i][_SEG][_S_ES] is not None:
                    i += 1
                if i == n:
                    return None
                b = vals[i]
        ms = self._max_split
        bs = b[_SIZE]
        if size < ms and bs >= ms:                         # CCA:3171-3174 no oversize block for it
            return None
        if size >= ms and bs >= size + self._max_nsr:      # CCA:3175-3179 oversize rounding limit
            return None
        del keys[i]                                        # CCA:3180-3181
        del vals[i]
        return b

    # ---------------------------------------------------------------- slow path of malloc
    def _malloc_slow(self, pool: _Pool, rs: int, orig: int, stream: int) -> list:
        alloc_size = get_allocation_size(rs, self.config)  # CCA:1440
        if self._allowed is not None and self._gc_thr > 0.0:   # CCA:1465-1470
            self._garbage_collect()
        b = self._alloc_block(pool, rs, alloc_size, stream, False)      # CCA:1477
        if b is None and self._release_available_cached_blocks(pool, rs):   # CCA:1484-1485
            b = self._alloc_block(pool, rs, alloc_size, stream, False)
        if b is None:                                      # CCA:1487-1489
            self._release_cached_blocks()
            b = self._alloc_block(pool, rs, alloc_size, stream, True)
        if b is None:
            self._raise_oom(orig, rs, alloc_size, stream)
        return b

    def _alloc_block(self, pool: _Pool, rs: int, alloc_size: int, stream: int, retry: bool):
        """CCA:3258-3366 alloc_block (cudaMalloc modelled against `capacity`)."""
        if retry:
            self.num_alloc_retries += 1                    # CCA:3269-3271
        if self._allowed is not None and self.reserved_bytes + alloc_size > self._allowed:
            return None                                    # CCA:3278-3282 fraction limit
        if self._es:                                       # CCA:3284-3298
            return self._try_allocate_expandable_block(pool, rs, stream)
        if self.capacity is not None and self.reserved_bytes + alloc_size > self.capacity:
            return None                                    # cudaMalloc -> cudaErrorMemoryAllocation
        addr = self._take_va(alloc_size)
        seg: list = [addr, alloc_size, pool.small, stream, None, None]
        b: list = [alloc_size, addr, None, None, ALLOC, pool, seg, 0, 0, None]
        seg[_S_HEAD] = b
        self._segments[addr] = seg
        self.num_segments += 1                             # CCA:3341-3344 segment / reserved_bytes
        r = self.reserved_bytes + alloc_size               # CCA:3338 total_allocated_memory += size
        self.reserved_bytes = r
        if r > self.peak_reserved:
            self.peak_reserved = r
        self.num_device_alloc += 1
        return b

    def _take_va(self, size: int) -> int:
        a = self._next_addr
        self._next_addr = a + ((size + _ADDR_ALIGN - 1) // _ADDR_ALIGN) * _ADDR_ALIGN
        if self._next_addr >= 1 << _KEY_SHIFT:
            raise OverflowError("synthetic address space exhausted")
        return a

    # ---------------------------------------------------------------- free_block / merge
    def _free_block(self, b: list) -> None:
        """CCA:2949-3023 free_block: merge with free neighbours, back into the pool."""
        pool = b[_POOL]
        seg = b[_SEG]
        orig_size = b[_SIZE]
        net_n = 0
        net_b = 0
        keys, vals = pool.keys, pool.vals
        p = b[_PREV]                                       # CCA:2973-2980 merge_candidates
        if p is not None and p[_STATE] == FREE:            # CCA:3028-3031 try_merge_blocks guard
            i = bisect_left(keys, (p[_SIZE] << _KEY_SHIFT) | p[_ADDR])
            del keys[i]
            del vals[i]
            b[_ADDR] = p[_ADDR]                            # CCA:3035-3042 [src dst]
            pp = p[_PREV]
            b[_PREV] = pp
            if pp is not None:
                pp[_NEXT] = b
            else:
                seg[_S_HEAD] = b
            b[_SIZE] += p[_SIZE]
            net_n -= 1
            net_b -= p[_SIZE]
        nx = b[_NEXT]
        if nx is not None and nx[_STATE] == FREE:          # CCA:3043-3048 [dst src]
            i = bisect_left(keys, (nx[_SIZE] << _KEY_SHIFT) | nx[_ADDR])
            del keys[i]
            del vals[i]
            nn = nx[_NEXT]
            b[_NEXT] = nn
            if nn is not None:
                nn[_PREV] = b
            b[_SIZE] += nx[_SIZE]
            net_n -= 1
            net_b -= nx[_SIZE]
        k = (b[_SIZE] << _KEY_SHIFT) | b[_ADDR]            # CCA:2986 insert_into_blocks
        i = bisect_left(keys, k)
        keys.insert(i, k)
        vals.insert(i, b)
        b[_GCB] = self._gc_calls[pool.small]
        b[_STATE] = FREE
        if seg[_S_ES] is None:                             # CCA:3003-3020 inactive_split (not expandable)
            if b[_PREV] is not None or b[_NEXT] is not None:   # CCA:2989-2992
                net_n += 1
                net_b += b[_SIZE]
            self.inactive_split += net_n
            self.inactive_split_bytes += net_b
        self.active_bytes -= orig_size                     # CCA:3020-3021
        self.requested_bytes -= b[_REQ]
        b[_REQ] = 0

    def _try_merge(self, dst: list, src: list | None) -> int:
        """CCA:3027-3058 try_merge_blocks for the map/unmap paths (mapped or unmapped pairs)."""
        if src is None:
            return 0
        st = src[_STATE]
        if st in (ALLOC, PENDING):                         # allocated / event_count / stream_uses
            return 0
        if (st == UNMAPPED) != (dst[_STATE] == UNMAPPED):  # dst->mapped != src->mapped
            return 0
        if st == UNMAPPED:
            self._uremove(src)
        else:
            self._remove(src)
        if dst[_PREV] is src:
            dst[_ADDR] = src[_ADDR]
            dst[_PREV] = src[_PREV]
            if dst[_PREV] is not None:
                dst[_PREV][_NEXT] = dst
            else:
                dst[_SEG][_S_HEAD] = dst
        else:
            dst[_NEXT] = src[_NEXT]
            if dst[_NEXT] is not None:
                dst[_NEXT][_PREV] = dst
        dst[_SIZE] += src[_SIZE]
        return src[_SIZE]

    # ---------------------------------------------------------------- events (record_stream)
    def _process_events(self) -> None:
        """CCA:3739-3780 process_events: a pending block is freed once its events are complete; here
        ``event_lag`` mallocs after its free (None = never, until synchronize / OOM retry)."""
        now = self._nmalloc
        keep = []
        for ent in self._pending:
            if ent[0] is not None and ent[0] <= now:
                self._free_block(ent[1])
            else:
                keep.append(ent)
        self._pending = keep

    # ---------------------------------------------------------------- releasing memory (release.py)
    def _release_block(self, b: list) -> None:
        """CCA:3489-3534 release_block: cudaFree of a whole (unsplit) segment."""
        _release._release_block(self, b)

    def _release_cached_blocks(self) -> None:
        """CCA:3428-3471 release_cached_blocks (default pool, no capture underway)."""
        _release._release_cached_blocks(self)

    def _release_blocks(self, pool: _Pool) -> None:
        """CCA:3607-3631 release_blocks: cudaFree unsplit segments, unmap free expandable pages."""
        _release._release_blocks(self, pool)

    def _release_available_cached_blocks(self, pool: _Pool, rs: int) -> bool:
        """CCA:3371-3416: free oversize (>= max_split_size) cached blocks, only enough for rs."""
        return _release._release_available_cached_blocks(self, pool, rs)

    def _garbage_collect(self) -> None:
        """CCA:3194-3251 garbage_collect_cached_blocks (large pool only, unsplit blocks)."""
        _release._garbage_collect(self)

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, stream: int):
        """CCA:2915-2946 try_allocate_expandable_block."""
        return _expandable._try_allocate_expandable_block(self, pool, size, stream)

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> list:
        """CCA:2799-2844 find_expandable_block: lowest-address unmapped range (plus a free block"""
        return _expandable._find_expandable_block(self, pool, size, stream)

    def _map_block(self, b: list, size: int) -> bool:
        """CCA:2846-2913 map_block (ExpandableSegment::map, CCA:399-494: whole pages)."""
        return _expandable._map_block(self, b, size)

    def _unmap_block(self, b: list) -> None:
        """CCA:3536-3606 unmap_block (ExpandableSegment::unmap, CCA:500-509: whole free pages)."""
        return _expandable._unmap_block(self, b)

    def _release_expandable_segment(self, b: list) -> None:
        """CCA release_expandable_segment: the whole VA range is one unmapped block again."""
        return _expandable._release_expandable_segment(self, b)

    # ---------------------------------------------------------------- OOM (report.py)
    def _raise_oom(self, orig: int, rs: int, alloc_size: int, stream: int) -> None:
        """CCA:1492-1613: no block after all retries -> OutOfMemoryError, with a verdict."""
        _report.raise_oom(self, orig, rs, alloc_size, stream)

    def replay(self, events: Sequence[int], streams: Sequence[int] | None = None,
               timeline: bool = True, memo: bool = True, watch_from: int = -1) -> ReplayResult:
        """Replay a compact trace: ``e > 0`` is ``malloc(e)`` (allocations are numbered 0, 1, 2, ..."""
        return _replay.replay(self, events, streams, timeline, memo, watch_from)

    def _fingerprint(self) -> tuple:
        """Everything the next decisions depend on, given that no allocation made by the trace"""
        return _replay._fingerprint(self)

    def _replay_generic(self, ev, st, timeline, handles, res_t, all_t) -> None:
        return _replay._replay_generic(self, ev, st, timeline, handles, res_t, all_t)

    def _replay_fast(self, ev, st, timeline, handles, res_t, all_t) -> None:
        """The same decisions as malloc()/free()/_free_block() with the default-path rules inlined"""
        return _replay._replay_fast(self, ev, st, timeline, handles, res_t, all_t)
