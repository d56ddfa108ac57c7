"""Attention kernels at the aten level: SDPA's flash kernel, its math fallback and the eager
matmul-softmax-matmul, each with what it saves and its backward's allocations.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tape import Graph, Sz, T
from .core import BOOL, F32, ONE, Ctx, cast
from .elementwise import add, dropout, scalar_op, softmax
from .linear import bmm
from .shape import clone, heads_view


def sdpa_flash(g: Graph, ctx: Ctx, q: T, k: T, v: T, lse_n: Sz, label: str = "sdpa") -> T:
    """``F.scaled_dot_product_attention`` on a flash-style kernel (CPU flash without dropout; CUDA
    flash / memory-efficient): the output in q's layout and an fp32 logsumexp; saves q, k, v, the
    output and the logsumexp; backward allocates the three input gradients. Autocast casts key,
    query, value (a no-op for 16-bit inputs)."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} k cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} q cast") if cd else g.hold(q)
    vc = cast(g, v, cd, f"{label} v cast") if cd else g.hold(v)
    out, lse = g.sac_outputs(lambda: (g.alloc(qc.n, qc.dt, f"{label} out"), g.alloc(lse_n, F32, f"{label} logsumexp")),
                             "attention")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(qc.n, qc.dt, f"{label} grad q"), g.alloc(kc.n, kc.dt, f"{label} grad k"),
                g.alloc(vc.n, vc.dt, f"{label} grad v")]

    # the node releases its saved tensors in the order key, query, value, logsumexp, output
    g.record(label, [qc, kc, vc], [out, lse], [kc, qc, vc, lse, out], bwd)
    g.drop(lse, qc, kc, vc)
    return out


