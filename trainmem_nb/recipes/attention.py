"""Decoder self-attention as Hugging Face's llama-derived modules run it, and the attention kernels.

``LlamaAttention.forward`` and its relatives: the q/k/v projections (separate, or one fused ``qkv_proj``
sliced into three views), viewed as heads, rotary embeddings, the attention implementation HF
dispatches to (eager; SDPA, which on CPU runs its math kernel when attention dropout is on; SDPA with an
explicit mask once a sliding window applies), ``o_proj``. The kernels mirror their aten sources,
including the copies ``matmul`` makes of operands whose batch dims cannot fold into one and the CUDA
kernels' backward scratch.

The functions take the recipe (`trainmem_nb.recipes.decoder.DecoderRecipe`: the model, the step's
options, the op context, dropout rates) and the layer's kind (its mask).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..engine import ops
from ..engine.ops import F32
from ..engine.tape import Graph, T, per_token_sq
from ..model.layers import LayerKind
from ..spec.choices import Attention
from .base import Shared, tok
from .masks import sdpa_additive_mask
from .rotary import apply_rotary_pair, apply_rotary_partial

if TYPE_CHECKING:
    from .decoder import DecoderRecipe

__all__ = ["ATTENTIONS", "eager_attention", "math_attention", "self_attention"]


def self_attention(rec: DecoderRecipe, g: Graph, h: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
    """The attention module's forward: projections viewed as heads, rotary, the kernel, ``o_proj``;
    its locals (the fused projection's output, the rotated q/k, v) die when it returns."""
    m = rec.m
    if m.fused_qkv:
        # Phi3Attention: ``qkv = self.qkv_proj(h)`` (a local until return), three slices viewed as heads
        qkv = rec.linear(g, h, p, "self_attn.qkv_proj", m.hidden, m.q_dim + 2 * m.kv_dim)
        width = m.q_dim + 2 * m.kv_dim
        parts = [ops.slice_view(g, qkv, qkv.n * (dim / width), f"qkv[..., {name}]")
                 for name, dim in (("query", m.q_dim), ("key", m.kv_dim), ("value", m.kv_dim))]
        qs, ks, vs = parts
        qv = ops.heads_view(g, qs, "q view")
        kv = ops.heads_view(g, ks, "k view", clone_grad=m.n_kv_heads > 1)
        vv = ops.heads_view(g, vs, "v view", clone_grad=rec.value_grad_contiguous(kind) and m.n_kv_heads > 1)
        g.drop(qs, ks, vs)
        local: list[T] = [qkv]
    elif rec.d.qk_norm == "full":
        # Olmo2Attention: ``q_norm(q_proj(x))``, ``k_norm(k_proj(x))`` over the projection widths, then
        # the three views as heads
        q0 = rec.linear(g, h, p, "self_attn.q_proj", m.hidden, m.q_dim)
        q = rec.norm(g, q0, p["self_attn.q_norm.weight"], "q_norm")
        g.drop(q0)
        k0 = rec.linear(g, h, p, "self_attn.k_proj", m.hidden, m.kv_dim)
        k = rec.norm(g, k0, p["self_attn.k_norm.weight"], "k_norm")
        g.drop(k0)
        v = rec.linear(g, h, p, "self_attn.v_proj", m.hidden, m.kv_dim)
        qv = ops.heads_view(g, q, "q view")
        kv = ops.heads_view(g, k, "k view", clone_grad=m.n_kv_heads > 1)
        vv = ops.heads_view(g, v, "v view", clone_grad=rec.value_grad_contiguous(kind) and m.n_kv_heads > 1)
        g.drop(q, k, v)
        local = []
    else:
        # with q/k norms the transpose follows the norm: the copy of the transposed gradient moves to
        # the view before the norm (its element-wise backward keeps the gradient's layout)
        qkn = rec.d.qk_norm == "head_view"
        # without rotary (a NoPE layer) q and k reach the kernel as views of the projections, and their
        # gradients come back like the value's (SDPA's flash kernel: in the projections' layout)
        q_clone = kind.rope or rec.t.attention is Attention.EAGER or rec.sdpa_falls_back_to_math
        k_clone = m.n_kv_heads > 1 and (kind.rope or rec.value_grad_contiguous(kind))
        q = head_norm(rec, g, rec.linear(g, h, p, "self_attn.q_proj", m.hidden, m.q_dim), p, "q_norm", q_clone)
        qv = ops.heads_view(g, q, "q view", clone_grad=q_clone and not qkn)
        g.drop(q)
        k = head_norm(rec, g, rec.linear(g, h, p, "self_attn.k_proj", m.hidden, m.kv_dim), p, "k_norm", k_clone)
        kv = ops.heads_view(g, k, "k view", clone_grad=k_clone and not qkn)
        g.drop(k)
        v = rec.linear(g, h, p, "self_attn.v_proj", m.hidden, m.kv_dim)
        vv = ops.heads_view(g, v, "v view", clone_grad=rec.value_grad_contiguous(kind) and m.n_kv_heads > 1)
        g.drop(v)
        local = []
    if rec.d.qk_norm == "head":
        # Gemma3Attention: ``q_norm`` / ``k_norm`` over each head of the (b, heads, s, d) views
        qn = rec.norm(g, qv, p["self_attn.q_norm.weight"], "q_norm", rows=m.n_heads)
        g.drop(qv)  # ``query_states = self.q_norm(query_states)`` rebinds the view
        kn = rec.norm(g, kv, p["self_attn.k_norm.weight"], "k_norm", rows=m.n_kv_heads)
        g.drop(kv)
        qv, kv = qn, kn
    cos, sin = sh.rotary(kind)
    if cos is None or sin is None:  # a NoPE layer (SmolLM3's ``if self.use_rope``): q and k as projected
        qr, kr = g.hold(qv), g.hold(kv)
    elif rec.d.rotary == "cat":
        qr, kr = apply_rotary_partial(g, rec.ctx, qv, kv, cos, sin, m.rotary_dims / m.head_dim, cat_each=True)
    else:
        qr, kr = apply_rotary_pair(g, qv, kv, cos, sin, cast_back=rec.d.rotary_fp32)
    g.drop(qv, kv)
    o = attention_kernel(rec, g, qr, kr, vv, sh.attention_mask(kind), kind)
    out = rec.linear(g, o, p, "self_attn.o_proj", m.q_dim, m.hidden)
    g.drop(o)
    if rec.d.module_dropout:  # Starcoder2Attention: ``attn_output = dropout(o_proj(...), residual_dropout)``
        od = ops.dropout(g, rec.ctx, out, rec.dropout_hidden, "self_attn residual_dropout")
        g.drop(out)
        out = od
    g.drop(*local, qr, kr, vv)  # locals (qkv,) query_states, key_states, value_states die when forward returns
    return out


def head_norm(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T], name: str, clone_grad: bool) -> T:
    """Qwen3Attention's ``self.q_norm(self.q_proj(h).view(hidden_shape))`` (and ``k_norm``): the
    family's RMSNorm over each head's dims of the projection viewed as (b, s, heads, d), whose output
    the caller transposes; the projection itself is a temporary. The gradient reaches the view in the
    transposed layout, so its backward (a reshape) copies it (`clone_grad`: more than one head).
    Without ``qk_norm == "head_view"``: `x` unchanged."""
    if rec.d.qk_norm != "head_view":
        return x
    heads = rec.m.n_heads if name == "q_norm" else rec.m.n_kv_heads
    v = ops.heads_view(g, x, f"{name} view", clone_grad=clone_grad)
    g.drop(x)
    out = rec.norm(g, v, p[f"self_attn.{name}.weight"], f"self_attn.{name}", heads)
    g.drop(v)
    return out


