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


def autocast_weight(g: Graph, ctx: Ctx, w: T) -> T:
    """Autocast's 16-bit copy of a parameter: made at first use and cached for the autocast region
    (at::autocast::cached_cast caches leaf tensors that require grad); frozen weights are cast at
    every use, uncached."""
    assert ctx.autocast is not None
    if w.dt == ctx.autocast:
        return g.hold(w)
    if w.rg:
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
           label: str = "linear", grad_w_first: bool | None = None) -> T:
    """``F.linear(x, w, b)`` on (tokens, in) activations: ``mm``/``addmm`` (cuBLAS/MKL) output of
    (tokens, out). Saves x if the weight needs a gradient and the weight if x does; under autocast
    the saved copies are the 16-bit casts."""
    if ctx.autocast is None:
        xc = g.hold(x)
        wc: T = g.hold(w)
        bc = g.hold(b) if b is not None else None
    else:  # autocast casts the weight (cached) and bias before the input
        wc = autocast_weight(g, ctx, w)
        bc = autocast_weight(g, ctx, b) if b is not None else None
        xc = cast(g, x, ctx.autocast, f"{label} input cast")
    ins = [xc, wc] + ([bc] if bc is not None else [])
    saved = [wc if xc.rg else None, xc if wc.rg else None]  # released weight first, then input
    g.before_outputs(ins, saved)
    (out,) = g.sac_outputs(lambda: (g.alloc(xc.n * (out_features / in_features), xc.dt, label),))
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
def bmm(g: Graph, ctx: Ctx, a: T, b: T, out_n: Sz, label: str = "bmm") -> T:
    """``torch.matmul`` of two (batched) matrices (``bmm`` after reshapes); autocast casts both to
    16 bit. Saves b if a needs a gradient and a if b does."""
    (out,) = g.sac_outputs(lambda: (g.alloc(out_n, a.dt, label),))

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
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
