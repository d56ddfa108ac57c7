"""Rotary position embeddings: the cos/sin a rotary module computes once per forward.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import F32, Ctx
from ..engine.tape import Graph, T, per_seq


def rotary_cos_sin(g: Graph, rotary_dims: int, x_dt: int, cat: bool = True, to_dtype: bool = True) -> tuple[T, T]:
    """A rotary embedding module's forward (LlamaRotaryEmbedding, GPTNeoXRotaryEmbedding):
    ``position_ids[..., None].float() * inv_freq``, ``cat``, ``cos``/``sin`` times ``attention_scaling``
    (fp32, (1, s, rotary_dims)), cast to the hidden states' dtype on return (a no-op under autocast,
    whose hidden states are fp32; not at all without `to_dtype`: Olmo2RotaryEmbedding returns fp32);
    the fp32 locals die when the function returns. Without `cat` (GptOssRotaryEmbedding: ``emb =
    freqs``) cos and sin are half as wide and nothing is concatenated."""
    d = rotary_dims
    pos_f = g.alloc(per_seq(1), F32, "position_ids float")
    freqs = g.alloc(per_seq(d / 2), F32, "freqs")
    g.drop(pos_f)
    if not cat:
        d //= 2
    emb = g.alloc(per_seq(d), F32, "emb cat") if cat else g.hold(freqs)
    full = []
    for name in ("cos", "sin"):
        raw = g.alloc(per_seq(d), F32, name)
        scaled = g.alloc(per_seq(d), F32, f"{name} * attention_scaling")
        g.drop(raw)
        full.append(scaled)
    cast_dt = x_dt if to_dtype else F32
    out = [ops.cast(g, full[0], cast_dt, "cos to dtype"), ops.cast(g, full[1], cast_dt, "sin to dtype")]
    g.drop(freqs, emb, full[0], full[1])
    return out[0], out[1]


def apply_rotary(g: Graph, x: T, cos: T, sin: T, name: str) -> T:
    """Llama's ``apply_rotary_pos_emb`` on one of q, k: ``(x * cos) + (rotate_half(x) * sin)``, element-wise
    in the projections' (b, s, heads, d) layout."""
    a = ops.mul(g, x, cos, f"{name} * cos")
    rh = ops.rotate_half(g, x, 1.0, f"{name} rotate_half")
    b = ops.mul(g, rh, sin, f"{name} rotate_half * sin")
    g.drop(rh)
    out = ops.add(g, a, b, f"{name} rotary add")
    g.drop(a, b)
    return out


def apply_rotary_pair(g: Graph, q: T, k: T, cos: T, sin: T, cast_back: bool = False) -> tuple[T, T]:
    """Llama's ``apply_rotary_pos_emb(q, k, cos, sin)``: `apply_rotary` on q, then on k; with
    `cast_back` (OLMo 2) ``return q_embed.to(q_type), k_embed.to(k_type)`` (copies when fp32 cos/sin
    promoted them; the promoted results die when the function returns)."""
    qe, ke = apply_rotary(g, q, cos, sin, "q"), apply_rotary(g, k, cos, sin, "k")
    if not cast_back:
        return qe, ke
    qc, kc = ops.cast(g, qe, q.dt, "q_embed.to(q_type)"), ops.cast(g, ke, k.dt, "k_embed.to(k_type)")
    g.drop(qe, ke)
    return qc, kc


def apply_rotary_partial(g: Graph, ctx: Ctx, q: T, k: T, cos: T, sin: T, frac: float,
                         cat_each: bool, keep: list[T] | None = None) -> tuple[T, T]:
    """``apply_rotary_pos_emb`` of the families that rotate part of each head and concatenate (Phi-3,
    GPT-NeoX): ``q_rot, q_pass = q[..., :rot], q[..., rot:]`` (a full slice is ``alias(q)``: Python
    indexing returns an alias when nothing is cut), the same for k, then ``(x_rot * cos) +
    (rotate_half(x_rot) * sin)`` concatenated with the pass-through part (`trainmem_nb.engine.ops.cat_last`:
    under CPU autocast the 16-bit pass-through part is promoted to the fp32 rotary part's dtype first).
    The results are contiguous (b, heads, s, d) tensors. Phi-3 concatenates each right after rotating
    it (`cat_each`: one expression per tensor); GPT-NeoX rotates both, then concatenates both. `frac` is
    the rotary share of each head. With `keep` (Phi: ``query_rot, key_rot = apply_rotary_pos_emb(...)``
    binds the rotated parts, like ``query_pass, key_pass``, to locals until the attention returns) the
    rotated and pass-through parts are appended to it instead of freed."""
    parts = []
    for name, x in (("q", q), ("k", k)):
        rot = ops.alias_view(g, x, f"{name}_rot") if frac == 1.0 else ops.slice_view(g, x, x.n * frac, f"{name}_rot")
        parts.append((name, rot, ops.slice_view(g, x, x.n * (1.0 - frac), f"{name}_pass")))
    out = []
    if cat_each:
        for name, rot, pas in parts:
            c = apply_rotary(g, rot, cos, sin, name)
            out.append(ops.cat_last(g, ctx, [c, pas], f"{name} cat rot, pass"))
            g.drop(c)
    else:
        embeds = [apply_rotary(g, rot, cos, sin, name) for name, rot, _ in parts]
        for (name, _, pas), e in zip(parts, embeds, strict=True):
            out.append(ops.cat_last(g, ctx, [e, pas], f"{name}_embed cat"))
            if keep is None:
                g.drop(e)  # `q_embed` / `k_embed` rebind
            else:
                keep.append(e)
    for _, rot, pas in parts:
        g.drop(rot)
        if keep is None:
            g.drop(pas)
        else:
            keep.append(pas)
    return out[0], out[1]
