"""The ops' common ground: dtype sizes, the op context (autocast, device, batch of one), casts and
autocast's weight copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..tape import Graph, Sz, T, const

__all__ = ['Ctx']

F32, F16, I64, BOOL = 4, 2, 8, 1


@dataclass
class Ctx:
    """What decides dtypes and kernels: the precision recipe and the device.

    ``autocast``: bytes of the autocast compute dtype (2) or None without autocast. ``device``: 'cuda'
    or 'cpu' (their kernels and autocast op lists differ).
    """

    autocast: int | None
    device: str
    batch1: bool = False  # micro-batch 1: some slices are already contiguous (no copy)
    #: how the transformers version computes the causal-LM loss (`trainmem_nb.recipes.head.causal_lm_loss`)
    causal_lm_loss: str = "labels-shifted"
    #: fp8 training's recipe for the block linears (`trainmem_nb.engine.ops.fp8`): None, "tensorwise", "rowwise"
    fp8: str | None = None
    #: bytes per element of the model's floating buffers where they differ from the weights the layers compute
    #: with (FSDP2's MixedPrecisionPolicy casts the gathered parameters only); None: the weights' dtype
    buffer_dt: int | None = None
    #: whose fp8 linears (`fp8`): "torchao" (``Float8Linear``, `trainmem_nb.engine.ops.fp8`) or "te" (Transformer
    #: Engine's under Megatron, `trainmem_nb.engine.ops.te_fp8`)
    fp8_kernels: str = "torchao"
    wcache: dict[int, T] = field(default_factory=dict)
    #: Transformer Engine (`fp8_kernels` "te"): each projection of a fused group (the family's
    #: ``fused_projections``) mapped to the group's last, and the projection that saves its 16-bit input ("": none)
    te_fused: Mapping[str, str] = field(default_factory=dict)
    te_original_input: str = ""
    #: Transformer Engine: each fused group's fp8 input cast, under its last projection's name (the input, the
    #: saved transpose, the row-wise data), shared by the group's projections until the last has run
    fp8_inputs: dict[str, tuple[T, T, T]] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def _promote(a: T, b: T) -> int:
    return max(a.dt, b.dt)


def _bigger(a: T, b: T) -> Sz:
    return a.n if a.n.key() >= b.n.key() else b.n


# -- dtype casts --------------------------------------------------------------------------------
def cast(g: Graph, x: T, dt: int, label: str = "to") -> T:
    """``x.to(dt)``: the same tensor when the dtype matches (a new reference), else a copy whose
    backward casts the gradient back (``_to_copy``)."""
    if x.dt == dt:
        return g.hold(x)
    out = g.alloc(x.n, dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward")]

    g.record(label, [x], [out], [], bwd)
    return out


def autocast_weight(g: Graph, ctx: Ctx, w: T, leaf: bool = True) -> T:
    """Autocast's 16-bit copy of a parameter: made at first use and cached for the autocast region
    (at::autocast::cached_cast caches leaf tensors that require grad); frozen weights, and weights
    computed in the step (``leaf=False``: peft's merged ``W + delta``), are cast at every use, uncached."""
    assert ctx.autocast is not None
    if w.dt == ctx.autocast:
        return g.hold(w)
    if w.rg and leaf:
        key = id(w)
        if key in ctx.wcache:
            return g.hold(ctx.wcache[key])
        c = cast(g, w, ctx.autocast, f"autocast {w.label}")
        c.wcopy = True
        ctx.wcache[key] = c
        return g.hold(c)
    c = cast(g, w, ctx.autocast, f"autocast {w.label}")
    c.wcopy = True
    return c


def end_autocast(g: Graph, ctx: Ctx) -> None:
    """Leaving the autocast region clears the weight-cast cache (its references go)."""
    for c in ctx.wcache.values():
        g.drop(c)
    ctx.wcache.clear()


def reserve(n: Sz, dt: int) -> Sz:
    """Bytes of `n` elements of `dt` (helper for recipes)."""
    return n * dt


ONE = const(1)
