"""The composed decoder with biased projections as the LayerNorm families run them (phi, starcoder2).

``at::linear`` runs a biased ``nn.Linear`` on a 3-D input as ``addmm`` on a flattened view, whose bias
gradient is the output gradient reduced by the engine after the node returns (`LayerNormRecipe.linear`,
`ops.addmm`): under gradient checkpointing that is after the recomputed saved tensors are released.
Under QLoRA every in-layer projection is a bitsandbytes ``Linear4bit``, biased or not.
"""

from __future__ import annotations

from ..engine.tape import Graph, T
from .base import Recipe
from .decoder import DecoderRecipe
from .layernorm import LayerNormRecipe

__all__ = ["BiasedDecoderRecipe"]


class BiasedDecoderRecipe(LayerNormRecipe, DecoderRecipe):
    """`DecoderRecipe` (its parts, from the family's description) with `LayerNormRecipe`'s projections."""

    #: ``hidden_states = inputs_embeds``: the first layer's input is a model local (a family with an
    #: embedding dropout sets this per instance: `DecoderRecipe.__init__`)
    embed_output_kept = True

    def linear(self, g: Graph, x: T, p: dict[str, T], module: str, in_features: int, out_features: int,
               **kw: object) -> T:
        """`LayerNormRecipe.linear` (a biased projection as ``addmm``), except under QLoRA: transformers'
        ``replace_with_bnb_linear`` makes every in-layer ``nn.Linear`` a bitsandbytes ``Linear4bit``,
        biased or not (the bias stays in the model's dtype; ``MatMul4Bit`` runs ``F.linear(A,
        dequantize_4bit(B), bias)``), so a frozen biased projection takes the 4-bit path of `Recipe.linear`
        (`ops.linear_4bit`), not the full-precision ``addmm``."""
        if p[f"{module}.weight"].nf4:
            return Recipe.linear(self, g, x, p, module, in_features, out_features, **kw)
        return super().linear(g, x, p, module, in_features, out_features, **kw)
