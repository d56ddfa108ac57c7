"""View, copy, split and concatenation ops: which are views (no allocation) and what their backward
allocates.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tape import Graph, Sz, T
from .core import I64, Ctx, cast


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


def repeat_kv(g: Graph, x: T, n_rep: int, label: str, kv_heads: int = 0) -> T:
    """HF ``repeat_kv``: ``hidden_states[:, :, None].expand(...)`` then ``reshape`` (a copy n_rep times
    larger; a view when there is one kv head, `kv_heads` == 1: ``reshape`` then merges a size-1 dim
    with the expanded one); its backward sums the repeats back (one kv-sized gradient)."""
    if n_rep == 1:
        return g.hold(x)
    out = g.view(x, label, n=x.n * n_rep) if kv_heads == 1 else g.alloc(x.n * n_rep, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward sum")]

    g.record(label, [x], [out], [], bwd)
    return out


def split(g: Graph, x: T, parts: Sequence[float], label: str = "split", sizes: Sequence[Sz] | None = None) -> list[T]:
    """``x.split(...)`` along the last dim: views (fractions `parts` of x, or exactly `sizes`
    elements each); backward (``split_with_sizes_backward``) concatenates the parts' gradients into
    one x-sized tensor (missing ones are zero-filled first)."""
    ns = list(sizes) if sizes is not None else [x.n * f for f in parts]
    views = [g.view(x, f"{label} part", n=n) for n in ns]

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        zeros = [g.alloc(n, x.dt, f"{label} zeros") for n, gr in zip(ns, go, strict=True) if gr is None]
        out = g.alloc(x.n, x.dt, f"{label} backward cat")
        g.drop(*zeros)
        return [out]

    g.record(label, [x], views, [], bwd)
    return views


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


def index_pairs(g: Graph, x: T, rows: T, cols: T, out_n: Sz, label: str = "index") -> T:
    """``x[rows, cols]`` with two int64 index tensors (advanced indexing on the first two dims): a new
    tensor; saves both indices; backward as `index_rows` (zeros the size of x, then index_put)."""
    g.before_outputs([x, rows, cols], [rows, cols])
    out = g.alloc(out_n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        zeros = g.alloc(x.n, x.dt, f"{label} backward zeros")
        res = g.alloc(x.n, x.dt, f"{label} backward index_put")
        g.drop(zeros)
        return [res, None, None]

    g.record(label, [x, rows, cols], [out], [rows, cols], bwd)
    return out


# -- ops added for deepseek_v3 (multi-head latent attention) -------------------------------------------
def expand_view(g: Graph, x: T, n: Sz, label: str = "expand") -> T:
    """``x.expand(...)``: a view `n` elements big; backward ``sum_to`` x's shape (one x-sized tensor)."""
    v = g.view(x, label, n=n)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, go[0].dt if go[0] is not None else x.dt, f"{label} backward sum_to")]

    g.record(label, [x], [v], [], bwd)
    return v


def copy_into_new(g: Graph, parts: Sequence[T], dt: int, label: str = "new_empty + copy_") -> T:
    """``out = t.new_empty(...)`` then ``out[..., a:b].copy_(part)`` for each part in turn (DeepSeek's
    ``expand_kv``): one allocation in `dt`; each copy is a ``CopySlices`` node. Its backward
    (torch/csrc/autograd/functions/tensor.cpp ``CopySlices::apply``) copies the whole incoming gradient
    into a new tensor, hands ``CopyBackwards`` a contiguous clone of the slice, which gives the
    overwritten base ``zeros_like`` of the slice (only when the base needs a gradient: not the first
    copy, whose base is the fresh tensor) and the source the clone, cast to its dtype (a new tensor, the
    clone then freed) when it differs; the base's gradient is the whole copy, the zeros die on return."""
    n = parts[0].n
    for x in parts[1:]:
        n = n + x.n
    base = g.alloc(n, dt, label)
    cur = base
    for i, src in enumerate(parts):
        nxt = g.view(base, f"{label} [{i}]")
        first = i == 0

        def bwd(g: Graph, go: Sequence[T | None], src: T = src, first: bool = first) -> list[T | None]:
            (grad,) = go
            assert grad is not None
            result = g.alloc(n, grad.dt, f"{label} CopySlices result")
            sl = g.alloc(src.n, grad.dt, f"{label} grad slice clone")
            zeros = None if first else g.alloc(src.n, grad.dt, f"{label} CopyBackwards zeros_like")
            gs = sl
            if src.dt != grad.dt:
                gs = g.alloc(src.n, src.dt, f"{label} CopyBackwards grad.to(src)")
                g.drop(sl)
            g.drop(zeros)
            if first:
                g.drop(result)
                return [gs]
            return [result, gs]

        ins = [src] if first else [cur, src]
        g.record(f"{label} copy_ [{i}]", ins, [nxt], [], bwd)
        if not first:
            g.drop(cur)
        cur = nxt
    g.drop(base)  # the views keep it
    return cur
