"""Attention masks as transformers' ``masking_utils`` builds them.
"""

from __future__ import annotations

from ..engine.ops import BOOL, F32, I64
from ..engine.tape import Graph, Sz, T, const, per_seq, per_token_sq


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


def sliding_window_mask(g: Graph, eager_dt: int | None) -> T:
    """``sdpa_mask``/``eager_mask`` with ``sliding_window_causal_mask_function`` (masking_utils.py):
    the index aranges, then ``and_masks`` starts from a 0-d ``new_ones`` and ANDs in
    ``kv_idx > q_idx - window`` and ``kv_idx <= q_idx``, each a (1, 1, s, s) boolean. With
    `eager_dt` the pattern becomes ``torch.where(mask, zeros(()), min)``: a (b, 1, s, s) additive
    mask in that dtype; else the boolean pattern is returned (SDPA expands it to (b, 1, s, s))."""
    a1 = g.alloc(Sz(b_=1), I64, "batch arange")
    a2 = g.alloc(const(1), I64, "head arange")
    qa = g.alloc(per_seq(1), I64, "q arange")
    qi = g.alloc(per_seq(1), I64, "q idx")
    g.drop(qa)
    ka = g.alloc(per_seq(1), I64, "kv arange")
    ki = g.alloc(per_seq(1), I64, "kv idx")
    g.drop(ka)
    ones = g.alloc(const(1), BOOL, "and_masks new_ones")
    sub = g.alloc(per_seq(1), I64, "q_idx - sliding_window")
    gt = g.alloc(Sz(ss=1), BOOL, "kv_idx > q_idx - window")
    g.drop(sub)
    and1 = g.alloc(Sz(ss=1), BOOL, "and_masks & window")
    g.drop(gt, ones)
    le = g.alloc(Sz(ss=1), BOOL, "kv_idx <= q_idx")
    and2 = g.alloc(Sz(ss=1), BOOL, "and_masks & causal")
    g.drop(le, and1)
    g.drop(a1, a2, qi, ki)
    if eager_dt is None:
        return and2
    z = g.alloc(const(1), F32, "zero")
    mn = g.alloc(const(1), F32, "min")
    mask = g.alloc(Sz(bss=1), eager_dt, "sliding window mask")
    g.drop(mn, z, and2)
    return mask


def sdpa_additive_mask(g: Graph, dt: int) -> T:
    """``convert_boolean_attn_mask`` (aten/src/ATen/native/transformers/attention.cpp): ``where`` of
    the expanded boolean mask with two 0-d scalars: a (b, 1, s, s) tensor in `dt`."""
    zero = g.alloc(const(1), dt, "mask 0")
    neg = g.alloc(const(1), dt, "mask -inf")
    mask = g.alloc(per_token_sq(1), dt, "sdpa additive mask")
    g.drop(neg, zero)
    return mask
