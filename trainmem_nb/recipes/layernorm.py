"""What the LayerNorm families' recipes share (gpt2, opt, bert, gpt_neox): biased projections as
``addmm``, projections whose output gradient comes back strided, peft's input-embedding leaf, the CPU
SDPA math fallback, and the model locals that die when the base model returns."""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import Ctx
from ..engine.tape import Graph, T
from ..model.spec import ModelSpec
from ..spec.choices import Attention
from ..spec.training import TrainingSpec
from .base import Recipe, peft_input_leaf

__all__ = ["LayerNormRecipe"]


class LayerNormRecipe(Recipe):
    """Base of the gpt2, opt, bert and gpt_neox recipes."""

    #: the embedding output handed to the first layer is no model local (``hidden_states`` rebinds in
    #: the layer loop; the model's own locals are freed in `final_norm`): it dies after the first
    #: layer unless saved (read by `trainmem_nb.step.compile.compile_step`)
    embed_output_kept = False

    def __init__(self, m: ModelSpec, t: TrainingSpec, ctx: Ctx) -> None:
        super().__init__(m, t, ctx)
        self.model_locals: list[T] = []  # the base model's locals that die when it returns

    def release_model_locals(self, g: Graph) -> None:
        """The base model returns: its locals (``inputs_embeds``, position embeddings...) go."""
        g.drop(*self.model_locals)
        self.model_locals = []

    def linear(self, g: Graph, x: T, p: dict[str, T], module: str, in_features: int, out_features: int,
               **kw: object) -> T:
        """`Recipe.linear`, except that a projection with a (trainable) bias runs as ``addmm``, whose
        bias gradient is the engine's reduction of the output gradient (`ops.addmm`)."""
        b = p.get(f"{module}.bias")
        if b is None or p.get(f"{module}.lora_A.weight") is not None or self.fp8_linear(module, in_features, out_features):
            return super().linear(g, x, p, module, in_features, out_features, **kw)
        return ops.addmm(g, self.ctx, x, p[f"{module}.weight"], b, in_features, out_features, module, linear_casts=True)

    def linear_strided_grad(self, g: Graph, x: T, p: dict[str, T], module: str, in_features: int,
                            out_features: int, strided: bool) -> T:
        """`linear` for a projection whose output gradient comes back strided (see
        `ops.linear_strided_grad`), LoRA-wrapped or not."""
        a_w = p.get(f"{module}.lora_A.weight")
        lora = (a_w, p[f"{module}.lora_B.weight"], self.t.lora_rank, self.t.lora_dropout) if a_w is not None else None
        return ops.linear_strided_grad(g, self.ctx, x, p[f"{module}.weight"], p.get(f"{module}.bias"), in_features,
                                       out_features, strided, module, lora)

    def input_requires_grad(self, g: Graph, inputs_embeds: T) -> None:
        """peft turns on ``enable_input_require_grads()`` for a model with gradient checkpointing: a
        forward hook makes the input embeddings' output a leaf that requires grad, so gradients reach
        the checkpointed layers. The graph's ``AccumulateGrad`` node holds that leaf, and with it its
        ``.grad``, until the loss (and its graph) is deleted at the end of the step (`peft_input_leaf`)."""
        peft_input_leaf(g, self.t, inputs_embeds)

    @property
    def sdpa_falls_back_to_math(self) -> bool:
        """On CPU, SDPA with attention dropout runs the math kernel (the CPU flash kernel has no
        dropout); CUDA's flash and memory-efficient kernels apply dropout inside the kernel."""
        return self.t.attention is Attention.SDPA and not self.ctx.cuda and self.dropout_attn > 0
