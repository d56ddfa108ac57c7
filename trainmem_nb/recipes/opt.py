"""OPT as Hugging Face implements it (``OPTForCausalLM``, modeling_opt.py, transformers 5.x).

Learned positions with offset 2 computed from an all-ones attention mask (``cumsum``), LayerNorm
before (``do_layer_norm_before``) or after each block (opt-350m, which also projects the 512-wide
word embeddings in and out of the hidden size), separate q/k/v projections with the query scaled,
a ReLU MLP with dropout, and an lm_head tied to ``embed_tokens``. Mirrors the HF code op by op,
including the lifetimes of its Python locals.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import F32, I64
from ..engine.tape import Graph, T, per_token_sq
from ..model.families import describe
from ..model.layers import LayerKind
from ..spec.choices import Attention
from .base import DEFAULT_KIND, Shared, tok
from .head import causal_lm_loss
from .layernorm import LayerNormRecipe
from .masks import causal_mask

__all__ = ["OPTRecipe"]


class OPTRecipe(LayerNormRecipe):
    """opt: ``OPTDecoder`` layers under ``OPTForCausalLM``."""

    @property
    def proj(self) -> int:
        """Width of the word embeddings (``word_embed_proj_dim``)."""
        return self.m.word_embed_proj_dim or self.m.hidden

    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        """OPTDecoder.forward up to the layers: ``embed_tokens``, ``position_attention_mask = ones(b, s)``
        (fp32), ``position_ids = (cumsum(mask) * mask - 1).long()``, the eager causal mask,
        ``embed_positions(position_ids + 2)``, ``project_in``, and the sum (no embedding dropout).

        ``inputs_embeds``, the ones mask and ``pos_embeds`` live until the decoder returns (freed in
        `final_norm`); ``position_ids`` is passed to every layer."""
        m = self.m
        sh = Shared()
        inputs_embeds = ops.embedding(g, ids, p["embed_tokens.weight"], tok(self.proj), "embed_tokens")
        self.input_requires_grad(g, inputs_embeds)
        ones = g.alloc(tok(1), F32, "position_attention_mask")
        cs = g.alloc(tok(1), F32, "cumsum")
        pm = g.alloc(tok(1), F32, "position_ids * mask")
        sub = g.alloc(tok(1), F32, "- 1")
        g.drop(pm)
        pos = g.alloc(tok(1), I64, "position_ids .long()")
        g.drop(sub, cs)
        sh.extra.append(pos)
        if self.t.attention is Attention.EAGER:
            sh.mask = causal_mask(g, inputs_embeds.dt)
        # OPTLearnedPositionalEmbedding.forward: embedding(position_ids + offset)
        pos2 = g.alloc(tok(1), I64, "position_ids + offset")
        pos_embeds = ops.embedding(g, pos2, p["embed_positions.weight"], tok(m.hidden), "embed_positions")
        g.drop(pos2)
        self.model_locals = [ones, pos_embeds]
        if "project_in.weight" in p:
            projected = self.linear(g, inputs_embeds, p, "project_in", self.proj, m.hidden)
            g.drop(inputs_embeds)  # `inputs_embeds` rebinds
            inputs_embeds = projected
        self.model_locals.insert(0, inputs_embeds)
        h = ops.add(g, inputs_embeds, pos_embeds, "inputs_embeds + pos_embeds")
        return h, sh

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind = DEFAULT_KIND) -> T:
        """OPTDecoderLayer.forward: ``residual + dropout(self_attn(ln(x)))`` and
        ``residual + dropout(fc2(act(fc1(ln(h)))))``, LayerNorm before (pre-norm) or after (post-norm)
        each block. The attention weights (``_``) live until the layer returns."""
        m, ctx = self.m, self.ctx
        pre = m.pre_norm
        attn_weights: list[T] = []
        h = ops.layer_norm(g, ctx, x, p["self_attn_layer_norm.weight"], p["self_attn_layer_norm.bias"], tok(1),
                           "self_attn_layer_norm") if pre else g.hold(x)
        a = self.attention(g, h, sh, p, attn_weights)
        g.drop(h)  # `hidden_states, _ = self.self_attn(...)` rebinds
        ad = ops.dropout(g, ctx, a, self.dropout_hidden, "dropout")
        g.drop(a)
        h1 = ops.add(g, x, ad, "residual + hidden_states")
        g.drop(ad)
        if not pre:
            n1 = ops.layer_norm(g, ctx, h1, p["self_attn_layer_norm.weight"], p["self_attn_layer_norm.bias"], tok(1),
                                "self_attn_layer_norm")
            g.drop(h1)
            h1 = n1
        # `hidden_states.reshape(-1, h)` is a view; `residual` keeps it
        h2 = ops.layer_norm(g, ctx, h1, p["final_layer_norm.weight"], p["final_layer_norm.bias"], tok(1),
                            "final_layer_norm") if pre else g.hold(h1)
        f1 = self.linear(g, h2, p, "fc1", m.hidden, m.ffn)
        g.drop(h2)
        act = ops.activation(g, ctx, f1, m.activation, "activation_fn")
        g.drop(f1)
        f2 = self.linear(g, act, p, "fc2", m.ffn, m.hidden)
        g.drop(act)
        last = ops.dropout_last if pre else ops.dropout
        fd = last(g, ctx, f2, self.dropout_hidden, "dropout")
        g.drop(f2)
        out = ops.add(g, h1, fd, "residual + hidden_states")
        g.drop(fd)
        if not pre:
            n2 = ops.layer_norm(g, ctx, out, p["final_layer_norm.weight"], p["final_layer_norm.bias"], tok(1),
                                "final_layer_norm")
            g.drop(out)
            out = n2
        g.drop(h1, *attn_weights)  # locals `residual` and `_`
        return out

    def attention(self, g: Graph, h: T, sh: Shared, p: dict[str, T], attn_weights: list[T]) -> T:
        """OPTAttention.forward: ``q_proj(h) * scaling``, ``k_proj``, ``v_proj``, each viewed as
        (b, heads, s, d); the attention interface (scaling 1.0); ``out_proj``."""
        m, ctx = self.m, self.ctx
        eager = self.t.attention is Attention.EAGER
        math = not eager and self.sdpa_falls_back_to_math
        fold = not ctx.batch1  # (b, heads) fold into one batch dim without a copy only when b == 1
        hh, a = m.hidden, m.q_dim  # a: the heads' width (a tensor-parallel rank's share)
        q0 = self.linear(g, h, p, "self_attn.q_proj", hh, a)
        q1 = ops.scalar_op(g, q0, "q * scaling")
        g.drop(q0)
        # eager's and the math kernel's gradients come back in (b, heads, s, d) layouts that the views
        # (query, value) or the projection's reshape of its output (key) copy; SDPA's flash kernels
        # return them in the projections' layout
        q = ops.heads_view(g, q1, "query view", clone_grad=eager or math)
        g.drop(q1)
        # the key's gradient is copied by k_proj's own output reshape, before v_proj's backward runs
        k1 = self.linear_strided_grad(g, h, p, "self_attn.k_proj", hh, a, (eager or math) and fold)
        v0 = self.linear(g, h, p, "self_attn.v_proj", hh, a)
        k = ops.heads_view(g, k1, "key view", clone_grad=False)
        v = ops.heads_view(g, v0, "value view", clone_grad=eager or math)
        g.drop(k1, v0)
        if eager:
            # `softmax(w, dtype=float32).to(query.dtype)`: one expression
            o, pd = ops.eager_attention(g, ctx, q, k, v, sh.mask, per_token_sq(m.n_heads), self.dropout_attn, copy_q=fold,
                                        copy_k=fold, copy_v=fold, grad_copy=fold, softmax_dt=F32, one_expression=True)
            attn_weights.append(pd)
        elif math:
            o4 = ops.sdpa_math(g, ctx, q, k, v, per_token_sq(m.n_heads), self.dropout_attn, causal=True, copy_q=fold,
                               copy_k=fold, copy_v=fold, grad_copy=fold)
            o = ops.clone(g, o4, "attn_output transpose contiguous")  # sdpa_attention_forward
            g.drop(o4)
        else:
            o = ops.sdpa_flash(g, ctx, q, k, v, tok(m.n_heads), "sdpa")
        out = self.linear(g, o, p, "self_attn.out_proj", a, hh)
        g.drop(o)
        g.drop(q, k, v)  # query_states, key_states, value_states die when forward returns
        return out

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """The decoder's ``final_layer_norm`` (pre-norm models) and ``project_out``; then the decoder
        returns and its locals ``inputs_embeds``, the ones mask and ``pos_embeds`` go."""
        m, ctx = self.m, self.ctx
        h = ops.layer_norm(g, ctx, x, p["final_layer_norm.weight"], p["final_layer_norm.bias"], tok(1),
                           "final_layer_norm") if "final_layer_norm.weight" in p else g.hold(x)
        if "project_out.weight" in p:
            out = self.linear(g, h, p, "project_out", m.hidden, self.proj)
            g.drop(h)
            h = out
        self.release_model_locals(g)
        return h

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T]:
        """OPTForCausalLM: ``lm_head(h).contiguous()`` (tied to ``embed_tokens``) and ForCausalLMLoss."""
        m, ctx = self.m, self.ctx
        w = p.get("lm_head.weight") or p["embed_tokens.weight"]
        logits = ops.linear(g, ctx, h, w, self.proj, m.vocab, None, "lm_head")
        return causal_lm_loss(g, ctx, logits, m.vocab, v4_upcast=describe(m.family).v4_upcast)
