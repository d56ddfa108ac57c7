"""Matmul ops: ``nn.Linear`` (and bitsandbytes' 4-bit linear), ``addmm``, batched matmuls and the
embedding lookup, with autocast's weight copies and the gradients each backward allocates.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tape import Graph, Sz, T, const
from .core import Ctx, autocast_weight, cast


# -- matmuls ------------------------------------------------------------------------------------
def linear(g: Graph, ctx: Ctx, x: T, w: T, in_features: int, out_features: int, b: T | None = None,
           label: str = "linear", grad_w_first: bool | None = None, w_leaf: bool = True,
           cache_input: bool = False, bias_grad_reduced: bool = False) -> T:
    """``F.linear(x, w, b)`` on (tokens, in) activations: ``mm``/``addmm`` (cuBLAS/MKL) output of
    (tokens, out). Saves x if the weight needs a gradient and the weight if x does; under autocast
    the saved copies are the 16-bit casts (`w_leaf`: whether autocast may cache the weight's;
    `cache_input`: x is a leaf that requires grad, so autocast caches its cast too, as
    ``at::autocast::cached_cast`` does for any such leaf: one copy shared by every linear it feeds).
    With `bias_grad_reduced` the bias's gradient is the output gradient, which the engine reduces to
    the bias's shape after the node returns (``addmm``'s ``maybe_multiply(grad, beta)``; after a
    checkpointed node's recomputed saved tensors are released), as gpt_oss's biased projections are
    measured; otherwise it is allocated in the node."""
    if w.nf4:
        return linear_4bit(g, x, w, in_features, out_features, b, label)
    if ctx.autocast is None:
        xc = g.hold(x)
        wc: T = g.hold(w)
        bc = g.hold(b) if b is not None else None
    else:  # autocast casts the arguments right to left (C++ evaluation order): bias, weight, input
        bc = autocast_weight(g, ctx, b) if b is not None else None
        wc = autocast_weight(g, ctx, w, w_leaf)
        xc = _cached_input_cast(g, ctx, x, label) if cache_input else cast(g, x, ctx.autocast, f"{label} input cast")
    ins = [xc, wc] + ([bc] if bc is not None else [])
    saved = [wc if xc.rg else None, xc if wc.rg else None]  # released weight first, then input
    g.before_outputs(ins, saved)
    # at::linear runs a biased 3-D linear as ``addmm`` on a flattened view, an unbiased one as ``mm``
    (out,) = g.sac_outputs(lambda: (g.alloc(xc.n * (out_features / in_features), xc.dt, label),),
                           "mm" if bc is None else "other")
    has_bias = bc is not None
    w_first = (not has_bias) if grad_w_first is None else grad_w_first

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        gx = gw = gb = None
        if w_first and wc.rg:
            gw = weight_grad(g, wc, label)
        if xc.rg:
            gx = g.alloc(xc.n, xc.dt, f"{label} grad x")
        if not w_first and wc.rg:
            gw = weight_grad(g, wc, label)
        if has_bias and bc is not None and bc.rg:
            gb = g.hold(go[0]) if bias_grad_reduced and go[0] is not None else g.alloc(bc.n, bc.dt, f"{label} grad b")
        return [gx, gw] + ([gb] if has_bias else [])

    g.record(label, ins, [out], saved, bwd)
    g.drop(xc, wc, bc)
    return out


def weight_grad(g: Graph, w: T, label: str) -> T | None:
    """A linear's weight gradient: a new tensor of the weight's size, or, under Megatron's
    gradient_accumulation_fusion (`Graph.wgrad_fused`), none: the matmul adds into the parameter's fp32
    ``main_grad`` (megatron/core/tensor_parallel/layers.py ``wgrad_gemm_accum_fp32``; Transformer Engine's
    ``fuse_wgrad_accumulation``), which counts as that use's gradient."""
    if g.wgrad_fused and w.is_param:
        g.param_grad_done(w)
        return None
    return g.alloc(w.n, w.dt, f"{label} grad w")


def _cached_input_cast(g: Graph, ctx: Ctx, x: T, label: str) -> T:
    """Autocast's cached 16-bit copy of a leaf activation (kept until the autocast region ends)."""
    assert ctx.autocast is not None
    if x.dt == ctx.autocast:
        return g.hold(x)
    key = id(x)
    if key not in ctx.wcache:
        ctx.wcache[key] = cast(g, x, ctx.autocast, f"{label} input cast (cached)")
    return g.hold(ctx.wcache[key])


