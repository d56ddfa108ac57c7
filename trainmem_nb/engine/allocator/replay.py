"""Replaying a trace of malloc and free events through a `CachingAllocator`, fast, with a memo of the
steady state (a training loop that returns the allocator to the state it found it in)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count, repeat
from typing import TYPE_CHECKING

from ...spec.alloc_conf import _KEY_SHIFT, SIZE_MAX, round_size
from .blocks import _S_ADDR, _STATE, ALLOC, AllocatorOOM, _Pool

if TYPE_CHECKING:
    from .caching import CachingAllocator


@dataclass
class ReplayResult:
    reserved: tuple                 # reserved bytes after each event (empty if timeline=False)
    allocated: tuple                # allocated bytes after each event
    peak_reserved: int              # allocator's max_memory_reserved after the replay
    peak_allocated: int             # allocator's max_memory_allocated after the replay
    replay_peak_reserved: int       # highest reserved bytes during this replay
    replay_peak_allocated: int      # highest allocated bytes during this replay
    peak_reserved_event: int        # index of the first event after which reserved hit that peak
    final: dict                     # CachingAllocator.stats() at the end
    oom: dict | None             # None, or the AllocatorOOM info (+ 'event_index')
    handles: list = field(default_factory=list, repr=False)
    #: with ``watch_from``: (reserved, allocated, largest free block) at the point from that event on where
    #: (reserved, allocated) is highest (the earliest such point), and the highest allocated bytes from it on
    watched: tuple | None = None

    @property
    def fragmentation(self) -> tuple:
        """1 - allocated / reserved after each event (reserved but unallocated share)."""
        return tuple((1.0 - a / r) if r else 0.0 for r, a in zip(self.reserved, self.allocated, strict=True))

    @property
    def at_peak(self) -> dict:
        """Reserved, allocated and fragmentation right after the event that first reached the
        replay's reserved peak (empty without a timeline)."""
        i = self.peak_reserved_event
        if i < 0:
            return {}
        r, a = self.reserved[i], self.allocated[i]
        return {"event_index": i, "reserved": r, "allocated": a, "fragmentation": (1.0 - a / r) if r else 0.0}




# ---------------------------------------------------------------- replay
def replay(a: CachingAllocator, events: Sequence[int], streams: Sequence[int] | None = None,
           timeline: bool = True, memo: bool = True, watch_from: int = -1) -> ReplayResult:
    """Replay a compact trace: ``e > 0`` is ``malloc(e)`` (allocations are numbered 0, 1, 2, ...
    in order; ``0`` is a size-0 malloc, which allocates nothing), ``e < 0`` frees allocation
    number ``~e``. ``streams`` (same length) gives the stream of each malloc. Stops at the
    first OOM (reported in the result, the allocator keeps its state at that point).

    ``memo``: the simulation is deterministic, so when this allocator is in exactly the state
    (``_fingerprint``) in which it already replayed this trace, and that replay returned it to
    the same state (a training loop's steady state), the stored result is returned without
    re-simulating. Set ``memo=False`` to force the simulation.

    ``watch_from``: from that event on, keep the allocator's state where reserved, then allocated, is
    highest (`ReplayResult.watched`): one pass, where a timeline and a second replay to that point would
    take two."""
    ev = events if isinstance(events, tuple) else tuple(events)
    st = None if streams is None else (streams if isinstance(streams, tuple) else tuple(streams))
    fp = None
    if memo and not a._pending:
        fp = a._fingerprint()
        hit = a._memo.get((ev, st, timeline, watch_from))
        if hit is not None and hit[0] == fp:
            res, pr, pa, pact = hit[1], hit[2], hit[3], hit[4]
            a.peak_reserved = max(a.peak_reserved, pr)
            a.peak_allocated = max(a.peak_allocated, pa)
            a.peak_active = max(a.peak_active, pact)
            return ReplayResult(res.reserved, res.allocated, a.peak_reserved, a.peak_allocated,
                                res.replay_peak_reserved, res.replay_peak_allocated,
                                res.peak_reserved_event, a.stats(), None, [], res.watched)
    # peaks reached during this replay: start the running peaks at the current values
    saved = (a.peak_reserved, a.peak_allocated, a.peak_active)
    a.peak_reserved, a.peak_allocated, a.peak_active = (
        a.reserved_bytes, a.allocated_bytes, a.active_bytes)
    handles: list = []
    res_t: list = []
    all_t: list = []
    oom = None
    watch = [watch_from, -1, -1, 0, 0]  # from, reserved, allocated, largest free block, highest allocated
    try:
        if (a._allowed is None and not a._es and a._max_split == SIZE_MAX
                and not a._pending):
            _replay_fast(a, ev, st, timeline, handles, res_t, all_t, watch)
        else:
            _replay_generic(a, ev, st, timeline, handles, res_t, all_t, watch)
    except AllocatorOOM as ex:
        oom = dict(ex.info, event_index=a._replay_pos)
    rpr, rpa, rpact = a.peak_reserved, a.peak_allocated, a.peak_active
    a.peak_reserved = max(saved[0], rpr)
    a.peak_allocated = max(saved[1], rpa)
    a.peak_active = max(saved[2], rpact)
    peak_at = res_t.index(rpr) if (timeline and res_t and rpr in res_t) else -1
    result = ReplayResult(tuple(res_t), tuple(all_t), a.peak_reserved, a.peak_allocated,
                          rpr, rpa, peak_at, a.stats(), oom, handles,
                          tuple(watch[1:]) if watch_from >= 0 and watch[1] >= 0 else None)
    if fp is not None and oom is None and a._fingerprint() == fp and not any(
            h is not None and h[_STATE] == ALLOC for h in handles):
        if len(a._memo) >= 8:
            a._memo.pop(next(iter(a._memo)))
        a._memo[(ev, st, timeline, watch_from)] = (fp, result, rpr, rpa, rpact)
    return result


