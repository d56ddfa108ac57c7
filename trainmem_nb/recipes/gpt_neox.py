"""GPT-NeoX / Pythia as Hugging Face implements it (``GPTNeoXForCausalLM``, modeling_gpt_neox.py,
transformers 5.x).

Pre-norm LayerNorm layers with a parallel residual (``x + attn(ln1(x)) + mlp(ln2(x))``, or the
sequential form when ``use_parallel_residual`` is off), a fused ``query_key_value`` projection viewed
as (b, heads, s, 3 * d) and chunked into query/key/value, partial rotary embeddings (the first
``rotary_pct`` of each head rotates, then is concatenated with the pass-through part), an exact-GELU
MLP with biases, dropout after the embeddings and after each block, and an untied output head.
Mirrors the HF code op by op, including the lifetimes of its Python locals.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import F32, I64
from ..engine.tape import Graph, T, per_seq, per_token_sq
from ..model.families import describe
from ..model.layers import LayerKind
from ..spec.choices import Attention
from .base import DEFAULT_KIND, Shared, tok
from .head import causal_lm_loss
from .layernorm import LayerNormRecipe
from .masks import causal_mask
from .rotary import apply_rotary_partial, rotary_cos_sin

__all__ = ["GPTNeoXRecipe"]


class GPTNeoXRecipe(LayerNormRecipe):
    """gpt_neox (Pythia): ``GPTNeoXModel`` layers under ``GPTNeoXForCausalLM``."""

    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        """GPTNeoXModel.forward up to the layers: ``embed_in``, ``position_ids = arange(s) + past``,
        the eager causal mask, ``emb_dropout``, and the rotary ``cos``/``sin`` shared by every layer.
        ``inputs_embeds`` lives until the model returns (freed in `final_norm`)."""
        m, ctx = self.m, self.ctx
        sh = Shared()
        inputs_embeds = ops.embedding(g, ids, p["embed_in.weight"], tok(m.hidden), "embed_in")
        self.input_requires_grad(g, inputs_embeds)
        ar = g.alloc(per_seq(1), I64, "arange")
        pos = g.alloc(per_seq(1), I64, "position_ids")  # arange(s) + past_seen_tokens
        g.drop(ar)
        sh.extra.append(pos)
        if self.t.attention is Attention.EAGER:
            sh.mask = causal_mask(g, inputs_embeds.dt)
        h = ops.dropout(g, ctx, inputs_embeds, self.dropout_embd, "emb_dropout")
        sh.cos, sh.sin = rotary_cos_sin(g, self.m.rotary_dims, h.dt)
        self.model_locals = [inputs_embeds]
        return h, sh

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind = DEFAULT_KIND) -> T:
        """GPTNeoXLayer.forward: ``attn(input_layernorm(x))`` and its dropout, then either the parallel
        residual ``dropout(mlp(post_attention_layernorm(x))) + attn_output + x`` or the sequential
        ``h = attn_output + x; dropout(mlp(post_attention_layernorm(h))) + h``. The layer norms'
        outputs are call arguments that die when the call returns; ``attn_output``, ``_`` and
        ``mlp_output`` live until the layer returns."""
        m, ctx = self.m, self.ctx
        attn_weights: list[T] = []
        ln1 = ops.layer_norm(g, ctx, x, p["input_layernorm.weight"], p["input_layernorm.bias"], tok(1),
                             "input_layernorm")
        a = self.attention(g, ln1, sh, p, attn_weights)
        g.drop(ln1)
        attn_output = ops.dropout(g, ctx, a, self.dropout_hidden, "post_attention_dropout")
        g.drop(a)
        if m.parallel_residual:
            residual = x
        else:
            residual = ops.add(g, attn_output, x, "attn_output + hidden_states")
            g.drop(attn_output)  # `attn_output` rebinds
            attn_output = residual
        ln2 = ops.layer_norm(g, ctx, residual, p["post_attention_layernorm.weight"], p["post_attention_layernorm.bias"],
                             tok(1), "post_attention_layernorm")
        mo = self.mlp(g, ln2, p)
        g.drop(ln2)
        mlp_output = ops.dropout_last(g, ctx, mo, self.dropout_hidden, "post_mlp_dropout")
        g.drop(mo)
        if m.parallel_residual:
            s = ops.add(g, mlp_output, attn_output, "mlp_output + attn_output")
            out = ops.add(g, s, x, "+ hidden_states")
            g.drop(s)
        else:
            out = ops.add(g, mlp_output, attn_output, "mlp_output + attn_output")
        g.drop(attn_output, *attn_weights, mlp_output)
        return out

    def attention(self, g: Graph, h: T, sh: Shared, p: dict[str, T], attn_weights: list[T]) -> T:
        """GPTNeoXAttention.forward: ``query_key_value(h).view(b, s, heads, 3d).transpose(1, 2)``
        chunked into query/key/value views, partial rotary on query and key, the attention interface,
        ``reshape(...).contiguous()`` (no copy: the attention output is already contiguous), ``dense``.

        The rotary outputs are new contiguous (b, heads, s, d) tensors (``cat``); the value stays a
        strided view of the projection, whose view's backward copies the concatenated q/k/v gradient."""
        m, ctx = self.m, self.ctx
        eager = self.t.attention is Attention.EAGER
        math = not eager and self.sdpa_falls_back_to_math
        fold = not ctx.batch1  # (b, heads) fold into one batch dim without a copy only when b == 1
        y = self.linear(g, h, p, "attention.query_key_value", m.hidden, 3 * m.q_dim)  # q_dim: a rank's heads
        qkv = ops.heads_view(g, y, "qkv view", clone_grad=True)
        g.drop(y)
        q, k, v = ops.split(g, qkv, (1 / 3, 1 / 3, 1 / 3), "qkv chunk")
        assert sh.cos is not None and sh.sin is not None
        qe, ke = apply_rotary_partial(g, ctx, q, k, sh.cos, sh.sin, m.rotary_dims / m.head_dim, cat_each=False)
        if eager:
            # `softmax(w, dtype=float32).to(query.dtype)`: one expression; the query is fp32 under
            # autocast (the rotary output), so the probabilities stay fp32 until matmul casts them
            o, pd = ops.eager_attention(g, ctx, qe, ke, v, sh.mask, per_token_sq(m.n_heads), self.dropout_attn,
                                        copy_q=False, copy_k=False, copy_v=fold, grad_copy=fold, softmax_dt=F32,
                                        one_expression=True, probs_dt=qe.dt)
            attn_weights.append(pd)
        elif math:
            o4 = ops.sdpa_math(g, ctx, qe, ke, v, per_token_sq(m.n_heads), self.dropout_attn, causal=True, copy_q=False,
                               copy_k=False, copy_v=fold, grad_copy=fold)
            o = ops.clone(g, o4, "attn_output transpose contiguous")  # sdpa_attention_forward
            g.drop(o4)
        else:
            # flash kernels write the output in the query's layout, here contiguous (b, heads, s, d)
            # (CPU attention.cpp: `empty_like(query).transpose(1, 2)`; CUDA flash_api.cpp:
            # `empty_like(q)`), so sdpa_attention_forward's `transpose(1, 2).contiguous()` copies it;
            # CUDA's memory-efficient kernel, which fp32 inputs get, allocates (b, s, heads, d)
            # (attention.cu `_efficient_attention_forward`): no copy
            o = ops.sdpa_flash(g, ctx, qe, ke, v, tok(m.n_heads), "sdpa")
            if not (ctx.cuda and ctx.autocast is None and self.pdt == F32):
                o4 = o
                o = ops.clone(g, o4, "attn_output transpose contiguous")
                g.drop(o4)
        out = self.linear(g, o, p, "attention.dense", m.q_dim, m.hidden)
        g.drop(o)
        g.drop(qkv, q, k, v, qe, ke)  # locals qkv, query_states, key_states, value_states
        return out

    def mlp(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """GPTNeoXMLP.forward: ``dense_h_to_4h``, the activation, ``dense_4h_to_h``."""
        m, ctx = self.m, self.ctx
        h = self.linear(g, x, p, "mlp.dense_h_to_4h", m.hidden, m.ffn)
        a = ops.activation(g, ctx, h, m.activation, "mlp.act")
        g.drop(h)
        o = self.linear(g, a, p, "mlp.dense_4h_to_h", m.ffn, m.hidden)
        g.drop(a)
        return o

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """``final_layer_norm``; then the model returns and its local ``inputs_embeds`` goes."""
        out = ops.layer_norm(g, self.ctx, x, p["final_layer_norm.weight"], p["final_layer_norm.bias"], tok(1),
                             "final_layer_norm")
        self.release_model_locals(g)
        return out

    def lm_head_weight(self, p: dict[str, T]) -> T:
        """``embed_out`` (the untied head), or the input embeddings it is tied to."""
        return p.get("embed_out.weight") or p.get("lm_head.weight") or p["embed_in.weight"]

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T]:
        """GPTNeoXForCausalLM: ``lm_head`` (``embed_out``; tied to ``embed_in`` only if configured) and
        ForCausalLMLoss; returns (loss, logits)."""
        m, ctx = self.m, self.ctx
        logits = ops.linear(g, ctx, h, self.lm_head_weight(p), m.hidden, m.vocab, None, "lm_head")
        return causal_lm_loss(g, ctx, logits, m.vocab, v4_upcast=describe(m.family).v4_upcast)