def attention_kernel(rec: DecoderRecipe, g: Graph, q: T, k: T, v: T, mask: T | None, kind: LayerKind) -> T:
    """The attention implementation HF dispatches to: eager, SDPA's math fallback, or SDPA."""
    if rec.t.attention is Attention.EAGER:
        return eager_attention(rec, g, q, k, v, mask, qk_contiguous=rec.qk_contiguous, softcap=rec.m.attn_softcap > 0)
    if rec.sdpa_falls_back_to_math:
        return math_attention(rec, g, q, k, v, masked=rec.masked(kind), qk_contiguous=rec.qk_contiguous)
    if rec.masked(kind):
        return sdpa_masked(rec, g, q, k, v)
    out = sdpa(rec, g, q, k, v)
    if rec.qk_contiguous:
        # the flash kernels allocate their output like the query (CPU: measured; CUDA: ``out =
        # at::empty_like(q_padded)``, flash_attn/flash_api.cpp ``mha_fwd``), here (b, heads, s, d)-contiguous,
        # so ``transpose(1, 2).contiguous()`` copies it
        o = out
        out = ops.clone(g, o, "attn_output transpose contiguous")
        g.drop(o)
    return out


def sdpa(rec: DecoderRecipe, g: Graph, q: T, k: T, v: T) -> T:
    """HF's sdpa_attention_forward → torch SDPA (is_causal, enable_gqa: no repeated k/v).

    CPU without dropout and CUDA use a flash-style kernel that saves q, k, v, the output and an
    fp32 logsumexp of (b, heads, s); autocast casts the key before the query (seen in measured traces)."""
    m = rec.m
    return ops.sdpa_flash(g, rec.ctx, q, k, v, tok(m.n_heads), "sdpa")


