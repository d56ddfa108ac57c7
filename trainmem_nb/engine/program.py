"""A compiled step: segments of allocation and free events, repeated per layer, and their evaluation.

A `Program` depends on the model and the training options but not on the batch shape: its event sizes
are linear forms in (micro_batch, seq_len). `evaluate` turns it into bytes, a peak and a breakdown for
one batch shape in well under a millisecond; since every repetition of a repeated segment adds the same
bytes, the peak over repetitions is at the first or the last one. `timeline` draws the live bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter, mul
from typing import NamedTuple

from ..device import CUDA_BLOCK_BYTES
from .breakdown import DETAIL_KEYS, TOP_KEYS
from .tape import Sz

__all__ = ['Program', 'Segment', 'TimelinePoint', 'activations_at_forward_end', 'evaluate',
           'forward_activation_events', 'peak_with_churn', 'timeline']

CAT_INDEX = {k: i for i, k in enumerate(DETAIL_KEYS)}


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
    pairs: tuple[tuple[int, int], ...] = ()
    gather: Callable[[list[float]], tuple[float, ...]] | None = None
    #: picks every event's category weight from a per-category list (`peak_with_churn`, in C)
    pick_cats: Callable[[list[float]], tuple[float, ...]] | None = None


def _segment(phase: str, label: str, repeat: int, events: tuple[tuple[int, int, Sz, str], ...]) -> Segment:
    """A segment with its events' sizes precompiled for `evaluate`."""
    fast = tuple((*_terms(sz), sign) for _c, sign, sz, _l in events)
    net: dict[tuple[int, int, float], int] = {}
    for (cat, _sign, _sz, _l), (i, c, k) in zip(events, fast, strict=True):
        if i >= 0:
            net[(cat, i, c)] = net.get((cat, i, c), 0) + k
    distinct: dict[tuple[int, float], int] = {}
    which = tuple((distinct.setdefault((max(i, 0), c), len(distinct)), k) for i, c, k in fast)
    general = tuple(j for j, f in enumerate(fast) if f[0] < 0)
    slot: dict[tuple[int, int], int] = {}
    index = [slot.setdefault(w, len(slot)) for w in which]
    for g_index, j in enumerate(general):  # several-term sizes: a slot of their own, after the pairs
        index[j] = len(slot) + g_index
    gather: Callable[[list[float]], tuple[float, ...]] | None = None
    if len(index) == 1:
        only = index[0]
        gather = lambda table: (table[only],)  # noqa: E731  (itemgetter of one index returns no tuple)
    elif index:
        gather = itemgetter(*index)
    cats = [e[0] for e in events]
    pick_cats: Callable[[list[float]], tuple[float, ...]] | None = None
    if len(cats) == 1:
        only_cat = cats[0]
        pick_cats = lambda weights: (weights[only_cat],)  # noqa: E731
    elif cats:
        pick_cats = itemgetter(*cats)
    return Segment(phase, label, repeat, events, fast, general,
                   tuple((cat, i, c, k) for (cat, i, c), k in net.items() if k), tuple(distinct), which,
                   tuple(slot), gather, pick_cats)


@dataclass(frozen=True)
class Program:
    """A compiled step: what is alive before it (by category) and its segments."""

    init: tuple[tuple[int, Sz, int], ...]  # (category index, bytes of one tensor, count)
    segments: tuple[Segment, ...]
    n_params: int
    n_trainable: int


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


def _sizes(seg: Segment, b: int, s: int, mono: tuple[int, ...]) -> tuple[float, ...]:
    """Signed, 512-B-rounded bytes of each event at (b, s): a table of the distinct (size, sign) pairs
    and several-term sizes, then every event's entry picked from it. The last shapes' results are kept
    (`_SIZES`): an estimate asks for the same ones in `evaluate` and in `peak_with_churn`."""
    hit = _SIZES.get(id(seg))
    if hit is not None and hit[0] is seg and hit[1] == b and hit[2] == s:
        return hit[3]
    out = _sizes_of(seg, b, s, mono)
    if len(_SIZES) >= 4096:
        _SIZES.clear()
    _SIZES[id(seg)] = (seg, b, s, out)
    return out


