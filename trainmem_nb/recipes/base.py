"""What each model family's forward allocates and keeps for backward, op by op.

Each recipe mirrors the family's Hugging Face modeling code (transformers 5.x): the same ops in the
same order, and the same Python variable lifetimes (a temporary dies where the code drops its last
name; a tensor an op saves lives until that op's backward). Run on symbolic tensors
(`trainmem_nb.engine.tape`), a recipe yields the exact sequence of allocations and frees of a real step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import ops
from ..engine.ops import Ctx
from ..engine.tape import Graph, Sz, T, per_token
from ..model.layers import LayerKind
from ..model.params import ParamTensor, quantized
from ..model.spec import ModelSpec
from ..spec.choices import Checkpointing, Method
from ..spec.training import TrainingSpec

__all__ = ["DEFAULT_KIND", "Recipe", "Shared", "peft_input_leaf", "tok"]

#: The kind of every layer of a model whose layers do not differ.
DEFAULT_KIND = LayerKind()


@dataclass
class Shared:
    """Tensors made once per forward and passed to every layer (rotary cos/sin, attention masks,
    position ids). Models whose layers differ build one mask per attention kind (`masks`)."""

    cos: T | None = None
    sin: T | None = None
    mask: T | None = None
    extra: list[T] = field(default_factory=list)
    #: the mask of each attention kind (``"full"``, ``"sliding"``) when the model builds one per kind
    masks: dict[str, T | None] = field(default_factory=dict)
    #: the cos/sin of each attention kind when the model has one rotary base per kind (Gemma 3)
    rotaries: dict[str, tuple[T, T]] = field(default_factory=dict)

    def attention_mask(self, kind: LayerKind) -> T | None:
        """The mask a layer of `kind` gets."""
        return self.masks[kind.attention] if self.masks else self.mask

    def rotary(self, kind: LayerKind) -> tuple[T | None, T | None]:
        """The rotary cos/sin a layer of `kind` applies (none on a NoPE layer)."""
        if not kind.rope:
            return None, None
        return self.rotaries[kind.attention] if self.rotaries else (self.cos, self.sin)

    def layer_inputs(self, kind: LayerKind) -> list[T]:
        """The tensors a layer call receives besides its input, in the order the call passes them
        (a checkpointed layer's frame keeps them until its recomputation is done)."""
        cos, sin = self.rotaries[kind.attention] if self.rotaries else (self.cos, self.sin)
        return [t for t in (*self.extra, self.attention_mask(kind), cos, sin) if t is not None]

    def rotary_tensors(self) -> list[T | None]:
        """Every rotary cos/sin the model computed, in the order it computed them."""
        if self.rotaries:
            return [t for pair in self.rotaries.values() for t in pair]
        return [self.cos, self.sin]

    def all_masks(self) -> list[T | None]:
        """Every mask the model built, in the order it built them."""
        return list(self.masks.values()) if self.masks else [self.mask]


#: Output heads that fp8 training leaves in high precision (torchtitan filters its ``output``; BERT's masked-LM head
#: is ``cls.predictions.decoder``; the measured
#: steps filter these by name, `trainmem_nb.measure.step.fp8_module_filter`)
FP8_SKIPPED = frozenset({"lm_head", "score", "classifier", "decoder"})


def fp8_converted(module: str, in_features: int, out_features: int) -> bool:
    """Does fp8 training convert the projection `module` (its name in the layer) of these dimensions: its
    dimensions are multiples of 16 (``torch._scaled_mm``'s rule; torchtitan's and torchao's auto filters skip
    the others too) and it is not an output head (`FP8_SKIPPED`). accelerate's default filter also skips the
    model's first linear: not modelled."""
    return in_features % 16 == 0 and out_features % 16 == 0 and module not in FP8_SKIPPED


def fp8_weight(p: ParamTensor, m: ModelSpec, te: bool = False) -> bool:
    """Is `p` the weight of a projection fp8 training converts (`fp8_converted`): the weight of an ``nn.Linear``
    in a layer (`quantized`'s set: not a router, which transformers 5 holds in a custom module, nor a 3-D expert
    stack; gpt2's projections are Conv1D, which torchao leaves as they are, and which Megatron's GPT runs as
    Transformer Engine linears: `te`)."""
    if (m.family.value == "gpt2" and not te) or not quantized(p):
        return False
    module = p.name[len("layers."):-len(".weight")]
    return fp8_converted(module, p.shape[1], p.shape[0])


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
        if self.fp8_linear(module, in_features, out_features):
            fp8 = ops.te_fp8_linear if self.ctx.fp8_kernels == "te" else ops.fp8_linear
            return fp8(g, self.ctx, x, p[f"{module}.weight"], in_features, out_features, p.get(f"{module}.bias"),
                       module)
        a_w = p.get(f"{module}.lora_A.weight")
        if a_w is not None:
            return ops.lora_linear(g, self.ctx, x, p[f"{module}.weight"], p.get(f"{module}.bias"), a_w,
                                   p[f"{module}.lora_B.weight"], in_features, out_features, self.t.lora_rank,
                                   self.t.lora_dropout, module, cache_input=bool(kw.get("cache_input", False)))
        return ops.linear(g, self.ctx, x, p[f"{module}.weight"], in_features, out_features, p.get(f"{module}.bias"),
                          module, **kw)  # type: ignore[arg-type]

    def fp8_linear(self, module: str, in_features: int, out_features: int) -> bool:
        """Does fp8 training convert this projection: every block ``nn.Linear`` whose dimensions are multiples
        of 16 (``torch._scaled_mm``'s rule, which torchtitan's and accelerate's module filters apply), never a
        classifier (`FP8_SKIPPED`)."""
        return self.ctx.fp8 is not None and fp8_converted(module, in_features, out_features)

    # parameters are created by simulate.py from the inventory and passed in by name
    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        raise NotImplementedError

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind = DEFAULT_KIND) -> T:
        raise NotImplementedError

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        raise NotImplementedError

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T | None]:
        raise NotImplementedError

    def lm_head_weight(self, p: dict[str, T]) -> T:
        """The output projection's weight (the composed decoders'; `check_model_options` refuses the rest
        where a loss needs it on its own)."""
        raise NotImplementedError


def tok(n: float) -> Sz:
    """``(b, s, n)`` elements: a per-token activation of width n."""
    return per_token(n)


def peft_input_leaf(g: Graph, t: TrainingSpec, inputs_embeds: T) -> None:
    """peft turns on ``enable_input_require_grads()`` for a model with gradient checkpointing: a
    forward hook makes the input embeddings' output a leaf that requires grad, so gradients reach
    the checkpointed layers. The graph's ``AccumulateGrad`` node holds that leaf, and with it its
    ``.grad``, until the loss (and its graph) is deleted at the end of the step."""
    if t.method is not Method.FULL and t.checkpointing is not Checkpointing.NONE:
        inputs_embeds.rg = True
        g.hold(inputs_embeds)  # AccumulateGrad's reference: released after this step's events
