"""The decoders Hugging Face builds from llama, mistral, gemma and mixtral, composed from parts.

A family's `Description` (`trainmem_nb.model.families`) names its parts: the RMSNorm variant
(`trainmem_nb.recipes.norms`), embedding scaling, the mask it builds, how rotary is applied
(`trainmem_nb.recipes.rotary`), fused or separate projections, the MLP (`trainmem_nb.recipes.mlp`, or
the mixture of experts of `trainmem_nb.recipes.moe`) and residual dropout. `DecoderRecipe` runs
``*ForCausalLM.forward`` with them: pre-norm layers with rotary positions, grouped-query attention
(`trainmem_nb.recipes.attention`) and a gated MLP, including the lifetimes of the Python locals of
modeling_llama.py (transformers 5.x) and its relatives.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.ops import I64, Ctx
from ..engine.tape import Graph, Sz, T, const, per_seq
from ..model.families import describe
from ..model.layers import LayerKind
from ..model.spec import ModelSpec
from ..spec.choices import Attention, LossImpl
from ..spec.training import TrainingSpec
from .attention import ATTENTIONS
from .base import DEFAULT_KIND, Recipe, Shared, peft_input_leaf, tok
from .head import causal_lm_loss, classifier_labels, fused_head_loss, sequence_classification_loss
from .layers import LAYERS
from .masks import causal_mask, sliding_window_mask
from .mlp import MLPS
from .moe import MOES
from .norms import RMS_NORMS
from .rotary import rotary_cos_sin

__all__ = ["DecoderRecipe"]


class DecoderRecipe(Recipe):
    """A llama-derived decoder as its description composes it."""

    def __init__(self, m: ModelSpec, t: TrainingSpec, ctx: Ctx) -> None:
        super().__init__(m, t, ctx)
        self.d = describe(m.family)
        self._norm = RMS_NORMS[self.d.norm]
        self.attn_weights: list[T] = []  # eager attention's probabilities, bound until the layer returns
        self.embed_locals: list[T] = []  # the base model's locals that die when it returns
        if self.d.embed_dropout:
            # the dropout's output is the first layer's input only (``hidden_states`` rebinds in the
            # layer loop); ``inputs_embeds`` is kept in `embed_locals` (read by `compile_step`)
            self.embed_output_kept = False
        if not self.d.sdpa and t.attention is Attention.SDPA:
            # no SDPA for this class (Gemma 2): Hugging Face runs eager attention by default
            self.t = t.model_copy(update={"attention": Attention.EAGER})

    # -- the kernels' switches ------------------------------------------------------------------
    @property
    def qk_contiguous(self) -> bool:
        """Are the rotary outputs contiguous (b, heads, s, d) tensors (``cat``), not views in the
        projections' (b, s, heads, d) layout (element-wise rotary)? Decides matmul and output copies."""
        return self.d.rotary == "cat"

    @property
    def sdpa_falls_back_to_math(self) -> bool:
        """On CPU, SDPA with attention dropout runs the math kernel (the CPU flash kernel has no
        dropout); CUDA's flash and memory-efficient kernels apply dropout inside the kernel."""
        return self.t.attention is Attention.SDPA and not self.ctx.cuda and self.dropout_attn > 0

    def masked(self, kind: LayerKind) -> bool:
        """Does SDPA get an explicit mask in a layer of `kind`? Once a sliding window applies:
        ``_ignore_causal_mask_sdpa`` returns False once ``kv_length >= local_attention_size``.

        The compiled program is symbolic in the sequence length, so this switch is part of its cache
        key (`trainmem_nb.step.compile.program_key` passes ``seq_len = sliding_window`` or 1)."""
        w = self.m.sliding_window
        return kind.attention == "sliding" and self.t.attention is Attention.SDPA and self.t.seq_len >= w

    def value_grad_contiguous(self, kind: LayerKind) -> bool:
        """Does the value's gradient reach its (b, s, kv, d) -> (b, kv, s, d) view contiguous in the
        latter layout, so that the view's backward copies it? From eager attention's matmuls and SDPA's
        math kernel, and from ``repeat_kv``'s backward (a sum) when a mask keeps SDPA from
        grouped-query attention; not from SDPA's flash kernel (the projection's layout)."""
        return (self.t.attention is Attention.EAGER or self.sdpa_falls_back_to_math
                or (self.masked(kind) and self.m.n_heads > self.m.n_kv_heads))

    # -- the model ------------------------------------------------------------------------------
    def linear(self, g: Graph, x: T, p: dict[str, T], module: str, in_features: int, out_features: int,
               **kw: object) -> T:
        """`Recipe.linear`; a projection fed by a leaf activation that requires grad (the embedding
        output under peft's ``enable_input_require_grads``, which OLMo 2's first layer projects without
        a norm before) shares autocast's cached cast of it (``cache_input``)."""
        if self.ctx.autocast is not None and any(x is leaf for leaf in g.input_leaves):
            kw["cache_input"] = True
        if f"{module}.bias" in p:  # at::linear runs a biased 3-D linear as addmm: the engine reduces the bias grad
            kw.setdefault("bias_grad_reduced", True)
        return super().linear(g, x, p, module, in_features, out_features, **kw)

    def norm(self, g: Graph, x: T, w: T, label: str, rows: int = 1) -> T:
        """The family's RMSNorm (over `rows` vectors per token: per-head q/k norms)."""
        return self._norm(g, x, w, label, rows=rows) if rows != 1 else self._norm(g, x, w, label)

    def norm_module(self, g: Graph, x: T, p: dict[str, T], name: str) -> T:
        """The norm module `name` (``input_layernorm``, ``norm``...) on `x`: ``nn.LayerNorm`` (with its
        bias when it has one) for a model whose norm is one (Starcoder2), else the family's RMSNorm."""
        if self.m.norm == "layernorm":
            return ops.layer_norm(g, self.ctx, x, p[f"{name}.weight"], p.get(f"{name}.bias"), tok(1), name)
        return self.norm(g, x, p[f"{name}.weight"], name)

    def act(self, g: Graph, x: T) -> T:
        """The MLP's activation (``ACT2FN[hidden_act]``), which saves its input."""
        return ops.unary_saving_input(g, x, self.m.activation)

    def embed(self, g: Graph, ids: T, p: dict[str, T]) -> tuple[T, Shared]:
        """``*Model.forward`` up to the layers: the token embeddings, the position ids, the attention
        mask and rotary cos/sin, in that order."""
        x = self.embed_tokens(g, ids, p)
        sh = Shared()
        # position ids: cache_position = arange(s) (+ past length) -> unsqueeze
        ar = g.alloc(per_seq(1), I64, "arange")
        pos = g.alloc(per_seq(1), I64, "cache_position")
        g.drop(ar)
        sh.extra.append(pos)
        kinds = sorted({k.attention for k in self.m.layer_kinds}, key=("full", "sliding").index)
        attention = sorted(set(kinds) | set(self.d.always_masks), key=("full", "sliding").index)
        if len(attention) == 1:
            sh.mask = self.attention_mask(g, x.dt, self.m.layer_kinds[0])
        else:  # one mask per attention kind, the full one first (the models' ``causal_mask_mapping``)
            sh.masks = {a: self.attention_mask(g, x.dt, LayerKind(a)) for a in attention}
        if self.d.embed_dropout:
            # Starcoder2Model: ``hidden_states = dropout(inputs_embeds, p=embedding_dropout)``
            peft_input_leaf(g, self.t, x)  # the hook is on embed_tokens, whose output is not the layers' input
            self.embed_locals = [x]
            x = ops.dropout(g, self.ctx, x, self.dropout_embd, "embedding_dropout")
        cat = self.d.rotary != "chunk"
        if self.d.rotary_per_kind:
            # Gemma3TextModel: ``position_embeddings[layer_type] = self.rotary_emb(x, position_ids,
            # layer_type)`` for each layer type (a set: its order varies, the sizes do not)
            sh.rotaries = {a: rotary_cos_sin(g, self.m.rotary_dims, x.dt, cat) for a in kinds}
        else:
            sh.cos, sh.sin = rotary_cos_sin(g, self.m.rotary_dims, x.dt, cat, to_dtype=not self.d.rotary_fp32)
        return x, sh

    def embed_tokens(self, g: Graph, ids: T, p: dict[str, T]) -> T:
        """``embed_tokens(input_ids)``: (tokens, hidden) in the weight's dtype; Gemma's
        ``GemmaTextScaledWordEmbedding`` then multiplies by ``embed_scale.to(weight.dtype)`` (a 0-d
        buffer, in the model's dtype: no copy, unless the weight is FSDP2's 16-bit gather of an fp32 model, whose
        buffer the policy leaves fp32: a new scalar, measured), whose multiply saves only the scalar."""
        w = p["embed_tokens.weight"]
        e = ops.embedding(g, ids, w, tok(self.m.hidden), "embed_tokens")
        if self.d.multipliers:  # Granite: ``inputs_embeds = inputs_embeds * self.embedding_multiplier``
            x = ops.scalar_op(g, e, "inputs_embeds * embedding_multiplier")
            g.drop(e)
            return x
        if not self.d.embed_scale:
            return e
        if self.ctx.buffer_dt not in (None, w.dt):
            scale = g.alloc(const(1), w.dt, "embed_scale.to(weight.dtype)")
            x = ops.mul(g, e, scale, "embed_tokens * embed_scale")
            g.drop(e, scale)
            return x
        scale = g.external(const(1), w.dt, "embed_scale")
        x = ops.mul(g, e, scale, "embed_tokens * embed_scale")
        g.drop(e)
        return x

    def attention_mask(self, g: Graph, dt: int, kind: LayerKind) -> T | None:
        """The mask layers of `kind` get: with a sliding window, ``create_sliding_window_causal_mask``
        (masking_utils.py): eager attention always gets a (b, 1, s, s) additive mask; SDPA gets the
        boolean window pattern once ``s >= sliding_window`` (`masked`), no mask before
        (``is_causal`` is enough). Without a window, a causal mask for eager attention only."""
        eager = self.t.attention is Attention.EAGER
        if kind.attention == "sliding":
            if eager:
                return sliding_window_mask(g, dt)
            return sliding_window_mask(g, None) if self.masked(kind) else None
        return causal_mask(g, dt) if eager else None

    def layer(self, g: Graph, x: T, sh: Shared, p: dict[str, T], kind: LayerKind = DEFAULT_KIND) -> T:
        """``*DecoderLayer.forward``: the family's placement of norms and residuals (`LAYERS`)."""
        return LAYERS[self.d.layer](self, g, x, sh, p, kind)

    def attention(self, g: Graph, h: T, sh: Shared, p: dict[str, T], kind: LayerKind) -> T:
        """The attention module's forward (`ATTENTIONS`)."""
        return ATTENTIONS[self.d.attention](self, g, h, sh, p, kind)

    def mlp(self, g: Graph, x: T, p: dict[str, T], kind: LayerKind) -> T:
        """The layer's MLP: the family's mixture of experts in an MoE layer (`MOES`), else its dense
        MLP (`MLPS`)."""
        return MOES[self.d.moe](self, g, x, p) if kind.moe else MLPS[self.d.mlp](self, g, x, p)

    def final_norm(self, g: Graph, x: T, p: dict[str, T]) -> T:
        """The base model's last op (its output is held by the returned model output); then the model
        returns and its locals (`embed_locals`) go."""
        out = self.norm_module(g, x, p, "norm")
        g.drop(*self.embed_locals)
        self.embed_locals = []
        return out

    def lm_head_weight(self, p: dict[str, T]) -> T:
        """The output projection's weight: ``lm_head``'s, or the token embeddings it is tied to."""
        return p.get("lm_head.weight") or p["embed_tokens.weight"]

    def lm_head_loss(self, g: Graph, h: T, ids: T, p: dict[str, T]) -> tuple[T, T | None]:
        """``*ForCausalLM``: logits over the vocabulary and the loss; returns (loss, logits). With a
        memory-efficient `TrainingSpec.loss_impl` the head's projection is part of the loss (no logits)."""
        m, ctx = self.m, self.ctx
        if m.num_labels:
            return self.sequence_classification_loss(g, h, p)
        w = self.lm_head_weight(p)
        if self.t.loss_impl in (LossImpl.CHUNKED, LossImpl.LIGER, LossImpl.CCE):  # no logits returned
            return fused_head_loss(g, ctx, self.t, h, w, m.hidden, m.vocab), None
        logits = ops.linear(g, ctx, h, w, m.hidden, m.vocab, None, "lm_head")
        if self.d.multipliers:  # Granite: ``logits = logits / self.config.logits_scaling`` (a new tensor)
            raw = logits
            logits = ops.scalar_op(g, raw, "logits / logits_scaling")
            g.drop(raw)
        if m.final_softcap:
            # Gemma 2: ``logits / cap``, ``tanh`` (saves its result), ``* cap``, each rebinding ``logits``
            ld = ops.scalar_op(g, logits, "logits / final_softcap")
            g.drop(logits)
            lt = ops.unary_saving_output(g, ld, "logits tanh")
            g.drop(ld)
            logits = ops.scalar_op(g, lt, "logits * final_softcap")
            g.drop(lt)
        return causal_lm_loss(g, ctx, logits, m.vocab)

    def sequence_classification_loss(self, g: Graph, h: T, p: dict[str, T]) -> tuple[T, T]:
        """transformers 5.x ``GenericForSequenceClassification``: ``logits = self.score(hidden_states)`` (every
        token, a local until the forward returns), the last non-pad token of each sequence
        (``(input_ids != pad_token_id).to(int32)``, ``arange(seq, dtype=int32)``, their product, ``argmax(-1)``;
        a batch needs a pad token, so the pad path is the one modelled), ``logits[arange(batch), last]``
        (saves both indices; backward ``index_backward``: zeros the size of ``logits``, then index_put), then
        the loss on the pooled logits (`sequence_classification_loss`). Returns (loss, pooled logits)."""
        m, ctx = self.m, self.ctx
        logits = ops.linear(g, ctx, h, p["score.weight"], m.hidden, m.num_labels, None, "score")
        mask = g.alloc(tok(1), ops.BOOL, "input_ids != pad_token_id")
        mask32 = g.alloc(tok(1), 4, "non_pad_mask .to(int32)")
        g.drop(mask)
        positions = g.alloc(Sz(s_=1), 4, "token_indices arange")
        product = g.alloc(tok(1), 4, "token_indices * non_pad_mask")
        last = g.alloc(Sz(b_=1), I64, "last_non_pad_token argmax")
        g.drop(product, positions, mask32)
        rows = g.alloc(Sz(b_=1), I64, "arange(batch_size)")
        pooled = ops.index_pairs(g, logits, rows, last, Sz(b_=m.num_labels), "logits[arange, last_non_pad_token]")
        g.drop(rows, last)
        labels = classifier_labels(g, m.num_labels)
        loss = sequence_classification_loss(g, ctx, pooled, labels, m.num_labels)
        g.drop(logits)  # a local of the forward
        return loss, pooled
