"""fp8 matmuls as torchao's Float8 training runs them in eager mode (``torchao.float8``, 0.18).

``convert_to_float8_training`` swaps a block's ``nn.Linear`` for ``Float8Linear``, whose autograd function
(``matmul_with_hp_or_float8_args``) saves the *high-precision* input and weight, as ``nn.Linear`` does, and
casts each operand to fp8 right before each of the three matmuls (forward, grad input, grad weight): six
casts per linear, each a chain of full-size temporaries (``float8_scaling_utils.hp_tensor_to_float8_dynamic``:
``abs`` and ``max``/``amax`` for the scale, then an fp32 copy, its product with the scale, a clamp and the fp8
copy). ``_scaled_mm`` wants its second operand column-major and its first row-major
(``float8_ops.preprocess_addmm``): in backward both operands of the weight-gradient matmul and the weight of
the input-gradient one are copied. With rowwise scaling, the matmuls that run without fast accumulation
(both in backward) apply the scales afterwards: an fp32 outer product of them, as large as the output
(``addmm_float8_unwrapped``). Nothing fp8 outlives its linear: the memory saved for backward is a bf16
step's; what fp8 adds in eager mode is these transients. (Under ``torch.compile`` Inductor fuses the casts;
not modelled.)
"""

from __future__ import annotations

from collections.abc import Sequence

from ...device import CUDA_BLOCK_BYTES
from ..tape import Graph, Sz, T, const
from .core import F32, Ctx
from .elementwise import add

__all__ = ["fp8_cast", "fp8_linear"]

F64, FP8 = 8, 1


def fp8_cast(g: Graph, n: Sz, dt: int, scale_n: Sz, rowwise: bool, label: str,
             all_reduced: bool = False) -> tuple[T, T]:
    """``hp_tensor_to_float8_dynamic`` of an `n`-element tensor of `dt`: the fp8 data and its scale
    (`scale_n` elements: one, or one per row or column), after the temporaries that make them. With
    `all_reduced` (``reduce_amax=True``: a weight shard before FSDP's float8 all-gather) the amax is
    all-reduced over the ranks into a new tensor."""
    # tensor_to_amax: abs then max (tensorwise) or amax along the scaled dim (rowwise)
    a = g.alloc(n, dt, f"{label} abs")
    amax = g.alloc(scale_n, dt, f"{label} amax")
    g.drop(a)
    if all_reduced:  # functional all_reduce: a new tensor, the local amax goes
        reduced = g.alloc(scale_n, dt, f"{label} amax all-reduced")
        g.drop(amax)
        amax = reduced
    # amax_to_scale: float64 upcast, clamp, fp8 max / it (reciprocal, mul), back to float32
    if g.merge_scalar_chains and not rowwise:
        # the folded program (peak bytes, not the allocator's replay): one scalar's four float64 temporaries as
        # one event of their four blocks, the most of them alive at once, then the scale; the same highest point
        # and the same bytes after, in 5 events instead of 11
        chain = g.alloc(const(4 * CUDA_BLOCK_BYTES), 1, f"{label} scale float64 temporaries")
        g.drop(chain)
        scale = g.alloc(scale_n, F32, f"{label} scale")
        g.drop(amax)
        return _to_fp8(g, n, dt, label), scale
    up = g.alloc(scale_n, F64, f"{label} amax float64")
    cl = g.alloc(scale_n, F64, f"{label} clamp")
    rc = g.alloc(scale_n, F64, f"{label} reciprocal")
    mu = g.alloc(scale_n, F64, f"{label} scale float64")
    g.drop(rc, cl)
    scale = g.alloc(scale_n, F32, f"{label} scale")
    g.drop(mu)
    if rowwise:  # round_scales_to_power_of_2: exp2(floor(log2(scale)))
        lg = g.alloc(scale_n, F32, f"{label} log2")
        fl = g.alloc(scale_n, F32, f"{label} floor")
        g.drop(lg)
        p2 = g.alloc(scale_n, F32, f"{label} exp2")
        g.drop(fl, scale)
        scale = p2
    g.drop(up, amax)
    return _to_fp8(g, n, dt, label), scale


def _to_fp8(g: Graph, n: Sz, dt: int, label: str) -> T:
    """hp_tensor_and_scale_to_float8: ``x.to(float32) * scale``, clamped to the fp8 range, then to fp8."""
    if g.merge_scalar_chains and dt != F32:
        # the folded program: the fp32 copy is freed right before the clamp's fp32 output of its size is
        # allocated, so one tensor stands for both (the same bytes at every point but that free and alloc)
        both = g.alloc(n, F32, f"{label} to float32, clamp")
        scaled = g.alloc(n, F32, f"{label} scaled")
        data = g.alloc(n, FP8, f"{label} fp8")
        g.drop(both, scaled)
        return data
    up32 = g.alloc(n, F32, f"{label} to float32") if dt != F32 else None
    scaled = g.alloc(n, F32, f"{label} scaled")
    g.drop(up32)
    clamped = g.alloc(n, F32, f"{label} clamp")
    data = g.alloc(n, FP8, f"{label} fp8")
    g.drop(clamped, scaled)
    return data


