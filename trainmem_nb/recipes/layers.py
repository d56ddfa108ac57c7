"""Decoder layers: where the norms and residual adds sit around attention and the MLP.

Each function is one ``*DecoderLayer.forward``; a description names its placement
(`trainmem_nb.model.families.Description.layer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine import ops
from ..engine.tape import Graph, T
from ..model.layers import LayerKind
from .base import Shared

if TYPE_CHECKING:
    from .decoder import DecoderRecipe

__all__ = ["LAYERS", "post_norm_layer", "pre_norm_layer", "sandwich_norm_layer"]


def pre_norm_layer(rec: DecoderRecipe, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
    """``LlamaDecoderLayer.forward``: pre-norm attention and MLP, each added to the residual stream
    (with residual dropout first when the family has it, Phi-3: ``residual + self.resid_attn_dropout(h)``,
    whose dropout output is a temporary of the sum); the attention weights are bound until it returns."""
    rd = rec.d.residual_dropout
    rec.attn_weights = []
    residual = g.hold(x)
    h = rec.norm_module(g, x, p, "input_layernorm")
    a = rec.attention(g, h, sh, p, kind)
    g.drop(h)
    scaled = rec.d.multipliers  # Granite: ``residual + hidden_states * self.residual_multiplier``
    if rd or scaled:
        ad = (ops.scalar_op(g, a, "attn * residual_multiplier") if scaled
              else ops.dropout(g, rec.ctx, a, rec.dropout_hidden, "resid_attn_dropout"))
        h1 = ops.add(g, residual, ad, "residual add (attn)")
        g.drop(ad, a, residual)
    else:
        h1 = ops.add(g, residual, a, "residual add (attn)")
        g.drop(a, residual)
    residual = g.hold(h1)
    h2 = rec.norm_module(g, h1, p, "post_attention_layernorm")
    g.drop(h1)
    mo = rec.mlp(g, h2, p, kind)
    g.drop(h2)
    if rd or scaled:
        md = (ops.scalar_op(g, mo, "mlp * residual_multiplier") if scaled
              else ops.dropout_last(g, rec.ctx, mo, rec.dropout_hidden, "resid_mlp_dropout"))
        out = ops.add(g, residual, md, "residual add (mlp)")
        g.drop(md, mo, residual, *rec.attn_weights)
    else:
        out = ops.add(g, residual, mo, "residual add (mlp)")
        g.drop(mo, residual, *rec.attn_weights)
    return out


def post_norm_layer(rec: DecoderRecipe, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
    """``Olmo2DecoderLayer.forward``: attention on the residual stream itself, its output normalised
    (``post_attention_layernorm``) and added; the same for the MLP (``post_feedforward_layernorm``)."""
    rec.attn_weights = []
    residual = g.hold(x)
    a = rec.attention(g, x, sh, p, kind)
    h = rec.norm(g, a, p["post_attention_layernorm.weight"], "post_attention_layernorm")
    g.drop(a)
    h1 = ops.add(g, residual, h, "residual add (attn)")
    g.drop(h, residual)
    residual = g.hold(h1)
    mo = rec.mlp(g, h1, p, kind)
    g.drop(h1)
    h2 = rec.norm(g, mo, p["post_feedforward_layernorm.weight"], "post_feedforward_layernorm")
    g.drop(mo)
    out = ops.add(g, residual, h2, "residual add (mlp)")
    g.drop(h2, residual, *rec.attn_weights)
    return out


def sandwich_norm_layer(rec: DecoderRecipe, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
    """``Gemma2DecoderLayer.forward`` (and Gemma 3's): ``input_layernorm`` before attention and
    ``post_attention_layernorm`` on its output before the residual add, then ``pre_feedforward_layernorm``
    and ``post_feedforward_layernorm`` around the MLP."""
    rec.attn_weights = []
    residual = g.hold(x)
    h = rec.norm(g, x, p["input_layernorm.weight"], "input_layernorm")
    a = rec.attention(g, h, sh, p, kind)
    g.drop(h)
    h = rec.norm(g, a, p["post_attention_layernorm.weight"], "post_attention_layernorm")
    g.drop(a)
    h1 = ops.add(g, residual, h, "residual add (attn)")
    g.drop(h, residual)
    residual = g.hold(h1)
    h2 = rec.norm(g, h1, p["pre_feedforward_layernorm.weight"], "pre_feedforward_layernorm")
    g.drop(h1)
    mo = rec.mlp(g, h2, p, kind)
    g.drop(h2)
    h3 = rec.norm(g, mo, p["post_feedforward_layernorm.weight"], "post_feedforward_layernorm")
    g.drop(mo)
    out = ops.add(g, residual, h3, "residual add (mlp)")
    g.drop(h3, residual, *rec.attn_weights)
    return out


#: The layer placements a description names.
LAYERS: dict[str, Callable[[DecoderRecipe, Graph, T, Shared, dict[str, T], LayerKind], T]] = {
    "pre": pre_norm_layer, "post": post_norm_layer, "sandwich": sandwich_norm_layer}
