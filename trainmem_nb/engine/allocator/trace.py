"""Whole traces on a fresh allocator: `simulate` (memoised) and `build_trace` (named events to a trace)."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from ...spec.alloc_conf import AllocatorConfig, parse_alloc_conf
from .caching import CachingAllocator
from .replay import ReplayResult


@functools.lru_cache(maxsize=64)
def _simulate_cached(events: tuple, streams: tuple | None, config: AllocatorConfig,
                     capacity: int | None, event_lag: int | None, timeline: bool) -> ReplayResult:
    r = CachingAllocator(config, capacity, event_lag).replay(events, streams, timeline)
    r.handles = []
    return r


def simulate(events: Iterable[int], config: AllocatorConfig | str | None = None,
             capacity: int | None = None, streams: Iterable[int] | None = None,
             event_lag: int | None = None, timeline: bool = True) -> ReplayResult:
    """Replay `events` on a fresh allocator; the result is memoised on (events, streams, config,
    capacity), so a repeated estimate of the same step costs one hash of the trace. Treat the
    returned object as read-only (it is shared between calls)."""
    if config is None or isinstance(config, str):
        config = parse_alloc_conf(config)
    ev = events if isinstance(events, tuple) else tuple(events)
    st = None if streams is None else (streams if isinstance(streams, tuple) else tuple(streams))
    return _simulate_cached(ev, st, config, capacity, event_lag, timeline)


def build_trace(ops: Iterable[tuple]) -> tuple:
    """Helper: ``[('malloc', name, size[, stream]), ('free', name), ...]`` -> (events, streams)."""
    ids: dict = {}
    ev: list = []
    st: list = []
    for op in ops:
        if op[0] == "malloc":
            ids[op[1]] = len(ids)
            ev.append(int(op[2]))
            st.append(op[3] if len(op) > 3 else 0)
        elif op[0] == "free":
            ev.append(~ids[op[1]])
            st.append(0)
        else:
            raise ValueError(f"unknown op {op[0]!r}")
    return tuple(ev), (tuple(st) if any(st) else None)


