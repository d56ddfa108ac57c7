"""peft's LoRA forward paths on symbolic tensors: adapters after a base linear, on ``addmm`` and on
parameters (the MoE router and experts' ``ParamWrapper``).
"""

from __future__ import annotations

from ..tape import Graph, T
from .core import F16, F32, Ctx, _bigger, _promote, autocast_weight, cast
from .elementwise import add, dropout, scalar_op
from .linear import addmm, linear, linear_4bit
from .shape import clone, heads_view


# -- fine-tuning adapters -----------------------------------------------------------------------
def lora_linear(g: Graph, ctx: Ctx, x: T, w: T, b: T | None, a_w: T, b_w: T, in_features: int, out_features: int,
                rank: int, dropout_p: float, label: str, cache_input: bool = False) -> T:
    """peft ``lora.Linear.forward``: ``result = base(x)``; ``x`` cast to the adapter dtype (fp32 by
    default); ``result = result + lora_B(lora_A(dropout(x))) * scaling``; cast back to the base
    result's dtype (peft/tuners/lora/layer.py). `cache_input`: x is a leaf autocast caches the cast of
    (`linear`). On a bitsandbytes 4-bit base (QLoRA) peft's own layer runs: `lora_linear_4bit`."""
    if w.nf4:
        return lora_linear_4bit(g, ctx, x, w, b, a_w, b_w, in_features, out_features, rank, dropout_p, label)
    result = linear(g, ctx, x, w, in_features, out_features, b, f"{label}.base_layer", cache_input=cache_input)
    return lora_update(g, ctx, x, result, a_w, b_w, in_features, out_features, rank, dropout_p, label,
                       cache_input=cache_input)


def lora_linear_4bit(g: Graph, ctx: Ctx, x: T, w: T, b: T | None, a_w: T, b_w: T, in_features: int,
                     out_features: int, rank: int, dropout_p: float, label: str) -> T:
    """peft's ``lora.bnb.Linear4bit.forward`` (peft/tuners/lora/bnb.py, 0.21.2), not ``lora.Linear``'s:
    the 4-bit base, then ``result = result.clone()`` (a copy "as per Tim Dettmers", for backward
    through a manipulated view); unless autocast is on, x goes to the adapter's dtype and the
    adapter's output back to the result's dtype *before* the add (``lora.Linear`` adds, promoting,
    and casts the sum). ``torch.is_autocast_enabled()`` without a device asks about CUDA's autocast,
    so in a CPU autocast region peft still converts. Traced on CPU with bitsandbytes 0.50.2 (a
    dispatch log of the layer's forward: gemm_4bit, clone, the input cast, lora_A, lora_B, mul, the
    output cast, add)."""
    base = linear_4bit(g, x, w, in_features, out_features, b, f"{label}.base_layer")
    result = clone(g, base, f"{label} result.clone()")
    g.drop(base)
    convert = not (ctx.cuda and ctx.autocast is not None)
    xa = cast(g, x, a_w.dt, f"{label} lora input cast") if convert else g.hold(x)
    d = dropout(g, ctx, xa, dropout_p, f"{label}.lora_dropout")
    a = linear(g, ctx, d, a_w, in_features, rank, None, f"{label}.lora_A")
    bb = linear(g, ctx, a, b_w, rank, out_features, None, f"{label}.lora_B")
    g.drop(a, d)
    sc = scalar_op(g, bb, f"{label} * scaling")
    g.drop(bb)
    out = cast(g, sc, result.dt, f"{label} output to result dtype") if convert else g.hold(sc)
    g.drop(sc)
    total = add(g, result, out, f"{label} + lora")
    g.drop(result, out, xa)
    return total


def lora_update(g: Graph, ctx: Ctx, x: T, result: T, a_w: T, b_w: T, in_features: int, out_features: int,
                rank: int, dropout_p: float, label: str, reshape_grad: bool | None = None,
                cache_input: bool = False) -> T:
    """What peft's ``lora.Linear.forward`` adds to its base layer's `result` (the caller's, which this
    takes over): ``x`` cast to the adapter dtype, ``lora_B(lora_A(dropout(x))) * scaling`` added, the
    sum cast back to the result's dtype. With `reshape_grad` not None, ``lora_B``'s output is viewed as
    heads like the base output (`linear_strided_grad`), copying its gradient when True."""
    result_dt = result.dt
    xa = cast(g, x, a_w.dt, f"{label} lora input cast")
    d = dropout(g, ctx, xa, dropout_p, f"{label}.lora_dropout")
    # the adapter sees x itself (the same leaf) when neither the dtype cast nor dropout made a copy
    a = linear(g, ctx, d, a_w, in_features, rank, None, f"{label}.lora_A", cache_input=cache_input and d is x)
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


def lora_addmm(g: Graph, ctx: Ctx, x: T, w: T, b: T, a_w: T, b_w: T, in_features: int, out_features: int,
               rank: int, dropout_p: float, label: str) -> T:
    """peft ``lora.Linear`` around a transformers ``Conv1D`` (``fan_in_fan_out``): `lora_linear` with
    the base layer's ``addmm`` (peft/tuners/lora/layer.py). Under QLoRA transformers has made the
    ``Conv1D`` a bitsandbytes ``Linear4bit`` (its weight transposed before quantizing), so peft wraps
    that: `lora_linear_4bit`."""
    if w.nf4:
        return lora_linear_4bit(g, ctx, x, w, b, a_w, b_w, in_features, out_features, rank, dropout_p, label)
    result = addmm(g, ctx, x, w, b, in_features, out_features, f"{label}.base_layer")
    return lora_update(g, ctx, x, result, a_w, b_w, in_features, out_features, rank, dropout_p, label)


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


def lora_param_merge(g: Graph, w: T, delta: T, label: str, checked: bool = False) -> T:
    """peft's ``_LoraParameterProxy``: the registration check ``W + delta`` (a transient; `checked`: it ran
    already, `lora_param_check`), then the cached ``W + delta`` the forward uses (the frozen ``W`` gets no
    gradient)."""
    if not checked:
        lora_param_check(g, w, delta, label)
    return add(g, w, delta, f"{label} W + delta")


def lora_param_check(g: Graph, w: T, delta: T, label: str) -> None:
    """The parametrization's registration check ``W + delta``: computed and dropped when peft registers it
    (on the wrapper's entry), before the module's forward reads the weight."""
    check = g.alloc(_bigger(w, delta), _promote(w, delta), f"{label} parametrization check")
    g.drop(check)


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
    if w.nf4:  # peft's 4-bit layer (`lora_linear_4bit`); the model's view of its output copies the gradient
        y = lora_linear_4bit(g, ctx, x, w, b, a_w, b_w, in_features, out_features, rank, dropout_p, label)
        out = heads_view(g, y, f"{label} output reshape", clone_grad=strided)
        g.drop(y)
        return out
    r0 = linear(g, ctx, x, w, in_features, out_features, b, f"{label}.base_layer")
    result = heads_view(g, r0, f"{label}.base_layer output reshape", clone_grad=strided)
    g.drop(r0)
    return lora_update(g, ctx, x, result, a_w, b_w, in_features, out_features, rank, dropout_p, label,
                       reshape_grad=strided)
