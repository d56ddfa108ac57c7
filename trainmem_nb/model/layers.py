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

__all__ = ["LayerKind", "LayerPattern", "compress"]


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
