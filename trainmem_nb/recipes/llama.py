"""Llama-style decoders as Hugging Face implements them: llama, mistral, qwen2, gemma, phi3, mixtral.

Pre-norm RMSNorm layers with rotary positions, grouped-query attention (SDPA, eager, or SDPA's CPU
math fallback when attention dropout is on) and a gated MLP. Mirrors modeling_llama.py (transformers
5.x), including the lifetimes of its Python locals.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import ops
from ..engine.ops import BOOL, F32, I64
from ..engine.tape import Graph, Sz, T, const, per_seq, per_token_sq
from ..spec.choices import Attention
from .base import Recipe, Shared, tok
from .head import causal_lm_loss
from .masks import causal_mask
from .rotary import rotary_cos_sin

__all__ = ["LlamaRecipe"]


class LlamaRecipe(Recipe):
    """llama, mistral, qwen2, gemma, phi3 and mixtral: pre-norm RMSNorm decoder with RoPE."""

    def rmsnorm(self, g: Graph, x: T, w: T, label: str) -> T:
        """LlamaRMSNorm.forward: upcast to fp32, ``x * rsqrt(mean(x**2) + eps)``, cast back, ``* w``."""
        h = self.m.hidden
        input_dt = x.dt
        hs = ops.cast(g, x, F32, f"{label} to fp32")
        p = ops.pow2(g, hs, f"{label} pow")
        var = ops.mean_last(g, p, tok(1), f"{label} mean")
        g.drop(p)
        ve = ops.scalar_op(g, var, f"{label} +eps", grad_allocs=False)
        r = ops.rsqrt(g, ve, f"{label} rsqrt")
        g.drop(ve)
        hs2 = ops.mul(g, hs, r, f"{label} x*rsqrt")
        g.drop(r, hs)
        hs3 = ops.cast(g, hs2, input_dt, f"{label} to input dtype")
        out = ops.mul(g, w, hs3, f"{label} *weight")
        g.drop(hs3, hs2, var)
        _ = h
        return out

    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        """LlamaModel.forward up to the layers: the token embeddings, the position ids, the attention
        mask (`attention_mask`) and rotary cos/sin, in that order."""
        x = self.embed_tokens(g, ids, p)
        sh = Shared()
        # position ids: cache_position = arange(s) (+ past length) -> unsqueeze
        ar = g.alloc(per_seq(1), I64, "arange")
        pos = g.alloc(per_seq(1), I64, "cache_position")
        g.drop(ar)
        sh.extra.append(pos)
        sh.mask = self.attention_mask(g, x.dt)
        sh.cos, sh.sin = rotary_cos_sin(g, self.m.rotary_dims, x.dt)
        return x, sh

    def embed_tokens(self, g: Graph, ids: T, p: dict[str, T]) -> T:
        """``embed_tokens(input_ids)``: (tokens, hidden) in the weight's dtype."""
        return ops.embedding(g, ids, p["embed_tokens.weight"], tok(self.m.hidden), "embed_tokens")

    def attention_mask(self, g: Graph, dt: int) -> T | None:
        """The mask the layers get: a (b, 1, s, s) causal mask for eager attention, none for SDPA
        (``is_causal``)."""
        return causal_mask(g, dt) if self.t.attention is Attention.EAGER else None

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T]) -> T:
        m = self.m
        self.attn_weights: list[T] = []
        residual = g.hold(x)
        h = self.rmsnorm(g, x, p["input_layernorm.weight"], "input_layernorm")
        a = self.attention(g, h, sh, p)
        g.drop(h)
        h1 = ops.add(g, residual, a, "residual add (attn)")
        g.drop(a, residual)
        residual = g.hold(h1)
        h2 = self.rmsnorm(g, h1, p["post_attention_layernorm.weight"], "post_attention_layernorm")
        g.drop(h1)
        mo = self.mlp(g, h2, p)
        g.drop(h2)
        out = ops.add(g, residual, mo, "residual add (mlp)")
        g.drop(mo, residual, *self.attn_weights)
        _ = m
        return out

    def attention(self, g: Graph, h: T, sh: Shared, p: dict[str, T]) -> T:
        m = self.m
        q = self.linear(g, h, p, "self_attn.q_proj", m.hidden, m.q_dim)
        qv = ops.heads_view(g, q, "q view")
        g.drop(q)
        k = self.linear(g, h, p, "self_attn.k_proj", m.hidden, m.kv_dim)
        kv = ops.heads_view(g, k, "k view")
        g.drop(k)
        v = self.linear(g, h, p, "self_attn.v_proj", m.hidden, m.kv_dim)
        vv = ops.heads_view(g, v, "v view", clone_grad=self.value_grad_contiguous)
        g.drop(v)
        assert sh.cos is not None and sh.sin is not None
        qr = self.apply_rotary(g, qv, sh.cos, sh.sin, "q")
        kr = self.apply_rotary(g, kv, sh.cos, sh.sin, "k")
        g.drop(qv, kv)
        o = self.attention_kernel(g, qr, kr, vv, sh.mask)
        out = self.linear(g, o, p, "self_attn.o_proj", m.q_dim, m.hidden)
        g.drop(o)
        g.drop(qr, kr, vv)  # locals query_states, key_states, value_states die when forward returns
        return out

    @property
    def value_grad_contiguous(self) -> bool:
        """Does the value's gradient reach its (b, s, kv, d) -> (b, kv, s, d) view contiguous in the
        latter layout, so that the view's backward copies it? Not from SDPA's kernel (the projection's
        layout), but from eager attention's matmuls and SDPA's math kernel."""
        return self.t.attention is Attention.EAGER or self.sdpa_falls_back_to_math

    def attention_kernel(self, g: Graph, q: T, k: T, v: T, mask: T | None) -> T:
        """The attention implementation HF dispatches to: eager, SDPA's math fallback, or SDPA."""
        if self.t.attention is Attention.EAGER:
            return self.eager(g, q, k, v, mask)
        if self.sdpa_falls_back_to_math:
            return self.sdpa_math(g, q, k, v)
        return self.sdpa(g, q, k, v)

    def apply_rotary(self, g: Graph, x: T, cos: T, sin: T, name: str) -> T:
        """``(x * cos) + (rotate_half(x) * sin)``."""
        a = ops.mul(g, x, cos, f"{name} * cos")
        rh = ops.rotate_half(g, x, 1.0, f"{name} rotate_half")
        b = ops.mul(g, rh, sin, f"{name} rotate_half * sin")
        g.drop(rh)
        out = ops.add(g, a, b, f"{name} rotary add")
        g.drop(a, b)
        return out

    def sdpa(self, g: Graph, q: T, k: T, v: T) -> T:
        """HF's sdpa_attention_forward → torch SDPA (is_causal, enable_gqa: no repeated k/v).

        CPU without dropout and CUDA use a flash-style kernel that saves q, k, v, the output and an
        fp32 logsumexp of (b, heads, s)."""
        m, ctx = self.m, self.ctx
        cd = ctx.autocast
        # autocast casts the key before the query (seen in measured traces); value is already 16-bit
        kc = k if cd is None else ops.cast(g, k, cd, "sdpa k cast")
        qc = q if cd is None else ops.cast(g, q, cd, "sdpa q cast")
        vc = v if cd is None else ops.cast(g, v, cd, "sdpa v cast")
        if cd is None:
            g.hold(qc), g.hold(kc), g.hold(vc)
        out, lse = g.sac_outputs(lambda: (g.alloc(q.n, qc.dt, "sdpa out"), g.alloc(tok(m.n_heads), F32, "sdpa logsumexp")),
                                 "attention")

        def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
            grads: list[T | None] = [g.alloc(qc.n, qc.dt, "sdpa grad q"), g.alloc(kc.n, kc.dt, "sdpa grad k"),
                     g.alloc(vc.n, vc.dt, "sdpa grad v")]
            if ctx.cuda:
                g.drop(*flash_backward_scratch(g, m, qc.dt))
            return grads

        # the node releases its saved tensors in the order key, query, value, logsumexp, output
        g.record("sdpa", [qc, kc, vc], [out, lse], [kc, qc, vc, lse, out], bwd)
        g.drop(lse, qc, kc, vc)
        return out

    #: The rotary outputs are contiguous (b, heads, s, d) tensors (phi3's ``cat``), not views in the
    #: projections' (b, s, heads, d) layout (llama's element-wise rotary): decides matmul copies.
    qk_contiguous = False

    def eager(self, g: Graph, q: T, k: T, v: T, mask: T | None) -> T:
        """HF ``eager_attention_forward``: `eager_attention`."""
        return eager_attention(self, g, q, k, v, mask, qk_contiguous=self.qk_contiguous)

    @property
    def sdpa_falls_back_to_math(self) -> bool:
        """On CPU, SDPA with attention dropout runs the math kernel (the CPU flash kernel has no
        dropout); CUDA's flash and memory-efficient kernels apply dropout inside the kernel."""
        return self.t.attention is Attention.SDPA and not self.ctx.cuda and self.dropout_attn > 0

    def sdpa_math(self, g: Graph, q: T, k: T, v: T) -> T:
        """``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp):
        16-bit inputs are upcast to fp32 on CPU; q and k scaled by sqrt(scale), an (s, s) causal
        mask, k/v repeated for GQA, ``matmul``, ``_safe_softmax``, dropout, ``matmul``, results cast
        back; then HF makes the output contiguous."""
        m, ctx = self.m, self.ctx
        cd = ctx.autocast
        kc = k if cd is None else ops.cast(g, k, cd, "sdpa k cast")
        qc = q if cd is None else ops.cast(g, q, cd, "sdpa q cast")
        vc = v if cd is None else ops.cast(g, v, cd, "sdpa v cast")
        if cd is None:
            g.hold(qc), g.hold(kc), g.hold(vc)
        reduced = qc.dt != F32
        q32, k32, v32 = (ops.cast(g, x, F32, "sdpa math upcast") for x in (qc, kc, vc))
        n_rep = m.n_heads // m.n_kv_heads
        qs = ops.scalar_op(g, q32, "q * sqrt(scale)")
        ones = g.alloc(Sz(ss=1), BOOL, "causal ones")
        tril = g.alloc(Sz(ss=1), BOOL, "causal tril")
        g.drop(ones)
        zero, neg = g.alloc(const(1), F32, "0"), g.alloc(const(1), F32, "-inf")
        mask = g.alloc(Sz(ss=1), F32, "causal mask")
        g.drop(zero, neg, tril)
        kx = ops.repeat_kv(g, k32, n_rep, "key expanded")
        vx = ops.repeat_kv(g, v32, n_rep, "value expanded")
        kt = ops.scalar_op(g, kx, "k^T * sqrt(scale)")
        q2 = ops.clone(g, qs, "query contiguous")
        scores = ops.bmm(g, ctx, q2, kt, per_token_sq(m.n_heads), "q @ k^T")
        g.drop(q2, kt)
        sm = ops.add(g, scores, mask, "+ mask")
        g.drop(scores)
        probs = ops.softmax(g, sm, None, "_safe_softmax")
        g.drop(sm)
        pd = ops.dropout(g, ctx, probs, self.dropout_attn, "attn dropout")
        g.drop(probs)
        # make_tuple(matmul(attn, v).to(dtype), attn.to(dtype)): GCC evaluates the second first
        attn16 = ops.cast(g, pd, qc.dt, "attn to input dtype") if reduced else None
        o3 = ops.bmm(g, ctx, pd, vx, q.n, "probs @ v")
        o = ops.heads_view(g, o3, "matmul unsafe_view", clone_grad=True)
        g.drop(o3)
        if reduced:
            o16 = ops.cast(g, o, qc.dt, "output to input dtype")
            g.drop(o)
            o = o16
        g.drop(kx, qs, mask, k32, v32, q32, pd, vx, attn16, qc, kc, vc)
        out = ops.clone(g, o, "attn_output transpose contiguous")
        g.drop(o)
        return out

    def mlp(self, g: Graph, x: T, p: dict[str, T]) -> T:
        m = self.m
        gt = self.linear(g, x, p, "mlp.gate_proj", m.hidden, m.ffn)
        a = self.act(g, gt)
        g.drop(gt)
        u = self.linear(g, x, p, "mlp.up_proj", m.hidden, m.ffn)
        pr = ops.mul(g, a, u, "act * up")
        g.drop(a, u)
        out = self.linear(g, pr, p, "mlp.down_proj", m.ffn, m.hidden)
        g.drop(pr)
        return out

    def act(self, g: Graph, x: T) -> T:
        return ops.unary_saving_input(g, x, self.m.activation)

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """The base model's last op (its output is held by the returned model output)."""
        return self.rmsnorm(g, x, p["norm.weight"], "norm")

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T]:
        """``*ForCausalLM``: logits over the vocabulary and the loss; returns (loss, logits)."""
        m, ctx = self.m, self.ctx
        w = p.get("lm_head.weight") or p["embed_tokens.weight"]
        logits = ops.linear(g, ctx, h, w, m.hidden, m.vocab, None, "lm_head")
        return causal_lm_loss(g, logits, m.vocab, ctx.batch1), logits