def sdpa_masked(rec: DecoderRecipe, g: Graph, q: T, k: T, v: T) -> T:
    """``sdpa_attention_forward`` with an explicit mask (a sliding window once ``s >= window``): k and
    v are first repeated for grouped-query attention (``repeat_kv``: the repeated key/value are the
    function's locals until it returns), then SDPA casts its inputs (autocast: key, query, value),
    converts the boolean mask (`sdpa_additive_mask`) and runs the CPU flash kernel, which saves the
    converted mask with q, k, v, its output and logsumexp.

    CUDA (unmeasured here, from the source): flash attention takes no mask, so SDPA runs the
    memory-efficient kernel (``_scaled_dot_product_efficient_attention``, attention.cpp); the
    converted mask is only expanded (``preprocess_mask``: a view when s is a multiple of 16, else
    a padded copy, not modelled) and saved like the CPU kernel's; its logsumexp has s rounded up
    to 32 rows (not modelled: at most 31 * b * heads floats); its backward allocates scratch
    (`trainmem_nb.engine.ops.attention.cuda_backward_scratch`). That kernel allocates (b, s, heads, d) whatever the query
    (``_efficient_attention_forward``, transformers/cuda/attention.cu): no copy back on CUDA."""
    m, ctx = rec.m, rec.ctx
    n_rep = m.n_heads // m.n_kv_heads
    kx = ops.repeat_kv(g, k, n_rep, "repeat_kv key", m.n_kv_heads)
    vx = ops.repeat_kv(g, v, n_rep, "repeat_kv value", m.n_kv_heads)
    out = ops.sdpa_flash(g, ctx, q, kx, vx, tok(m.n_heads), "sdpa", mask=lambda dt: sdpa_additive_mask(g, dt))
    if rec.qk_contiguous and not ctx.cuda:
        # the CPU flash kernel's output follows the query's layout: transpose(1, 2).contiguous()
        # copies it before the function returns
        o = out
        out = ops.clone(g, o, "attn_output transpose contiguous")
        g.drop(o)
    g.drop(kx, vx)  # sdpa_attention_forward's locals (the repeated key and value)
    return out


