"""The caching allocator's segments in one comparable shape, from ``torch.cuda.memory._snapshot()`` or
from this model's `CachingAllocator.snapshot` (which has the same shape): what a GPU run recorded and
what the replay predicts can be printed side by side (``scripts/compare_snapshot.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["segment_summary", "segments_digest"]


def segment_summary(segments: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each segment as ``{"total_size", "segment_type", "stream", "blocks": [[size, state], ...]}`` (state:
    "active_allocated", "active_pending_free" / "active_awaiting_free" or "inactive"), in address order
    as the snapshot lists them; addresses are left out (the device's are not the model's)."""
    out = []
    for seg in segments:
        blocks = [[int(b["size"]), str(b["state"])] for b in seg.get("blocks", ())]
        out.append({"total_size": int(seg["total_size"]), "segment_type": str(seg.get("segment_type", "large")),
                    "stream": int(seg.get("stream", 0)), "blocks": blocks})
    return out


def segments_digest(summary: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Totals of a `segment_summary`: reserved bytes, segments of each pool, bytes allocated and cached
    free, and the largest free block (``cacheInfo``'s answer)."""
    segs = list(summary)
    free = [size for s in segs for size, state in s["blocks"] if state == "inactive"]
    return {
        "reserved_bytes": sum(s["total_size"] for s in segs),
        "large_segments": sum(1 for s in segs if s["segment_type"] == "large"),
        "small_segments": sum(1 for s in segs if s["segment_type"] == "small"),
        "allocated_bytes": sum(size for s in segs for size, state in s["blocks"] if state == "active_allocated"),
        "free_cached_bytes": sum(free),
        "largest_free_block_bytes": max(free, default=0),
    }
