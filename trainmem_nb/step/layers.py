"""Which layers the step driver runs, and which parameters each holds.

`layer_plan` turns a model's layer kinds (`trainmem_nb.model.layers`) into the layers to simulate: the
prefix, the first, a middle and the last period of the repeating pattern, the suffix. The middle
period's events repeat ``repeats - 2`` times. Every repetition adds the same bytes, so the peak over
repetitions is at the first or the last one (`trainmem_nb.engine.program.evaluate`): that holds for a
period of several layers as for one, since the period is one segment. Where layers of one kind are
interleaved with others of another, the simulated neighbours of each layer are its real ones.
"""

from __future__ import annotations

from typing import NamedTuple

from ..model.families import DESCRIPTIONS
from ..model.layers import LayerKind, LayerPattern, compress, compress_between
from ..model.params import ParamTensor
from ..model.spec import ModelSpec

__all__ = ["LayerPlan", "in_layer_of", "layer_plan"]


class LayerPlan(NamedTuple):
    """The simulated layers: their kinds, engine unit names and segment labels, which of them form
    the repeated period (``block``: simulated layers ``block[0]..block[1]-1``; empty when none) and
    how often it repeats."""

    kinds: tuple[LayerKind, ...]
    units: tuple[str, ...]
    labels: tuple[str, ...]
    block: tuple[int, int]
    reps: int


def in_layer_of(p: ParamTensor, kind: LayerKind) -> bool:
    """Does a layer of `kind` hold the per-layer parameter `p` (MoE experts only in MoE layers)?"""
    return not p.kind or (p.kind == "moe") == kind.moe


def layer_plan(m: ModelSpec, unrolled: bool = False) -> LayerPlan:
    """The layers the step of `m` simulates (see the module docstring); `unrolled`: every layer."""
    kinds = m.layer_kinds
    pattern = LayerPattern(kinds, (), 0, ()) if unrolled else compress(kinds)
    once = compress_between(kinds) if DESCRIPTIONS[m.family].period_once and not unrolled else None
    if once is not None and len(once.prefix) + len(once.period) + len(once.suffix) < pattern.simulated:
        return _plan_between(once, len({k.moe for k in kinds}) > 1)
    period, a = pattern.period, len(pattern.prefix)
    sim = (*pattern.prefix, *period, *period, *period, *pattern.suffix) if period else pattern.prefix
    # the layer index each simulated layer stands for (the middle period: its first repetition's)
    real = list(range(a))
    if period:
        p, r = len(period), pattern.repeats
        real += [a + j for j in range(p)] + [a + p + j for j in range(p)] + [a + (r - 1) * p + j for j in range(p)]
        real += [a + r * p + j for j in range(len(pattern.suffix))]
    lo, hi = (a + len(period), a + 2 * len(period)) if period else (0, 0)
    uniform = len(set(kinds)) == 1
    labels = [f"layer {real[i]}" for i in range(len(sim))]
    if period:
        start, end = a + len(period), a + (pattern.repeats - 1) * len(period) - 1
        labels[lo] = "layers" if uniform else (
            f"layers {start}-{end} ({pattern.repeats - 2} x {' / '.join(k.tag for k in period)})")
    mixed_mlp = len({k.moe for k in kinds}) > 1
    units = tuple(f"L{i}" + (("/moe" if k.moe else "/dense") if mixed_mlp else "") for i, k in enumerate(sim))
    return LayerPlan(tuple(sim), units, tuple(labels), (lo, hi), max(0, pattern.repeats - 2))


def _plan_between(pattern: LayerPattern, mixed_mlp: bool) -> LayerPlan:
    """The plan of a `compress_between` decomposition: the prefix, the period once (the block, standing
    for its ``repeats`` repetitions), the suffix."""
    a, p, r = len(pattern.prefix), len(pattern.period), pattern.repeats
    sim = (*pattern.prefix, *pattern.period, *pattern.suffix)
    real = [*range(a + p), *(a + r * p + j for j in range(len(pattern.suffix)))]
    labels = [f"layer {real[i]}" for i in range(len(sim))]
    labels[a] = f"layers {a}-{a + r * p - 1} ({r} x {' / '.join(k.tag for k in pattern.period)})"
    units = tuple(f"L{i}" + (("/moe" if k.moe else "/dense") if mixed_mlp else "") for i, k in enumerate(sim))
    return LayerPlan(sim, units, tuple(labels), (a, a + p), r)
