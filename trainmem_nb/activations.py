"""What each model family's forward allocates and keeps for backward, op by op.

Each recipe mirrors the family's Hugging Face modeling code (transformers 5.x): the same ops in the
same order, and the same Python variable lifetimes (a temporary dies where the code drops its last
name; a tensor an op saves lives until that op's backward). Run on symbolic tensors
(`trainmem_nb.tape`), a recipe yields the exact sequence of allocations and frees of a real step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from . import ops
from .ops import BOOL, F32, I64, Ctx
from .specs import Attention, Family, ModelSpec, TrainingSpec
from .tape import Graph, Sz, T, const, per_seq, per_token, per_token_sq

__all__ = ["Recipe", "recipe_for"]


@dataclass
class Shared:
    """Tensors made once per forward and used by every layer (rotary cos/sin, attention mask)."""

    cos: T | None = None
    sin: T | None = None
    mask: T | None = None
    extra: list[T] = field(default_factory=list)


class Recipe:
    """A family's forward on symbolic tensors: ``embed`` → ``layer`` (per layer) → ``head``."""

    def __init__(self, m: ModelSpec, t: TrainingSpec, ctx: Ctx) -> None:
        self.m = m
        self.t = t
        self.ctx = ctx
        self.pdt = t.param_bytes  # dtype of weights and of the residual stream
        self.dropout_attn = m.attn_dropout if t.dropout is None else t.dropout
        self.dropout_hidden = m.hidden_dropout if t.dropout is None else t.dropout
        self.dropout_embd = m.embd_dropout if t.dropout is None else t.dropout

    def linear(self, g: Graph, x: T, p: dict[str, T], module: str, in_features: int, out_features: int,
               **kw: object) -> T:
        """A projection layer (``nn.Linear``/``Conv1D``) by its module name in the layer: the plain
        matmul, or peft's LoRA-wrapped forward when an adapter targets it."""
        a_w = p.get(f"{module}.lora_A.weight")
        if a_w is not None:
            return ops.lora_linear(g, self.ctx, x, p[f"{module}.weight"], p.get(f"{module}.bias"), a_w,
                                   p[f"{module}.lora_B.weight"], in_features, out_features, self.t.lora_rank,
                                   self.t.lora_dropout, module)
        return ops.linear(g, self.ctx, x, p[f"{module}.weight"], in_features, out_features, p.get(f"{module}.bias"),
                          module, **kw)  # type: ignore[arg-type]

    # parameters are created by simulate.py from the inventory and passed in by name
    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        raise NotImplementedError

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T]) -> T:
        raise NotImplementedError

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        raise NotImplementedError

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T]:
        raise NotImplementedError


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


def causal_mask(g: Graph, dt: int) -> T:
    """transformers' ``create_causal_mask`` for eager attention: a (b, 1, s, s) additive mask in the
    model's dtype (0 or the dtype's minimum), built from a (1, 1, s, s) boolean causal pattern."""
    a1 = g.alloc(Sz(b_=1), I64, "batch arange")
    a2 = g.alloc(const(1), I64, "head arange")
    kv = [g.alloc(per_seq(1), I64, "kv arange"), None]
    kv[1] = g.alloc(per_seq(1), I64, "kv idx")
    g.drop(kv[0])
    qa = g.alloc(per_seq(1), I64, "q arange")
    qi = g.alloc(per_seq(1), I64, "q idx")
    g.drop(qa)
    le = g.alloc(Sz(ss=1), BOOL, "causal bool")
    g.drop(a1, a2, kv[1], qi)
    z = g.alloc(const(1), F32, "zero")
    mn = g.alloc(const(1), F32, "min")
    mask = g.alloc(Sz(bss=1), dt, "causal mask")
    g.drop(mn, z, le)
    return mask


def causal_lm_loss(g: Graph, logits: T, vocab: int, batch1: bool = False) -> T:
    """transformers' ForCausalLMLoss: logits upcast to fp32, labels padded and shifted, then
    ``cross_entropy`` = log_softmax (saves its fp32 result) + nll_loss (mean)."""
    lf = ops.cast(g, logits, F32, "logits.float()")
    pad = g.alloc(Sz(bs=1, b_=1), I64, "labels pad")  # F.pad(labels, (0, 1)): (b, s+1) int64
    # labels[..., 1:].contiguous(): a copy, except with one sequence, where the slice is contiguous
    shift = g.view(pad, "shift_labels", n=tok(1)) if batch1 else g.alloc(tok(1), I64, "shift_labels")
    ls = g.alloc(lf.n, F32, "log_softmax")

    def ls_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(lf.n, F32, "log_softmax backward")]

    g.record("log_softmax", [lf], [ls], [ls], ls_bwd)
    loss = g.alloc(const(1), F32, "loss")
    total_weight = g.alloc(const(1), F32, "nll total_weight")

    def nll_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(lf.n, F32, "nll_loss backward"), None]

    g.record("nll_loss", [ls, shift], [loss, total_weight], [shift, total_weight], nll_bwd)
    g.drop(ls, shift, total_weight, lf, pad)
    return loss


def recipe_for(m: ModelSpec, t: TrainingSpec, ctx: Ctx) -> Recipe:
    """The recipe of `m`'s family (one module per family in `trainmem_nb.families`)."""
    from .families import RECIPES

    try:
        cls = RECIPES[m.family]
    except KeyError:
        raise NotImplementedError(f"family {m.family.value!r} has no recipe yet") from None
    return cls(m, t, ctx)


def tok(n: float) -> Sz:
    """``(b, s, n)`` elements: a per-token activation of width n."""
    return per_token(n)


_ = (Attention, Family, per_token_sq)