#: `_sizes` of each segment at the last batch shape asked (the segment itself is kept: an id is not reused)
_SIZES: dict[int, tuple[Segment, int, int, tuple[float, ...]]] = {}


def _sizes_of(seg: Segment, b: int, s: int, mono: tuple[int, ...]) -> tuple[float, ...]:
    """`_sizes`, computed."""
    vals = [-(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES for i, c in seg.sizes_of]
    table = [k * vals[u] for u, k in seg.pairs]
    for j in seg.general:
        table.append(seg.fast[j][2] * _round(seg.events[j][2].at(b, s)))
    return seg.gather(table) if seg.gather is not None else ()


def evaluate(prog: Program, micro_batch: int, seq_len: int) -> Evaluation:
    """The peak of `prog` for one batch shape, with its category breakdown and phase."""
    b, s = micro_batch, seq_len
    mono = (1, b, s, b * s, s * s, b * s * s)
    init = _init_bytes(prog, b, s)
    total: float = sum(init)
    best, best_where = total, (-1, 0, 0)  # (segment index, event index, repetitions before)
    phase_peaks: dict[str, float] = {}
    all_sizes: list[tuple[float, ...]] = []
    for si, seg in enumerate(prog.segments):
        n = seg.repeat
        sizes = _sizes(seg, b, s, mono) if n > 0 and seg.events else ()
        all_sizes.append(sizes)
        if not sizes:
            continue
        run = list(accumulate(sizes))
        net = run[-1]
        pmax = max(run)
        if pmax > 0:
            reps_before = (n - 1) if net > 0 else 0
            cand = total + reps_before * net + pmax
            phase_peaks[seg.phase] = max(phase_peaks.get(seg.phase, 0), cand)
            if cand > best:
                best, best_where = cand, (si, run.index(pmax), reps_before)
        total += net * n
    detail = _breakdown_at(prog, init, all_sizes, *best_where, mono)
    si, ei, reps = best_where
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
    weight = [1 + fraction if k.startswith(("activations/", "transient/")) else 1.0 for k in DETAIL_KEYS]
    total = float(sum(w * v for w, v in zip(weight, _init_bytes(prog, b, s), strict=True)))
    best = total
    for seg in prog.segments:
        n = seg.repeat
        if n <= 0 or not seg.events:
            continue
        sizes = _sizes(seg, b, s, mono)
        if seg.pick_cats is not None:  # the same products as weight[cat] * d per event, taken in C
            sizes = tuple(map(mul, seg.pick_cats(weight), sizes))
        else:
            sizes = tuple(weight[cat] * d for (cat, _, _, _), d in zip(seg.events, sizes, strict=True))
        run = list(accumulate(sizes))
        net, pmax = run[-1], max(run)
        best = max(best, total + ((n - 1) * net if net > 0 else 0) + pmax)
        total += net * n
    return best


def _init_bytes(prog: Program, b: int, s: int) -> list[int]:
    """Bytes per detailed category alive before the step."""
    cats = [0] * len(DETAIL_KEYS)
    for cat, sz, count in prog.init:
        cats[cat] += (_round(sz.c0) if sz.c0 == sz.at(b, s) else _round(sz.at(b, s))) * count
    return cats


def _breakdown_at(prog: Program, init: list[int], all_sizes: list[tuple[float, ...]], si: int, ei: int,
                  reps: int, mono: tuple[int, ...]) -> dict[str, int]:
    """Bytes per detailed category just after event `ei` of segment `si` (repeated `reps` times before)."""
    cats: list[float] = list(init)
    for j, seg in enumerate(prog.segments):
        if si < 0 or j > si:
            break
        sizes = all_sizes[j]
        times = seg.repeat if j < si else reps
        if times and sizes:
            for cat, i, c, k in seg.net:
                cats[cat] += k * -(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES * times
            for e in seg.general:
                cats[seg.events[e][0]] += sizes[e] * times
        if j == si:
            for (cat, _, _, _), d in zip(seg.events[: ei + 1], sizes[: ei + 1], strict=True):
                cats[cat] += d
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
    the result is thinned to `max_points`, keeping each bucket's highest point (the peak survives)."""
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
    size = -(-len(points) // max_points)
    return [max(points[i:i + size], key=lambda p: p.total_bytes) for i in range(0, len(points), size)]


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