def math_attention(rec: DecoderRecipe, g: Graph, q: T, k: T, v: T, masked: bool = False,
                   qk_contiguous: bool = False) -> T:
    """SDPA's math kernel (`trainmem_nb.engine.ops.sdpa_math`), which CPU SDPA runs when attention
    dropout is on, then HF copies the output to (b, s, heads, d).

    Without a mask (``is_causal``) the kernel builds an (s, s) additive causal mask and repeats
    grouped k/v itself (``enable_gqa``). With a mask (`masked`: the sliding window) HF has repeated
    k/v (``repeat_kv``, locals until ``sdpa_attention_forward`` returns) and SDPA converted the
    boolean mask before the kernel (`sdpa_additive_mask`).

    ``matmul`` folds (b, heads) into one batch dim with ``reshape``; operands whose batch dims cannot
    fold (b > 1) are copied: the query and key when they keep the projections' (b, s, heads, d)
    layout (not `qk_contiguous`), the key and value when not repeated (one kv head per head); and the
    gradient reaching the result's (b, s, heads, d) view is then copied by its reshape too."""
    m, ctx = rec.m, rec.ctx
    n_rep = m.n_heads // m.n_kv_heads
    if masked:
        k, v = (ops.repeat_kv(g, k, n_rep, "repeat_kv key", m.n_kv_heads),
                ops.repeat_kv(g, v, n_rep, "repeat_kv value", m.n_kv_heads))
    else:
        g.hold(k), g.hold(v)
    fold = ctx.batch1
    copy_qk = not qk_contiguous and not fold
    copy_kv = n_rep == 1 and not fold
    # one kv head: repeat_kv's value is an expanded view, which the probabilities' matmul copies (the key is
    # scaled first, which makes it contiguous)
    expanded_v = masked and n_rep > 1 and m.n_kv_heads == 1 and not fold
    o = ops.sdpa_math(g, ctx, q, k, v, per_token_sq(m.n_heads), rec.dropout_attn, causal=not masked,
                      copy_q=copy_qk, copy_k=copy_qk and copy_kv, copy_v=copy_kv or expanded_v, grad_copy=not fold,
                      mask=(lambda dt: sdpa_additive_mask(g, dt)) if masked else None,
                      n_rep=1 if masked else n_rep, label="sdpa")
    out = ops.clone(g, o, "attn_output transpose contiguous")
    g.drop(o, k, v)
    return out


def eager_attention(rec: DecoderRecipe, g: Graph, q: T, k: T, v: T, mask: T | None,
                    qk_contiguous: bool = False, softcap: bool = False) -> T:
    """HF ``eager_attention_forward``: ``repeat_kv`` for GQA, then the eager kernel
    (`trainmem_nb.engine.ops.eager_attention`: ``q @ k^T * scaling + mask``, fp32 softmax cast back to
    q's dtype in one expression, dropout, ``@ v``, transposed back contiguous); the attention weights
    stay bound in the decoder layer until it returns (`DecoderRecipe.attn_weights`).

    ``matmul`` copies operands whose (b, heads) cannot fold into one batch dim (b > 1): the query and
    key in the projections' layout (not `qk_contiguous`), the key and value when not repeated, and an
    expanded key/value (one kv head: ``repeat_kv`` made a view) unless autocast's cast already made a
    contiguous copy (it casts only what is not already 16-bit: the rotated fp32 key, not the linear's 16-bit
    value); with b == 1 nothing is copied and neither is the output's gradient. `softcap`:
    Gemma 2's ``attn_logit_softcapping`` (``/ softcap``, ``tanh``, ``* softcap`` after the scaling)."""
    m, ctx = rec.m, rec.ctx
    n_rep = m.n_heads // m.n_kv_heads
    fold = ctx.batch1
    copy_qk = not qk_contiguous and not fold
    copy_kv = n_rep == 1 and not fold
    expanded = n_rep > 1 and m.n_kv_heads == 1 and not fold

    def still_expanded(x: T) -> bool:  # autocast's cast copies only a tensor not already in its dtype
        return expanded and (not ctx.autocast or x.dt == ctx.autocast)

    kx = ops.repeat_kv(g, k, n_rep, "repeat_kv key", m.n_kv_heads)
    vx = ops.repeat_kv(g, v, n_rep, "repeat_kv value", m.n_kv_heads)
    out, pd = ops.eager_attention(g, ctx, q, kx, vx, mask, per_token_sq(m.n_heads), rec.dropout_attn,
                                  copy_q=copy_qk, copy_k=(copy_qk and copy_kv) or still_expanded(k),
                                  copy_v=copy_kv or still_expanded(v), grad_copy=not fold, softmax_dt=F32, probs_dt=q.dt,
                                  one_expression=True, softcap=softcap, label="eager")
    g.drop(kx, vx)  # locals of eager_attention_forward
    rec.attn_weights.append(pd)
    return out


