"""A compiled step as the caching allocator sees it: every malloc and free, in order, with sizes.

The allocator decides which cached block serves which request from the exact order of every
allocation and free, so the trace is built from an *unrolled* program (``compile_step(...,
unrolled=True)``: each layer its own segment, each tensor named by a token). `allocator_trace` expands
it at one batch shape into the trace `trainmem_nb.engine.allocator` replays: what is alive before the
step first (weights, optimizer states, workspaces, allocated once as loading leaves them), then
`steps` training steps. Events the optimizer and the engines group (``k`` tensors of one size) have no
names: their frees take the most recent live tensors of that size, as ``zero_grad`` and ``foreach``
release what they made. A step ends with nothing it made alive, and what it freed of the state it
found (accumulated gradients, zeroed) made again, so that the second step starts as the first did.

>>> from trainmem_nb.model.spec import ModelSpec
>>> from trainmem_nb.spec.training import TrainingSpec
>>> from trainmem_nb.step.compile import compile_step
>>> m = ModelSpec(family="llama", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=256)
>>> trace = allocator_trace(compile_step(m, TrainingSpec(micro_batch=1, seq_len=16), unrolled=True), 1, 16)
>>> sum(1 for e in trace if e >= 0) - sum(1 for e in trace if e < 0) > 0  # the weights stay allocated
True
"""

from __future__ import annotations

from array import array
from collections import defaultdict

from .program import CAT_INDEX, Program

__all__ = ["allocator_trace", "step_starts", "trace_arrays", "trace_length", "trace_streams"]


def _bytes(sz: object, b: int, s: int) -> int:
    n = round(sz.at(b, s))  # type: ignore[attr-defined]
    return n if n > 0 else 0


def allocator_trace(prog: Program, micro_batch: int, seq_len: int, steps: int = 2,
                    first_step: bool = False) -> tuple[int, ...]:
    """The program's allocations and frees at (micro_batch, seq_len) as a replay trace: ``e >= 0``
    mallocs ``e`` bytes (allocations numbered 0, 1, ... in order; size-0 mallocs are numbered too),
    ``e < 0`` frees allocation ``~e``. `prog` should be unrolled: a repeated segment is replayed as its
    repetitions, each free taking the most recent live tensor of its name (the backward frees the
    forward's repetitions in reverse), which is exact only when no repetition frees a predecessor's
    tensor by a name it no longer has (then the latest tensor of that size goes instead).

    `first_step`: the first of the steps is a training loop's first, whose ``optimizer.step()`` creates
    the optimizer state (``_init_group``'s ``zeros_like``, one tensor at a time, when the step's
    activations are freed and cached) instead of finding it allocated: the history a real run's
    allocator has before its steady state (measured on an H200: the segments then match)."""
    sizes, ops, _starts = _template(prog, steps, first_step)
    b, s = micro_batch, seq_len
    at = [_bytes(sz, b, s) for sz in sizes]
    return tuple(at[o] if o >= 0 else o for o in ops)


def trace_arrays(prog: Program, micro_batch: int, seq_len: int, steps: int = 2,
                 first_step: bool = False) -> tuple[array, array]:
    """`allocator_trace` left as its template: ``(ops, sizes)``, both ``array('q')``, where an op ``o >= 0``
    mallocs ``sizes[o]`` and ``o < 0`` frees allocation ``~o`` (what `trainmem_nb.engine.allocator.fast`
    replays without building the trace in Python)."""
    sizes, ops, _starts = _template(prog, steps, first_step)
    b, s = micro_batch, seq_len
    return ops, array("q", [_bytes(sz, b, s) for sz in sizes])


def trace_streams(prog: Program, steps: int = 2, first_step: bool = False) -> array | None:
    """The CUDA stream of each of `trace_arrays`'s ops (``array('q')``, 0 for the default stream and for every
    free), or None when the program allocates on the default stream only (`Program.stream_tokens`)."""
    return _template_entry(prog, steps, first_step)[4]


def trace_length(prog: Program, steps: int = 2) -> int:
    """About how many events `allocator_trace` gives for `prog`, folded or unrolled, without building it
    (what the state made again after a step adds is left out): to decide whether a replay is affordable.
    Memoised on the program, as `_template` is."""
    hit = _LENGTHS.get(id(prog))
    if hit is None or hit[0] is not prog:
        per_step = sum(seg.repeat * sum(abs(k) for _c, k, _sz, _l in seg.events) for seg in prog.segments)
        hit = _LENGTHS[id(prog)] = (prog, sum(n for _c, _sz, n in prog.init), per_step)
        if len(_LENGTHS) > 1024:
            _LENGTHS.pop(next(iter(_LENGTHS)))
    return hit[1] + steps * hit[2]


_LENGTHS: dict[int, tuple[Program, int, int]] = {}


