"""Attention kernels at the aten level: SDPA's flash kernel, its math fallback and the eager
matmul-softmax-matmul, each with what it saves and its backward's allocations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..tape import Graph, Sz, T
from .core import BOOL, F32, ONE, Ctx, cast
from .elementwise import add, dropout, scalar_op, softmax, unary_saving_output
from .linear import bmm
from .shape import clone, heads_view, repeat_kv

#: The largest head size FlashAttention-2 takes (aten/src/ATen/native/transformers/sdp_utils.cpp,
#: ``check_head_dim_size_flash``); larger heads go to the memory-efficient kernel.
FLASH_MAX_HEAD_DIM = 256


def sdpa_flash(g: Graph, ctx: Ctx, q: T, k: T, v: T, lse_n: Sz, label: str = "sdpa",
               mask: Callable[[int], T] | None = None) -> T:
    """``F.scaled_dot_product_attention`` on a flash-style kernel (CPU flash; CUDA flash or
    memory-efficient): the output in q's layout and an fp32 logsumexp; saves q, k, v, the output and the
    logsumexp (and the attention mask, first, when there is one); backward allocates the three input
    gradients, and on CUDA the kernel's scratch (`cuda_backward_scratch`). Autocast casts key, query,
    value (a no-op for 16-bit inputs); an explicit `mask` is converted to the query's dtype before the
    kernel runs."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} k cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} q cast") if cd else g.hold(q)
    vc = cast(g, v, cd, f"{label} v cast") if cd else g.hold(v)
    am = mask(qc.dt) if mask is not None else None
    out, lse = g.sac_outputs(lambda: (g.alloc(qc.n, qc.dt, f"{label} out"), g.alloc(lse_n, F32, f"{label} logsumexp")),
                             "attention")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        grads: list[T | None] = [g.alloc(qc.n, qc.dt, f"{label} grad q"), g.alloc(kc.n, kc.dt, f"{label} grad k"),
                                 g.alloc(vc.n, vc.dt, f"{label} grad v")]
        if ctx.cuda:
            g.drop(*cuda_backward_scratch(g, qc, kc, lse_n, masked=am is not None))
        return grads

    # the node releases its saved tensors in the order (mask,) key, query, value, logsumexp, output
    g.record(label, [qc, kc, vc], [out, lse], [am, kc, qc, vc, lse, out], bwd)
    g.drop(lse, am, qc, kc, vc)
    return out


def cuda_backward_scratch(g: Graph, q: T, k: T, lse_n: Sz, masked: bool) -> list[T]:
    """What SDPA's CUDA backward allocates besides the input gradients, through the caching allocator.
    The kernel is FlashAttention-2 for 16-bit inputs without a mask and heads of at most
    `FLASH_MAX_HEAD_DIM` (sdp_utils.cpp ``use_flash_attention``), else the memory-efficient kernel:

    * FlashAttention-2 (cuda/flash_attn/flash_api.cpp, ``mha_bwd``): ``softmax_d`` (b, heads, s) fp32,
      ``dq_accum`` (b, s, heads, head_dim) fp32, and for grouped-query attention ``dk_expanded`` /
      ``dv_expanded`` (b, s, heads, head_dim) before they are summed per kv head (FA2 rounds s up to 128
      and head_dim to 32; those few rows are left out);
    * memory-efficient (cuda/attention_backward.cu, ``_efficient_attention_backward``): ``delta``
      (b, heads, s) fp32 and the kernel workspace, which for sm80+ kernels holds an fp32 accumulator of
      the query gradient (mem_eff_attention/kernel_backward.h ``workspace_size``; the key/value
      accumulators, only for heads wider than the kernel's block, are left out).

    Modelled from the sources; no GPU measured it here."""
    heads = lse_n.bs
    head_dim = q.n.bs / heads
    if q.dt == 2 and not masked and head_dim <= FLASH_MAX_HEAD_DIM:
        out = [g.alloc(lse_n, F32, "flash softmax_d"), g.alloc(q.n, F32, "flash dq_accum")]
        if k.n.bs != q.n.bs:  # fewer kv heads than query heads
            out += [g.alloc(q.n, q.dt, "flash dk_expanded"), g.alloc(q.n, q.dt, "flash dv_expanded")]
        return out
    return [g.alloc(lse_n, F32, "mem-efficient delta"), g.alloc(q.n, F32, "mem-efficient workspace (grad q accumulator)")]


