"""A standard-library-only model of PyTorch's CUDA caching allocator (its default path also in C, `fast`).

It replays a sequence of malloc/free events (sizes in bytes, optional stream ids) through the
same decisions ``c10/cuda/CUDACachingAllocator.cpp`` makes and reports what ``torch.cuda``
would: ``memory_reserved`` / ``max_memory_reserved`` (reserved_bytes.all.current/peak),
``memory_allocated`` / ``max_memory_allocated`` (allocated_bytes.all.current/peak), the largest
cached free block (``cacheInfo``), ``inactive_split_bytes`` and a ``_snapshot()``-shaped segment
list.

Source read (see RULES.md for every rule with its quote):

* ``CCA``  c10/cuda/CUDACachingAllocator.cpp, stored copy (index id 79076714, 168,130 chars) of the
  torch 2.1x tree; line numbers are of that copy.
* ``AC.cpp`` c10/core/AllocatorConfig.cpp, cyyever/pytorch@106319cb; its checks raise at the same
  places in the installed torch 2.13.0 libc10.so, 4 lines lower (AC.cpp:121 here = :117 in 2.13).
* ``AC.h`` / ``CAC.h`` / ``Alloc.h``: c10/core/AllocatorConfig.h, c10/cuda/CUDAAllocatorConfig.h,
  c10/core/Allocator.h exactly as installed with torch 2.13.0 (git cf30153c).
* ``CAC.cpp`` c10/cuda/CUDAAllocatorConfig.cpp, cyyever/pytorch@0b2b76de.

Not modelled (see RULES.md): CUDA-graph private pools / MemPool, the pinned (host) allocator, the
cudaMallocAsync backend, IPC, multiple devices, driver-side fragmentation of physical memory.

Usage::

    cfg = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")   # frozen dataclass
    a = CachingAllocator(cfg, capacity=80 << 30)
    h = a.malloc(3 << 20, stream=0); a.free(h)
    a.reserved_bytes, a.peak_reserved, a.allocated_bytes, a.largest_free_block(), a.snapshot()

    # a whole trace: e > 0 mallocs e bytes (allocation ids 0, 1, 2, ...), e < 0 frees id ~e
    r = simulate([3 << 20, 30 << 20, ~1, ~0], "max_split_size_mb:128", capacity=80 << 30)
    r.reserved, r.allocated, r.peak_reserved, r.at_peak, r.final["largest_free_block"], r.oom

Representation (chosen for speed): a block is a Python list
``[size, addr, prev, next, state, pool, seg, requested, gc_base, stream_uses]``; a free pool is a
sorted list of integer keys ``size << 56 | addr`` plus the parallel list of blocks, so the
C++ ``std::set`` ordered by (stream, size, address) becomes one ``bisect`` per pool per stream.
"""

from ...spec.alloc_conf import (
    VALID_KEYS,
    AllocatorConfig,
    get_allocation_size,
    kLargeBuffer,
    kMinBlockSize,
    kMinLargeAlloc,
    kRoundLarge,
    kSmallBuffer,
    kSmallSize,
    parse_alloc_conf,
    round_size,
    roundup_power2_next_division,
)
from .blocks import AllocatorOOM
from .caching import CachingAllocator
from .replay import ReplayResult
from .trace import build_trace, simulate

__all__ = [
    "VALID_KEYS", "AllocatorConfig", "AllocatorOOM", "CachingAllocator", "ReplayResult", "build_trace",
    "get_allocation_size", "kLargeBuffer", "kMinBlockSize", "kMinLargeAlloc", "kRoundLarge", "kSmallBuffer",
    "kSmallSize", "parse_alloc_conf", "round_size", "roundup_power2_next_division", "simulate",
]