def step_starts(prog: Program, steps: int = 2, first_step: bool = False) -> tuple[int, ...]:
    """Where each step begins in `allocator_trace`'s events (after the loaded state)."""
    return _template(prog, steps, first_step)[2]


_TEMPLATES: dict[tuple[int, int, bool], tuple[Program, list[object], array, tuple[int, ...], array | None]] = {}
_STATES = CAT_INDEX["optimizer_states"]


def _template(prog: Program, steps: int, first_step: bool = False) -> tuple[list[object], array, tuple[int, ...]]:
    """The trace with sizes left symbolic: distinct size expressions, and per event the index of its
    size (a malloc) or ``~allocation`` (a free); built once per program (the compile cache keeps the
    program alive, so its id is a stable key while it is held here)."""
    _prog, sizes, ops, starts, _streams = _template_entry(prog, steps, first_step)
    return sizes, ops, starts


def _template_entry(prog: Program, steps: int, first_step: bool
                    ) -> tuple[Program, list[object], array, tuple[int, ...], array | None]:
    """`_template`'s cached entry: the program, sizes, ops, step starts and each op's stream (None when every
    malloc is on the default stream)."""
    hit = _TEMPLATES.get((id(prog), steps, first_step))
    if hit is not None and hit[0] is prog:
        return hit
    index: dict[object, int] = {}
    sizes: list[object] = []

    def size_of(sz: object) -> int:
        i = index.get(sz)
        if i is None:
            i = index[sz] = len(sizes)
            sizes.append(sz)
        return i

    ops: list[int] = []
    on = dict(prog.stream_tokens)  # the named tensors made on another stream than the default one
    streams: list[int] = []  # per op, the stream a malloc allocates on (0 for a free)
    count = [0]

    def malloc(i: int, tok: int = 0) -> int:
        ops.append(i)
        streams.append(on.get(tok, 0))
        count[0] += 1
        return count[0] - 1

    by_size: dict[int, list[int]] = defaultdict(list)  # every allocation by size, most recent last
    freed: set[int] = set()
    persistent: list[tuple[int, int]] = []  # (size index, allocation) alive before the step

    def new(i: int, tok: int = 0) -> int:
        a = malloc(i, tok)
        by_size[i].append(a)
        return a

    def free(a: int) -> None:
        freed.add(a)
        ops.append(~a)
        streams.append(0)

    def free_by_size(i: int) -> None:
        stack = by_size[i]
        while stack and stack[-1] in freed:
            stack.pop()
        if stack:
            free(stack.pop())

    kept: set[int] = set()  # allocations a step made that outlive it (a first step's optimizer states)
    deferred: list[int] = []  # a first step's optimizer states: size indices, made when its optimizer runs
    has_optimizer = any(seg.phase == "optimizer" for seg in prog.segments)
    for cat, sz, n in prog.init:
        i = size_of(sz)
        if first_step and has_optimizer and cat == _STATES:
            deferred += [i] * n
            continue
        persistent += [(i, new(i)) for _ in range(n)]
    starts: list[int] = []
    for _step in range(steps):
        starts.append(len(ops))
        named: dict[int, list[int]] = defaultdict(list)
        first = count[0]
        for seg in prog.segments:
            if deferred and seg.phase == "optimizer":
                made = [(i, new(i)) for i in deferred]
                persistent += made
                kept.update(a for _i, a in made)
                deferred = []
            toks = seg.tokens or (0,) * len(seg.events)
            for (_cat, k, sz, _label), tok in [e for _ in range(seg.repeat) for e in zip(seg.events, toks, strict=True)]:
                i = size_of(sz)
                if k > 0:
                    for _ in range(k):
                        a = new(i, tok)
                        if tok:
                            named[tok].append(a)
                    continue
                for _ in range(-k):
                    live = named.get(tok) if tok else None
                    while live and live[-1] in freed:
                        live.pop()
                    if live:
                        free(live.pop())
                    else:  # unnamed (grouped) or made before the step (the batch): the latest of its size
                        free_by_size(i)
        # the step is over: what it made and did not free goes (the loss, the batch); what existed
        # before it is made again if the step freed it (accumulated gradients, zeroed in place)
        for a in range(count[0] - 1, first - 1, -1):
            if a not in freed and a not in kept:
                free(a)
        for j, (i, a) in enumerate(persistent):
            if a in freed:
                persistent[j] = (i, new(i))
    if len(_TEMPLATES) >= 256:
        _TEMPLATES.pop(next(iter(_TEMPLATES)))
    # what the C replay reads (`trace_arrays`, `trace_streams`)
    entry = (prog, sizes, array("q", ops), tuple(starts), array("q", streams) if any(streams) else None)
    _TEMPLATES[(id(prog), steps, first_step)] = entry
    return entry
