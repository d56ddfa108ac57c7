"""Phi-1.5 / Phi-2 as Hugging Face implements them (``PhiForCausalLM``, modeling_phi.py, transformers 5.x).

One LayerNorm per layer feeding attention and the MLP in parallel (``attn + mlp + residual``), q/k/v
projections with biases viewed as heads, partial rotary embeddings (the first ``partial_rotary_factor``
of each head rotates and is concatenated with the pass-through part), a ``gelu_new`` MLP (fc1/fc2),
``resid_pdrop`` on both branches, ``embd_pdrop`` after the embeddings, ``final_layernorm`` and an
``lm_head`` with a bias. Built from the shared parts: LayerNorm families' biased projections
(`BiasedDecoderRecipe`), the composed decoder's attention kernels (`attention.attention_kernel`, with the
contiguous rotary outputs of ``rotary="cat"``) and `rotary.apply_rotary_partial`. Mirrors the HF code
op by op, including the lifetimes of its Python locals.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import I64
from ..engine.tape import Graph, T, per_seq
from ..model.layers import LayerKind
from ..spec.choices import Attention
from .attention import attention_kernel
from .base import DEFAULT_KIND, Shared, tok
from .biased import BiasedDecoderRecipe
from .head import causal_lm_loss
from .masks import causal_mask
from .rotary import apply_rotary_partial, rotary_cos_sin

__all__ = ["PhiRecipe"]


class PhiRecipe(BiasedDecoderRecipe):
    """phi: ``PhiModel`` layers under ``PhiForCausalLM``. ``inputs_embeds =
    self.embed_dropout(inputs_embeds)``: the model keeps the dropout's output, the first layer's input,
    bound until it returns (`BiasedDecoderRecipe.embed_output_kept`)."""

    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        """PhiModel.forward up to the layers: ``embed_tokens``, ``position_ids = arange(s) + past``,
        ``create_causal_mask`` (a mask for eager attention only), ``embed_dropout`` (the raw embedding
        goes when ``inputs_embeds`` rebinds), the rotary ``cos``/``sin`` shared by every layer."""
        m, ctx = self.m, self.ctx
        sh = Shared()
        e = ops.embedding(g, ids, p["embed_tokens.weight"], tok(m.hidden), "embed_tokens")
        self.input_requires_grad(g, e)
        ar = g.alloc(per_seq(1), I64, "arange")
        pos = g.alloc(per_seq(1), I64, "position_ids")  # arange(s) + past_seen_tokens
        g.drop(ar)
        sh.extra.append(pos)
        if self.t.attention is Attention.EAGER:
            sh.mask = causal_mask(g, e.dt)
        h = ops.dropout(g, ctx, e, self.dropout_embd, "embed_dropout")
        g.drop(e)
        sh.cos, sh.sin = rotary_cos_sin(g, m.rotary_dims, h.dt)
        return h, sh

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind = DEFAULT_KIND) -> T:
        """PhiDecoderLayer.forward: ``h = input_layernorm(x)``, ``attn_outputs = resid_dropout(attn(h))``,
        ``resid_dropout(mlp(h))``, ``attn_outputs + feed_forward_hidden_states + residual``. The norm's
        output is bound (``hidden_states``) until the sum rebinds it; ``attn_outputs``, ``_`` (the
        attention weights) and ``feed_forward_hidden_states`` live until the layer returns."""
        ctx = self.ctx
        self.attn_weights = []
        ln = ops.layer_norm(g, ctx, x, p["input_layernorm.weight"], p["input_layernorm.bias"], tok(1),
                            "input_layernorm")
        a = self.attention(g, ln, sh, p, kind)
        attn_outputs = ops.dropout(g, ctx, a, self.dropout_hidden, "resid_dropout (attn)")
        g.drop(a)
        mo = self.mlp(g, ln, p, kind)
        ff = ops.dropout_last(g, ctx, mo, self.dropout_hidden, "resid_dropout (mlp)")
        g.drop(mo)
        s = ops.add(g, attn_outputs, ff, "attn_outputs + feed_forward_hidden_states")
        out = ops.add(g, s, x, "+ residual")
        g.drop(s, ln)
        g.drop(attn_outputs, *self.attn_weights, ff)
        return out

    def attention(self, g: Graph, h: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
        """PhiAttention.forward: ``q_proj(h).view(b, s, -1, d).transpose(1, 2)`` (and k, v), with
        ``qk_layernorm`` a LayerNorm on each of the transposed query and key (not modelled: the transient
        contiguous copy ``layer_norm_cpu``/``layer_norm_cuda`` make of their non-contiguous input with
        ``expect_contiguous()``, inside the kernel where no measured step sees it either), partial
        rotary (``query_rot, key_rot = apply_rotary_pos_emb(...)`` and ``query_pass, key_pass`` stay
        bound until it returns), ``cat`` into contiguous (b, heads, s, d) query/key, the attention
        interface, ``reshape(...).contiguous()`` (no copy), ``dense``."""
        m = self.m
        q = self.linear(g, h, p, "self_attn.q_proj", m.hidden, m.q_dim)
        qv = ops.heads_view(g, q, "q view")
        g.drop(q)
        k = self.linear(g, h, p, "self_attn.k_proj", m.hidden, m.kv_dim)
        kv = ops.heads_view(g, k, "k view", clone_grad=m.n_kv_heads > 1)
        g.drop(k)
        v = self.linear(g, h, p, "self_attn.v_proj", m.hidden, m.kv_dim)
        vv = ops.heads_view(g, v, "v view", clone_grad=self.value_grad_contiguous(kind) and m.n_kv_heads > 1)
        g.drop(v)
        if m.qk_layernorm:  # ``query_states = self.q_layernorm(query_states)`` (and the key): per head
            qn = ops.layer_norm(g, self.ctx, qv, p["self_attn.q_layernorm.weight"], p["self_attn.q_layernorm.bias"],
                                tok(m.n_heads), "self_attn.q_layernorm")
            g.drop(qv)  # `query_states` rebinds
            kn = ops.layer_norm(g, self.ctx, kv, p["self_attn.k_layernorm.weight"], p["self_attn.k_layernorm.bias"],
                                tok(m.n_kv_heads), "self_attn.k_layernorm")
            g.drop(kv)
            qv, kv = qn, kn
        assert sh.cos is not None and sh.sin is not None
        kept: list[T] = []
        qe, ke = apply_rotary_partial(g, self.ctx, qv, kv, sh.cos, sh.sin, m.rotary_dims / m.head_dim,
                                      cat_each=False, keep=kept)
        g.drop(qv, kv)  # `query_states` / `key_states` rebind to the concatenations
        o = attention_kernel(self, g, qe, ke, vv, sh.attention_mask(kind), kind)
        out = self.linear(g, o, p, "self_attn.dense", m.q_dim, m.hidden)
        g.drop(o)
        g.drop(qe, ke, vv, *kept)
        return out

    def mlp(self, g: Graph, x: T, p: dict[str, T], kind: LayerKind) -> T:
        """PhiMLP.forward: ``fc1``, the activation (``gelu_new``), ``fc2``."""
        m, ctx = self.m, self.ctx
        h = self.linear(g, x, p, "mlp.fc1", m.hidden, m.ffn)
        a = ops.activation(g, ctx, h, m.activation, "mlp.activation_fn")
        g.drop(h)
        o = self.linear(g, a, p, "mlp.fc2", m.ffn, m.hidden)
        g.drop(a)
        return o

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """``final_layernorm``."""
        return ops.layer_norm(g, self.ctx, x, p["final_layernorm.weight"], p["final_layernorm.bias"], tok(1),
                              "final_layernorm")

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T]:
        """PhiForCausalLM: ``lm_head`` (an ``nn.Linear`` with a bias: ``addmm``; its weight tied to
        ``embed_tokens`` only if configured) and ForCausalLMLoss; returns (loss, logits)."""
        m, ctx = self.m, self.ctx
        w = p.get("lm_head.weight") or p["embed_tokens.weight"]
        b = p.get("lm_head.bias")
        if b is None:
            logits = ops.linear(g, ctx, h, w, m.hidden, m.vocab, None, "lm_head")
        else:
            logits = ops.addmm(g, ctx, h, w, b, m.hidden, m.vocab, "lm_head", linear_casts=True)
        return causal_lm_loss(g, ctx, logits, m.vocab)