def _fingerprint(a: CachingAllocator) -> tuple:
    """Everything the next decisions depend on, given that no allocation made by the trace
    outlives it (blocks allocated before it are then untouched): pool contents (size and
    address of every cached free and unmapped block), segments, counters."""
    pools = tuple((small, s, tuple(p.keys), tuple(p.ukeys))
                  for small, d in ((0, a._large_pools), (1, a._small_pools))
                  for s, p in sorted(d.items()) if p.keys or p.ukeys)
    return (a.reserved_bytes, a.allocated_bytes, a.active_bytes, a.requested_bytes,
            a.inactive_split_bytes, a.inactive_split, a.num_segments, a._next_addr,
            tuple(a._gc_calls), a.num_device_alloc, a.num_device_free,
            a.num_alloc_retries, a.num_ooms, a.num_sync_all_streams, len(a._pending),
            a._allowed, a.capacity, a.event_lag, a.config, tuple(a._segments),
            tuple(s[_S_ADDR] for s in a._expandable), pools)


def _replay_generic(a: CachingAllocator, ev, st, timeline, handles, res_t, all_t, watch=None) -> None:
    push = handles.append
    malloc, free = a.malloc, a.free
    if st is None:
        st = (0,) * len(ev)
    w0 = watch[0] if watch is not None and watch[0] >= 0 else len(ev)
    for k, (e, s) in enumerate(zip(ev, st, strict=True)):
        a._replay_pos = k
        if e >= 0:
            push(malloc(e, s))
            if k >= w0 and e > 0:  # a size-0 malloc allocates nothing (as `_replay_fast` skips it)
                _watch(a, watch, a.reserved_bytes, a.allocated_bytes)
        else:
            free(handles[~e])
        if timeline:
            res_t.append(a.reserved_bytes)
            all_t.append(a.allocated_bytes)


def _watch(a: CachingAllocator, watch: list, reserved: int, alloc: int) -> None:
    """Keep the state at the highest (reserved, allocated) point (the earliest of equals) in `watch`."""
    if reserved > watch[1] or (reserved == watch[1] and alloc > watch[2]):
        watch[1], watch[2], watch[3] = reserved, alloc, a.largest_free_block()
    if alloc > watch[4]:
        watch[4] = alloc