def sdpa_math(g: Graph, ctx: Ctx, q: T, k: T, v: T, scores_n: Sz, p: float, *, causal: bool,
              copy_q: bool, copy_k: bool, copy_v: bool, grad_copy: bool, mask: Callable[[int], T] | None = None,
              n_rep: int = 1, label: str = "sdpa math") -> T:
    """``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp), which
    CPU SDPA runs when attention dropout is on: 16-bit inputs are upcast to fp32 on CPU; q and k^T
    scaled by sqrt(scale); with ``is_causal`` an (s, s) additive mask (``ones.tril`` → ``where``), or
    the explicit `mask` SDPA converted to the query's dtype before the kernel; grouped k/v repeated
    (``enable_gqa``: `n_rep`); ``matmul`` (it copies operands whose batch dims cannot be folded into
    one: `copy_q`, `copy_k`, `copy_v`; the gradient reaching the result's view is copied back when
    `grad_copy`), ``_safe_softmax``, dropout, ``matmul``; the results are cast back. Returns the
    (b, heads, s, d) output (a view of the last matmul's result when no cast back happens)."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} k cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} q cast") if cd else g.hold(q)
    vc = cast(g, v, cd, f"{label} v cast") if cd else g.hold(v)
    am = mask(qc.dt) if mask is not None else None
    reduced = qc.dt != F32 and not ctx.cuda
    q32, k32, v32 = ((cast(g, x, F32, f"{label} upcast") if reduced else g.hold(x)) for x in (qc, kc, vc))
    qs = scalar_op(g, q32, f"{label} q * sqrt(scale)")
    if causal:
        ones = g.alloc(Sz(ss=1), BOOL, f"{label} causal ones")
        tril = g.alloc(Sz(ss=1), BOOL, f"{label} causal tril")
        g.drop(ones)
        zero, neg = g.alloc(ONE, q32.dt, "0"), g.alloc(ONE, q32.dt, "-inf")
        am = g.alloc(Sz(ss=1), q32.dt, f"{label} causal mask")
        g.drop(zero, neg, tril)
    kx = repeat_kv(g, k32, n_rep, f"{label} key expanded")
    vx = repeat_kv(g, v32, n_rep, f"{label} value expanded")
    kt = scalar_op(g, kx, f"{label} k^T * sqrt(scale)")
    q2 = clone(g, qs, f"{label} query contiguous") if copy_q else g.hold(qs)
    k2 = clone(g, kt, f"{label} key^T contiguous") if copy_k else g.hold(kt)
    scores = bmm(g, ctx, q2, k2, scores_n, f"{label} q @ k^T", grad_b_first=True)
    g.drop(q2, k2, kt)
    if am is not None:
        sm = add(g, scores, am, f"{label} + mask")
        g.drop(scores)
    else:
        sm = scores
    probs = softmax(g, sm, None, f"{label} _safe_softmax")
    g.drop(sm)
    pd = dropout(g, ctx, probs, p, f"{label} attn dropout")
    g.drop(probs)
    # make_tuple(matmul(attn, v).to(dtype), attn.to(dtype)): GCC evaluates the second first
    attn16 = cast(g, pd, qc.dt, f"{label} attn to input dtype") if reduced else None
    v2 = clone(g, vx, f"{label} value contiguous") if copy_v else g.hold(vx)
    o3 = bmm(g, ctx, pd, v2, vx.n, f"{label} probs @ v", grad_b_first=True)  # (b, heads, s, v's head width)
    g.drop(v2)
    # matmul returns a view of the bmm result; the gradient reaching it through the transpose is
    # strided and its reshape copies it, unless (b, heads) fold into one dim (b == 1)
    o = heads_view(g, o3, f"{label} matmul unsafe_view", clone_grad=grad_copy)
    g.drop(o3)
    if reduced:
        o16 = cast(g, o, qc.dt, f"{label} output to input dtype")
        g.drop(o)
        o = o16
    g.drop(kx, qs, am, k32, v32, q32, pd, vx, attn16, qc, kc, vc)
    return o


def eager_attention(g: Graph, ctx: Ctx, q: T, k: T, v: T, mask: T | None, scores_n: Sz, p: float, *,
                    copy_q: bool, copy_k: bool, copy_v: bool, grad_copy: bool, softmax_dt: int | None = None,
                    cast_back: bool = True, one_expression: bool = False, probs_dt: int | None = None,
                    softcap: bool = False, label: str = "eager") -> tuple[T, T]:
    """A family's ``eager_attention_forward`` after any ``repeat_kv``: ``matmul(q, k^T) * scaling (+ mask)``,
    ``softmax`` (in `softmax_dt` when the code asks for it), cast back to the value's dtype
    (`cast_back`, to `probs_dt` when the code names the query's dtype; without it autocast's matmul
    casts the dropped-out probabilities; with `one_expression`, ``softmax(...).to(dtype)`` rebinds
    the scores' name only after the cast), dropout, ``matmul(probs, v)``, and the transposed result
    copied contiguous (by the function or by its caller's ``reshape``). Returns (output, attention
    weights); the caller keeps the weights alive as the function's second result.

    ``matmul`` copies operands whose batch dims cannot fold into one batch dim (`copy_q`, `copy_k`,
    `copy_v`: strided views with b > 1, or an expanded key/value); the gradient reaching the result's
    transpose is strided, so the view's backward copies it (`grad_copy`). Autocast casts right to left
    (key before query, value before probabilities); CUDA autocast runs a softmax without dtype in fp32.
    With `softcap` the scaled scores are soft-capped before the mask (Gemma 2: ``w / cap``, ``tanh``,
    ``* cap``, each rebinding the scores' name; ``tanh`` saves its result)."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} matmul key cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} matmul query cast") if cd else g.hold(q)
    q2 = clone(g, qc, f"{label} query contiguous") if copy_q else g.hold(qc)
    k2 = clone(g, kc, f"{label} key^T contiguous") if copy_k else g.hold(kc)
    scores = bmm(g, ctx, q2, k2, scores_n, f"{label} q @ k^T", grad_b_first=True)
    g.drop(q2, k2, qc, kc)  # matmul's operands and their copies die when matmul returns
    w = scalar_op(g, scores, f"{label} * scaling")
    g.drop(scores)
    if softcap:
        wd = scalar_op(g, w, f"{label} / softcap")
        g.drop(w)
        wt = unary_saving_output(g, wd, f"{label} tanh")
        g.drop(wd)
        w = scalar_op(g, wt, f"{label} * softcap")
        g.drop(wt)
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
    v2 = clone(g, vc, f"{label} value contiguous") if copy_v else g.hold(vc)
    o3 = bmm(g, ctx, pc, v2, v.n, f"{label} probs @ v", grad_b_first=True)
    g.drop(pc, vc, v2)
    o = heads_view(g, o3, f"{label} matmul unsafe_view", clone_grad=grad_copy)
    g.drop(o3)
    out = clone(g, o, f"{label} attn_output transpose contiguous")
    g.drop(o)
    return out, pd
