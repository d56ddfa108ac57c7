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

__all__ = ["LAYERS", "pre_norm_layer"]


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


#: The layer placements a description names.
LAYERS: dict[str, Callable[[DecoderRecipe, Graph, T, Shared, dict[str, T], LayerKind], T]] = {"pre": pre_norm_layer}
