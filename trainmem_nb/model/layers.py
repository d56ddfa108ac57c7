"""Layer patterns: what kind each decoder layer is, and the list compressed to a prefix, a repeating
period and a suffix.

Models people train today do not repeat one layer: Gemma 3 has five sliding-window layers then a global
one, gpt-oss alternates sliding and full attention, SmolLM3 drops rotary on every 4th layer, DeepSeek-V3
starts with dense MLP layers before the MoE ones. A `LayerKind` says what a layer is in the ways that
change its step (its attention mask, whether it applies rotary, its MLP). The step driver simulates one
of each distinct stretch and repeats it (`LayerPattern`).

>>> kinds = [LayerKind("sliding")] * 5 + [LayerKind("full")]
>>> p = compress(tuple(kinds * 10 + kinds[:2]))
>>> len(p.prefix), len(p.period), p.repeats, len(p.suffix), p.simulated
(0, 6, 10, 2, 20)
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["LayerKind", "LayerPattern", "compress", "compress_between"]


class LayerKind(NamedTuple):
    """What one decoder layer is, where layers of a model differ."""

    attention: str = "full"  #: ``"full"`` (causal) or ``"sliding"`` (a sliding-window mask)
    rope: bool = True  #: applies rotary position embeddings (False: a NoPE layer)
    moe: bool = False  #: a mixture-of-experts MLP (else the dense one)

    @property
    def tag(self) -> str:
        """A short name for labels: ``"full"``, ``"sliding, NoPE"``, ``"full, MoE"``..."""
        return ", ".join([self.attention, *(["NoPE"] if not self.rope else []), *(["MoE"] if self.moe else [])])


class LayerPattern(NamedTuple):
    """A layer list as ``prefix + period * repeats + suffix`` (``repeats >= 3`` when `period` is
    set: the step repeats the middle periods; otherwise every layer is in `prefix`)."""

    prefix: tuple[LayerKind, ...]
    period: tuple[LayerKind, ...]
    repeats: int
    suffix: tuple[LayerKind, ...]

    @property
    def simulated(self) -> int:
        """Layers the step driver runs: the prefix, three periods (first, a repeated one, last), the suffix."""
        return len(self.prefix) + 3 * len(self.period) + len(self.suffix) if self.period else len(self.prefix)

    @property
    def n_layers(self) -> int:
        """Layers of the model."""
        return len(self.prefix) + len(self.period) * self.repeats + len(self.suffix)


#: The longest prefix and period searched: real patterns have a period of 1-6 and a dense prefix of
#: at most a few layers (DeepSeek-V3's ``first_k_dense_replace`` is 3).
MAX_PREFIX = 8
MAX_PERIOD = 12


def compress(kinds: tuple[LayerKind, ...]) -> LayerPattern:
    """The decomposition of `kinds` that simulates the fewest layers (ties: the shortest period, then
    the shortest prefix). A uniform stack of n >= 3 layers is ``period=(k,), repeats=n`` (first, middle
    and last layer simulated, as before layer patterns existed)."""
    n = len(kinds)
    best = LayerPattern(kinds, (), 0, ())
    for a in range(min(MAX_PREFIX, n) + 1):
        for p in range(1, min(MAX_PERIOD, (n - a) // 3) + 1):
            period = kinds[a:a + p]
            r = 1
            while a + (r + 1) * p <= n and kinds[a + r * p:a + (r + 1) * p] == period:
                r += 1
            if r < 3:
                continue
            cand = LayerPattern(kinds[:a], period, r, kinds[a + r * p:])
            if cand.simulated < best.simulated:
                best = cand
    return best


def compress_between(kinds: tuple[LayerKind, ...]) -> LayerPattern | None:
    """A decomposition ``prefix + period * repeats + suffix`` whose period is simulated once, between a
    prefix and a non-empty suffix, standing for all its repetitions (`trainmem_nb.step.layers.layer_plan`
    with a description's ``period_once``). Every simulated neighbour is a real one of the same kind (the
    layer before the period is of its last layer's kind, the one after it of its first layer's), and the
    prefix holds a layer of every kind in the period, so that what all layers of a kind share (its rotary
    cos/sin, its mask) is last used, in backward, outside the repeated period. Fewest simulated layers
    (ties: the shortest period); None when no period repeats twice.

    >>> s, f = LayerKind("sliding"), LayerKind("full")
    >>> p = compress_between(((s,) * 5 + (f,)) * 4 + (s, s))
    >>> len(p.prefix), len(p.period), p.repeats, len(p.suffix)
    (6, 6, 3, 2)
    """
    n = len(kinds)
    best: tuple[int, int, int, int] | None = None  # (simulated, period, prefix, repeats)
    for a in range(1, min(MAX_PREFIX, n - 2) + 1):
        for p in range(1, min(MAX_PERIOD, (n - a - 1) // 2) + 1):
            period = kinds[a:a + p]
            if kinds[a - 1] != period[-1] or not set(period) <= set(kinds[:a]):
                continue
            r = 1
            while a + (r + 1) * p <= n - 1 and kinds[a + r * p:a + (r + 1) * p] == period:
                r += 1
            while r >= 2 and kinds[a + r * p] != period[0]:
                r -= 1
            if r < 2:
                continue
            cand = (n - (r - 1) * p, p, a, r)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return None
    _sim, p, a, r = best
    return LayerPattern(kinds[:a], kinds[a:a + p], r, kinds[a + r * p:])
