"""Memory rules of the PyTorch ops a transformer step uses, on symbolic tensors (`trainmem_nb.tape`).

Each function allocates what the op returns, records what autograd saves (following the derivative
formulas in PyTorch's ``tools/autograd/derivatives.yaml``: an op saves only what the gradients of
inputs that require grad need) and the allocations of its backward. Callers release their own
references, so temporaries die where Python drops them, as in Hugging Face's model code.

Byte sizes per element: fp32 4, bf16/fp16 2, int64 8, bool 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .tape import Graph, Sz, T, const

__all__ = ["Ctx"]

F32, F16, I64, BOOL = 4, 2, 8, 1


@dataclass
class Ctx:
    """What decides dtypes and kernels: the precision recipe and the device.

    ``autocast``: bytes of the autocast compute dtype (2) or None without autocast. ``device``: 'cuda'
    or 'cpu' (their kernels and autocast op lists differ).
    """

    autocast: int | None
    device: str
    batch1: bool = False  # micro-batch 1: some slices are already contiguous (no copy)
    wcache: dict[int, T] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def _promote(a: T, b: T) -> int:
    return max(a.dt, b.dt)


def _bigger(a: T, b: T) -> Sz:
    return a.n if a.n.key() >= b.n.key() else b.n


# -- dtype casts --------------------------------------------------------------------------------
def cast(g: Graph, x: T, dt: int, label: str = "to") -> T:
    """``x.to(dt)``: the same tensor when the dtype matches (a new reference), else a copy whose
    backward casts the gradient back (``_to_copy``)."""
    if x.dt == dt:
        return g.hold(x)
    out = g.alloc(x.n, dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward")]

    g.record(label, [x], [out], [], bwd)
    return out


def autocast_weight(g: Graph, ctx: Ctx, w: T, leaf: bool = True) -> T:
    """Autocast's 16-bit copy of a parameter: made at first use and cached for the autocast region
    (at::autocast::cached_cast caches leaf tensors that require grad); frozen weights, and weights
    computed in the step (``leaf=False``: peft's merged ``W + delta``), are cast at every use, uncached."""
    assert ctx.autocast is not None
    if w.dt == ctx.autocast:
        return g.hold(w)
    if w.rg and leaf:
        key = id(w)
        if key in ctx.wcache:
            return g.hold(ctx.wcache[key])
        c = cast(g, w, ctx.autocast, f"autocast {w.label}")
        c.wcopy = True
        ctx.wcache[key] = c
        return g.hold(c)
    c = cast(g, w, ctx.autocast, f"autocast {w.label}")
    c.wcopy = True
    return c


def end_autocast(g: Graph, ctx: Ctx) -> None:
    """Leaving the autocast region clears the weight-cast cache (its references go)."""
    for c in ctx.wcache.values():
        g.drop(c)
    ctx.wcache.clear()


# -- matmuls ------------------------------------------------------------------------------------
def linear(g: Graph, ctx: Ctx, x: T, w: T, in_features: int, out_features: int, b: T | None = None,
           label: str = "linear", grad_w_first: bool | None = None, w_leaf: bool = True) -> T:
    """``F.linear(x, w, b)`` on (tokens, in) activations: ``mm``/``addmm`` (cuBLAS/MKL) output of
    (tokens, out). Saves x if the weight needs a gradient and the weight if x does; under autocast
    the saved copies are the 16-bit casts (`w_leaf`: whether autocast may cache the weight's)."""
    if w.nf4:
        return linear_4bit(g, x, w, in_features, out_features, b, label)
    if ctx.autocast is None:
        xc = g.hold(x)
        wc: T = g.hold(w)
        bc = g.hold(b) if b is not None else None
    else:  # autocast casts the arguments right to left (C++ evaluation order): bias, weight, input
        bc = autocast_weight(g, ctx, b) if b is not None else None
        wc = autocast_weight(g, ctx, w, w_leaf)
        xc = cast(g, x, ctx.autocast, f"{label} input cast")
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
            gw = g.alloc(wc.n, wc.dt, f"{label} grad w")
        if xc.rg:
            gx = g.alloc(xc.n, xc.dt, f"{label} grad x")
        if not w_first and wc.rg:
            gw = g.alloc(wc.n, wc.dt, f"{label} grad w")
        if has_bias and bc is not None and bc.rg:
            gb = g.alloc(bc.n, bc.dt, f"{label} grad b")
        return [gx, gw] + ([gb] if has_bias else [])

    g.record(label, ins, [out], saved, bwd)
    g.drop(xc, wc, bc)
    return out


def linear_4bit(g: Graph, x: T, w: T, in_features: int, out_features: int, b: T | None, label: str) -> T:
    """bitsandbytes ``Linear4bit`` (QLoRA's frozen NF4 base): the input goes to the compute dtype,
    ``MatMul4Bit`` dequantizes the weight into a temporary (out, in) buffer for the matmul and saves
    nothing of size; backward dequantizes again for the input's gradient. The output returns to the
    input's dtype (bitsandbytes/nn/modules.py, autograd/_functions.py)."""
    cdt = w.nf4
    xc = cast(g, x, cdt, f"{label} input to compute dtype")
    ins = [xc] + ([b] if b is not None else [])
    g.before_outputs(ins, [None])
    deq = g.alloc(const(in_features * out_features), cdt, f"{label} dequantize_4bit")
    (out,) = g.sac_outputs(lambda: (g.alloc(xc.n * (out_features / in_features), cdt, label),), "mm")
    g.drop(deq)
    n_in = xc.n

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        deq_b = g.alloc(const(in_features * out_features), cdt, f"{label} dequantize_4bit (backward)")
        gx = g.alloc(n_in, cdt, f"{label} grad x")
        g.drop(deq_b)
        return [gx] + ([None] if b is not None else [])

    g.record(label, ins, [out], [], bwd)
    g.drop(xc)
    res = cast(g, out, x.dt, f"{label} output to input dtype")
    g.drop(out)
    return res


# -- element-wise -------------------------------------------------------------------------------
def mul(g: Graph, a: T, b: T, label: str = "mul") -> T:
    """``a * b`` (broadcasting). Saves b if a needs a gradient and a if b does; backward computes
    both full-size gradients (the engine then reduces broadcast ones)."""
    out = g.alloc(_bigger(a, b), _promote(a, b), label)
    n_out = out.n

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None

        def one(x: T, other: T, name: str) -> T:
            # mul_tensor_backward: grad * other in the promoted dtype, then cast to x's dtype
            prod_dt = max(grad.dt, other.dt)
            prod = g.alloc(n_out, prod_dt, f"{label} grad {name}")
            if prod_dt == x.dt:
                return prod
            res = g.alloc(n_out, x.dt, f"{label} grad {name} cast")
            g.drop(prod)
            return res

        ga = one(a, b, "a") if a.rg else None
        gb = one(b, a, "b") if b.rg else None
        return [ga, gb]

    g.record(label, [a, b], [out], [b if a.rg else None, a if b.rg else None], bwd)
    return out


def add(g: Graph, a: T, b: T, label: str = "add") -> T:
    """``a + b``: saves nothing; the gradient passes to both inputs (cast when an input's dtype
    differs from the output's)."""
    out = g.alloc(_bigger(a, b), _promote(a, b), label)
    odt = out.dt

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        res: list[T | None] = []
        for x in (a, b):
            if not x.rg:
                res.append(None)
            elif x.dt != odt:
                res.append(g.alloc(grad.n, x.dt, f"{label} grad cast"))
            else:
                res.append(g.hold(grad))
        return res

    g.record(label, [a, b], [out], [], bwd)
    return out


def scalar_op(g: Graph, x: T, label: str, grad_allocs: bool = True) -> T:
    """``x * c`` or ``x / c`` (grad_allocs: backward multiplies the gradient) or ``x + c``
    (gradient passes through)."""
    out = g.alloc(x.n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.alloc(x.n, x.dt, f"{label} backward") if grad_allocs else g.hold(grad)]

    g.record(label, [x], [out], [], bwd)
    return out


def unary_saving_input(g: Graph, x: T, label: str, temps: int = 0, out_dt: int | None = None) -> T:
    """An element-wise op that saves its input and whose backward allocates one gradient (plus
    `temps` transient full-size tensors first): silu, gelu, tanh-gelu."""
    out = g.alloc(x.n, out_dt or x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        tmp = [g.alloc(x.n, x.dt, f"{label} backward temp") for _ in range(temps)]
        gx = g.alloc(x.n, x.dt, f"{label} backward")
        g.drop(*tmp)
        return [gx]

    g.record(label, [x], [out], [x], bwd)
    return out


def unary_saving_output(g: Graph, x: T, label: str) -> T:
    """An element-wise op that saves its result (relu, tanh's result is used by its backward)."""
    out = g.alloc(x.n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward")]

    g.record(label, [x], [out], [out], bwd)
    return out


def pow2(g: Graph, x: T, label: str = "pow") -> T:
    """``x.pow(2)``: saves x; backward ``grad * 2 * x.pow(1)`` allocates three full tensors, keeps one."""
    out = g.alloc(x.n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        p = g.alloc(x.n, x.dt, f"{label} backward pow")
        m = g.alloc(x.n, x.dt, f"{label} backward mul")
        r = g.alloc(x.n, x.dt, f"{label} backward")
        g.drop(m, p)
        return [r]

    g.record(label, [x], [out], [x], bwd)
    return out


def mean_last(g: Graph, x: T, out_n: Sz, label: str = "mean") -> T:
    """``x.mean(-1, keepdim=True)``: saves nothing big; backward expands and divides (one full tensor)."""
    out = g.alloc(out_n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward")]

    g.record(label, [x], [out], [], bwd)
    return out


def rsqrt(g: Graph, x: T, label: str = "rsqrt") -> T:
    """``torch.rsqrt``: saves its result; backward ``-0.5 * grad * result**3`` (three small temps)."""
    out = g.alloc(x.n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        p = g.alloc(x.n, x.dt, f"{label} backward pow")
        m = g.alloc(x.n, x.dt, f"{label} backward mul")
        r = g.alloc(x.n, x.dt, f"{label} backward")
        g.drop(m, p)
        return [r]

    g.record(label, [x], [out], [out], bwd)
    return out


# -- structure ----------------------------------------------------------------------------------
def heads_view(g: Graph, x: T, label: str = "view heads", clone_grad: bool = True) -> T:
    """``x.view(b, s, heads, d).transpose(1, 2)``: no allocation; in backward the transposed
    gradient is made contiguous for the view (a ``clone``) when `clone_grad`."""
    v = g.view(x, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.alloc(x.n, grad.dt, f"{label} backward clone") if clone_grad else g.hold(grad)]

    g.record(label, [x], [v], [], bwd)
    return v


def rotate_half(g: Graph, x: T, rot_dims: float = 1.0, label: str = "rotate_half") -> T:
    """``cat((-x2, x1), -1)`` over the rotary part of x (a fraction `rot_dims` of its last dim):
    ``neg`` of a half, then ``cat``; backward: neg of a half gradient, two ``slice_backward``
    full-size zero-padded gradients, summed into x's gradient buffer."""
    half = x.n * (0.5 * rot_dims)
    x1 = g.view(x, f"{label} x1", n=half)
    x2 = g.view(x, f"{label} x2", n=half)
    _slice_node(g, x, x1, label)
    _slice_node(g, x, x2, label)
    neg = g.alloc(half, x.dt, f"{label} neg")

    def neg_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(half, x.dt, f"{label} neg backward")]

    g.record(f"{label} neg", [x2], [neg], [], neg_bwd)
    out = g.alloc(x.n * rot_dims, x.dt, f"{label} cat")

    def cat_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.view(grad, "cat grad part", n=half), g.view(grad, "cat grad part", n=half)]

    g.record(f"{label} cat", [neg, x1], [out], [], cat_bwd)
    g.drop(neg, x1, x2)
    return out


def _slice_node(g: Graph, x: T, part: T, label: str) -> None:
    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} slice_backward")]

    g.record(f"{label} slice", [x], [part], [], bwd)


def embedding(g: Graph, ids: T, w: T, tokens_n: Sz, label: str = "embedding") -> T:
    """``F.embedding(ids, w)``: (tokens, d) in the weight's dtype; saves the indices; backward
    ``embedding_dense_backward`` allocates a full weight-sized gradient."""
    out = g.alloc(tokens_n, w.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [None, g.alloc(w.n, w.dt, f"{label} grad")]

    g.record(label, [ids, w], [out], [ids], bwd)
    return out


def reserve(n: Sz, dt: int) -> Sz:
    """Bytes of `n` elements of `dt` (helper for recipes)."""
    return n * dt


ONE = const(1)


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


def clone(g: Graph, x: T, label: str = "clone", n: Sz | None = None) -> T:
    """A contiguous copy (``.contiguous()``, a reshape that cannot be a view); the gradient passes
    through to the input unchanged."""
    out = g.alloc(x.n if n is None else n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.hold(grad)]

    g.record(label, [x], [out], [], bwd)
    return out


def repeat_kv(g: Graph, x: T, n_rep: int, label: str) -> T:
    """HF ``repeat_kv``: ``expand`` then ``reshape`` (a copy n_rep times larger); its backward sums
    the repeats back (one kv-sized gradient)."""
    if n_rep == 1:
        return g.hold(x)
    out = g.alloc(x.n * n_rep, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward sum")]

    g.record(label, [x], [out], [], bwd)
    return out


def softmax(g: Graph, x: T, dt: int | None = None, label: str = "softmax") -> T:
    """``softmax(x, dim=-1, dtype=dt)``: an input in another dtype is first cast (a temporary);
    saves its output; backward allocates one gradient (then casts it back if the input was cast)."""
    src = cast(g, x, dt, f"{label} input cast") if dt is not None else g.hold(x)
    out = g.alloc(src.n, src.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(src.n, src.dt, f"{label} backward")]

    g.record(label, [src], [out], [out], bwd)
    g.drop(src)
    return out


def dropout(g: Graph, ctx: Ctx, x: T, p: float, label: str = "dropout") -> T:
    """``F.dropout(x, p, training=True)``. p == 0 returns the input itself. On CUDA the fused
    ``native_dropout`` keeps a bool mask (1 B/element); on CPU ``at::dropout`` keeps a mask in the
    input's dtype (``empty_like(x).bernoulli_()``) and multiplies (aten/src/ATen/native/Dropout.cpp)."""
    if p <= 0:
        return g.hold(x)
    if ctx.cuda:
        out = g.alloc(x.n, x.dt, label)
        mask = g.alloc(x.n, BOOL, f"{label} mask")

        def cuda_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
            return [g.alloc(x.n, x.dt, f"{label} backward")]

        g.record(label, [x], [out], [mask], cuda_bwd)
        g.drop(mask)
        return out
    noise = g.alloc(x.n, x.dt, f"{label} mask")
    out = g.alloc(x.n, x.dt, label)

    def cpu_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward"), None]

    g.record(label, [x, noise], [out], [noise], cpu_bwd)
    g.drop(noise)
    return out


# -- fine-tuning adapters -----------------------------------------------------------------------
def lora_linear(g: Graph, ctx: Ctx, x: T, w: T, b: T | None, a_w: T, b_w: T, in_features: int, out_features: int,
                rank: int, dropout_p: float, label: str) -> T:
    """peft ``lora.Linear.forward``: ``result = base(x)``; ``x`` cast to the adapter dtype (fp32 by
    default); ``result = result + lora_B(lora_A(dropout(x))) * scaling``; cast back to the base
    result's dtype (peft/tuners/lora/layer.py)."""
    result = linear(g, ctx, x, w, in_features, out_features, b, f"{label}.base_layer")
    return lora_update(g, ctx, x, result, a_w, b_w, in_features, out_features, rank, dropout_p, label)


def lora_update(g: Graph, ctx: Ctx, x: T, result: T, a_w: T, b_w: T, in_features: int, out_features: int,
                rank: int, dropout_p: float, label: str, reshape_grad: bool | None = None) -> T:
    """What peft's ``lora.Linear.forward`` adds to its base layer's `result` (the caller's, which this
    takes over): ``x`` cast to the adapter dtype, ``lora_B(lora_A(dropout(x))) * scaling`` added, the
    sum cast back to the result's dtype. With `reshape_grad` not None, ``lora_B``'s output is viewed as
    heads like the base output (`linear_strided_grad`), copying its gradient when True."""
    result_dt = result.dt
    xa = cast(g, x, a_w.dt, f"{label} lora input cast")
    d = dropout(g, ctx, xa, dropout_p, f"{label}.lora_dropout")
    a = linear(g, ctx, d, a_w, in_features, rank, None, f"{label}.lora_A")
    bb = linear(g, ctx, a, b_w, rank, out_features, None, f"{label}.lora_B")
    if reshape_grad is not None:
        b0 = bb
        bb = heads_view(g, b0, f"{label}.lora_B output reshape", clone_grad=reshape_grad)
        g.drop(b0)
    g.drop(a, d)
    sc = scalar_op(g, bb, f"{label} * scaling")
    g.drop(bb)
    total = add(g, result, sc, f"{label} + lora")
    g.drop(result, sc)
    out = cast(g, total, result_dt, f"{label} to result dtype")
    g.drop(total, xa)
    return out


# -- ops added for the LayerNorm families ---------------------------------------------------------
# (gpt2, opt, bert, gpt_neox: LayerNorm, Conv1D/linear with biases, GELU/ReLU, fused qkv, SDPA/eager)
def layer_norm(g: Graph, ctx: Ctx, x: T, w: T, b: T | None, stats_n: Sz, label: str = "layer_norm") -> T:
    """``F.layer_norm`` → ``native_layer_norm``: output in the input's dtype plus ``mean`` and
    ``rstd`` of (tokens, 1); saves input, weight, bias, mean, rstd (derivatives.yaml
    native_layer_norm); backward (``native_layer_norm_backward``) allocates the input's, the
    weight's and the bias's gradients.

    Statistics dtype: CPU ``layer_norm_cpu`` uses ``param_scalar_type`` (the input's dtype, fp32 when a
    16-bit input meets fp32 parameters); CUDA ``layer_norm_cuda`` uses the accumulate type (fp32).
    CUDA autocast runs ``layer_norm`` in fp32 (at::autocast fp32 list): a 16-bit input is cast first."""
    src = cast(g, x, F32, f"{label} autocast fp32") if ctx.cuda and ctx.autocast and x.dt != F32 else g.hold(x)
    stats_dt = F32 if (ctx.cuda or src.dt == F32 or w.dt == F32) else src.dt
    out = g.alloc(src.n, src.dt, label)
    mean = g.alloc(stats_n, stats_dt, f"{label} mean")
    rstd = g.alloc(stats_n, stats_dt, f"{label} rstd")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        gx = g.alloc(src.n, src.dt, f"{label} grad x") if src.rg else None
        gw = g.alloc(w.n, w.dt, f"{label} grad w") if w.rg else None
        gb = g.alloc(b.n, b.dt, f"{label} grad b") if b is not None and b.rg else None
        return [gx, gw] + ([gb] if b is not None else [])

    ins = [src, w] + ([b] if b is not None else [])
    g.record(label, ins, [out], [src, w, b, mean, rstd], bwd)
    g.drop(mean, rstd, src)
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
    (cached), the input, then the bias (cached); for ``linear`` the bias, the weight, the input."""
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
        gw = g.alloc(wc.n, wc.dt, f"{label} grad w") if wc.rg else None
        gb = g.hold(go[0]) if bc.rg and go[0] is not None else None
        return [gx, gw, gb]

    g.record(label, ins, [out], saved, bwd)
    g.drop(xc, wc, bc)
    return out


def split(g: Graph, x: T, parts: Sequence[float], label: str = "split") -> list[T]:
    """``x.split(...)`` along the last dim: views (fractions `parts` of x); backward
    (``split_with_sizes_backward``) concatenates the parts' gradients into one x-sized tensor
    (missing ones are zero-filled first)."""
    views = [g.view(x, f"{label} part", n=x.n * f) for f in parts]

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        zeros = [g.alloc(x.n * f, x.dt, f"{label} zeros") for f, gr in zip(parts, go, strict=True) if gr is None]
        out = g.alloc(x.n, x.dt, f"{label} backward cat")
        g.drop(*zeros)
        return [out]

    g.record(label, [x], views, [], bwd)
    return views


def gelu(g: Graph, x: T, label: str = "gelu") -> T:
    """``F.gelu`` (exact, erf): saves its input; backward ``gelu_backward`` allocates one gradient."""
    return unary_saving_input(g, x, label)


def relu(g: Graph, x: T, label: str = "relu") -> T:
    """``F.relu``: saves its result; backward ``threshold_backward`` allocates one gradient."""
    return unary_saving_output(g, x, label)


def gelu_new(g: Graph, ctx: Ctx, x: T, label: str = "gelu_new") -> T:
    """transformers ``NewGELUActivation``: the Python formula
    ``0.5 * x * (1.0 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3.0))))``, op by op (each temporary dies
    where the expression stops using it). Saved: x (by pow), 0.5*x, tanh's result, 1+tanh, and the
    product's inputs.

    CUDA autocast runs ``pow`` in fp32 (at::autocast fp32 list): x is cast to fp32 (that copy is what
    pow saves) and everything downstream of it is promoted to fp32."""
    half = scalar_op(g, x, f"{label} 0.5*x")
    if ctx.cuda and ctx.autocast and x.dt != F32:
        x32 = cast(g, x, F32, f"{label} pow autocast fp32")
        p = pow2(g, x32, f"{label} pow3")
        g.drop(x32)
    else:
        p = pow2(g, x, f"{label} pow3")
    m = scalar_op(g, p, f"{label} 0.044715*")
    g.drop(p)
    s = add(g, x, m, f"{label} x+")
    g.drop(m)
    e = scalar_op(g, s, f"{label} sqrt(2/pi)*")
    g.drop(s)
    t = unary_saving_output(g, e, f"{label} tanh")
    g.drop(e)
    u = scalar_op(g, t, f"{label} 1+", grad_allocs=False)
    g.drop(t)
    out = mul(g, half, u, f"{label} mul")
    g.drop(half, u)
    return out


def activation(g: Graph, ctx: Ctx, x: T, name: str, label: str = "act") -> T:
    """The MLP activation by its transformers name (``ACT2FN``)."""
    if name == "gelu_new":
        return gelu_new(g, ctx, x, label)
    if name == "relu":
        return relu(g, x, label)
    if name in ("gelu", "silu", "gelu_pytorch_tanh"):
        return unary_saving_input(g, x, label)
    raise NotImplementedError(f"activation {name!r}")


def sdpa_flash(g: Graph, ctx: Ctx, q: T, k: T, v: T, lse_n: Sz, label: str = "sdpa") -> T:
    """``F.scaled_dot_product_attention`` on a flash-style kernel (CPU flash without dropout; CUDA
    flash / memory-efficient): the output in q's layout and an fp32 logsumexp; saves q, k, v, the
    output and the logsumexp; backward allocates the three input gradients. Autocast casts key,
    query, value (a no-op for 16-bit inputs)."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} k cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} q cast") if cd else g.hold(q)
    vc = cast(g, v, cd, f"{label} v cast") if cd else g.hold(v)
    out, lse = g.sac_outputs(lambda: (g.alloc(qc.n, qc.dt, f"{label} out"), g.alloc(lse_n, F32, f"{label} logsumexp")),
                             "attention")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(qc.n, qc.dt, f"{label} grad q"), g.alloc(kc.n, kc.dt, f"{label} grad k"),
                g.alloc(vc.n, vc.dt, f"{label} grad v")]

    # the node releases its saved tensors in the order key, query, value, logsumexp, output
    g.record(label, [qc, kc, vc], [out, lse], [kc, qc, vc, lse, out], bwd)
    g.drop(lse, qc, kc, vc)
    return out


