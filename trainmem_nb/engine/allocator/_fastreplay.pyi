"""Types of the C replay (`_fastreplay.c`); `fast.replay_trace` is its Python entry point."""

from array import array

def replay(load: array, ops: array, sizes: array, watch_from: int, large_segment_size: int,
           max_split_size: int, max_non_split_rounding_size: int, capacity: int, expandable: bool = ...,
           streams: array | None = ..., /) -> tuple[int, int, int, int, int, tuple[int, int, int, int] | None] | None: ...
