"""One replay of a whole step's trace, as the estimator asks for it: in C (`_fastreplay.c`) where the
extension is built and the configuration keeps to the rules it has (`default_path`), else through
`CachingAllocator`.
Both give the same bytes (tests/test_allocator_fast.py checks them against each other)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

from ...spec.alloc_conf import AllocatorConfig
from .caching import CachingAllocator

_native: ModuleType | None
try:  # built by setup.py where a C compiler is found (optional); _fastreplay.pyi gives its types
    from . import _fastreplay as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

_INT64_MAX = (1 << 63) - 1  # the C replay's sizes are int64: SIZE_MAX (no max_split_size) becomes this

#: Whether the C replay is built here (the Python one gives the same bytes, about twenty times slower).
NATIVE: bool = _native is not None


class TraceReplay(NamedTuple):
    """What one replay of a trace leaves: the final and highest reserved and allocated bytes, and with
    ``watch_from`` the highest (reserved, allocated) point from that event on (`ReplayResult.watched`)."""

    reserved: int
    allocated: int
    largest_free_block: int
    peak_reserved: int
    peak_allocated: int
    #: (reserved, allocated, largest free block) at the highest (reserved, allocated) point from
    #: `watch_from` on, and the highest allocated bytes from it on; None when no malloc came after it
    watched: tuple[int, int, int, int] | None
    #: with a `capacity`: the out-of-memory report where the trace does not fit (`ReplayResult.oom`), else None
    oom: dict | None = None


def default_path(config: AllocatorConfig) -> bool:
    """Does `config` keep to the rules the C replay has (no memory fraction or power-of-two rounding;
    `max_split_size_mb`, `expandable_segments` and up to eight streams, which it checks, it has)?"""
    return config.per_process_memory_fraction >= 1.0 and not any(d > 1 for d in config.roundup_power2_divisions)


def expand(load: Sequence[int], ops: array, sizes: array) -> tuple[int, ...]:
    """The trace `replay_trace` replays, as `CachingAllocator.replay` takes it (the ops' allocations
    numbered after loading's)."""
    shift = sum(1 for e in load if e >= 0)
    return tuple(load) + tuple(sizes[o] if o >= 0 else ~(~o + shift) for o in ops)


def expand_streams(load: Sequence[int], streams: array | None) -> tuple[int, ...] | None:
    """`expand`'s trace's stream per event (`CachingAllocator.replay`'s ``streams``): loading's on the default
    stream, then `streams` (`trainmem_nb.engine.trace.trace_streams`); None for the default stream only."""
    return None if streams is None else (0,) * len(load) + tuple(streams)


def replay_trace(load: array, ops: array, sizes: array, config: AllocatorConfig, watch_from: int = -1,
                 capacity: int | None = None, native: bool = True, streams: array | None = None) -> TraceReplay:
    """Replay `load` and then `ops` at `sizes` (``o >= 0`` mallocs ``sizes[o]``, ``o < 0`` frees
    allocation ``~o`` counted after `load`'s) on a fresh allocator; all three are ``array('q')``.
    `streams`: each op's CUDA stream (`trainmem_nb.engine.trace.trace_streams`; loading's are the default one).
    With `capacity`, short of memory it frees its cache and retries; the result's `oom` says where it failed."""
    if native and _native is not None and default_path(config):
        got = _native.replay(load, ops, sizes, watch_from, config.large_segment_size,
                             min(config.max_split_size, _INT64_MAX), min(config.max_non_split_rounding_size, _INT64_MAX),
                             -1 if capacity is None else capacity, bool(config.expandable_segments), streams)
        if got is not None:
            return TraceReplay(*got)
        # past the capacity: the out-of-memory retry path is Python's
    run = CachingAllocator(config, capacity=capacity).replay(expand(load, ops, sizes), expand_streams(load, streams),
                                                            timeline=False, memo=False, watch_from=watch_from)
    f = run.final
    return TraceReplay(f["reserved_bytes"], f["allocated_bytes"], f["largest_free_block"], f["peak_reserved"],
                       f["peak_allocated"], run.watched, run.oom)
