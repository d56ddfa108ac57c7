"""Element-wise and reduction ops: what each saves for backward and allocates in it
(``tools/autograd/derivatives.yaml``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tape import Graph, Sz, T
from .core import BOOL, F32, Ctx, _bigger, _promote, cast


# -- element-wise -------------------------------------------------------------------------------
def mul(g: Graph, a: T, b: T, label: str = "mul", cast_each: bool = False) -> T:
    """``a * b`` (broadcasting). Saves b if a needs a gradient and a if b does; backward computes
    both full-size gradients in the promoted dtype; the engine then reduces broadcast ones and casts
    them to their input's dtype, input by input (``validate_outputs``: both products exist before the
    first cast, as a bf16 x fp32 multiply's backward shows under a dispatch log).

    `cast_each` casts each product right after it is computed instead (the order gpt2's CUDA
    ``gelu_new``, unmeasured, keeps until its fingerprints are re-recorded)."""
    out = g.alloc(_bigger(a, b), _promote(a, b), label)
    n_out = out.n

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None

        def one(x: T, other: T, name: str) -> T:
            # mul_tensor_backward: grad * other in the promoted dtype (`Graph.backward` casts it to x's)
            prod_dt = max(grad.dt, other.dt)
            prod = g.alloc(n_out, prod_dt, f"{label} grad {name}")
            if prod_dt == x.dt or not cast_each:
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


def softmax(g: Graph, x: T, dt: int | None = None, label: str = "softmax") -> T:
    """``softmax(x, dim=-1, dtype=dt)``: an input in another dtype is first cast (a temporary);
    saves its output (and its input where `Graph.softmax_saves_input`); backward allocates one gradient
    (then casts it back if the input was cast)."""
    src = cast(g, x, dt, f"{label} input cast") if dt is not None else g.hold(x)
    out = g.alloc(src.n, src.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(src.n, src.dt, f"{label} backward")]

    g.record(label, [src], [out], [out, src] if g.softmax_saves_input else [out], bwd)
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
    out = mul(g, half, u, f"{label} mul", cast_each=True)
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


def mul_both_grads(g: Graph, a: T, b: T, label: str = "mul") -> T:
    """``a * b`` where both inputs need gradients and dtypes or shapes differ (routing weights times
    expert outputs). ``MulBackward0`` computes both products in the promoted dtype; then the engine's
    ``validate_outputs`` (torch/csrc/autograd/engine.cpp) fixes each input's gradient in turn: a cast
    to the input's dtype, or a reduction to its shape (done by `Graph.backward`). That runs after the
    node's apply returned, so under checkpointing the recomputed saved tensors, which die with the
    apply, are gone before the casts. A broadcast input that needs a cast (Qwen3-MoE's 16-bit routing
    weights) gets its product as it is: `Graph.backward` reduces it, then casts it."""
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
            if pr is not None and x.dt != odt and x.n.key() == n_out.key():
                c = g.alloc(n_out, x.dt, f"{label} grad cast")
                g.drop(pr)
                pr = c
            res.append(pr)
        return res

    g.record(label, [a, b], [out], [b if a.rg else None, a if b.rg else None], bwd)
    recorded.extend(g.nodes[n_nodes:n_nodes + 1])
    return out


# -- ops added for gpt_oss (sinks attention, clamped SwiGLU experts) ---------------------------------
def sub(g: Graph, a: T, b: T, label: str = "sub") -> T:
    """``a - b`` (broadcasting): saves nothing; backward passes the gradient to ``a`` and allocates
    ``-grad`` for ``b`` (derivatives.yaml ``sub.Tensor``: ``maybe_multiply(-grad, alpha)``), which the
    engine then reduces to b's shape when b was broadcast."""
    out = g.alloc(_bigger(a, b), _promote(a, b), label)
    odt = out.dt

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        ga = (g.hold(grad) if a.dt == odt else g.alloc(grad.n, a.dt, f"{label} grad cast")) if a.rg else None
        gb = None
        if b.rg:
            gb = g.alloc(grad.n, grad.dt, f"{label} -grad")
            if b.dt != odt:
                c = g.alloc(grad.n, b.dt, f"{label} grad cast")
                g.drop(gb)
                gb = c
        return [ga, gb]

    g.record(label, [a, b], [out], [], bwd)
    return out


def clamp(g: Graph, x: T, both: bool, label: str = "clamp") -> T:
    """``x.clamp(max=c)`` (or ``clamp(min=-c, max=c)`` with `both`): saves its input; backward
    ``clamp_backward`` is ``where(mask, grad, zero)``: a 0-d zero, the boolean mask (``self <= max``;
    with both bounds ``(self >= min).logical_and_(self <= max)``, whose second comparison is a temporary
    of the same expression), then the gradient (FunctionsManual.cpp)."""
    out = g.alloc(x.n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        zero = g.alloc(Sz(c0=1), grad.dt, f"{label} backward zero")
        m1 = g.alloc(x.n, BOOL, f"{label} backward mask")
        m2 = g.alloc(x.n, BOOL, f"{label} backward mask <= max") if both else None
        gx = g.alloc(x.n, grad.dt, f"{label} backward where")
        g.drop(m2, m1, zero)  # temporaries of the one full expression
        return [gx]

    g.record(label, [x], [out], [x], bwd)
    return out


def add_(g: Graph, a: T, b: T, label: str = "add_") -> T:
    """``a.add_(b)`` of same-shape, same-dtype tensors: in place (the result is a's storage); saves
    nothing; the gradient passes to both unchanged."""
    out = g.view(a, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        (grad,) = go
        assert grad is not None
        return [g.hold(grad) if a.rg else None, g.hold(grad) if b.rg else None]

    g.record(label, [a, b], [out], [], bwd)
    g.drop(a)  # the result is the same tensor: it replaces the caller's reference
    return out


def mul_reduce_cast(g: Graph, a: T, b: T, label: str = "mul") -> T:
    """``a * b`` where either input may be broadcast and need a cast back: ``MulBackward0`` computes
    both products full-size in the promoted dtype (a's first), then the engine's ``validate_outputs``
    fixes each input's gradient in turn: a broadcast one is reduced to its shape (``sum_to``, in the
    product's dtype) and only then cast to the input's dtype (torch/csrc/autograd/engine.cpp). That
    runs after the node's apply, so a checkpointed node's recomputed saved tensors are gone first."""
    out = g.alloc(_bigger(a, b), _promote(a, b), label)
    n_out, odt = out.n, out.dt
    n_nodes = len(g.nodes)
    recorded: list = []

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        prods = [g.alloc(n_out, odt, f"{label} grad {name}") if x.rg else None for name, x in (("a", a), ("b", b))]
        node = recorded[0] if recorded else None
        if node is not None and node.checkpoint is not None:
            g.drop(*node.saved)
            node.saved = ()
        res: list[T | None] = []
        for x, pr in zip((a, b), prods, strict=True):
            if pr is not None and x.n.key() < n_out.key():
                r = g.alloc(x.n, odt, f"{label} grad sum_to")
                g.drop(pr)
                pr = r
            if pr is not None and x.dt != odt:
                c = g.alloc(x.n, x.dt, f"{label} grad cast")
                g.drop(pr)
                pr = c
            res.append(pr)
        return res

    g.record(label, [a, b], [out], [b if a.rg else None, a if b.rg else None], bwd)
    recorded.extend(g.nodes[n_nodes:n_nodes + 1])
    return out
