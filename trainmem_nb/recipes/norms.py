"""Normalisation layers as Hugging Face's modules compute them, and what each keeps for backward.

Each function is one module's ``forward``: the ops, their dtypes and when each temporary dies, which
decide what autograd saves (an fp32 product saved by the weight multiply is twice a bf16 one).
"""

from __future__ import annotations

from collections.abc import Callable

from ..engine import ops
from ..engine.ops import F32
from ..engine.tape import Graph, T
from .base import tok

__all__ = ["RMS_NORMS", "rms_norm", "rms_norm_deepseek", "rms_norm_gemma", "rms_norm_gpt_oss"]


def rms_norm(g: Graph, x: T, w: T, label: str, weight_mul: Callable[[Graph, T, T, str], T] = ops.mul) -> T:
    """``LlamaRMSNorm.forward``: upcast to fp32, ``x * rsqrt(mean(x**2) + eps)``, cast back to the
    input's dtype, then ``weight *`` (in the weight's dtype: the multiply saves the cast-back copy)."""
    input_dt = x.dt
    hs = ops.cast(g, x, F32, f"{label} to fp32")
    p = ops.pow2(g, hs, f"{label} pow")
    var = ops.mean_last(g, p, tok(1), f"{label} mean")
    g.drop(p)
    ve = ops.scalar_op(g, var, f"{label} +eps", grad_allocs=False)
    r = ops.rsqrt(g, ve, f"{label} rsqrt")
    g.drop(ve)
    hs2 = ops.mul(g, hs, r, f"{label} x*rsqrt")
    g.drop(r, hs)
    hs3 = ops.cast(g, hs2, input_dt, f"{label} to input dtype")
    out = weight_mul(g, w, hs3, f"{label} *weight")
    g.drop(hs3, hs2, var)
    return out


def rms_norm_deepseek(g: Graph, x: T, w: T, label: str) -> T:
    """``DeepseekV3RMSNorm.forward``: llama's (`rms_norm`); its q_a/kv_a norms take 16-bit projection
    outputs under autocast, whose fp32-weight multiply's backward reduces the weight's gradient and casts
    the input's only after both products exist (`ops.mul_reduce_cast`, the engine's order)."""
    return rms_norm(g, x, w, label, ops.mul_reduce_cast)


def rms_norm_gemma(g: Graph, x: T, w: T, label: str) -> T:
    """``GemmaRMSNorm.forward``: ``output = self._norm(x.float())`` (``x * rsqrt(x.pow(2).mean(-1) +
    eps)``, whose mean and sum are unnamed temporaries), ``output * (1.0 + self.weight.float())`` in
    fp32, then ``type_as(x)``. The fp32 product and ``1 + w`` are saved by the multiply."""
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


def rms_norm_gpt_oss(g: Graph, x: T, w: T, label: str) -> T:
    """``GptOssRMSNorm.forward`` (modeling_gpt_oss.py): llama's normalisation in fp32, then
    ``(self.weight * hidden_states).to(input_dtype)``: the weight multiplies the fp32 result (the
    product is fp32 and the multiply saves the fp32 normalised states), and only then is it cast."""
    input_dt = x.dt
    hs = ops.cast(g, x, F32, f"{label} to fp32")
    p = ops.pow2(g, hs, f"{label} pow")
    var = ops.mean_last(g, p, tok(1), f"{label} mean")
    g.drop(p)
    ve = ops.scalar_op(g, var, f"{label} +eps", grad_allocs=False)
    r = ops.rsqrt(g, ve, f"{label} rsqrt")
    g.drop(ve)
    hs2 = ops.mul(g, hs, r, f"{label} x*rsqrt")
    g.drop(r, hs)
    prod = ops.mul_reduce_cast(g, w, hs2, f"{label} weight*")
    out = ops.cast(g, prod, input_dt, f"{label} to input dtype")
    g.drop(prod, hs2, var)
    return out


#: The RMSNorm variants a description names (`trainmem_nb.model.families.Description.norm`).
RMS_NORMS: dict[str, Callable[[Graph, T, T, str], T]] = {"llama": rms_norm, "gemma": rms_norm_gemma}
RMS_NORMS["gpt_oss"] = rms_norm_gpt_oss
RMS_NORMS["deepseek"] = rms_norm_deepseek
