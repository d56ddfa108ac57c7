"""Gemma as Hugging Face implements it (modeling_gemma.py, transformers 5.x).

The llama layout with three differences that change memory: the embedding output is multiplied by a
scalar buffer (``GemmaTextScaledWordEmbedding``), ``GemmaRMSNorm`` computes in fp32 and multiplies
by ``1 + weight`` *before* casting back (so its saved product is fp32), and the MLP uses tanh-GELU.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import F32
from ..engine.tape import Graph, T, const
from .base import tok
from .llama import LlamaRecipe
from .mistral import math_attention

__all__ = ["GemmaRecipe"]


class GemmaRecipe(LlamaRecipe):
    """gemma: llama attention and gated MLP, (1 + w) fp32 RMSNorm, scaled embeddings."""

    def rmsnorm(self, g: Graph, x: T, w: T, label: str) -> T:
        """GemmaRMSNorm.forward: ``output = self._norm(x.float())`` (``x * rsqrt(x.pow(2).mean(-1) +
        eps)``, whose mean and sum are unnamed temporaries), ``output * (1.0 + self.weight.float())``
        in fp32, then ``type_as(x)``. The fp32 product and ``1 + w`` are saved by the multiply."""
        xf = ops.cast(g, x, F32, f"{label} x.float()")
        p = ops.pow2(g, xf, f"{label} pow")
        var = ops.mean_last(g, p, tok(1), f"{label} mean")
        g.drop(p)
        ve = ops.scalar_op(g, var, f"{label} +eps", grad_allocs=False)
        g.drop(var)
        r = ops.rsqrt(g, ve, f"{label} rsqrt")
        g.drop(ve)
        normed = ops.mul(g, xf, r, f"{label} x*rsqrt")
        g.drop(r, xf)  # _norm returns: its argument (the x.float() temporary) goes
        wf = ops.cast(g, w, F32, f"{label} weight.float()")
        w1 = ops.scalar_op(g, wf, f"{label} 1 + weight", grad_allocs=False)
        g.drop(wf)
        prod = ops.mul(g, normed, w1, f"{label} *(1 + weight)")
        g.drop(w1, normed)
        out = ops.cast(g, prod, x.dt, f"{label} type_as")
        g.drop(prod)
        return out

    def embed_tokens(self, g: Graph, ids: T, p: dict[str, T]) -> T:
        """GemmaModel.forward: ``embed_tokens(input_ids)`` times ``embed_scale.to(weight.dtype)`` (a 0-d
        buffer already in the model's dtype: no copy), whose multiply saves only the scalar; the
        positions, mask and rotary cos/sin follow as llama's."""
        w = p["embed_tokens.weight"]
        e = ops.embedding(g, ids, w, tok(self.m.hidden), "embed_tokens")
        scale = g.external(const(1), w.dt, "embed_scale")
        x = ops.mul(g, e, scale, "embed_tokens * embed_scale")
        g.drop(e)
        return x


    def sdpa_math(self, g: Graph, q: T, k: T, v: T) -> T:
        """SDPA's CPU math kernel (attention dropout): `trainmem_nb.recipes.mistral.math_attention`."""
        return math_attention(self, g, q, k, v)
