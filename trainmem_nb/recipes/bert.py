"""BERT as Hugging Face implements it (``BertForMaskedLM``, modeling_bert.py, transformers 5.x).

A bidirectional encoder: word + token-type + position embeddings, LayerNorm and dropout; post-norm
layers (``LayerNorm(dropout(dense(x)) + x)`` after attention and after the GELU MLP) with separate
query/key/value projections and no attention mask; the masked-LM head (dense, GELU, LayerNorm, a
decoder tied to the word embeddings plus a bias) and ``CrossEntropyLoss`` over every position (the
measured step passes ``labels = input_ids``). Mirrors the HF code op by op, including the lifetimes
of its Python locals.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import I64
from ..engine.tape import Graph, Sz, T, per_seq, per_token_sq
from ..model.layers import LayerKind
from ..spec.choices import Attention
from .base import DEFAULT_KIND, Shared, tok
from .head import classifier_labels, masked_lm_loss, sequence_classification_loss
from .layernorm import LayerNormRecipe

__all__ = ["BertRecipe"]


class BertRecipe(LayerNormRecipe):
    """bert: ``BertModel`` (no pooler) under ``BertForMaskedLM``."""

    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        """BertEmbeddings.forward: token types gathered from the zero buffer (``gather``, then
        expanded to (b, s)), ``word + token_type``, ``+ position`` (positions are a view of the
        ``position_ids`` buffer, broadcast over the batch), LayerNorm, dropout. BertModel keeps the
        result (``embedding_output``) until it returns; the embeddings die when this function returns."""
        m, ctx = self.m, self.ctx
        sh = Shared()
        tt_ids = g.alloc(per_seq(1), I64, "token_type_ids gather") if m.type_vocab else None
        words = ops.embedding(g, ids, p["embeddings.word_embeddings.weight"], tok(m.hidden), "word_embeddings")
        self.input_requires_grad(g, words)
        e = g.hold(words)
        tt = None
        if tt_ids is not None:
            tt = ops.embedding(g, tt_ids, p["embeddings.token_type_embeddings.weight"], tok(m.hidden),
                               "token_type_embeddings")
            e2 = ops.add(g, e, tt, "inputs_embeds + token_type_embeddings")
            g.drop(e)
            e = e2
        pos_ids = g.external(per_seq(1), I64, "position_ids buffer view")
        # (1, s, h): broadcast over the batch (with one sequence its gradient needs no reduction)
        pos_n = tok(m.hidden) if ctx.batch1 else per_seq(m.hidden)
        pos = ops.embedding(g, pos_ids, p["embeddings.position_embeddings.weight"], pos_n, "position_embeddings")
        e3 = ops.add(g, e, pos, "+ position_embeddings")
        g.drop(e)
        ln = ops.layer_norm(g, ctx, e3, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"], tok(1),
                            "embeddings.LayerNorm")
        g.drop(e3)
        out = ops.dropout(g, ctx, ln, self.dropout_hidden, "embeddings.dropout")
        g.drop(ln)
        # locals token_type_ids (the gathered ids, kept by their embedding when it trains), inputs_embeds,
        # token_type_embeddings, position_embeddings
        g.drop(tt_ids, words, tt, pos)
        self.model_locals = [g.hold(out)]  # BertModel's `embedding_output`
        return out, sh

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind = DEFAULT_KIND) -> T:
        """BertLayer.forward: BertAttention (self-attention, then BertSelfOutput
        ``LayerNorm(dropout(dense(a)) + x)``), then the feed-forward chunk (BertIntermediate dense +
        GELU, BertOutput ``LayerNorm(dropout(dense(i)) + attention_output)``). ``attention_output`` and
        the attention weights (``_``) live until the layer returns."""
        m, ctx = self.m, self.ctx
        attn_weights: list[T] = []
        a = self.self_attention(g, x, p, attn_weights)
        attention_output = self.add_norm(g, a, x, p, "attention.output", m.q_dim)
        g.drop(a)  # BertAttention rebinds `attention_output`
        i = self.linear(g, attention_output, p, "intermediate.dense", m.hidden, m.ffn)
        act = ops.activation(g, ctx, i, m.activation, "intermediate_act_fn")
        g.drop(i)
        out = self.add_norm(g, act, attention_output, p, "output", m.ffn)
        g.drop(act)  # `intermediate_output` dies when feed_forward_chunk returns
        g.drop(attention_output, *attn_weights)
        return out

    def add_norm(self, g: Graph, h: T, residual: T, p: dict[str, T], name: str, in_features: int) -> T:
        """BertSelfOutput / BertOutput: ``dense``, ``dropout``, ``LayerNorm(hidden + input_tensor)``."""
        m, ctx = self.m, self.ctx
        d = self.linear(g, h, p, f"{name}.dense", in_features, m.hidden)
        dd = ops.dropout(g, ctx, d, self.dropout_hidden, f"{name}.dropout")
        g.drop(d)
        s = ops.add(g, dd, residual, f"{name} + input_tensor")
        out = ops.layer_norm(g, ctx, s, p[f"{name}.LayerNorm.weight"], p[f"{name}.LayerNorm.bias"], tok(1),
                             f"{name}.LayerNorm")
        g.drop(s, dd)
        return out

    def self_attention(self, g: Graph, h: T, p: dict[str, T], attn_weights: list[T]) -> T:
        """BertSelfAttention.forward: ``query``, ``key``, ``value`` (each viewed as (b, heads, s, d)),
        the attention interface without a mask (bidirectional; SDPA without ``is_causal``), then
        ``reshape(...).contiguous()`` (the kernels' outputs are already contiguous)."""
        m, ctx = self.m, self.ctx
        eager = self.t.attention is Attention.EAGER
        math = not eager and self.sdpa_falls_back_to_math
        fold = not ctx.batch1  # (b, heads) fold into one batch dim without a copy only when b == 1
        # eager's and the math kernel's gradients come back in (b, heads, s, d) layouts that the views
        # (query, value) or the projection's reshape of its output (key) copy; SDPA's flash kernels
        # return them in the projections' layout
        views = []
        for name in ("query", "key", "value"):
            if name == "key":
                y = self.linear_strided_grad(g, h, p, f"attention.self.{name}", m.hidden, m.q_dim,
                                             (eager or math) and fold)
                views.append(ops.heads_view(g, y, f"{name} view", clone_grad=False))
            else:
                y = self.linear(g, h, p, f"attention.self.{name}", m.hidden, m.q_dim)  # q_dim: a rank's heads
                views.append(ops.heads_view(g, y, f"{name} view", clone_grad=eager or math))
            g.drop(y)
        q, k, v = views
        if eager:
            # BERT's softmax has no dtype and its result is not cast back before dropout and matmul
            o, pd = ops.eager_attention(g, ctx, q, k, v, None, per_token_sq(m.n_heads), self.dropout_attn, copy_q=fold,
                                        copy_k=fold, copy_v=fold, grad_copy=fold, cast_back=False)
            attn_weights.append(pd)
        elif math:
            o4 = ops.sdpa_math(g, ctx, q, k, v, per_token_sq(m.n_heads), self.dropout_attn, causal=False, copy_q=fold,
                               copy_k=fold, copy_v=fold, grad_copy=fold)
            o = ops.clone(g, o4, "attn_output transpose contiguous")  # sdpa_attention_forward
            g.drop(o4)
        else:
            o = ops.sdpa_flash(g, ctx, q, k, v, tok(m.n_heads), "sdpa")
        g.drop(q, k, v)  # query_layer, key_layer, value_layer die when forward returns
        return o

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """BERT has no final norm: the last layer's output is ``sequence_output``; BertModel returns
        and its ``embedding_output`` goes."""
        self.release_model_locals(g)
        return g.hold(x)

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T]:
        """BertOnlyMLMHead: transform (``dense``, GELU, ``LayerNorm``), ``decoder`` (tied to the word
        embeddings with bias ``cls.predictions.bias``, or untied with its own); then the masked-LM loss.
        Returns (loss, scores). With ``num_labels``, BertForSequenceClassification's head instead
        (`sequence_classification_loss`)."""
        m, ctx = self.m, self.ctx
        if m.num_labels:
            return self.sequence_classification_loss(g, h, p)
        d = self.linear(g, h, p, "cls.predictions.transform.dense", m.hidden, m.hidden)
        a = ops.activation(g, ctx, d, m.activation, "transform_act_fn")
        g.drop(d)
        n = ops.layer_norm(g, ctx, a, p["cls.predictions.transform.LayerNorm.weight"],
                           p["cls.predictions.transform.LayerNorm.bias"], tok(1), "transform.LayerNorm")
        g.drop(a)
        w = p.get("cls.predictions.decoder.weight") or p["embeddings.word_embeddings.weight"]
        # tied, the decoder's bias is cls.predictions.bias; untied, it has its own
        b = p.get("cls.predictions.decoder.bias") or p["cls.predictions.bias"]
        scores = ops.addmm(g, ctx, n, w, b, m.hidden, m.vocab, "decoder", linear_casts=True)
        g.drop(n)
        return masked_lm_loss(g, ctx, scores, ids), scores

    def sequence_classification_loss(self, g: Graph, h: T, p: dict[str, T]) -> tuple[T, T]:
        """BertForSequenceClassification: ``BertPooler`` (``hidden_states[:, 0]``, whose backward
        ``select_backward`` makes a full-size zero gradient, ``dense``, ``tanh``), the classifier's dropout
        (``hidden_dropout_prob`` when ``classifier_dropout`` is unset), ``classifier``; then
        ``CrossEntropyLoss`` over the labels (one per sequence, an input), or ``MSELoss`` for one label
        (regression). Returns (loss, logits)."""
        m, ctx = self.m, self.ctx
        first = ops.slice_view(g, h, Sz(b_=m.hidden), "hidden_states[:, 0]")
        d = self.linear(g, first, p, "pooler.dense", m.hidden, m.hidden)
        g.drop(first)
        pooled = ops.unary_saving_output(g, d, "pooler tanh")
        g.drop(d)
        dropped = ops.dropout(g, ctx, pooled, self.dropout_hidden, "classifier dropout")
        g.drop(pooled)
        logits = self.linear(g, dropped, p, "classifier", m.hidden, m.num_labels)
        g.drop(dropped)
        labels = classifier_labels(g, m.num_labels)
        return sequence_classification_loss(g, ctx, logits, labels, m.num_labels), logits


_ = (Sz,)