def dropout_last(g: Graph, ctx: Ctx, x: T, p: float, label: str = "dropout") -> T:
    """`dropout` for the last saving op of a checkpointed region: on CPU ``at::dropout`` is
    ``input * noise`` and the ``mul`` packs its saved input (the noise) before its kernel runs, so a
    recomputation that ends with it stops before the output exists (`Graph.before_outputs`)."""
    if p <= 0 or ctx.cuda:
        return dropout(g, ctx, x, p, label)
    noise = g.alloc(x.n, x.dt, f"{label} mask")
    g.before_outputs([x, noise], [noise])
    out = g.alloc(x.n, x.dt, label)

    def cpu_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward"), None]

    g.record(label, [x, noise], [out], [noise], cpu_bwd)
    g.drop(noise)
    return out


def sdpa_math(g: Graph, ctx: Ctx, q: T, k: T, v: T, scores_n: Sz, p: float, causal: bool,
              copy_q: bool = True, copy_k: bool = True, copy_v: bool = True, grad_copy: bool | None = None,
              label: str = "sdpa math") -> T:
    """``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp), which
    CPU SDPA runs when attention dropout is on: 16-bit inputs are upcast to fp32 on CPU; q and k^T
    scaled by sqrt(scale); with ``is_causal`` an (s, s) additive mask (``ones.tril`` → ``where``);
    ``matmul`` (it copies operands whose batch dims cannot be folded into one: `copy_q`, `copy_k`,
    `copy_v`; the output's gradient is copied back unless b == 1: `grad_copy`, default `copy_q`),
    ``_safe_softmax``, dropout, ``matmul``; the results are cast back. Returns the
    (b, heads, s, d) output (a view of the last matmul's result when no cast back happens)."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} k cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} q cast") if cd else g.hold(q)
    vc = cast(g, v, cd, f"{label} v cast") if cd else g.hold(v)
    reduced = qc.dt != F32 and not ctx.cuda
    q32, k32, v32 = ((cast(g, x, F32, f"{label} upcast") if reduced else g.hold(x)) for x in (qc, kc, vc))
    qs = scalar_op(g, q32, f"{label} q * sqrt(scale)")
    mask = None
    if causal:
        ones = g.alloc(Sz(ss=1), BOOL, f"{label} causal ones")
        tril = g.alloc(Sz(ss=1), BOOL, f"{label} causal tril")
        g.drop(ones)
        zero, neg = g.alloc(ONE, q32.dt, "0"), g.alloc(ONE, q32.dt, "-inf")
        mask = g.alloc(Sz(ss=1), q32.dt, f"{label} causal mask")
        g.drop(zero, neg, tril)
    kt = scalar_op(g, k32, f"{label} k^T * sqrt(scale)")
    q2 = clone(g, qs, f"{label} query contiguous") if copy_q else g.hold(qs)
    k2 = clone(g, kt, f"{label} key^T contiguous") if copy_k else g.hold(kt)
    scores = bmm(g, ctx, q2, k2, scores_n, f"{label} q @ k^T", grad_b_first=True)
    g.drop(q2, k2, kt)
    if mask is not None:
        sm = add(g, scores, mask, f"{label} + mask")
        g.drop(scores)
    else:
        sm = scores
    probs = softmax(g, sm, None, f"{label} _safe_softmax")
    g.drop(sm)
    pd = dropout(g, ctx, probs, p, f"{label} attn dropout")
    g.drop(probs)
    # make_tuple(matmul(attn, v).to(dtype), attn.to(dtype)): GCC evaluates the second first
    attn16 = cast(g, pd, qc.dt, f"{label} attn to input dtype") if reduced else None
    v2 = clone(g, v32, f"{label} value contiguous") if copy_v else g.hold(v32)
    o3 = bmm(g, ctx, pd, v2, q.n, f"{label} probs @ v", grad_b_first=True)
    g.drop(v2)
    # matmul returns a view of the bmm result; the gradient reaching it through the transpose is
    # strided and its reshape copies it, unless (b, heads) fold into one dim (b == 1)
    o = heads_view(g, o3, f"{label} matmul unsafe_view", clone_grad=copy_q if grad_copy is None else grad_copy)
    g.drop(o3)
    if reduced:
        o16 = cast(g, o, qc.dt, f"{label} output to input dtype")
        g.drop(o)
        o = o16
    g.drop(qs, mask, q32, k32, v32, pd, attn16, qc, kc, vc)
    return o


def eager_attention(g: Graph, ctx: Ctx, q: T, k: T, v: T, mask: T | None, scores_n: Sz, p: float, fold: bool,
                    softmax_dt: int | None = None, cast_back: bool = True, one_expression: bool = False,
                    probs_dt: int | None = None, contiguous_qk: bool = False, label: str = "eager") -> tuple[T, T]:
    """A family's ``eager_attention_forward`` without GQA: ``matmul(q, k^T) * scaling (+ mask)``,
    ``softmax`` (in `softmax_dt` when the code asks for it), cast back to the value's dtype
    (`cast_back`, to `probs_dt` when the code names the query's dtype; without it autocast's matmul
    casts the dropped-out probabilities; with `one_expression`, ``softmax(...).to(dtype)`` rebinds
    the scores' name only after the cast), dropout,
    ``matmul(probs, v)``, and the transposed result copied contiguous (by the function or by its
    caller's ``reshape``). Returns (output, attention weights); the caller keeps the weights alive as
    the function's second result.

    q, k, v are (b, s, heads, d)-laid-out views (q and k are contiguous (b, heads, s, d) tensors when
    `contiguous_qk`): ``matmul`` copies strided ones to fold (b, heads) into one batch dim (`fold`; with
    b == 1 that is a view), and the gradient reaching the result's transpose is strided, so the view's
    backward copies it (again unless b == 1). Autocast casts right to left (key before query, value
    before probabilities); CUDA autocast runs a softmax without dtype in fp32."""
    cd = ctx.autocast
    kc = cast(g, k, cd, f"{label} matmul key cast") if cd else g.hold(k)
    qc = cast(g, q, cd, f"{label} matmul query cast") if cd else g.hold(q)
    copy_qk = fold and not contiguous_qk
    q2 = clone(g, qc, f"{label} query contiguous") if copy_qk else g.hold(qc)
    k2 = clone(g, kc, f"{label} key^T contiguous") if copy_qk else g.hold(kc)
    scores = bmm(g, ctx, q2, k2, scores_n, f"{label} q @ k^T", grad_b_first=True)
    g.drop(q2, k2, qc, kc)
    w = scalar_op(g, scores, f"{label} * scaling")
    g.drop(scores)
    if mask is not None:
        w2 = add(g, w, mask, f"{label} + mask")
        g.drop(w)
        w = w2
    sm_dt = softmax_dt if softmax_dt is not None else (F32 if ctx.cuda and cd and w.dt != F32 else None)
    probs = softmax(g, w, sm_dt, f"{label} softmax")
    if not one_expression:
        g.drop(w)
    pt = cast(g, probs, probs_dt or v.dt, f"{label} probs cast back") if cast_back else g.hold(probs)
    g.drop(probs)
    if one_expression:
        g.drop(w)
    pd = dropout(g, ctx, pt, p, f"{label} attn dropout")
    g.drop(pt)
    vc = cast(g, v, cd, f"{label} matmul value cast") if cd else g.hold(v)
    pc = cast(g, pd, cd, f"{label} matmul probs cast") if cd else g.hold(pd)
    v2 = clone(g, vc, f"{label} value contiguous") if fold else g.hold(vc)
    o3 = bmm(g, ctx, pc, v2, v.n, f"{label} probs @ v", grad_b_first=True)
    g.drop(pc, vc, v2)
    o = heads_view(g, o3, f"{label} matmul unsafe_view", clone_grad=fold)
    g.drop(o3)
    out = clone(g, o, f"{label} attn_output transpose contiguous")
    g.drop(o)
    return out, pd


def lora_addmm(g: Graph, ctx: Ctx, x: T, w: T, b: T, a_w: T, b_w: T, in_features: int, out_features: int,
               rank: int, dropout_p: float, label: str) -> T:
    """peft ``lora.Linear`` around a transformers ``Conv1D`` (``fan_in_fan_out``): `lora_linear` with
    the base layer's ``addmm`` (peft/tuners/lora/layer.py)."""
    result = addmm(g, ctx, x, w, b, in_features, out_features, f"{label}.base_layer")
    return lora_update(g, ctx, x, result, a_w, b_w, in_features, out_features, rank, dropout_p, label)


def linear_strided_grad(g: Graph, ctx: Ctx, x: T, w: T, b: T | None, in_features: int, out_features: int,
                        strided: bool, label: str, lora: tuple[T, T, int, float] | None = None) -> T:
    """A projection whose output gradient comes back strided when `strided` (the key of eager or math
    attention: its (b, heads, s, d) view's transposes leave the gradient in a layout that the
    ``view`` of a linear's output cannot fold to (tokens, features) when b > 1, so each ``F.linear``
    output reshape copies it in backward, just before that linear's own backward; with b == 1 the
    ``mm`` takes the transposed layout as it is). With `lora` = (lora_A, lora_B, rank,
    dropout) the layer is peft's `lora_linear`, whose base and ``lora_B`` outputs both copy."""
    if lora is None:
        y = (addmm(g, ctx, x, w, b, in_features, out_features, label, linear_casts=True) if b is not None
             else linear(g, ctx, x, w, in_features, out_features, None, label))
        out = heads_view(g, y, f"{label} output reshape", clone_grad=strided)
        g.drop(y)
        return out
    a_w, b_w, rank, dropout_p = lora
    r0 = linear(g, ctx, x, w, in_features, out_features, b, f"{label}.base_layer")
    result = heads_view(g, r0, f"{label}.base_layer output reshape", clone_grad=strided)
    g.drop(r0)
    return lora_update(g, ctx, x, result, a_w, b_w, in_features, out_features, rank, dropout_p, label,
                       reshape_grad=strided)


def cat_last(g: Graph, ctx: Ctx, parts: Sequence[T], label: str = "cat") -> T:
    """``torch.cat(parts, dim=-1)``. Mixed dtypes: CPU autocast ``promote``s (casts the narrower parts
    to the widest dtype first, a temporary each; autocast_mode.cpp ``KERNEL_CPU(cat, promote)``); CUDA
    autocast has no rule for ``cat``, so the kernel writes the promoted result directly and its
    backward (``cat_tensors_backward``) casts those parts' gradient slices back. Backward otherwise
    hands out views of the gradient."""
    dt = max(x.dt for x in parts)
    promote = ctx.autocast is not None and not ctx.cuda
    srcs = [cast(g, x, dt, f"{label} autocast promote") if promote else g.hold(x) for x in parts]
    n = srcs[0].n
    for x in srcs[1:]:
        n = n + x.n
    out = g.alloc(n, dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.view(grad, f"{label} grad part", n=x.n) if x.dt == dt else g.alloc(x.n, x.dt, f"{label} grad part cast")
                for x in srcs]

    g.record(label, srcs, [out], [], bwd)
    g.drop(*srcs)
    return out


# -- ops added for gemma/phi3/mixtral ---------------------------------------------------------------
def slice_view(g: Graph, x: T, n: Sz, label: str = "slice") -> T:
    """``x[..., a:b]`` that cuts something: a view; backward ``slice_backward`` allocates a zero
    tensor of x's full size and copies the gradient into the slice (derivatives.yaml ``slice.Tensor``)."""
    v = g.view(x, label, n=n)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} slice_backward")]

    g.record(label, [x], [v], [], bwd)
    return v


def alias_view(g: Graph, x: T, label: str = "alias") -> T:
    """``x[..., :n]`` with n == x.shape[-1]: Python indexing returns ``at::alias(x)`` when nothing is
    cut (torch/csrc/autograd/python_variable_indexing.cpp); its backward passes the gradient on."""
    v = g.view(x, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.hold(grad)]

    g.record(label, [x], [v], [], bwd)
    return v


def cat2(g: Graph, a: T, b: T, label: str = "cat") -> T:
    """``torch.cat([a, b], -1)`` of same-dtype tensors: a new tensor; backward hands each input a
    narrow view of the gradient (derivatives.yaml ``cat``: ``cat_tensors_backward``, no allocation)."""
    out = g.alloc(a.n + b.n, a.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.view(grad, f"{label} grad part", n=a.n), g.view(grad, f"{label} grad part", n=b.n)]

    g.record(label, [a, b], [out], [], bwd)
    return out


def topk(g: Graph, x: T, out_n: Sz, label: str = "topk") -> tuple[T, T]:
    """``torch.topk(x, k)``: values (x's dtype) and int64 indices; saves the indices; backward
    ``value_selecting_reduction_backward`` = ``zeros(x.shape).scatter(dim, indices, grad)`` (a zero
    tensor, then the out-of-place scatter's result; the zeros die at once)."""
    vals = g.alloc(out_n, x.dt, f"{label} values")
    idx = g.alloc(out_n, I64, f"{label} indices")

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        zeros = g.alloc(x.n, x.dt, f"{label} backward zeros")
        out = g.alloc(x.n, x.dt, f"{label} backward scatter")
        g.drop(zeros)
        return [out]

    g.record(label, [x], [vals, idx], [idx], bwd)
    return vals, idx


def sum_keepdim(g: Graph, x: T, out_n: Sz, label: str = "sum") -> T:
    """``x.sum(dim, keepdim)`` (or without keepdim): saves nothing; backward ``sum_backward`` expands
    the gradient to x's shape (a view, no allocation)."""
    out = g.alloc(out_n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.view(grad, f"{label} backward expand", n=x.n)]

    g.record(label, [x], [out], [], bwd)
    return out


def div_(g: Graph, a: T, b: T, label: str = "div_") -> T:
    """``a /= b`` (b broadcast): in place, so autograd saves a copy of the original ``a``
    (``original_self.clone()``, needed by ``div_tensor_other_backward``) and ``b``. Returns the result
    (a view of a's storage). Backward: ``b``'s gradient ``-grad * ((self / other) / other)`` (three
    temporaries, freed in reverse), then ``a``'s ``grad / other``; the engine reduces ``b``'s to its
    shape."""
    # the clone is made only when b's gradient will need the original a
    orig = g.alloc(a.n, a.dt, f"{label} original self") if b.rg else None
    out = g.view(a, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        gb = None
        if b.rg:
            t1 = g.alloc(a.n, a.dt, f"{label} self / other")
            t2 = g.alloc(a.n, a.dt, f"{label} / other")
            neg = g.alloc(a.n, a.dt, f"{label} -grad")
            gb = g.alloc(a.n, b.dt, f"{label} grad other")
            g.drop(neg, t2, t1)
        ga = g.alloc(a.n, a.dt, f"{label} grad self") if a.rg else None
        return [ga, gb]

    g.record(label, [a, b], [out], [b, orig], bwd)
    g.drop(orig)
    return out


def index_rows(g: Graph, x: T, idx: T, out_n: Sz, label: str = "index") -> T:
    """``x[idx]`` with an int64 index tensor (advanced indexing on the first dim): a new tensor; saves
    the indices; backward ``index_backward`` = ``zeros(x.shape).index_put(indices, grad, True)``
    (zeros, then the out-of-place index_put's result; the zeros die at once). Autograd saves the
    indices (an input) before the kernel runs."""
    g.before_outputs([x, idx], [idx])
    out = g.alloc(out_n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        zeros = g.alloc(x.n, x.dt, f"{label} backward zeros")
        res = g.alloc(x.n, x.dt, f"{label} backward index_put")
        g.drop(zeros)
        return [res, None]

    g.record(label, [x, idx], [out], [idx], bwd)
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


def mul_both_grads(g: Graph, a: T, b: T, label: str = "mul") -> T:
    """``a * b`` where both inputs need gradients and dtypes or shapes differ (routing weights times
    expert outputs). ``MulBackward0`` computes both products in the promoted dtype; then the engine's
    ``validate_outputs`` (torch/csrc/autograd/engine.cpp) fixes each input's gradient in turn: a cast
    to the input's dtype, or a reduction to its shape (done by `Graph.backward`). That runs after the
    node's apply returned, so under checkpointing the recomputed saved tensors, which die with the
    apply, are gone before the casts. An input that needs a cast must not be broadcast."""
    g.before_outputs([a, b], [b if a.rg else None, a if b.rg else None])
    out = g.alloc(_bigger(a, b), _promote(a, b), label)
    n_out, odt = out.n, out.dt
    n_nodes = len(g.nodes)
    recorded: list = []  # the autograd node (none when recomputing: the original one is refilled)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        prods = [g.alloc(n_out, odt, f"{label} grad {name}") if x.rg else None for name, x in (("a", a), ("b", b))]
        node = recorded[0] if recorded else None
        casts = any(pr is not None and x.dt != odt for x, pr in zip((a, b), prods, strict=True))
        if casts and node is not None and node.checkpoint is not None:
            g.drop(*node.saved)
            node.saved = ()
        res: list[T | None] = []
        for x, pr in zip((a, b), prods, strict=True):
            if pr is not None and x.dt != odt:
                assert x.n.key() == n_out.key(), "a broadcast input that needs a cast"
                c = g.alloc(n_out, x.dt, f"{label} grad cast")
                g.drop(pr)
                pr = c
            res.append(pr)
        return res

    g.record(label, [a, b], [out], [b if a.rg else None, a if b.rg else None], bwd)
    recorded.extend(g.nodes[n_nodes:n_nodes + 1])
    return out


# -- peft ParamWrapper: LoRA on nn.Parameters (mixtral's router and 3-D experts) -------------------
# peft 0.21 (tuners/lora/layer.py ``ParamWrapper``) adapts a parameter by registering a
# ``torch.nn.utils.parametrize`` parametrization for the wrapped module's forward, inside
# ``parametrize.cached()``: registering it evaluates the parametrization once as a check (a
# transient of the parameter's size, unsafe=False), and the first access in the forward computes the
# merged weight again, which the consuming op saves. The wrapper removes the parametrization when its
# forward returns (the cache goes when the outermost ``cached()`` exits).
def lora_param_delta(g: Graph, ctx: Ctx, w: T, a_w: T, b_w: T, rank: int, label: str) -> T:
    """``ParamWrapper.get_delta_weight`` of a 2-D parameter (peft's ``Linear.get_delta_weight``):
    ``(lora_B @ lora_A) * scaling`` (on CPU, 16-bit adapters are first cast to fp32 with ``.float()``
    and the product back), then ``.to(w.dtype)``. Under autocast the ``mm`` casts both adapters (leaf
    parameters: cached). Returns the delta (held by peft's ``_LoraParameterProxy``)."""
    in_f = int(a_w.n.c0) // rank  # lora_A is (r, in)
    up = not ctx.cuda and a_w.dt == F16
    if up:
        a, b = cast(g, a_w, F32, f"{label} lora_A.float()"), cast(g, b_w, F32, f"{label} lora_B.float()")
    elif ctx.autocast is not None:  # autocast casts mm's arguments right to left: lora_A, then lora_B
        a, b = autocast_weight(g, ctx, a_w), autocast_weight(g, ctx, b_w)
    else:
        a, b = g.hold(a_w), g.hold(b_w)
    prod = linear(g, ctx, b, a, rank, in_f, None, f"{label} lora_B @ lora_A")  # (out, r) @ (r, in)
    sc = scalar_op(g, prod, f"{label} delta * scaling")
    g.drop(prod)
    if up:
        back = cast(g, sc, a_w.dt, f"{label} delta to adapter dtype")
        g.drop(sc)
        sc = back
    g.drop(a, b)
    delta = cast(g, sc, w.dt, f"{label} delta to weight dtype")
    g.drop(sc)
    return delta


def lora_param_merge(g: Graph, w: T, delta: T, label: str) -> T:
    """peft's ``_LoraParameterProxy``: the registration check ``W + delta`` (a transient), then the
    cached ``W + delta`` the forward uses (the frozen ``W`` gets no gradient)."""
    check = g.alloc(_bigger(w, delta), _promote(w, delta), f"{label} parametrization check")
    g.drop(check)
    return add(g, w, delta, f"{label} W + delta")


def lora_expert_factors(g: Graph, w: T, a_w: T, b_w: T, label: str) -> tuple[T, T]:
    """``ParamWrapper.get_delta_factors`` of a 3-D expert parameter stored (E, out, in): ``lhs`` is
    ``lora_B.reshape(out, r, E).permute(2, 0, 1)`` and ``rhs`` ``lora_A.reshape(E, r, in)`` (views),
    each ``.to(w.dtype)`` (a copy when the adapters are fp32 on a 16-bit base). In backward the
    permuted gradient of ``lora_B`` is made contiguous by the reshape (a clone)."""
    lv = heads_view(g, b_w, f"{label} lora_B reshape.permute", clone_grad=True)
    lhs = cast(g, lv, w.dt, f"{label} lhs.to(weight dtype)")
    g.drop(lv)
    rhs = cast(g, a_w, w.dt, f"{label} rhs.to(weight dtype)")
    return lhs, rhs


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
