"""Normalisation layers as Hugging Face's modules compute them, and what each keeps for backward.

Each function is one module's ``forward``: the ops, their dtypes and when each temporary dies, which
decide what autograd saves (an fp32 product saved by the weight multiply is twice a bf16 one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine import ops
from ..engine.ops import F32
from ..engine.tape import Graph, T
from .base import tok

__all__ = ["RMS_NORMS", "rms_norm", "rms_norm_deepseek", "rms_norm_gemma", "rms_norm_olmo2"]


def rms_norm(g: Graph, x: T, w: T, label: str, rows: int = 1,
             weight_mul: Callable[[Graph, T, T, str], T] = ops.mul) -> T:
    """``LlamaRMSNorm.forward``: upcast to fp32, ``x * rsqrt(mean(x**2) + eps)``, cast back to the
    input's dtype, then ``weight *`` (in the weight's dtype: the multiply saves the cast-back copy).
    `rows`: vectors normalised per token (per-head q/k norms normalise each head's dims)."""
    input_dt = x.dt
    hs = ops.cast(g, x, F32, f"{label} to fp32")
    p = ops.pow2(g, hs, f"{label} pow")
    var = ops.mean_last(g, p, tok(rows), f"{label} mean")
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
    return rms_norm(g, x, w, label, weight_mul=ops.mul_reduce_cast)


def rms_norm_gemma(g: Graph, x: T, w: T, label: str, rows: int = 1) -> T:
    """``GemmaRMSNorm.forward``: ``output = self._norm(x.float())`` (``x * rsqrt(x.pow(2).mean(-1) +
    eps)``, whose mean and sum are unnamed temporaries), ``output * (1.0 + self.weight.float())`` in
    fp32, then ``type_as(x)``. The fp32 product and ``1 + w`` are saved by the multiply. `rows`: vectors
    normalised per token (Gemma 3's per-head q/k norms: the heads; their means are (b, heads, s, 1))."""
    xf = ops.cast(g, x, F32, f"{label} x.float()")
    p = ops.pow2(g, xf, f"{label} pow")
    var = ops.mean_last(g, p, tok(rows), f"{label} mean")
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
    # MulBackward0 packs both inputs before the kernel runs: a recomputation whose last saving op this
    # is (Gemma 2's post_feedforward_layernorm) stops before the product exists
    g.before_outputs([normed, w1], [w1 if normed.rg else None, normed if w1.rg else None])
    prod = ops.mul(g, normed, w1, f"{label} *(1 + weight)")
    g.drop(w1, normed)
    out = ops.cast(g, prod, x.dt, f"{label} type_as")
    g.drop(prod)
    return out


def _weight_times_fp32(g: Graph, w: T, x: T, label: str) -> T:
    """``self.weight * hidden_states`` with fp32 states and a weight that may be 16-bit (the product is
    fp32). ``MulBackward0`` packs both inputs before the kernel runs (a recomputation that ends here
    stops before the product exists) and computes both gradients in fp32; the engine's
    ``validate_outputs`` (torch/csrc/autograd/engine.cpp) then reduces the weight's to its shape and
    casts it to the weight's dtype, after the node's apply returned (recomputed saved tensors are gone
    by then)."""
    saved = [x if w.rg else None, w if x.rg else None]
    g.before_outputs([w, x], saved)
    out = g.alloc(x.n, F32, label)
    recorded: list = []

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        gw = g.alloc(x.n, F32, f"{label} grad weight") if w.rg else None
        gx = g.alloc(x.n, F32, f"{label} grad x") if x.rg else None
        node = recorded[0] if recorded else None
        if gw is None or w.dt == F32:
            return [gw, gx]  # the engine reduces the weight's gradient (`Graph.backward`)
        if node is not None and node.checkpoint is not None:
            g.drop(*node.saved)
            node.saved = ()
        red = g.alloc(w.n, F32, f"sum_to {label} weight")
        g.drop(gw)
        cast = g.alloc(w.n, w.dt, f"{label} grad weight cast")
        g.drop(red)
        return [cast, gx]

    n_nodes = len(g.nodes)
    g.record(label, [w, x], [out], saved, bwd)
    recorded.extend(g.nodes[n_nodes:n_nodes + 1])
    return out


def rms_norm_olmo2(g: Graph, x: T, w: T, label: str, rows: int = 1) -> T:
    """``Olmo2RMSNorm.forward`` (and ``GptOssRMSNorm.forward``, the same code): llama's normalisation in
    fp32, then ``(self.weight * hidden_states).to(input_dtype)``: the weight multiplies the fp32 states
    (the product is fp32 and the multiply saves the fp32 normalised states), and only the product is
    cast back."""
    input_dt = x.dt
    hs = ops.cast(g, x, F32, f"{label} to fp32")
    p = ops.pow2(g, hs, f"{label} pow")
    var = ops.mean_last(g, p, tok(rows), f"{label} mean")
    g.drop(p)
    ve = ops.scalar_op(g, var, f"{label} +eps", grad_allocs=False)
    r = ops.rsqrt(g, ve, f"{label} rsqrt")
    g.drop(ve)
    hs2 = ops.mul(g, hs, r, f"{label} x*rsqrt")
    g.drop(r, hs)
    prod = _weight_times_fp32(g, w, hs2, f"{label} weight*")
    out = ops.cast(g, prod, input_dt, f"{label} to input dtype")
    g.drop(prod, hs2, var)  # the locals (hidden_states, variance) die when forward returns
    return out


#: The RMSNorm variants a description names (`trainmem_nb.model.families.Description.norm`).
RMS_NORMS: dict[str, Callable[..., T]] = {"llama": rms_norm, "gemma": rms_norm_gemma, "olmo2": rms_norm_olmo2,
                                          "deepseek": rms_norm_deepseek}
