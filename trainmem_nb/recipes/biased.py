"""The composed decoder with biased projections as the LayerNorm families run them (phi, starcoder2).

``at::linear`` runs a biased ``nn.Linear`` on a 3-D input as ``addmm`` on a flattened view, whose bias
gradient is the output gradient reduced by the engine after the node returns (`LayerNormRecipe.linear`,
`ops.addmm`): under gradient checkpointing that is after the recomputed saved tensors are released.
Under QLoRA every in-layer projection is a bitsandbytes ``Linear4bit``, biased or not (`ops.addmm`
runs `ops.linear_4bit` for a 4-bit weight).
"""

from __future__ import annotations

from .decoder import DecoderRecipe
from .layernorm import LayerNormRecipe

__all__ = ["BiasedDecoderRecipe"]


class BiasedDecoderRecipe(LayerNormRecipe, DecoderRecipe):
    """`DecoderRecipe` (its parts, from the family's description) with `LayerNormRecipe`'s projections."""

    #: ``hidden_states = inputs_embeds``: the first layer's input is a model local (a family with an
    #: embedding dropout sets this per instance: `DecoderRecipe.__init__`)
    embed_output_kept = True