def flash_backward_scratch(g: Graph, m: object, dt: int) -> list[T]:
    """FlashAttention-2's backward scratch on CUDA, allocated through PyTorch's caching allocator
    (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, ``mha_bwd``): ``softmax_d``
    (b, heads, s) fp32, ``dq_accum`` (b, s, heads, head_dim) fp32, and for grouped-query attention
    ``dk_expanded``/``dv_expanded`` (b, s, heads, head_dim) before they are summed per kv head.
    FA2 rounds s up to 128 and head_dim to 32; those few rows are left out (at most 127 tokens)."""
    heads, head_dim, kv = m.n_heads, m.head_dim, m.n_kv_heads  # type: ignore[attr-defined]
    out = [g.alloc(tok(heads), F32, "flash softmax_d"), g.alloc(tok(heads * head_dim), F32, "flash dq_accum")]
    if kv != heads:
        out += [g.alloc(tok(heads * head_dim), dt, "flash dk_expanded"), g.alloc(tok(heads * head_dim), dt, "flash dv_expanded")]
    return out


def eager_attention(rec: LlamaRecipe, g: Graph, q: T, k: T, v: T, mask: T | None,
                    qk_contiguous: bool = False) -> T:
    """HF ``eager_attention_forward``: repeat k/v for GQA, ``q @ k^T * scaling + mask``, fp32 softmax
    cast back to q's dtype, dropout, ``@ v``, transpose back to contiguous; the attention weights stay
    bound in the decoder layer until it returns.

    ``matmul`` copies operands whose (b, heads) cannot fold into one batch dim (b > 1): the query and
    key in the projections' layout (not `qk_contiguous`), the key and value when not repeated; with
    b == 1 nothing is copied and neither is the output's gradient."""
    m, ctx = rec.m, rec.ctx
    n_rep = m.n_heads // m.n_kv_heads
    fold = ctx.batch1
    copy_qk = not qk_contiguous and not fold
    copy_kv = n_rep == 1 and not fold
    kx = ops.repeat_kv(g, k, n_rep, "repeat_kv key")
    vx = ops.repeat_kv(g, v, n_rep, "repeat_kv value")
    # matmul(query, key^T): autocast casts key then query
    kc = ops.cast(g, kx, ctx.autocast, "matmul key cast") if ctx.autocast else g.hold(kx)
    qc = ops.cast(g, q, ctx.autocast, "matmul query cast") if ctx.autocast else g.hold(q)
    q2 = ops.clone(g, qc, "query contiguous") if copy_qk else g.hold(qc)
    k2 = ops.clone(g, kc, "key^T contiguous") if copy_qk and copy_kv else g.hold(kc)
    scores = ops.bmm(g, ctx, q2, k2, per_token_sq(m.n_heads), "q @ k^T")
    g.drop(q2, k2, qc, kc)  # matmul's operands and their copies die when matmul returns
    w = ops.scalar_op(g, scores, "* scaling")
    g.drop(scores)
    if mask is not None:
        w2 = ops.add(g, w, mask, "+ mask")
        g.drop(w)
        w = w2
    probs = ops.softmax(g, w, F32, "softmax")
    pq = ops.cast(g, probs, q.dt, "probs to q dtype")
    g.drop(probs, w)  # `attn_weights = softmax(...).to(dtype)` rebinds the name after the cast
    pd = ops.dropout(g, ctx, pq, rec.dropout_attn, "attn dropout")
    g.drop(pq)
    pc = ops.cast(g, pd, ctx.autocast, "matmul probs cast") if ctx.autocast else g.hold(pd)
    vc = ops.cast(g, vx, ctx.autocast, "matmul value cast") if ctx.autocast else g.hold(vx)
    v2 = ops.clone(g, vc, "value contiguous") if copy_kv else g.hold(vc)
    o3 = ops.bmm(g, ctx, pc, v2, q.n, "probs @ v")
    g.drop(v2, pc, vc)
    o = ops.heads_view(g, o3, "matmul unsafe_view", clone_grad=not fold)
    g.drop(o3)
    out = ops.clone(g, o, "attn_output transpose contiguous")
    g.drop(o, kx, vx)  # locals of eager_attention_forward
    rec.attn_weights.append(pd)
    return out
