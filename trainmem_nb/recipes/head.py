"""The language-model head's loss as transformers computes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import ops
from ..engine.ops import F32, I64
from ..engine.tape import Graph, Sz, T, const
from .base import tok


def causal_lm_loss(g: Graph, logits: T, vocab: int, batch1: bool = False) -> T:
    """transformers' ForCausalLMLoss: logits upcast to fp32, labels padded and shifted, then
    ``cross_entropy`` = log_softmax (saves its fp32 result) + nll_loss (mean)."""
    lf = ops.cast(g, logits, F32, "logits.float()")
    pad = g.alloc(Sz(bs=1, b_=1), I64, "labels pad")  # F.pad(labels, (0, 1)): (b, s+1) int64
    # labels[..., 1:].contiguous(): a copy, except with one sequence, where the slice is contiguous
    shift = g.view(pad, "shift_labels", n=tok(1)) if batch1 else g.alloc(tok(1), I64, "shift_labels")
    ls = g.alloc(lf.n, F32, "log_softmax")

    def ls_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(lf.n, F32, "log_softmax backward")]

    g.record("log_softmax", [lf], [ls], [ls], ls_bwd)
    loss = g.alloc(const(1), F32, "loss")
    total_weight = g.alloc(const(1), F32, "nll total_weight")

    def nll_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(lf.n, F32, "nll_loss backward"), None]

    g.record("nll_loss", [ls, shift], [loss, total_weight], [shift, total_weight], nll_bwd)
    g.drop(ls, shift, total_weight, lf, pad)
    return loss