def _replay_fast(a: CachingAllocator, ev, st, timeline, handles, res_t, all_t, watch=None) -> None:
    """The same decisions as malloc()/free()/_free_block() with the default-path rules inlined
    (no memory fraction, no expandable segments, no max_split_size): CCA:1438-1458 rounding,
    pool choice and best-fit; CCA:3095-3113 should_split; CCA:1654-1733 alloc_found_block;
    CCA:1980-2034 free; CCA:2949-3023 free_block. Anything else goes through the methods.
    The tests check it against _replay_generic event by event."""
    push = handles.append
    sp, lp = a._small_pools, a._large_pools
    rp2 = a._rp2
    cfg = a.config
    gcs, gcl = a._gc_calls[1], a._gc_calls[0]   # constant: no memory fraction set
    sh = _KEY_SHIFT
    alloc, peak_a = a.allocated_bytes, a.peak_allocated
    active, peak_act = a.active_bytes, a.peak_active
    req, isb, isn = a.requested_bytes, a.inactive_split_bytes, a.inactive_split
    reserved = a.reserved_bytes
    rt, at = res_t.append, all_t.append
    nm = a._nmalloc
    k_ev = 0
    w0 = watch[0] if watch is not None and watch[0] >= 0 else len(ev)
    try:
        for k_ev, e, s in zip(count(), ev, repeat(0) if st is None else st):
            if e > 0:
                nm += 1
                if e < 512:                                            # CCA:2586-2587
                    rs = 512
                elif rp2:
                    rs = round_size(e, cfg)
                else:
                    rs = (e + 511) & -512                              # CCA:2594
                small = rs <= 1048576                                  # CCA:3080 kSmallSize
                d = sp if small else lp
                pool = d.get(s)
                if pool is None:
                    pool = d[s] = _Pool(small, s)
                keys = pool.keys
                vals = pool.vals
                i = bisect_left(keys, rs << sh)                        # CCA:3134
                if i < len(keys):
                    b = vals[i]
                    del keys[i]
                    del vals[i]
                else:                                                  # new segment (CCA:1477-1489)
                    (a.allocated_bytes, a.peak_allocated, a.active_bytes, a.peak_active,
                     a.requested_bytes, a.inactive_split_bytes, a.inactive_split) = (
                        alloc, peak_a, active, peak_act, req, isb, isn)
                    a._nmalloc = nm
                    try:
                        b = a._malloc_slow(pool, rs, e, s)
                    finally:                       # the slow path may free pending blocks
                        (alloc, peak_a, active, peak_act, req, isb, isn) = (
                            a.allocated_bytes, a.peak_allocated, a.active_bytes,
                            a.peak_active, a.requested_bytes, a.inactive_split_bytes,
                            a.inactive_split)
                        reserved = a.reserved_bytes
                bsize = b[0]
                remaining = bsize - rs
                already_split = b[2] is not None or b[3] is not None
                if remaining >= 512 if small else remaining > 1048576:   # CCA:3107-3111
                    prev = b[2]
                    seg = b[6]
                    nb = [rs, b[1], prev, b, 1, pool, seg, e, 0, None]   # CCA:1674-1681
                    if prev is not None:
                        prev[3] = nb
                    else:
                        seg[5] = nb
                    b[2] = nb
                    a2 = b[1] + rs                                     # CCA:1683-1684
                    b[1] = a2
                    b[0] = remaining
                    k = (remaining << sh) | a2                         # CCA:1686 insert_into_blocks
                    j = bisect_left(keys, k)
                    keys.insert(j, k)
                    vals.insert(j, b)
                    b[8] = gcs if small else gcl
                    b[4] = 0
                    if already_split:                                  # CCA:1689-1700
                        isb -= rs
                    else:
                        isb += remaining
                        isn += 1
                    b = nb
                else:
                    if already_split:                                  # CCA:1702-1708
                        isb -= bsize
                        isn -= 1
                    b[4] = 1
                    b[7] = e
                bs = b[0]                                              # CCA:1727-1733
                alloc += bs
                if alloc > peak_a:
                    peak_a = alloc
                active += bs
                if active > peak_act:
                    peak_act = active
                req += e
                push(b)
                if k_ev >= w0:
                    _watch(a, watch, reserved, alloc)
            elif e == 0:
                push(None)
            else:
                b = handles[~e]
                if b is None:
                    pass
                elif b[4] != 1:
                    raise ValueError("free of a handle that is not allocated (double free?)")
                elif b[9]:                                             # recordStream'ed: methods
                    (a.allocated_bytes, a.active_bytes, a.requested_bytes,
                     a.inactive_split_bytes, a.inactive_split) = (alloc, active, req, isb, isn)
                    a._nmalloc = nm
                    a.free(b)
                    alloc, active, req = a.allocated_bytes, a.active_bytes, a.requested_bytes
                    isb, isn = a.inactive_split_bytes, a.inactive_split
                else:
                    bsize = b[0]
                    alloc -= bsize                                     # CCA:1993-1996
                    pool = b[5]
                    seg = b[6]
                    keys = pool.keys
                    vals = pool.vals
                    net_n = 0
                    net_b = 0
                    p = b[2]
                    if p is not None and p[4] == 0:                    # CCA:3028-3042
                        ps = p[0]
                        j = bisect_left(keys, (ps << sh) | p[1])
                        del keys[j]
                        del vals[j]
                        b[1] = p[1]
                        pp = p[2]
                        b[2] = pp
                        if pp is not None:
                            pp[3] = b
                        else:
                            seg[5] = b
                        b[0] += ps
                        net_n -= 1
                        net_b -= ps
                    nx = b[3]
                    if nx is not None and nx[4] == 0:                  # CCA:3043-3048
                        ns = nx[0]
                        j = bisect_left(keys, (ns << sh) | nx[1])
                        del keys[j]
                        del vals[j]
                        nn = nx[3]
                        b[3] = nn
                        if nn is not None:
                            nn[2] = b
                        b[0] += ns
                        net_n -= 1
                        net_b -= ns
                    k = (b[0] << sh) | b[1]                            # CCA:2986
                    j = bisect_left(keys, k)
                    keys.insert(j, k)
                    vals.insert(j, b)
                    b[8] = gcs if pool.small else gcl
                    b[4] = 0
                    if b[2] is not None or b[3] is not None:           # CCA:2989-2992
                        net_n += 1
                        net_b += b[0]
                    isn += net_n                                       # CCA:3003-3016
                    isb += net_b
                    active -= bsize                                    # CCA:3020-3021
                    req -= b[7]
                    b[7] = 0
            if timeline:
                rt(reserved)
                at(alloc)
    finally:
        (a.allocated_bytes, a.peak_allocated, a.active_bytes, a.peak_active,
         a.requested_bytes, a.inactive_split_bytes, a.inactive_split) = (
            alloc, peak_a, active, peak_act, req, isb, isn)
        a._nmalloc = nm
        a._replay_pos = k_ev