def sdpa_math(g: Graph, ctx: Ctx, q: T, k: T, v: T, scores_n: Sz, p: float, causal: bool,
              copy_q: bool = True, copy_k: bool = True, copy_v: bool = True, grad_copy: bool | None = None,
              label: str = "sdpa math") -> T:
    """``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp), which
    CPU SDPA runs when attention dropout is on: 16-bit inputs are upcast to fp32 on CPU; q and k^T
    scaled by sqrt(scale); with ``is_causal`` an (s, s) additive mask (``ones.tril`` → ``where``);
    ``matmul`` (it copies operands whose batch dims cannot be folded into one: `copy_q`, `copy_k`,
    `copy_v`; the output's gradient is copied back unless b == 1: `grad_copy`, default `copy_q`),
    ``_safe_softmax``, dropout, ``matmul``; the results are cast back. Returns the
    (b, heads, s, d) output (a view of the last matmul's result when no cast back happens)."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} k cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} q cast") if cd else g.hold(q)
    vc = cast(g, v, cd, f"{label} v cast") if cd else g.hold(v)
    reduced = qc.dt != F32 and not ctx.cuda
    q32, k32, v32 = ((cast(g, x, F32, f"{label} upcast") if reduced else g.hold(x)) for x in (qc, kc, vc))
    qs = scalar_op(g, q32, f"{label} q * sqrt(scale)")
    mask = None
    if causal:
        ones = g.alloc(Sz(ss=1), BOOL, f"{label} causal ones")
        tril = g.alloc(Sz(ss=1), BOOL, f"{label} causal tril")
        g.drop(ones)
        zero, neg = g.alloc(ONE, q32.dt, "0"), g.alloc(ONE, q32.dt, "-inf")
        mask = g.alloc(Sz(ss=1), q32.dt, f"{label} causal mask")
        g.drop(zero, neg, tril)
    kt = scalar_op(g, k32, f"{label} k^T * sqrt(scale)")
    q2 = clone(g, qs, f"{label} query contiguous") if copy_q else g.hold(qs)
    k2 = clone(g, kt, f"{label} key^T contiguous") if copy_k else g.hold(kt)
    scores = bmm(g, ctx, q2, k2, scores_n, f"{label} q @ k^T", grad_b_first=True)
    g.drop(q2, k2, kt)
    if mask is not None:
        sm = add(g, scores, mask, f"{label} + mask")
        g.drop(scores)
    else:
        sm = scores
    probs = softmax(g, sm, None, f"{label} _safe_softmax")
    g.drop(sm)
    pd = dropout(g, ctx, probs, p, f"{label} attn dropout")
    g.drop(probs)
    # make_tuple(matmul(attn, v).to(dtype), attn.to(dtype)): GCC evaluates the second first
    attn16 = cast(g, pd, qc.dt, f"{label} attn to input dtype") if reduced else None
    v2 = clone(g, v32, f"{label} value contiguous") if copy_v else g.hold(v32)
    o3 = bmm(g, ctx, pd, v2, q.n, f"{label} probs @ v", grad_b_first=True)
    g.drop(v2)
    # matmul returns a view of the bmm result; the gradient reaching it through the transpose is
    # strided and its reshape copies it, unless (b, heads) fold into one dim (b == 1)
    o = heads_view(g, o3, f"{label} matmul unsafe_view", clone_grad=copy_q if grad_copy is None else grad_copy)
    g.drop(o3)
    if reduced:
        o16 = cast(g, o, qc.dt, f"{label} output to input dtype")
        g.drop(o)
        o = o16
    g.drop(qs, mask, q32, k32, v32, pd, attn16, qc, kc, vc)
    return o


def eager_attention(g: Graph, ctx: Ctx, q: T, k: T, v: T, mask: T | None, scores_n: Sz, p: float, fold: bool,
                    softmax_dt: int | None = None, cast_back: bool = True, one_expression: bool = False,
                    probs_dt: int | None = None, contiguous_qk: bool = False, label: str = "eager") -> tuple[T, T]:
    """A family's ``eager_attention_forward`` without GQA: ``matmul(q, k^T) * scaling (+ mask)``,
    ``softmax`` (in `softmax_dt` when the code asks for it), cast back to the value's dtype
    (`cast_back`, to `probs_dt` when the code names the query's dtype; without it autocast's matmul
    casts the dropped-out probabilities; with `one_expression`, ``softmax(...).to(dtype)`` rebinds
    the scores' name only after the cast), dropout,
    ``matmul(probs, v)``, and the transposed result copied contiguous (by the function or by its
    caller's ``reshape``). Returns (output, attention weights); the caller keeps the weights alive as
    the function's second result.

    q, k, v are (b, s, heads, d)-laid-out views (q and k are contiguous (b, heads, s, d) tensors when
    `contiguous_qk`): ``matmul`` copies strided ones to fold (b, heads) into one batch dim (`fold`; with
    b == 1 that is a view), and the gradient reaching the result's transpose is strided, so the view's
    backward copies it (again unless b == 1). Autocast casts right to left (key before query, value
    before probabilities); CUDA autocast runs a softmax without dtype in fp32."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} matmul key cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} matmul query cast") if cd else g.hold(q)
    copy_qk = fold and not contiguous_qk
    q2 = clone(g, qc, f"{label} query contiguous") if copy_qk else g.hold(qc)
    k2 = clone(g, kc, f"{label} key^T contiguous") if copy_qk else g.hold(kc)
    scores = bmm(g, ctx, q2, k2, scores_n, f"{label} q @ k^T", grad_b_first=True)
    g.drop(q2, k2, qc, kc)
    w = scalar_op(g, scores, f"{label} * scaling")
    g.drop(scores)
    if mask is not None:
        w2 = add(g, w, mask, f"{label} + mask")
        g.drop(w)
        w = w2
    sm_dt = softmax_dt if softmax_dt is not None else (F32 if ctx.cuda and cd and w.dt != F32 else None)
    probs = softmax(g, w, sm_dt, f"{label} softmax")
    if not one_expression:
        g.drop(w)
    pt = cast(g, probs, probs_dt or v.dt, f"{label} probs cast back") if cast_back else g.hold(probs)
    g.drop(probs)
    if one_expression:
        g.drop(w)
    pd = dropout(g, ctx, pt, p, f"{label} attn dropout")
    g.drop(pt)
    vc = cast(g, v, cd, f"{label} matmul value cast") if cd else g.hold(v)
    pc = cast(g, pd, cd, f"{label} matmul probs cast") if cd else g.hold(pd)
    v2 = clone(g, vc, f"{label} value contiguous") if fold else g.hold(vc)
    o3 = bmm(g, ctx, pc, v2, v.n, f"{label} probs @ v", grad_b_first=True)
    g.drop(pc, vc, v2)
    o = heads_view(g, o3, f"{label} matmul unsafe_view", clone_grad=fold)
    g.drop(o3)
    out = clone(g, o, f"{label} attn_output transpose contiguous")
    g.drop(o)
    return out, pd
