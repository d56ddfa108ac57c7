"""Attention masks as transformers' ``masking_utils`` builds them.
"""

from __future__ import annotations

from ..engine.ops import BOOL, F32, I64
from ..engine.tape import Graph, Sz, T, const, per_seq


def causal_mask(g: Graph, dt: int) -> T:
    """transformers' ``create_causal_mask`` for eager attention: a (b, 1, s, s) additive mask in the
    model's dtype (0 or the dtype's minimum), built from a (1, 1, s, s) boolean causal pattern."""
    a1 = g.alloc(Sz(b_=1), I64, "batch arange")
    a2 = g.alloc(const(1), I64, "head arange")
    kv = [g.alloc(per_seq(1), I64, "kv arange"), None]
    kv[1] = g.alloc(per_seq(1), I64, "kv idx")
    g.drop(kv[0])
    qa = g.alloc(per_seq(1), I64, "q arange")
    qi = g.alloc(per_seq(1), I64, "q idx")
    g.drop(qa)
    le = g.alloc(Sz(ss=1), BOOL, "causal bool")
    g.drop(a1, a2, kv[1], qi)
    z = g.alloc(const(1), F32, "zero")
    mn = g.alloc(const(1), F32, "min")
    mask = g.alloc(Sz(bss=1), dt, "causal mask")
    g.drop(mn, z, le)
    return mask
