"""The caching allocator's records: blocks, per-stream pools, expandable segments and the OOM error."""

from __future__ import annotations

# block record fields
_SIZE, _ADDR, _PREV, _NEXT, _STATE, _POOL, _SEG, _REQ, _GCB, _USES = range(10)
# block states: FREE = cached & mapped (in pool.blocks), ALLOC = handed out,
# PENDING = freed but waiting for stream events (recordStream), UNMAPPED = expandable VA not backed
FREE, ALLOC, PENDING, UNMAPPED = 0, 1, 2, 3
# segment record fields: [address, size, is_small, stream, expandable (_ExpSeg or None), head block]
_S_ADDR, _S_SIZE, _S_SMALL, _S_STREAM, _S_ES, _S_HEAD = range(6)




class AllocatorOOM(MemoryError):
    """Raised where torch raises torch.OutOfMemoryError (CCA:1588-1612), with the model's verdict."""

    def __init__(self, info: dict):
        self.info = info
        super().__init__(info["message"])


class _Pool:
    """One BlockPool restricted to one stream (the C++ set is ordered by stream first, CCA:867-880,
    and every search stops at the first block of another stream, so per-stream lists are exact)."""
    __slots__ = ("keys", "small", "stream", "ukeys", "uvals", "vals")

    def __init__(self, small: bool, stream: int):
        self.keys: list = []      # size << 56 | addr, sorted  == BlockComparatorSize (CCA:867-875)
        self.vals: list = []      # blocks, parallel to keys
        self.small = small
        self.stream = stream
        self.ukeys: list = []     # unmapped blocks by address == BlockComparatorAddress (CCA:876-881)
        self.uvals: list = []


class _ExpSeg:
    """ExpandableSegment (CCA:368-780): a VA range of max_handles pages of `page` bytes."""
    __slots__ = ("base", "mapped", "max_handles", "page", "small", "stream", "va_size")

    def __init__(self, base: int, page: int, total_mem: int, stream: int, small: bool):
        self.base = base
        self.page = page                                  # 2 MiB small pool, large_segment_size large
        # CCA:385 max_handles_ = numSegments(totalGlobalMem + totalGlobalMem / 8)
        self.max_handles = (total_mem + total_mem // 8 + page - 1) // page
        self.va_size = self.max_handles * page
        self.mapped = bytearray(self.max_handles)
        self.stream = stream
        self.small = small