def linear_4bit(g: Graph, x: T, w: T, in_features: int, out_features: int, b: T | None, label: str) -> T:
    """bitsandbytes ``Linear4bit`` (QLoRA's frozen NF4 base): the input goes to the compute dtype,
    ``MatMul4Bit`` dequantizes the weight into a temporary (out, in) buffer for the matmul and saves
    nothing of size; backward dequantizes again for the input's gradient. The output returns to the
    input's dtype (bitsandbytes/nn/modules.py, autograd/_functions.py). Before bitsandbytes 0.43.2
    ``MatMul4Bit.forward`` kept its input too (``ctx.tensors = (A, B)``), which its backward never reads
    (`Graph.bnb_saves_input`): a Python attribute of the node, not a saved tensor, so backward does not free
    it; it lives as long as the graph (`Graph.bnb_kept`). Inside a checkpointed layer nothing is kept: the
    checkpointing of that era's stacks is reentrant (transformers 4.x ``gradient_checkpointing_enable()``'s
    default ``use_reentrant=True``, fsdp_qlora's ``--reentrant_checkpointing``), whose forward builds no
    graph, and the recomputation's graph goes with its backward. (Non-reentrant checkpointing would keep
    them: its saved-tensor hooks cannot reach an attribute. Not modelled: Answer.AI's published QLoRA rows,
    run on bitsandbytes 0.43.0 with reentrant checkpointing, read +68 % and +151 % with it.)"""
    cdt = w.nf4
    xc = cast(g, x, cdt, f"{label} input to compute dtype")
    ins = [xc] + ([b] if b is not None else [])
    g.before_outputs(ins, [None])
    deq = _dequantize_4bit(g, in_features * out_features, cdt, f"{label} dequantize_4bit")
    (out,) = g.sac_outputs(lambda: (g.alloc(xc.n * (out_features / in_features), cdt, label),), "mm")
    g.drop(deq)
    n_in = xc.n

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        deq_b = _dequantize_4bit(g, in_features * out_features, cdt, f"{label} dequantize_4bit (backward)")
        gx = g.alloc(n_in, cdt, f"{label} grad x")
        g.drop(deq_b)
        return [gx] + ([None] if b is not None else [])

    g.record(label, ins, [out], [], bwd)
    if g.bnb_saves_input and not g.recomputing and g.checkpoint is None:
        g.bnb_kept.append(g.hold(xc))
    g.drop(xc)
    res = cast(g, out, x.dt, f"{label} output to input dtype")
    g.drop(out)
    return res


def _dequantize_4bit(g: Graph, numel: int, cdt: int, label: str) -> T:
    """``F.dequantize_4bit(B, quant_state).to(A.dtype)``: a weight in the quantization state's dtype, copied to the
    compute dtype where they differ (`Graph.bnb_fp16_state`: Fabric quantized an fp16 copy, the compute dtype is
    bf16), the first copy freed once the second exists (bitsandbytes 0.42.0 autograd/_functions.py:516, 546)."""
    deq = g.alloc(const(numel), 2 if g.bnb_fp16_state else cdt, label)
    if not g.bnb_fp16_state:
        return deq
    out = g.alloc(const(numel), cdt, f"{label} to compute dtype")
    g.drop(deq)
    return out


