"""Phi-3 as Hugging Face implements it (modeling_phi3.py, transformers 5.x).

Llama's layout with fused projections: ``qkv_proj`` is sliced into the query, key and value (views
of one (tokens, q + 2 kv) output, so each slice's backward allocates a full-width gradient), and
``gate_up_proj`` is chunked into gate and up. ``apply_rotary_pos_emb`` splits each head into a rotary
and a pass-through part and concatenates them back (even when the pass-through part is empty), so
the rotary outputs are contiguous in (b, heads, s, d): SDPA's output then needs a copy to go back to
(b, s, heads, d), and eager attention's matmuls need no copy of q or k. Residual dropout
(``resid_pdrop``) follows attention and MLP; the v5 model has no embedding dropout (``embd_pdrop``
is in the config but unused). A config ``sliding_window`` acts as in mistral.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.tape import Graph, T
from .base import Shared
from .mistral import MistralRecipe

__all__ = ["Phi3Recipe"]


class Phi3Recipe(MistralRecipe):
    """phi3: fused qkv and gate_up projections, concatenating rotary, residual dropout."""

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T]) -> T:
        """Phi3DecoderLayer.forward: ``residual + self.resid_attn_dropout(hidden_states)`` (the
        dropout's output is a temporary of the sum), likewise after the MLP; the attention weights are
        bound to ``self_attn_weights`` until the layer returns."""
        self.attn_weights: list[T] = []
        residual = g.hold(x)
        h = self.rmsnorm(g, x, p["input_layernorm.weight"], "input_layernorm")
        a = self.attention(g, h, sh, p)
        g.drop(h)
        ad = ops.dropout(g, self.ctx, a, self.dropout_hidden, "resid_attn_dropout")
        h1 = ops.add(g, residual, ad, "residual add (attn)")
        g.drop(ad, a, residual)
        residual = g.hold(h1)
        h2 = self.rmsnorm(g, h1, p["post_attention_layernorm.weight"], "post_attention_layernorm")
        g.drop(h1)
        mo = self.mlp(g, h2, p)
        g.drop(h2)
        md = ops.dropout_last(g, self.ctx, mo, self.dropout_hidden, "resid_mlp_dropout")
        out = ops.add(g, residual, md, "residual add (mlp)")
        g.drop(md, mo, residual, *self.attn_weights)
        return out

    def attention(self, g: Graph, h: T, sh: Shared, p: dict[str, T]) -> T:
        """Phi3Attention.forward: ``qkv = self.qkv_proj(h)`` (a local until return), three slices of
        it viewed as heads (no copies), rotary, attention, ``o_proj``."""
        m = self.m
        qkv = self.linear(g, h, p, "self_attn.qkv_proj", m.hidden, m.q_dim + 2 * m.kv_dim)
        width = m.q_dim + 2 * m.kv_dim
        parts = []
        for name, dim in (("query", m.q_dim), ("key", m.kv_dim), ("value", m.kv_dim)):
            parts.append(ops.slice_view(g, qkv, qkv.n * (dim / width), f"qkv[..., {name}]"))
        qs, ks, vs = parts
        qv = ops.heads_view(g, qs, "q view")
        kv = ops.heads_view(g, ks, "k view")
        vv = ops.heads_view(g, vs, "v view", clone_grad=self.value_grad_contiguous)
        g.drop(qs, ks, vs)
        assert sh.cos is not None and sh.sin is not None
        qr, kr = self.apply_rotary_pair(g, qv, kv, sh.cos, sh.sin)
        g.drop(qv, kv)
        o = self.attention_kernel(g, qr, kr, vv, sh.mask)
        out = self.linear(g, o, p, "self_attn.o_proj", m.q_dim, m.hidden)
        g.drop(o)
        g.drop(qkv, qr, kr, vv)  # locals qkv, query_states, key_states, value_states
        return out

    def apply_rotary_pair(self, g: Graph, q: T, k: T, cos: T, sin: T) -> tuple[T, T]:
        """Phi3's ``apply_rotary_pos_emb``: ``q_rot, q_pass = q[..., :rot], q[..., rot:]`` (a full
        slice is ``alias(q)``: Python indexing returns an alias when nothing is cut), the same for k,
        then ``cat([(x_rot * cos) + (rotate_half(x_rot) * sin), x_pass])`` for q, then k. Under
        autocast ``cat`` promotes the 16-bit pass-through part to the fp32 rotary part's dtype."""
        frac = self.m.rotary_dims / self.m.head_dim
        split = {}
        for name, x in (("q", q), ("k", k)):
            rot = ops.alias_view(g, x, f"{name}_rot") if frac == 1.0 else ops.slice_view(g, x, x.n * frac, f"{name}_rot")
            split[name] = (rot, ops.slice_view(g, x, x.n * (1.0 - frac), f"{name}_pass"))
        out = []
        for name in ("q", "k"):
            rot, pas = split[name]
            a = ops.mul(g, rot, cos, f"{name} * cos")
            rh = ops.rotate_half(g, rot, 1.0, f"{name} rotate_half")
            b = ops.mul(g, rh, sin, f"{name} rotate_half * sin")
            g.drop(rh)
            c = ops.add(g, a, b, f"{name} rotary add")
            g.drop(a, b)
            pc = ops.cast(g, pas, c.dt, f"{name}_pass cat promote")
            out.append(ops.cat2(g, c, pc, f"{name} cat rot, pass"))
            g.drop(pc, c)
        for rot, pas in split.values():
            g.drop(rot, pas)
        return out[0], out[1]

    qk_contiguous = True

    def sdpa(self, g: Graph, q: T, k: T, v: T) -> T:
        """``sdpa_attention_forward`` (llama's or, with a window mask, mistral's). The flash kernels
        allocate their output like the query (CPU: measured; CUDA: ``out = at::empty_like(q_padded)``,
        flash_attn/flash_api.cpp ``mha_fwd``), here (b, heads, s, d)-contiguous, so
        ``transpose(1, 2).contiguous()`` copies it. CUDA's memory-efficient kernel (masked SDPA)
        allocates (b, s, heads, d) whatever the query (``_efficient_attention_forward``,
        transformers/cuda/attention.cu): no copy."""
        o = super().sdpa(g, q, k, v)
        if self.masked:
            return o  # mistral's masked path copies (CPU) or needs no copy (CUDA)
        out = ops.clone(g, o, "attn_output transpose contiguous")
        g.drop(o)
        return out

    def mlp(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """Phi3MLP.forward: ``gate, up_states = self.gate_up_proj(x).chunk(2, -1)`` (views; their
        backward concatenates), ``up_states * self.activation_fn(gate)``, ``down_proj``."""
        m = self.m
        gu = self.linear(g, x, p, "mlp.gate_up_proj", m.hidden, 2 * m.ffn)
        gate, up = ops.split(g, gu, (0.5, 0.5), "chunk gate, up")
        g.drop(gu)
        a = self.act(g, gate)
        pr = ops.mul(g, up, a, "up * act(gate)")
        g.drop(a, up)
        out = self.linear(g, pr, p, "mlp.down_proj", m.ffn, m.hidden)
        g.drop(pr, gate)
        return out