#: gpt_oss's biased projections: the bias gradient is reduced by the engine (`ops.linear`)
_REDUCED = {"bias_grad_reduced": True}


def _rotary_chunk(g: Graph, x: T, cos: T, sin: T, name: str) -> T:
    """gpt_oss ``_apply_rotary_emb``: ``first_half, second_half = torch.chunk(x, 2, dim=-1)`` (views),
    ``first_half * cos - second_half * sin``, ``second_half * cos + first_half * sin`` (cos/sin are half
    a head wide; the products promote to their dtype), ``torch.cat`` of the two: a contiguous
    (b, heads, s, head_dim) tensor."""
    x1, x2 = ops.split(g, x, (0.5, 0.5), f"{name} chunk")
    a1 = ops.mul(g, x1, cos, f"{name} first_half * cos")
    a2 = ops.mul(g, x2, sin, f"{name} second_half * sin")
    first = ops.sub(g, a1, a2, f"{name} first_")
    g.drop(a1, a2)
    b1 = ops.mul(g, x2, cos, f"{name} second_half * cos")
    b2 = ops.mul(g, x1, sin, f"{name} first_half * sin")
    second = ops.add(g, b1, b2, f"{name} second_")
    g.drop(b1, b2)
    out = ops.cat2(g, first, second, f"{name} cat")
    g.drop(first, second, x1, x2)
    return out