def embedding(g: Graph, ids: T, w: T, tokens_n: Sz, label: str = "embedding") -> T:
    """``F.embedding(ids, w)``: (tokens, d) in the weight's dtype; saves the indices; backward
    ``embedding_dense_backward`` allocates a full weight-sized gradient."""
    out = g.alloc(tokens_n, w.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [None, g.alloc(w.n, w.dt, f"{label} grad")]

    g.record(label, [ids, w], [out], [ids], bwd)
    return out


# -- attention building blocks ------------------------------------------------------------------
def bmm(g: Graph, ctx: Ctx, a: T, b: T, out_n: Sz, label: str = "bmm", grad_b_first: bool = False) -> T:
    """``torch.matmul`` of two (batched) matrices (``bmm`` after reshapes); autocast casts both to
    16 bit. Saves b if a needs a gradient and a if b does. With `grad_b_first`, backward allocates the
    second operand's gradient before the first's (measured for the LayerNorm families' matmuls:
    ``BmmBackward0`` computes ``mat2``'s gradient ``self^T.bmm(grad)`` first)."""
    (out,) = g.sac_outputs(lambda: (g.alloc(out_n, a.dt, label),), "other")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        if grad_b_first:
            gb = g.alloc(b.n, b.dt, f"{label} grad b") if b.rg else None
            ga = g.alloc(a.n, a.dt, f"{label} grad a") if a.rg else None
        else:
            ga = g.alloc(a.n, a.dt, f"{label} grad a") if a.rg else None
            gb = g.alloc(b.n, b.dt, f"{label} grad b") if b.rg else None
        return [ga, gb]

    g.record(label, [a, b], [out], [b if a.rg else None, a if b.rg else None], bwd)
    return out


def addmm(g: Graph, ctx: Ctx, x: T, w: T, b: T, in_features: int, out_features: int, label: str = "addmm",
          linear_casts: bool = False) -> T:
    """transformers ``Conv1D``: ``torch.addmm(bias, x.view(-1, nx), weight)`` with a (in, out) weight;
    with `linear_casts`, ``F.linear(x, w, b)`` with a bias, which ``at::linear`` also runs as
    ``addmm(b, x.view(-1, in), w.t())`` (aten/src/ATen/native/Linear.cpp).

    Saves the input and the weight; backward allocates the input's then the weight's gradient; the
    bias's gradient is the output gradient itself (derivatives.yaml addmm: ``maybe_multiply(grad,
    beta)``), which the engine reduces to the bias's shape after the node returns (so after
    recomputed saved tensors are released). Autocast's wrapper casts its arguments right to left (GCC
    evaluates the ``cached_cast(args)...`` pack from the last argument): for ``addmm`` the weight
    (cached), the input, then the bias (cached); for ``linear`` the bias, the weight, the input.

    A 4-bit weight (QLoRA: transformers' ``replace_with_bnb_linear`` makes every ``nn.Linear`` and
    ``Conv1D`` a bitsandbytes ``Linear4bit``, biased or not) runs `linear_4bit` instead."""
    if w.nf4:
        return linear_4bit(g, x, w, in_features, out_features, b, label)
    if ctx.autocast is None:
        xc, wc, bc = g.hold(x), g.hold(w), g.hold(b)
    elif linear_casts:
        bc = autocast_weight(g, ctx, b)
        wc = autocast_weight(g, ctx, w)
        xc = cast(g, x, ctx.autocast, f"{label} input cast")
    else:
        wc = autocast_weight(g, ctx, w)
        xc = cast(g, x, ctx.autocast, f"{label} input cast")
        bc = autocast_weight(g, ctx, b)
    ins = [xc, wc, bc]
    saved = [wc if xc.rg else None, xc if wc.rg else None]
    g.before_outputs(ins, saved)
    (out,) = g.sac_outputs(lambda: (g.alloc(xc.n * (out_features / in_features), xc.dt, label),), "other")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        gx = g.alloc(xc.n, xc.dt, f"{label} grad x") if xc.rg else None
        gw = weight_grad(g, wc, label) if wc.rg else None
        gb = g.hold(go[0]) if bc.rg and go[0] is not None else None
        return [gx, gw, gb]

    g.record(label, ins, [out], saved, bwd)
    g.drop(xc, wc, bc)
    return out




def grouped_mm(g: Graph, a: T, w: T, offs: T, out_n: Sz, label: str = "grouped_mm") -> T:
    """``F.grouped_mm(a, w, offs)`` (``aten._grouped_mm``) of (rows, k) activations with a 3-D
    (experts, k, n) weight (a transposed view of the parameter): (rows, n) in a's dtype; not an
    autocast op. Saves the weight, the offsets and the input (released in that order); backward
    computes the weight's gradient (in the parameter's layout) before the input's. On CUDA the bf16
    CUTLASS kernel or ``_grouped_mm_fallback`` (a loop of ``mm_out`` into the output) allocate
    nothing else (aten/src/ATen/native/cuda/GroupedBlas.cpp)."""
    saved = [w if a.rg else None, offs, a if w.rg else None]
    g.before_outputs([a, w, offs], saved)
    (out,) = g.sac_outputs(lambda: (g.alloc(out_n, a.dt, label),), "other")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        gw = g.alloc(w.n, w.dt, f"{label} grad w") if w.rg else None
        ga = g.alloc(a.n, a.dt, f"{label} grad a") if a.rg else None
        return [ga, gw, None]

    g.record(label, [a, w, offs], [out], saved, bwd)
    return out


def baddbmm(g: Graph, w: T, lhs: T, rhs: T, alpha: float, label: str = "baddbmm") -> T:
    """``torch.baddbmm(W, lhs, rhs, alpha=scaling)`` with autocast off (peft's ``_LoraFactorsProxy``):
    the merged expert weight in W's dtype. Saves lhs and rhs (released in that order); backward
    computes ``grad.bmm(rhs^T)`` then ``lhs^T.bmm(grad)``, each times alpha unless it is 1 (another
    tensor; derivatives.yaml ``baddbmm``, ``maybe_multiply``); W is frozen."""
    saved = [lhs if rhs.rg else None, rhs if lhs.rg else None]
    g.before_outputs([w, lhs, rhs], saved)
    (out,) = g.sac_outputs(lambda: (g.alloc(w.n, w.dt, label),), "other")

    def one(g: Graph, x: T, name: str) -> T:
        r = g.alloc(x.n, x.dt, f"{label} grad {name}")
        if alpha == 1:
            return r
        s = g.alloc(x.n, x.dt, f"{label} grad {name} * alpha")
        g.drop(r)
        return s

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [None, one(g, lhs, "lhs") if lhs.rg else None, one(g, rhs, "rhs") if rhs.rg else None]

    g.record(label, [w, lhs, rhs], [out], saved, bwd)
    return out


def baddbmm_check(g: Graph, w: T, label: str) -> None:
    """The registration check of a ``_LoraFactorsProxy``: one ``baddbmm`` whose result is dropped at
    once (selective checkpointing's cache keeps it: ``baddbmm`` is a saved op)."""
    (out,) = g.sac_outputs(lambda: (g.alloc(w.n, w.dt, f"{label} parametrization check"),), "other")
    g.drop(out)
