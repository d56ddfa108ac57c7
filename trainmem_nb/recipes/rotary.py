"""Rotary position embeddings: the cos/sin a rotary module computes once per forward.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import F32
from ..engine.tape import Graph, T, per_seq


def rotary_cos_sin(g: Graph, rotary_dims: int, x_dt: int) -> tuple[T, T]:
    """A rotary embedding module's forward (LlamaRotaryEmbedding, GPTNeoXRotaryEmbedding):
    ``position_ids[..., None].float() * inv_freq``, ``cat``, ``cos``/``sin`` times ``attention_scaling``
    (fp32, (1, s, rotary_dims)), cast to the hidden states' dtype on return (a no-op under autocast,
    whose hidden states are fp32); the fp32 locals die when the function returns."""
    d = rotary_dims
    pos_f = g.alloc(per_seq(1), F32, "position_ids float")
    freqs = g.alloc(per_seq(d / 2), F32, "freqs")
    g.drop(pos_f)
    emb = g.alloc(per_seq(d), F32, "emb cat")
    full = []
    for name in ("cos", "sin"):
        raw = g.alloc(per_seq(d), F32, name)
        scaled = g.alloc(per_seq(d), F32, f"{name} * attention_scaling")
        g.drop(raw)
        full.append(scaled)
    out = [ops.cast(g, full[0], x_dt, "cos to dtype"), ops.cast(g, full[1], x_dt, "sin to dtype")]
    g.drop(freqs, emb, full[0], full[1])
    return out[0], out[1]