def sinks_attention(rec: DecoderRecipe, g: Graph, h: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
    """``GptOssAttention.forward`` (modeling_gpt_oss.py): biased q/k/v projections viewed as heads,
    chunked rotary (`_rotary_chunk`, q then k), ``eager_attention_forward`` with the layer's sinks
    (`eager_sinks_attention`; transformers 5.24 runs gpt_oss only eagerly: ``_supports_sdpa = False``),
    ``o_proj``. The attention weights stay bound in the decoder layer until it returns."""
    m = rec.m
    q = rec.linear(g, h, p, "self_attn.q_proj", m.hidden, m.q_dim, **_REDUCED)
    qv = ops.heads_view(g, q, "q view", clone_grad=m.n_heads > 1)
    g.drop(q)
    k = rec.linear(g, h, p, "self_attn.k_proj", m.hidden, m.kv_dim, **_REDUCED)
    kv = ops.heads_view(g, k, "k view", clone_grad=m.n_kv_heads > 1)
    g.drop(k)
    v = rec.linear(g, h, p, "self_attn.v_proj", m.hidden, m.kv_dim, **_REDUCED)
    vv = ops.heads_view(g, v, "v view", clone_grad=m.n_kv_heads > 1)
    g.drop(v)
    cos, sin = sh.rotary(kind)
    assert cos is not None and sin is not None
    qr = _rotary_chunk(g, qv, cos, sin, "q")
    kr = _rotary_chunk(g, kv, cos, sin, "k")
    g.drop(qv, kv)
    o, weights = eager_sinks_attention(rec, g, qr, kr, vv, sh.attention_mask(kind), p["self_attn.sinks"])
    rec.attn_weights.append(weights)
    out = rec.linear(g, o, p, "self_attn.o_proj", m.q_dim, m.hidden, **_REDUCED)
    g.drop(o)
    g.drop(qr, kr, vv)
    return out


def eager_sinks_attention(rec: DecoderRecipe, g: Graph, q: T, k: T, v: T, mask: T | None, sinks: T) -> tuple[T, T]:
    """gpt_oss ``eager_attention_forward``: ``repeat_kv``; ``matmul(q, k^T) * scaling + mask`` (the
    masked logits stay bound as ``attn_weights`` until that name is rebound); the sinks, viewed
    (1, heads, 1, 1) and expanded to (b, heads, s, 1), concatenated as one more key column (CPU
    autocast promotes the parts to the widest dtype first); ``combined - combined.max(-1).values``;
    ``softmax`` in that dtype (``combined_logits`` stays bound until return); the sink column sliced
    off (a view), dropout, ``.to(value.dtype)``, ``matmul`` with v and the transposed result made
    contiguous. q and k come contiguous from the rotary ``cat``; matmul copies only a value in the
    projection's layout (no repeat, b > 1) or an expanded one-kv-head key/value."""
    m, ctx = rec.m, rec.ctx
    H = m.n_heads
    n_rep = H // m.n_kv_heads
    fold = ctx.batch1
    copy_expanded = n_rep > 1 and m.n_kv_heads == 1 and not fold and not ctx.autocast
    copy_v = (n_rep == 1 and not fold) or copy_expanded
    kx = ops.repeat_kv(g, k, n_rep, "repeat_kv key", m.n_kv_heads)
    vx = ops.repeat_kv(g, v, n_rep, "repeat_kv value", m.n_kv_heads)
    cd = ctx.autocast
    kc = ops.cast(g, kx, cd, "eager matmul key cast") if cd else g.hold(kx)
    qc = ops.cast(g, q, cd, "eager matmul query cast") if cd else g.hold(q)
    k2 = ops.clone(g, kc, "eager key^T contiguous") if copy_expanded else g.hold(kc)
    scores = ops.bmm(g, ctx, qc, k2, per_token_sq(H), "eager q @ k^T", grad_b_first=True)
    g.drop(k2, qc, kc)
    w = ops.scalar_op(g, scores, "eager * scaling")
    g.drop(scores)
    if mask is not None:
        w2 = ops.add(g, w, mask, "eager + mask")
        g.drop(w)
        w = w2
    sv = ops.alias_view(g, sinks, "sinks reshape")
    se = g.view(sv, "sinks expand", n=tok(H))

    def expand_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(sv.n, sv.dt, "sinks expand backward sum_to")]

    g.record("sinks expand", [sv], [se], [], expand_bwd)
    g.drop(sv)
    combined = ops.cat_last(g, ctx, [w, se], "cat logits, sinks")
    g.drop(se)
    mx, idx = ops.topk(g, combined, tok(H), "combined max")
    g.drop(idx)  # ``.values`` of the temporary (values, indices) tuple: the indices go unless saved
    shifted = ops.sub(g, combined, mx, "combined - max")
    g.drop(mx, combined)
    probs = ops.softmax(g, shifted, None, "eager softmax")
    scores_v = ops.slice_view(g, probs, per_token_sq(H), "probs[..., :-1]")
    pd = ops.dropout(g, ctx, scores_v, rec.dropout_attn, "eager attn dropout")
    pt = ops.cast(g, pd, vx.dt, "probs to value dtype")
    g.drop(pd, w)  # `attn_weights` rebinds: the masked logits go
    vc = ops.cast(g, vx, cd, "eager matmul value cast") if cd else g.hold(vx)
    pc = ops.cast(g, pt, cd, "eager matmul probs cast") if cd else g.hold(pt)
    v2 = ops.clone(g, vc, "eager value contiguous") if copy_v else g.hold(vc)
    o3 = ops.bmm(g, ctx, pc, v2, vx.n, "eager probs @ v", grad_b_first=True)
    g.drop(pc, vc, v2)
    o = ops.heads_view(g, o3, "eager matmul unsafe_view", clone_grad=not fold)
    g.drop(o3)
    out = ops.clone(g, o, "eager attn_output transpose contiguous")
    g.drop(o)
    g.drop(kx, vx, shifted, probs, scores_v)  # the function's locals
    return out, pt


