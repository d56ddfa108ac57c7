"""Decoder MLPs as Hugging Face's llama-derived modules run them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine import ops
from ..engine.tape import Graph, T

if TYPE_CHECKING:
    from .decoder import DecoderRecipe

__all__ = ["MLPS", "gated_mlp"]


def gated_mlp(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> T:
    """``LlamaMLP.forward``: ``down_proj(act(gate_proj(x)) * up_proj(x))``; with a fused ``gate_up_proj``
    (``Phi3MLP.forward``) ``gate, up_states = gate_up_proj(x).chunk(2, -1)`` (views; their backward
    concatenates), ``up_states * act(gate)``, ``down_proj``."""
    m = rec.m
    if rec.d.fused_gate_up:
        gu = rec.linear(g, x, p, "mlp.gate_up_proj", m.hidden, 2 * m.ffn)
        gate, up = ops.split(g, gu, (0.5, 0.5), "chunk gate, up")
        g.drop(gu)
        a = rec.act(g, gate)
        pr = ops.mul(g, up, a, "up * act(gate)")
        g.drop(a, up)
        out = rec.linear(g, pr, p, "mlp.down_proj", m.ffn, m.hidden)
        g.drop(pr, gate)
        return out
    gt = rec.linear(g, x, p, "mlp.gate_proj", m.hidden, m.ffn)
    a = rec.act(g, gt)
    g.drop(gt)
    u = rec.linear(g, x, p, "mlp.up_proj", m.hidden, m.ffn)
    pr = ops.mul(g, a, u, "act * up")
    g.drop(a, u)
    out = rec.linear(g, pr, p, "mlp.down_proj", m.ffn, m.hidden)
    g.drop(pr)
    return out


def starcoder2_mlp(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> T:
    """``Starcoder2MLP.forward``: ``c_fc``, the activation, ``c_proj``, then dropout
    (``residual_dropout``, the layer's last op that saves: `ops.dropout_last`); each step rebinds
    ``hidden_states``."""
    m = rec.m
    h = rec.linear(g, x, p, "mlp.c_fc", m.hidden, m.ffn)
    a = rec.act(g, h)
    g.drop(h)
    o = rec.linear(g, a, p, "mlp.c_proj", m.ffn, m.hidden)
    g.drop(a)
    out = ops.dropout_last(g, rec.ctx, o, rec.dropout_hidden, "mlp residual_dropout")
    g.drop(o)
    return out


#: The dense MLPs a description names (`trainmem_nb.model.families.Description.mlp`).
MLPS: dict[str, Callable[[DecoderRecipe, Graph, T, dict[str, T]], T]] = {"gated": gated_mlp}
MLPS["starcoder2"] = starcoder2_mlp
