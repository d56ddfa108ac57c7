"""A compiled step: segments of allocation and free events, repeated per layer, and their evaluation.

A `Program` depends on the model and the training options but not on the batch shape: its event sizes
are linear forms in (micro_batch, seq_len). `evaluate` turns it into bytes, a peak and a breakdown for
one batch shape in well under a millisecond; since every repetition of a repeated segment adds the same
bytes, the peak over repetitions is at the first or the last one. `timeline` draws the live bytes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from operator import itemgetter
from typing import NamedTuple

from ..device import CUDA_BLOCK_BYTES
from .breakdown import DETAIL_KEYS, TOP_KEYS
from .tape import Sz

__all__ = ['Program', 'Segment', 'TimelinePoint', 'activations_at_forward_end', 'evaluate',
           'forward_activation_events', 'peak_with_churn', 'timeline']

CAT_INDEX = {k: i for i, k in enumerate(DETAIL_KEYS)}
#: the categories whose bytes `peak_with_churn` weighs (the churn the caching allocator keeps cached)
_CHURN_PREFIXES = ("activations/", "transient/")
_CHURN_CATS = frozenset(i for i, k in enumerate(DETAIL_KEYS) if k.startswith(_CHURN_PREFIXES))


class Segment(NamedTuple):
    """Events of one part of the step, repeated `repeat` times (a layer's events repeat)."""

    phase: str  # forward | backward | optimizer | zero
    label: str
    repeat: int
    events: tuple[tuple[int, int, Sz, str], ...]  # (category index, +k alloc / -k free of k tensors, bytes, label)
    fast: tuple[tuple[int, float, int], ...] = ()  # per event: (monomial index or -1, coefficient, sign)
    general: tuple[int, ...] = ()  # events whose size has several terms (computed in full)
    #: the segment's net effect per category: (category, monomial index, coefficient, summed sign) of its
    #: one-term events (an alloc and its free inside the segment cancel out), for `_breakdown_at`
    net: tuple[tuple[int, int, float, int], ...] = ()
    sizes_of: tuple[tuple[int, float], ...] = ()  # the distinct one-term sizes (monomial index, coefficient)
    which: tuple[tuple[int, int], ...] = ()  # per event: (index into sizes_of, sign)
    #: the distinct (index into sizes_of, sign) pairs of the one-term events, then one slot per
    #: several-term event; `gather` picks every event's signed bytes from a table of them (in C)
    pairs: tuple[tuple[int, int, bool], ...] = ()
    gather: Callable[[list[float]], tuple[float, ...]] | None = None
    #: per event, the tensor it allocates or frees (a token unique in the program; 0: unnamed, as the
    #: optimizer's and engines' grouped events are), for replaying the step through the caching allocator
    tokens: tuple[int, ...] = ()
    #: per table slot (the pairs, then the several-term events): does it hold activation or transient
    #: bytes, which `peak_with_churn` weighs (a pair's slot is split by it, so the weights apply to the table)
    churn: tuple[bool, ...] = ()
    #: where one layer ends and the next begins inside a segment that runs several (a period of a layer
    #: pattern), as event offsets: `evaluate` computes the bytes of each distinct layer once. Any offsets
    #: give the same bytes (the blocks compose exactly); these make the blocks recur
    cuts: tuple[int, ...] = ()


def _segment(phase: str, label: str, repeat: int, events: tuple[tuple[int, int, Sz, str], ...],
             tokens: tuple[int, ...] = (), cuts: tuple[int, ...] = ()) -> Segment:
    """A segment with its events' sizes precompiled for `evaluate` (and, optionally, its events'
    tensors named by `tokens` and its layers' boundaries by `cuts`)."""
    fast = tuple((*_terms(sz), sign) for _c, sign, sz, _l in events)
    net: dict[tuple[int, int, float], int] = {}
    for (cat, _sign, _sz, _l), (i, c, k) in zip(events, fast, strict=True):
        if i >= 0:
            net[(cat, i, c)] = net.get((cat, i, c), 0) + k
    distinct: dict[tuple[int, float], int] = {}
    which = tuple((distinct.setdefault((max(i, 0), c), len(distinct)), k) for i, c, k in fast)
    general = tuple(j for j, f in enumerate(fast) if f[0] < 0)
    slot: dict[tuple[int, int, bool], int] = {}
    index = [slot.setdefault((*w, e[0] in _CHURN_CATS), len(slot)) for w, e in zip(which, events, strict=True)]
    for g_index, j in enumerate(general):  # several-term sizes: a slot of their own, after the pairs
        index[j] = len(slot) + g_index
    churn = (*(c for _u, _k, c in slot), *(events[j][0] in _CHURN_CATS for j in general))
    gather: Callable[[list[float]], tuple[float, ...]] | None = None
    if len(index) == 1:
        only = index[0]
        gather = lambda table: (table[only],)  # noqa: E731  (itemgetter of one index returns no tuple)
    elif index:
        gather = itemgetter(*index)
    return Segment(phase, label, repeat, events, fast, general,
                   tuple((cat, i, c, k) for (cat, i, c), k in net.items() if k), tuple(distinct), which,
                   tuple(slot), gather, tokens, churn, cuts)


@dataclass(frozen=True)
class Program:
    """A compiled step: what is alive before it (by category) and its segments."""

    init: tuple[tuple[int, Sz, int], ...]  # (category index, bytes of one tensor, count)
    segments: tuple[Segment, ...]
    n_params: int
    n_trainable: int
    #: the tokens of the tensors passed from one layer to the next (outputs, input gradients, an engine's
    #: lingering buffers): a repeated segment's first repetition frees its predecessor's, a later one the
    #: previous repetition's (`trainmem_nb.engine.trace`)
    chain_tokens: frozenset[int] = frozenset()
    #: ``(token, stream)`` of the tensors allocated on another CUDA stream than the default one (an engine's
    #: communication streams, `trainmem_nb.engine.tape.T.stream`): the allocator replay pools them apart
    stream_tokens: tuple[tuple[int, int], ...] = ()
    #: an engine made some of its tensors where the repeated layers begin instead of a few layers into them
    #: (`trainmem_nb.engine.tape.Graph.approximated`): the program with every layer (``unrolled=True``) is exact
    approximated: bool = False
    #: per segment, the index of the first segment with the same events (a layer's first, middle and last
    #: repetitions usually are): `evaluate` computes their bytes once
    same_as: tuple[int, ...] = field(init=False, repr=False, compare=False)
    #: per segment, its blocks (`Segment.cuts`: a layer each) as indices into `block_segments`, the distinct
    #: blocks of the program, compiled: `evaluate` and `peak_with_churn` compute each distinct block once
    blocks: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    block_segments: tuple[Segment, ...] = field(init=False, repr=False, compare=False)
    #: bytes per detailed category of the `init` tensors whose size does not depend on the batch shape
    init_fixed: tuple[int, ...] = field(init=False, repr=False, compare=False)
    #: the `init` entries whose size does (category index, bytes of one tensor, count)
    init_shaped: tuple[tuple[int, Sz, int], ...] = field(init=False, repr=False, compare=False)
    #: per peak segment, the one-term events of every segment before it summed by (category, monomial,
    #: coefficient), and those segments with several-term events (`_prefix_terms`, filled on demand)
    prefix: dict[int, tuple[tuple[tuple[int, int, float, int], ...], tuple[int, ...]]] = field(
        init=False, repr=False, compare=False)
    #: per segment, each several-term event as (category, its block's place in the segment, its index in the
    #: block): where `evaluate`'s per-block sizes hold it
    general_at: tuple[tuple[tuple[int, int, int], ...], ...] = field(init=False, repr=False, compare=False)
    #: one table of signed, rounded event sizes for the whole program (`evaluate` fills it once per batch
    #: shape): the distinct one-term sizes (monomial index, coefficient), the distinct (size, sign) slots
    #: built from them, then the several-term events (size, sign); each distinct block picks its events'
    #: entries from it (`block_gathers`, in C)
    size_keys: tuple[tuple[int, float], ...] = field(init=False, repr=False, compare=False)
    slot_keys: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    general_keys: tuple[tuple[Sz, int], ...] = field(init=False, repr=False, compare=False)
    block_gathers: tuple[Callable[[list[float]], tuple[float, ...]], ...] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first: dict[tuple[object, ...], int] = {}
        same = tuple(first.setdefault((seg.repeat > 0, tuple((c, k, sz) for c, k, sz, _l in seg.events)), i)
                     for i, seg in enumerate(self.segments))
        fixed = [0] * len(DETAIL_KEYS)
        shaped = []
        for cat, sz, count in self.init:
            if sz.s_ or sz.bs or sz.bss or sz.b_ or sz.ss:
                shaped.append((cat, sz, count))
            else:
                fixed[cat] += _round(sz.c0) * count
        unique: dict[tuple[object, ...], int] = {}
        block_segments: list[Segment] = []
        blocks: list[tuple[int, ...]] = []
        general_at: list[tuple[tuple[int, int, int], ...]] = []
        for seg in self.segments:
            if seg.repeat <= 0 or not seg.events:
                blocks.append(())
                general_at.append(())
                continue
            edges = [0, *sorted(c for c in set(seg.cuts) if 0 < c < len(seg.events)), len(seg.events)]
            general_at.append(tuple((seg.events[e][0], p, e - edges[p])
                                    for e in seg.general for p in [bisect_right(edges, e) - 1]))
            ids = []
            for a, z in pairwise(edges):
                part = seg.events[a:z]
                key = tuple((c, k, sz) for c, k, sz, _l in part)
                i = unique.get(key)
                if i is None:
                    i = unique[key] = len(block_segments)
                    block_segments.append(seg if len(edges) == 2 else _segment(seg.phase, seg.label, seg.repeat, part))
                ids.append(i)
            blocks.append(tuple(ids))
        sizes: dict[tuple[int, float], int] = {}
        slots: dict[tuple[int, int], int] = {}
        general: dict[tuple[Sz, int], int] = {}
        picks = []
        for seg in block_segments:
            pick: list[tuple[bool, int]] = []
            for (i, c, k), (_cat, _sign, sz, _l) in zip(seg.fast, seg.events, strict=True):
                if i >= 0:
                    pick.append((True, slots.setdefault((sizes.setdefault((i, c), len(sizes)), k), len(slots))))
                else:
                    pick.append((False, general.setdefault((sz, k), len(general))))
            picks.append(pick)
        gathers = [_picker([j if one else len(slots) + j for one, j in pick])  # the several-term events' entries
                   for pick in picks]                                          # follow the slots
        object.__setattr__(self, "size_keys", tuple(sizes))
        object.__setattr__(self, "slot_keys", tuple(slots))
        object.__setattr__(self, "general_keys", tuple(general))
        object.__setattr__(self, "block_gathers", tuple(gathers))
        object.__setattr__(self, "same_as", same)
        object.__setattr__(self, "blocks", tuple(blocks))
        object.__setattr__(self, "block_segments", tuple(block_segments))
        object.__setattr__(self, "init_fixed", tuple(fixed))
        object.__setattr__(self, "init_shaped", tuple(shaped))
        object.__setattr__(self, "prefix", {})
        object.__setattr__(self, "general_at", tuple(general_at))


def _picker(index: list[int]) -> Callable[[list[float]], tuple[float, ...]]:
    """The entries of a table at `index`, as a tuple (`operator.itemgetter`, which returns no tuple for one
    index and takes none)."""
    if not index:
        return lambda table: ()
    if len(index) == 1:
        only = index[0]
        return lambda table: (table[only],)
    return itemgetter(*index)


def _round(nbytes: float) -> int:
    n = round(nbytes)
    return -(-n // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if n > 0 else 0


class Evaluation(NamedTuple):
    """Bytes of a compiled program for one batch shape."""

    peak: int
    peak_phase: str
    peak_at: str
    detail: dict[str, int]
    phase_peaks: dict[str, int]


# The size forms' monomials, in the order of `_terms`: 1, b, s, b*s, s*s, b*s*s.
_FIELDS = ("c0", "b_", "s_", "bs", "ss", "bss")


def _terms(sz: Sz) -> tuple[int, float]:
    """An event's size as (monomial index, coefficient) when it has one term, else (-1, 0)."""
    hit = _TERMS.get(sz)
    if hit is None:
        nz = [(i, c) for i, c in enumerate((sz.c0, sz.b_, sz.s_, sz.bs, sz.ss, sz.bss)) if c]
        if len(nz) == 1:
            coef = nz[0][1]
            hit = nz[0][0], int(coef) if float(coef).is_integer() else coef
        else:
            hit = (-1, 0) if nz else (0, 0)
        if len(_TERMS) < 1 << 16:  # sizes recur across layers and programs; bound the memo all the same
            _TERMS[sz] = hit
    return hit


_TERMS: dict[Sz, tuple[int, float]] = {}


def _program_table(prog: Program, b: int, s: int, mono: tuple[int, ...]) -> list[float]:
    """`Program`'s table of signed, 512-B-rounded event sizes at (b, s): each distinct one-term size
    computed once for the whole program, then its signed slots and the several-term events."""
    vals = [-(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES for i, c in prog.size_keys]
    table = [k * vals[u] for u, k in prog.slot_keys]
    table += [k * _round(sz.at(b, s)) for sz, k in prog.general_keys]
    return table


def _sizes(seg: Segment, b: int, s: int, mono: tuple[int, ...]) -> tuple[float, ...]:
    """Signed, 512-B-rounded bytes of each event at (b, s): a table of the distinct (size, sign) pairs
    and several-term sizes, then every event's entry picked from it."""
    return seg.gather(_table(seg, b, s, mono)) if seg.gather is not None else ()


def _table(seg: Segment, b: int, s: int, mono: tuple[int, ...]) -> list[float]:
    """The signed, rounded bytes of each of `seg`'s table slots at (b, s) (`Segment.pairs`, then the
    several-term events)."""
    vals = [-(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES for i, c in seg.sizes_of]
    table = [k * vals[u] for u, k, _c in seg.pairs]
    for j in seg.general:
        table.append(seg.fast[j][2] * _round(seg.events[j][2].at(b, s)))
    return table


def evaluate(prog: Program, micro_batch: int, seq_len: int) -> Evaluation:
    """The peak of `prog` for one batch shape, with its category breakdown and phase."""
    b, s = micro_batch, seq_len
    mono = (1, b, s, b * s, s * s, b * s * s)
    init = _init_bytes(prog, b, s)
    total: float = sum(init)
    # (segment index, (block, its first event's index in the segment), repetitions before)
    best, best_at = total, (-1, (-1, 0), 0)
    phase_peaks: dict[str, float] = {}
    all_sizes: list[list[tuple[float, ...]]] = []  # per segment, its blocks' signed bytes per event
    done: dict[int, tuple[tuple[float, ...], float, float]] = {}  # per distinct block (`Program.blocks`)
    table = _program_table(prog, b, s, mono)
    gathers = prog.block_gathers
    for si, seg in enumerate(prog.segments):
        ids = prog.blocks[si]
        if not ids:
            all_sizes.append([])
            continue
        parts = []
        net: float = 0
        pos, at = 0, (-1, 0)
        pmax: float = float("-inf")
        for bi in ids:
            hit = done.get(bi)
            if hit is None:
                sizes = gathers[bi](table)
                # the block's net bytes and highest running total (its position is found for the peak alone)
                hit = done[bi] = (sizes, sum(sizes), max(accumulate(sizes)) if sizes else 0)
            sizes, b_net, b_max = hit
            if net + b_max > pmax:  # the first block reaching the highest point
                pmax, at = net + b_max, (bi, pos)
            net += b_net
            pos += len(sizes)
            parts.append(sizes)
        all_sizes.append(parts)
        n = seg.repeat
        if pmax > 0:
            reps_before = (n - 1) if net > 0 else 0
            cand = total + reps_before * net + pmax
            if cand > phase_peaks.get(seg.phase, 0):
                phase_peaks[seg.phase] = cand
            if cand > best:
                best, best_at = cand, (si, at, reps_before)
        total += net * n
    si, (bi, pos), reps = best_at
    ei = 0
    if si >= 0:  # the first event of the peak's block at its highest running total, as list.index finds it
        run = list(accumulate(done[bi][0]))
        ei = pos + run.index(done[bi][2])
    detail = _breakdown_at(prog, init, all_sizes, si, ei, reps, mono)
    if si < 0:
        phase, where = "forward", "start of step"
    else:
        seg = prog.segments[si]
        rep = "" if seg.repeat == 1 else f" ({'last' if reps else 'first'} of {seg.repeat})"
        phase, where = seg.phase, f"{seg.label}{rep}: {seg.events[ei][3]}"
    return Evaluation(int(best), phase, where, detail, {k: int(v) for k, v in phase_peaks.items()})


def peak_with_churn(prog: Program, micro_batch: int, seq_len: int, fraction: float) -> float:
    """The highest point over the step of allocated bytes plus `fraction` of the activation and
    temporary bytes alive there (the churn that leaves cached, fragmented blocks behind): what the
    caching allocator is modelled to reserve (`trainmem_nb.step.reserved`). Taken over every point, not
    only at the allocated peak, so it never falls when the batch or the sequence grows (every point's
    live tensors grow with them) and never lies below ``peak + fraction * churn at the peak``.
    Repeated segments are handled as in `evaluate`."""
    b, s = micro_batch, seq_len
    mono = (1, b, s, b * s, s * s, b * s * s)
    weight = [1 + fraction if k.startswith(_CHURN_PREFIXES) else 1.0 for k in DETAIL_KEYS]
    total = float(sum(w * v for w, v in zip(weight, _init_bytes(prog, b, s), strict=True)))
    best = total
    w = 1 + fraction
    done: dict[int, tuple[float, float]] = {}  # by `Program.same_as` (whole segments: the weighted sums
    for si, seg in enumerate(prog.segments):  # are fractional, so they keep one order of addition)
        n = seg.repeat
        if n <= 0 or not seg.events or seg.gather is None:
            continue
        hit = done.get(prog.same_as[si])
        if hit is None:
            # weigh the table's slots (a few dozen), then gather every event's weighted bytes (in C)
            table = [v * w if c else 1.0 * v for v, c in zip(_table(seg, b, s, mono), seg.churn, strict=True)]
            run = list(accumulate(seg.gather(table)))
            hit = done[si] = run[-1], max(run)
        net, pmax = hit
        best = max(best, total + ((n - 1) * net if net > 0 else 0) + pmax)
        total += net * n
    return best


def _init_bytes(prog: Program, b: int, s: int) -> list[int]:
    """Bytes per detailed category alive before the step."""
    cats = list(prog.init_fixed)
    for cat, sz, count in prog.init_shaped:
        cats[cat] += _round(sz.at(b, s)) * count
    return cats


def _prefix_terms(prog: Program, si: int) -> tuple[tuple[tuple[int, int, float, int], ...], tuple[int, ...]]:
    """The one-term events of the segments before `si` (those with events), summed per (category, monomial,
    coefficient) over their repetitions, and those of them with several-term events: what `_breakdown_at`
    adds for everything before the peak segment, computed once per program and peak segment."""
    hit = prog.prefix.get(si)
    if hit is None:
        summed: dict[tuple[int, int, float], int] = {}
        general = []
        for j, seg in enumerate(prog.segments[:si]):
            if not prog.blocks[j]:
                continue
            for cat, i, c, k in seg.net:
                summed[(cat, i, c)] = summed.get((cat, i, c), 0) + k * seg.repeat
            if seg.general:
                general.append(j)
        hit = prog.prefix[si] = (tuple((cat, i, c, n) for (cat, i, c), n in summed.items() if n), tuple(general))
    return hit


def _breakdown_at(prog: Program, init: list[int], all_sizes: list[list[tuple[float, ...]]], si: int, ei: int,
                  reps: int, mono: tuple[int, ...]) -> dict[str, int]:
    """Bytes per detailed category just after event `ei` of segment `si` (repeated `reps` times before)."""
    cats: list[float] = list(init)
    if si >= 0:
        terms, general = _prefix_terms(prog, si)
        for cat, i, c, n in terms:  # the segments before the peak's, summed (`_prefix_terms`)
            cats[cat] += n * -(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
        for j in general:
            parts, n = all_sizes[j], prog.segments[j].repeat
            for cat, p, off in prog.general_at[j]:
                cats[cat] += parts[p][off] * n
        seg, parts = prog.segments[si], all_sizes[si]
        if reps and parts:
            for cat, i, c, k in seg.net:
                cats[cat] += k * -(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES * reps
            for cat, p, off in prog.general_at[si]:
                cats[cat] += parts[p][off] * reps
        start = 0  # the events up to the peak, block by block
        for part in parts:
            if start > ei:
                break
            upto = part[: ei + 1 - start]
            for (cat, _, _, _), d in zip(seg.events[start:start + len(upto)], upto, strict=True):
                cats[cat] += d
            start += len(part)
    return {DETAIL_KEYS[i]: int(v) for i, v in enumerate(cats) if v}


class TimelinePoint(NamedTuple):
    """Live memory after one operation of the step."""

    step: int  #: position in the step (operations since its start)
    phase: str  #: forward | backward | optimizer | zero
    label: str  #: what was just allocated or freed
    total_bytes: int
    by_category: tuple[int, ...]  #: bytes per `trainmem_nb.engine.breakdown.TOP_KEYS` entry


def timeline(prog: Program, micro_batch: int, seq_len: int, max_points: int = 1500) -> list[TimelinePoint]:
    """Live bytes through the step. Repeated layers are drawn in full for the first and last one and
    as their start and peak in between, so a 126-layer model costs about as much as a 2-layer one;
    the result is thinned to `max_points`, keeping each bucket's highest point (the peak survives) and the
    last point (the state the step ends in)."""
    b, s = micro_batch, seq_len
    mono = (1, b, s, b * s, s * s, b * s * s)
    top_of = [TOP_KEYS.index(k.split("/")[0]) for k in DETAIL_KEYS]
    cats = [0] * len(TOP_KEYS)
    for cat, nbytes in enumerate(_init_bytes(prog, b, s)):
        cats[top_of[cat]] += nbytes
    points = [TimelinePoint(0, "forward", "start of step", sum(cats), tuple(cats))]
    step = 0
    for seg in prog.segments:
        # each event's bytes exactly as `evaluate` rounds them, so the highest point is its peak
        deltas = [(top_of[cat], int(d), label)
                  for (cat, _, _, label), d in zip(seg.events, _sizes(seg, b, s, mono), strict=True)]
        n = seg.repeat
        # every repetition of a repeated layer changes memory the same way: its highest point is at the
        # same event, offset by what the earlier repetitions left (found once, not per repetition)
        running, best_i, best_run = 0, -1, 0
        net = [0] * len(TOP_KEYS)
        best_net: list[int] = list(net)
        for i, (top, d, _label) in enumerate(deltas):
            running += d
            net[top] += d
            if best_i < 0 or running > best_run:
                best_i, best_run, best_net = i, running, list(net)
        for rep in range(n):
            if rep in (0, n - 1):
                total = sum(cats)
                prefix = f"{seg.label}: "
                for top, d, label in deltas:
                    cats[top] += d
                    total += d
                    step += 1
                    points.append(TimelinePoint(step, seg.phase, prefix + label, total, tuple(cats)))
                continue
            if best_i >= 0:
                at = tuple(c + d for c, d in zip(cats, best_net, strict=True))
                points.append(TimelinePoint(step + best_i + 1, seg.phase,
                                            f"{seg.label} ({rep + 1} of {n}): {deltas[best_i][2]}", sum(at), at))
            cats = [c + d for c, d in zip(cats, net, strict=True)]
            step += len(deltas)
            points.append(TimelinePoint(step, seg.phase, f"{seg.label} ({rep + 1} of {n}) done", sum(cats), tuple(cats)))
    if len(points) <= max_points:
        return points
    # the last point stays (the state the step ends in), the others are thinned
    body = points[:-1]
    size = -(-len(body) // max(1, max_points - 1))
    return [*(max(body[i:i + size], key=lambda p: p.total_bytes) for i in range(0, len(body), size)), points[-1]]


_ACTIVATIONS = frozenset(i for i, k in enumerate(DETAIL_KEYS) if k.startswith("activations/"))


def activations_at_forward_end(prog: Program, micro_batch: int, seq_len: int) -> int:
    """Bytes of activations alive when the forward pass ends: what is kept for backward (saved
    tensors, autocast weight copies, the loss path) plus the inputs."""
    b, s = micro_batch, seq_len
    mono = (1, b, s, b * s, s * s, b * s * s)
    total: float = sum(_round(sz.at(b, s)) * count for cat, sz, count in prog.init if cat in _ACTIVATIONS)
    for seg in prog.segments:
        if seg.phase != "forward":
            break
        for (cat, _, _, _), d in zip(seg.events, _sizes(seg, b, s, mono), strict=True):
            if cat in _ACTIVATIONS:
                total += d * seg.repeat
    return int(total)


def forward_activation_events(prog: Program) -> list[tuple[int, int, Sz, str]]:
    """The tensors `activations_at_forward_end` counts, as events (category, +count, bytes, label): the
    activations alive before the step and every activation event of the forward pass, times its
    segment's repetitions. Summed at a batch shape they give exactly `activations_at_forward_end` (each
    event is rounded to the allocator's block on its own, as in `evaluate`): what one more micro-batch
    in flight keeps (`trainmem_nb.parallel.pipeline`)."""
    out = [(cat, count, sz, "inputs") for cat, sz, count in prog.init if cat in _ACTIVATIONS and count]
    for seg in prog.segments:
        if seg.phase != "forward":
            break
        out += [(cat, k * seg.repeat, sz, f"{seg.label}: {label}")
                for cat, k, sz, label in seg.events if cat in _ACTIVATIONS and k * seg.repeat]
    return out