def _scaled_mm(g: Graph, out_n: Sz, dt: int, a_scale_n: Sz, b_scale_n: Sz, post_scaled: bool,
               copies: Sequence[Sz], label: str) -> T:
    """``float8_mm``: the layout copies `copies` (fp8), the scales' reciprocals, with rowwise scales and no
    fast accumulation their fp32 outer product (applied in place after the matmul), then the output."""
    made = [g.alloc(n, FP8, f"{label} contiguous") for n in copies]
    if g.merge_scalar_chains and not post_scaled and a_scale_n == b_scale_n == const(1):
        # the folded program: the two scalar reciprocals as one event of their two blocks (`fp8_cast`)
        both = g.alloc(const(2 * CUDA_BLOCK_BYTES), 1, f"{label} 1/scales")
        out = g.alloc(out_n, dt, label)
        g.drop(both, *made)
        return out
    ra = g.alloc(a_scale_n, F32, f"{label} 1/scale a")
    rb = g.alloc(b_scale_n, F32, f"{label} 1/scale b")
    if post_scaled:
        post = g.alloc(out_n, F32, f"{label} scale outer product")
        one_a = g.alloc(const(1), F32, f"{label} ones")
        g.drop(ra)
        one_b = g.alloc(const(1), F32, f"{label} ones")
        g.drop(rb)
        out = g.alloc(out_n, dt, label)
        g.drop(one_a, one_b, post)
    else:
        out = g.alloc(out_n, dt, label)
        g.drop(ra, rb)
    g.drop(*made)
    return out


def fp8_linear(g: Graph, ctx: Ctx, x: T, w: T, in_features: int, out_features: int, b: T | None,
               label: str) -> T:
    """``Float8Linear(x)``: `x` is (tokens, in) in the weight's 16-bit dtype, `w` the (out, in) weight; the
    output (tokens, out) is in x's dtype, plus the bias in a separate add. Saves x and w (high precision)."""
    rowwise = ctx.fp8 == "rowwise"
    dt = x.dt
    tokens = x.n * (1.0 / in_features)
    out_n = x.n * (out_features / in_features)
    w_n = const(in_features * out_features)
    one = const(1)

    def rows(n: Sz) -> Sz:
        return n if rowwise else one

    xc, wc = g.hold(x), g.hold(w)
    # a weight FSDP all-gathered in fp8 is already cast (``tensor_already_casted_to_fp8``): the autograd
    # function saves it as it came, a view holding the gather's scale
    gathered = w.fp8_scale
    saved_w = g.view(gathered, f"{label} fp8 weight") if gathered is not None else wc
    g.before_outputs([xc, wc], [xc, wc])
    # forward: input scaled per row (dim -1), weight (in, out) per output column (dim 0)
    x8, xs = fp8_cast(g, x.n, dt, rows(tokens), rowwise, f"{label} input")
    w8, ws = (None, None) if gathered is not None else fp8_cast(g, w_n, w.dt, rows(const(out_features)), rowwise,
                                                                   f"{label} weight")
    out = _scaled_mm(g, out_n, dt, rows(tokens), rows(const(out_features)), False, (), label)
    g.drop(w8, ws, x8, xs)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        # grad_input = grad_output @ weight: grad_output per row, the weight (in, out) per row (dim -1);
        # the weight's transpose is row-major, so _scaled_mm gets a column-major copy
        go8, gos = fp8_cast(g, out_n, dt, rows(tokens), rowwise, f"{label} grad output")
        wt8, wts = (None, None) if gathered is not None else fp8_cast(g, w_n, w.dt, rows(const(in_features)), rowwise,
                                                                       f"{label} weight (grad input)")
        gx = _scaled_mm(g, x.n, dt, rows(tokens), rows(const(in_features)), rowwise, (w_n,), f"{label} grad x")
        # grad_weight = grad_output.t() @ input: both scaled per column (dim 0), both copied to the layouts
        go8w, gosw = fp8_cast(g, out_n, dt, rows(const(out_features)), rowwise, f"{label} grad output (grad weight)")
        x8w, xsw = fp8_cast(g, x.n, dt, rows(const(in_features)), rowwise, f"{label} input (grad weight)")
        gw = _scaled_mm(g, w_n, w.dt, rows(const(out_features)), rows(const(in_features)), rowwise, (out_n, x.n),
                        f"{label} grad w")
        g.drop(go8, gos, wt8, wts, go8w, gosw, x8w, xsw)
        res: list[T | None] = [gx, gw]
        for i, t in enumerate((xc, wc)):  # the function returns both; autograd drops what nothing needs
            if not t.rg:
                g.drop(res[i])
                res[i] = None
        return res

    g.record(label, [xc, wc], [out], [xc, saved_w], bwd)
    g.drop(xc, wc)
    if saved_w is not wc:
        g.drop(saved_w)
    if b is None:
        return out
    res = add(g, out, b, f"{label} bias")  # ``output + self.bias.to(output.dtype)``
    g.drop(out)
    return res