def _rotary_interleave(g: Graph, q: T, k: T, cos: T, sin: T) -> tuple[T, T]:
    """DeepSeek's ``apply_rotary_pos_emb_interleave``: ``q1, q2 = q[..., 0::2], q[..., 1::2]`` and the
    same for k (four strided slices, all made first), then for q and for k ``cat([x1 * cos - x2 * sin,
    x2 * cos + x1 * sin], -1)`` with the first half of cos/sin (views); the slices are locals."""
    halves = [(ops.slice_view(g, x, x.n * 0.5, f"{name}[..., 0::2]"), ops.slice_view(g, x, x.n * 0.5, f"{name}[..., 1::2]"))
              for name, x in (("q", q), ("k", k))]
    out = []
    for name, (x1, x2) in zip("qk", halves, strict=True):
        a1 = ops.mul(g, x1, cos, f"{name}1 * cos")
        a2 = ops.mul(g, x2, sin, f"{name}2 * sin")
        first = ops.sub(g, a1, a2, f"{name} first")
        g.drop(a1, a2)
        b1 = ops.mul(g, x2, cos, f"{name}2 * cos")
        b2 = ops.mul(g, x1, sin, f"{name}1 * sin")
        second = ops.add(g, b1, b2, f"{name} second")
        g.drop(b1, b2)
        out.append(ops.cat2(g, first, second, f"{name}_embed cat"))
        g.drop(first, second)
    for x1, x2 in halves:
        g.drop(x1, x2)
    return out[0], out[1]


