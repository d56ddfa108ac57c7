"""GPT-2 as Hugging Face implements it (``GPT2LMHeadModel``, modeling_gpt2.py, transformers 5.x).

Learned positions (``wte`` + ``wpe``), pre-norm blocks with LayerNorm, a fused ``c_attn`` Conv1D
split into query/key/value views, SDPA or eager attention, a ``gelu_new`` MLP (a Python tanh formula),
resid/attn/embd dropout, and an lm_head tied to ``wte``. Mirrors the HF code op by op, including the
lifetimes of its Python locals.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import I64
from ..engine.tape import Graph, T, per_seq, per_token_sq
from ..model.families import describe
from ..model.layers import LayerKind
from ..spec.choices import Attention
from .base import DEFAULT_KIND, Shared, tok
from .head import causal_lm_loss
from .layernorm import LayerNormRecipe
from .masks import causal_mask

__all__ = ["GPT2Recipe"]


class GPT2Recipe(LayerNormRecipe):
    """gpt2: ``GPT2Model`` blocks under ``GPT2LMHeadModel``."""

    def conv1d(self, g: Graph, x: T, p: dict[str, T], module: str, in_features: int, out_features: int) -> T:
        """A ``Conv1D`` layer by its module name in the block: ``addmm``, or peft's LoRA-wrapped
        forward when an adapter targets it."""
        a_w = p.get(f"{module}.lora_A.weight")
        if a_w is not None:
            return ops.lora_addmm(g, self.ctx, x, p[f"{module}.weight"], p[f"{module}.bias"], a_w,
                                  p[f"{module}.lora_B.weight"], in_features, out_features, self.t.lora_rank,
                                  self.t.lora_dropout, module)
        if self.fp8_linear(module, in_features, out_features):
            return self.linear(g, x, p, module, in_features, out_features)
        return ops.addmm(g, self.ctx, x, p[f"{module}.weight"], p[f"{module}.bias"], in_features, out_features, module)

    def fp8_linear(self, module: str, in_features: int, out_features: int) -> bool:
        """torchao leaves ``Conv1D`` as it is; Megatron's GPT runs Transformer Engine's linears where HF's has
        Conv1D (whose (in, out) weight is the transpose of a linear's: the same bytes)."""
        return self.ctx.fp8_kernels == "te" and super().fp8_linear(module, in_features, out_features)

    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        """GPT2Model.forward up to the blocks: ``wte(input_ids)``, ``position_ids = arange(s) + past``,
        ``wpe(position_ids)``, their sum, the eager causal mask, then ``drop`` (embd_pdrop).

        ``inputs_embeds`` and ``position_embeds`` stay alive until the model returns (freed in
        `final_norm`); ``position_ids`` is passed to every block."""
        m = self.m
        inputs_embeds = ops.embedding(g, ids, p["wte.weight"], tok(m.hidden), "wte")
        self.input_requires_grad(g, inputs_embeds)
        ar = g.alloc(per_seq(1), I64, "arange")
        pos = g.alloc(per_seq(1), I64, "position_ids")  # arange(s) + past_seen_tokens
        g.drop(ar)
        # (1, s, h): broadcast over the batch (with one sequence its gradient needs no reduction)
        pos_n = tok(m.hidden) if self.ctx.batch1 else per_seq(m.hidden)
        position_embeds = ops.embedding(g, pos, p["wpe.weight"], pos_n, "wpe")
        h = ops.add(g, inputs_embeds, position_embeds, "inputs_embeds + position_embeds")
        sh = Shared()
        sh.extra.append(pos)
        if self.t.attention is Attention.EAGER:
            sh.mask = causal_mask(g, inputs_embeds.dt)
        hd = ops.dropout(g, self.ctx, h, self.dropout_embd, "drop")
        g.drop(h)
        self.model_locals = [inputs_embeds, position_embeds]
        return hd, sh

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind = DEFAULT_KIND) -> T:
        """GPT2Block.forward: ``residual + attn(ln_1(x))``, then ``residual + mlp(ln_2(h))``. The
        locals ``attn_output``, ``_`` (attention weights) and ``feed_forward_hidden_states`` live until
        the block returns."""
        ctx = self.ctx
        attn_weights: list[T] = []
        h = ops.layer_norm(g, ctx, x, p["ln_1.weight"], p["ln_1.bias"], tok(1), "ln_1")
        attn_output = self.attention(g, h, sh, p, attn_weights)
        h1 = ops.add(g, attn_output, x, "attn_output + residual")
        g.drop(h)  # `hidden_states` rebinds
        h2 = ops.layer_norm(g, ctx, h1, p["ln_2.weight"], p["ln_2.bias"], tok(1), "ln_2")
        ff = self.mlp(g, h2, p)
        out = ops.add(g, h1, ff, "residual + feed_forward")
        g.drop(h2)
        # frame locals in creation order: residual (h1), attn_output, _, feed_forward_hidden_states
        g.drop(h1, attn_output, *attn_weights, ff)
        return out

    def attention(self, g: Graph, h: T, sh: Shared, p: dict[str, T], attn_weights: list[T]) -> T:
        """GPT2Attention.forward (self-attention): ``c_attn(h).split(h, dim=2)`` into views, key and
        value then query viewed as (b, heads, s, d), the attention interface, ``reshape(...).contiguous()``
        (a copy after eager attention; the SDPA output already has that layout), ``c_proj``,
        ``resid_dropout``."""
        m, ctx = self.m, self.ctx
        qkv = self.conv1d(g, h, p, "attn.c_attn", m.hidden, 3 * m.q_dim)  # q_dim: a tensor-parallel rank's heads
        q0, k0, v0 = ops.split(g, qkv, (1 / 3, 1 / 3, 1 / 3), "c_attn split")
        g.drop(qkv)
        eager = self.t.attention is Attention.EAGER
        math = not eager and self.sdpa_falls_back_to_math
        # the kernels' gradients come back in the (b, s, heads, d) layout except eager's and the math
        # kernel's query and value gradients, which the views' backward copies
        k = ops.heads_view(g, k0, "key view", clone_grad=False)
        v = ops.heads_view(g, v0, "value view", clone_grad=eager or math)
        q = ops.heads_view(g, q0, "query view", clone_grad=eager or math)
        g.drop(q0, k0, v0)
        fold = not ctx.batch1  # (b, heads) fold into one batch dim without a copy only when b == 1
        if eager:
            # GPT-2's softmax has no dtype: fp32 only once the fp32 mask promoted the scores
            o, pd = ops.eager_attention(g, ctx, q, k, v, sh.mask, per_token_sq(m.n_heads), self.dropout_attn,
                                        copy_q=fold, copy_k=fold, copy_v=fold, grad_copy=fold)
            attn_weights.append(pd)  # returned to the block as `_`
        elif math:
            o4 = ops.sdpa_math(g, ctx, q, k, v, per_token_sq(m.n_heads), self.dropout_attn, causal=True, copy_q=fold,
                               copy_k=fold, copy_v=fold, grad_copy=fold)
            o = ops.clone(g, o4, "attn_output transpose contiguous")  # sdpa_attention_forward
            g.drop(o4)
        else:
            o = ops.sdpa_flash(g, ctx, q, k, v, tok(m.n_heads), "sdpa")
        out = self.conv1d(g, o, p, "attn.c_proj", m.q_dim, m.hidden)
        g.drop(o)
        od = ops.dropout(g, ctx, out, self.dropout_hidden, "resid_dropout")
        g.drop(out)
        g.drop(q, k, v)  # query_states, key_states, value_states die when forward returns
        return od

    def mlp(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """GPT2MLP.forward: ``c_fc``, the activation, ``c_proj``, dropout (each rebinding
        ``hidden_states``)."""
        m, ctx = self.m, self.ctx
        h = self.conv1d(g, x, p, "mlp.c_fc", m.hidden, m.ffn)
        a = ops.activation(g, ctx, h, m.activation, "mlp.act")
        g.drop(h)
        o = self.conv1d(g, a, p, "mlp.c_proj", m.ffn, m.hidden)
        g.drop(a)
        od = ops.dropout_last(g, ctx, o, self.dropout_hidden, "mlp.dropout")
        g.drop(o)
        return od

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """``ln_f``; then GPT2Model returns and its locals ``inputs_embeds`` and ``position_embeds`` go."""
        out = ops.layer_norm(g, self.ctx, x, p["ln_f.weight"], p["ln_f.bias"], tok(1), "ln_f")
        self.release_model_locals(g)
        return out

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T]:
        """GPT2LMHeadModel: ``lm_head`` (tied to ``wte``) and ForCausalLMLoss; returns (loss, logits)."""
        m, ctx = self.m, self.ctx
        w = p.get("lm_head.weight") or p["wte.weight"]
        logits = ops.linear(g, ctx, h, w, m.hidden, m.vocab, None, "lm_head")
        return causal_lm_loss(g, ctx, logits, m.vocab, v4_upcast=describe(m.family).v4_upcast)
