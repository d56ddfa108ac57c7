"""Mistral as Hugging Face implements it (modeling_mistral.py, transformers 5.x): llama with a sliding
attention window.

The window changes memory only through the attention mask. ``MistralModel.forward`` builds it with
``create_sliding_window_causal_mask`` (masking_utils.py):

* eager attention always gets a (b, 1, s, s) additive mask, built from the intersection of the
  sliding-window and causal patterns (``and_masks``: a few more (s, s) boolean temporaries than
  llama's causal mask);
* SDPA gets no mask while ``s < sliding_window`` (``_ignore_causal_mask_sdpa``: ``is_causal`` is
  enough), so the step is llama's; from ``s >= sliding_window`` on it gets the boolean (1, 1, s, s)
  pattern, expanded to (b, 1, s, s). Then ``sdpa_attention_forward`` cannot use ``enable_gqa``
  (``use_gqa_in_sdpa`` wants no mask): grouped k/v are repeated with ``repeat_kv``, and SDPA turns the
  boolean mask into an additive one in the query's dtype, which its kernel saves for backward.

Whether ``s >= sliding_window`` is a structural switch of the compiled program (see ``masked``).
The same switch serves mixtral and phi3 (``MixtralModel``/``Phi3Model`` pick the sliding mask when
the config has a window).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import ops
from ..engine.ops import BOOL, F32, I64
from ..engine.tape import Graph, Sz, T, const, per_seq, per_token_sq
from ..spec.choices import Attention
from .base import tok
from .llama import LlamaRecipe
from .masks import causal_mask

__all__ = ["MistralRecipe", "sliding_window_mask"]


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


class MistralRecipe(LlamaRecipe):
    """mistral (and the attention of mixtral and phi3): llama with a sliding attention window."""

    @property
    def masked(self) -> bool:
        """True when SDPA gets an explicit mask: a window is set and ``seq_len >= sliding_window``
        (``_ignore_causal_mask_sdpa`` returns False once ``kv_length >= local_attention_size``).

        The compiled program is symbolic in the sequence length, so this switch must be part of its
        cache key: `trainmem_nb.estimator.simulate.simulate` passes ``seq_len = sliding_window`` (masked) or 1."""
        w = self.m.sliding_window
        return bool(w) and self.t.attention is Attention.SDPA and self.t.seq_len >= w

    def attention_mask(self, g: Graph, dt: int) -> T | None:
        """MistralModel.forward's mask: ``create_sliding_window_causal_mask`` (when the config has a
        window) or the causal one for eager attention; with a window and SDPA, the boolean window mask
        SDPA converts (`sliding_window_mask` with no dtype)."""
        if self.t.attention is Attention.EAGER:
            return sliding_window_mask(g, dt) if self.m.sliding_window else causal_mask(g, dt)
        return sliding_window_mask(g, None) if self.masked else None

    @property
    def value_grad_contiguous(self) -> bool:
        """MistralAttention.forward is llama's except here: the value's gradient also comes back
        contiguous from ``repeat_kv``'s backward (a sum) when a mask keeps SDPA from grouped-query
        attention."""
        return super().value_grad_contiguous or (self.masked and self.m.n_heads > self.m.n_kv_heads)

    def sdpa(self, g: Graph, q: T, k: T, v: T) -> T:
        """``sdpa_attention_forward``: without a mask, llama's (``enable_gqa``, ``is_causal``). With
        one, k and v are first repeated for grouped-query attention (``repeat_kv``: the repeated
        key/value are the function's locals until it returns), then SDPA casts its inputs (autocast:
        key, query, value), converts the boolean mask (``convert_boolean_attn_mask``: ``where`` of two
        0-d scalars into a (b, 1, s, s) tensor in the query's dtype) and runs the CPU flash kernel,
        which saves the converted mask with q, k, v, its output and logsumexp.

        CUDA (unmeasured here, from the source): flash attention takes no mask, so SDPA runs the
        memory-efficient kernel (``_scaled_dot_product_efficient_attention``, attention.cpp); the
        converted mask is only expanded (``preprocess_mask``: a view when s is a multiple of 16, else
        a padded copy, not modelled) and saved like the CPU kernel's; its logsumexp has s rounded up
        to 32 rows (not modelled: at most 31 * b * heads floats); its backward allocates scratch
        (`mem_efficient_backward_scratch`)."""
        if not self.masked:
            return super().sdpa(g, q, k, v)
        m, ctx = self.m, self.ctx
        n_rep = m.n_heads // m.n_kv_heads
        kx = ops.repeat_kv(g, k, n_rep, "repeat_kv key")
        vx = ops.repeat_kv(g, v, n_rep, "repeat_kv value")
        cd = ctx.autocast
        kc = ops.cast(g, kx, cd, "sdpa k cast") if cd else g.hold(kx)
        qc = ops.cast(g, q, cd, "sdpa q cast") if cd else g.hold(q)
        vc = ops.cast(g, vx, cd, "sdpa v cast") if cd else g.hold(vx)
        mask = self.sdpa_additive_mask(g, qc.dt)
        out, lse = g.sac_outputs(lambda: (g.alloc(q.n, qc.dt, "sdpa out"),
                                          g.alloc(tok(m.n_heads), F32, "sdpa logsumexp")), "attention")

        def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
            grads: list[T | None] = [g.alloc(qc.n, qc.dt, "sdpa grad q"), g.alloc(kc.n, kc.dt, "sdpa grad k"),
                     g.alloc(vc.n, vc.dt, "sdpa grad v")]
            if ctx.cuda:
                g.drop(*mem_efficient_backward_scratch(g, m))
            return grads

        # the node releases its saved tensors in the order mask, key, query, value, logsumexp, output
        g.record("sdpa", [qc, kc, vc], [out, lse], [mask, kc, qc, vc, lse, out], bwd)
        g.drop(lse, mask, qc, kc, vc)
        if self.qk_contiguous and not ctx.cuda:
            # the CPU flash kernel's output follows the query's layout: transpose(1, 2).contiguous()
            # copies it before the function returns
            o = out
            out = ops.clone(g, o, "attn_output transpose contiguous")
            g.drop(o)
        g.drop(kx, vx)  # sdpa_attention_forward's locals (the repeated key and value)
        return out

    def sdpa_math(self, g: Graph, q: T, k: T, v: T) -> T:
        """SDPA's math kernel (CPU with attention dropout): `math_attention`."""
        return math_attention(self, g, q, k, v, masked=self.masked, qk_contiguous=self.qk_contiguous)

    def sdpa_additive_mask(self, g: Graph, dt: int) -> T:
        """``convert_boolean_attn_mask`` (aten/src/ATen/native/transformers/attention.cpp): ``where``
        of the expanded boolean mask with two 0-d scalars: a (b, 1, s, s) tensor in `dt`."""
        zero = g.alloc(const(1), dt, "mask 0")
        neg = g.alloc(const(1), dt, "mask -inf")
        mask = g.alloc(per_token_sq(1), dt, "sdpa additive mask")
        g.drop(neg, zero)
        return mask


def mem_efficient_backward_scratch(g: Graph, m: object) -> list[T]:
    """The memory-efficient attention backward's scratch on CUDA
    (aten/src/ATen/native/transformers/cuda/attention_backward.cu, ``_efficient_attention_backward``):
    ``delta`` (b, heads, s) fp32, then the kernel workspace, which for sm80+ kernels (split keys:
    ``kNeedsAccumGradQ``) holds an fp32 accumulator of the query gradient, (b, heads, s, head_dim)
    up to block rounding (mem_eff_attention/kernel_backward.h ``workspace_size``); the key/value
    accumulators (only when head_dim exceeds the kernel's block) are left out."""
    heads, head_dim = m.n_heads, m.head_dim  # type: ignore[attr-defined]
    return [g.alloc(tok(heads), F32, "mem-efficient delta"),
            g.alloc(tok(heads * head_dim), F32, "mem-efficient workspace (grad q accumulator)")]


def math_attention(rec: LlamaRecipe, g: Graph, q: T, k: T, v: T, masked: bool = False,
                   qk_contiguous: bool = False) -> T:
    """SDPA's math kernel, which CPU SDPA runs when attention dropout is on:
    ``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp). 16-bit
    inputs are upcast to fp32 on CPU; q and k^T are scaled by sqrt(scale); then ``matmul``,
    ``_safe_softmax``, dropout, ``matmul``, the results cast back; then HF copies the output to
    (b, s, heads, d).

    Without a mask (``is_causal``) the kernel builds an (s, s) additive causal mask and repeats
    grouped k/v itself (``enable_gqa``). With a mask (`masked`: the sliding window) HF has repeated
    k/v (``repeat_kv``, locals until ``sdpa_attention_forward`` returns) and SDPA converted the
    boolean mask before the kernel (`MistralRecipe.sdpa_additive_mask`).

    ``matmul`` folds (b, heads) into one batch dim with ``reshape``; operands whose batch dims cannot
    fold (b > 1) are copied: the query and key when they keep the projections' (b, s, heads, d)
    layout (not `qk_contiguous`), the key and value when not repeated (one kv head per head); and the
    gradient reaching the result's (b, s, heads, d) view is then copied by its reshape too."""
    m, ctx = rec.m, rec.ctx
    n_rep = m.n_heads // m.n_kv_heads
    if masked:
        k, v = ops.repeat_kv(g, k, n_rep, "repeat_kv key"), ops.repeat_kv(g, v, n_rep, "repeat_kv value")
    else:
        g.hold(k), g.hold(v)
    cd = ctx.autocast
    kc = ops.cast(g, k, cd, "sdpa k cast") if cd else g.hold(k)
    qc = ops.cast(g, q, cd, "sdpa q cast") if cd else g.hold(q)
    vc = ops.cast(g, v, cd, "sdpa v cast") if cd else g.hold(v)
    mask = rec.sdpa_additive_mask(g, qc.dt) if masked else None  # type: ignore[attr-defined]
    reduced = qc.dt != F32
    q32, k32, v32 = (ops.cast(g, x, F32, "sdpa math upcast") for x in (qc, kc, vc))
    qs = ops.scalar_op(g, q32, "q * sqrt(scale)")
    if masked:
        kx, vx = g.hold(k32), g.hold(v32)
    else:
        ones = g.alloc(Sz(ss=1), BOOL, "causal ones")
        tril = g.alloc(Sz(ss=1), BOOL, "causal tril")
        g.drop(ones)
        zero, neg = g.alloc(const(1), F32, "0"), g.alloc(const(1), F32, "-inf")
        mask = g.alloc(Sz(ss=1), F32, "causal mask")
        g.drop(zero, neg, tril)
        kx = ops.repeat_kv(g, k32, n_rep, "key expanded")
        vx = ops.repeat_kv(g, v32, n_rep, "value expanded")
    kt = ops.scalar_op(g, kx, "k^T * sqrt(scale)")
    fold = ctx.batch1
    copy_qk = not qk_contiguous and not fold
    copy_kv = n_rep == 1 and not fold
    q2 = ops.clone(g, qs, "query contiguous") if copy_qk else g.hold(qs)
    k2 = ops.clone(g, kt, "key^T contiguous") if copy_qk and copy_kv else g.hold(kt)
    scores = ops.bmm(g, ctx, q2, k2, per_token_sq(m.n_heads), "q @ k^T")
    g.drop(q2, k2, kt)
    assert mask is not None  # the window's mask (masked) or the causal one built above
    sm = ops.add(g, scores, mask, "+ mask")
    g.drop(scores)
    probs = ops.softmax(g, sm, None, "_safe_softmax")
    g.drop(sm)
    pd = ops.dropout(g, ctx, probs, rec.dropout_attn, "attn dropout")
    g.drop(probs)
    # make_tuple(matmul(attn, v).to(dtype), attn.to(dtype)): GCC evaluates the second first
    attn16 = ops.cast(g, pd, qc.dt, "attn to input dtype") if reduced else None
    v2 = ops.clone(g, vx, "value contiguous") if copy_kv else g.hold(vx)
    o3 = ops.bmm(g, ctx, pd, v2, q.n, "probs @ v")
    g.drop(v2)
    o = ops.heads_view(g, o3, "matmul unsafe_view", clone_grad=not fold)
    g.drop(o3)
    if reduced:
        o16 = ops.cast(g, o, qc.dt, "output to input dtype")
        g.drop(o)
        o = o16
    g.drop(kx, qs, mask, k32, v32, q32, pd, vx, attn16, qc, kc, vc)
    out = ops.clone(g, o, "attn_output transpose contiguous")
    g.drop(o, k, v)
    return out