def mla_attention(rec: DecoderRecipe, g: Graph, h: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
    """``DeepseekV3Attention.forward`` (modeling_deepseek_v3.py): q from ``q_proj`` or
    ``q_b_proj(q_a_layernorm(q_a_proj(h)))``, viewed as heads and split into its nope and rope parts;
    ``kv_a_proj_with_mqa`` split into the kv latent (``kv_a_layernorm``) and the shared rope key;
    interleaved rotary on q's rope part and on the key (q, then k; the rotated parts are concatenated
    with their slices: contiguous), ``query = cat(q_pass, q_rot)`` (CPU autocast promotes the 16-bit
    pass part to the rotated part's dtype), ``expand_kv``: ``kv_b_proj`` viewed as heads, split into the
    nope key and the value (a view), the rope key expanded to every head and both copied into a new key
    tensor (`ops.copy_into_new`); then the attention kernel HF dispatches to (eager; SDPA, whose CPU
    flash kernel needs equal q/k and v head dims, so a different v_head_dim runs its math kernel) and
    ``o_proj``. The forward's locals die when it returns."""
    m, t = rec.m, rec.t
    H, nope, rope, vd, r = m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    qk = nope + rope
    if m.q_lora_rank:
        qa = rec.linear(g, h, p, "self_attn.q_a_proj", m.hidden, m.q_lora_rank)
        qn = rec.norm(g, qa, p["self_attn.q_a_layernorm.weight"], "q_a_layernorm")
        g.drop(qa)
        q = rec.linear(g, qn, p, "self_attn.q_b_proj", m.q_lora_rank, H * qk)
        g.drop(qn)
    else:
        q = rec.linear(g, h, p, "self_attn.q_proj", m.hidden, H * qk)
    qh = ops.heads_view(g, q, "q view", clone_grad=H > 1)
    g.drop(q)
    q_pass, q_rot = ops.split(g, qh, (nope / qk, rope / qk), "split q_pass, q_rot")
    ckv = rec.linear(g, h, p, "self_attn.kv_a_proj_with_mqa", m.hidden, r + rope)
    kv_nope, k_rot = ops.split(g, ckv, (r / (r + rope), rope / (r + rope)), "split kv_nope, k_rot")
    kvn = rec.norm(g, kv_nope, p["self_attn.kv_a_layernorm.weight"], "kv_a_layernorm")
    g.drop(kv_nope)
    cos, sin = sh.rotary(kind)
    assert cos is not None and sin is not None
    ch = g.view(cos, "cos[..., :d/2]", n=cos.n * 0.5)
    sn = g.view(sin, "sin[..., :d/2]", n=sin.n * 0.5)
    q_emb, k_emb = _rotary_interleave(g, q_rot, k_rot, ch, sn)
    g.drop(ch, sn, q_rot, k_rot)
    query = ops.cat_last(g, rec.ctx, [q_pass, q_emb], "cat q_pass, q_rot")
    # expand_kv
    kv = rec.linear(g, kvn, p, "self_attn.kv_b_proj", r, H * (nope + vd))
    kvh = ops.heads_view(g, kv, "kv view", clone_grad=H > 1)
    g.drop(kv)
    k_nope, value = ops.split(g, kvh, (nope / (nope + vd), vd / (nope + vd)), "split k_nope, value")
    g.drop(kvh)
    k_exp = ops.expand_view(g, k_emb, k_emb.n * H, "k_rot.expand")
    key = ops.copy_into_new(g, [k_nope, k_exp], k_nope.dt, "key_states")
    g.drop(k_nope, k_exp)
    if t.attention is Attention.EAGER:
        o = eager_attention(rec, g, query, key, value, sh.attention_mask(kind), qk_contiguous=True)
    elif qk != vd and rec.ctx.cuda:
        o = _sdpa_mem_efficient(rec, g, query, key, value)
    elif qk != vd or rec.sdpa_falls_back_to_math:
        o = math_attention(rec, g, query, key, value, masked=False, qk_contiguous=True)
    else:  # the flash kernel's output follows the contiguous query: ``transpose(1, 2).contiguous()`` copies it
        o0 = sdpa(rec, g, query, key, value)
        o = ops.clone(g, o0, "attn_output transpose contiguous")
        g.drop(o0)
    out = rec.linear(g, o, p, "self_attn.o_proj", H * vd, m.hidden)
    g.drop(o)
    g.drop(q_pass, ckv, kvn, q_emb, k_emb, query, key, value, qh)  # the forward's locals
    return out


def _sdpa_mem_efficient(rec: DecoderRecipe, g: Graph, q: T, k: T, v: T) -> T:
    """CUDA SDPA when the value's head dim differs from the query's (MLA): FlashAttention-2 needs equal
    head dims (sdp_utils.cpp ``check_head_dim_size_flash``), the memory-efficient kernel does not
    (``check_head_dim_size_mem_efficient``), so it runs ``_efficient_attention_forward``: autocast casts
    key, query, value; the output is (b, s, heads, v_head_dim) whatever the query's layout (no copy
    back) with an fp32 logsumexp (b, heads, s); saved: q, k, v, output, logsumexp; backward: the three
    gradients and the kernel's scratch (`trainmem_nb.engine.ops.attention.cuda_backward_scratch`).
    Modelled from the sources: no GPU measured it here."""
    from ..engine.ops.attention import cuda_backward_scratch

    m, ctx = rec.m, rec.ctx
    cd = ctx.autocast
    kc = ops.cast(g, k, cd, "sdpa k cast") if cd else g.hold(k)
    qc = ops.cast(g, q, cd, "sdpa q cast") if cd else g.hold(q)
    vc = ops.cast(g, v, cd, "sdpa v cast") if cd else g.hold(v)
    lse_n = tok(m.n_heads)
    out, lse = g.sac_outputs(lambda: (g.alloc(vc.n, qc.dt, "sdpa out"), g.alloc(lse_n, F32, "sdpa logsumexp")),
                             "attention")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        grads: list[T | None] = [g.alloc(qc.n, qc.dt, "sdpa grad q"), g.alloc(kc.n, kc.dt, "sdpa grad k"),
                                 g.alloc(vc.n, vc.dt, "sdpa grad v")]
        g.drop(*cuda_backward_scratch(g, qc, kc, lse_n, masked=True))  # masked=True: the memory-efficient kernel
        return grads

    g.record("sdpa", [qc, kc, vc], [out, lse], [kc, qc, vc, lse, out], bwd)
    g.drop(lse, qc, kc, vc)
    return out


#: The attention modules a description names (`trainmem_nb.model.families.Description.attention`).
ATTENTIONS: dict[str, Callable[[DecoderRecipe, Graph, T, Shared, dict[str, T], LayerKind], T]] = {
    "gqa": self_attention,
}
ATTENTIONS["sinks"] = sinks_attention
ATTENTIONS["mla"] = mla_attention
