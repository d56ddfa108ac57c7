"""Every parameter tensor of a model, as Hugging Face's ``named_parameters()`` lists it.

The inventory is what weights, gradients and optimizer states are made of: counts per tensor (the CUDA
allocator rounds each tensor to 512 B), which are matmul weights (autocast copies them to 16 bit), which
sit in the decoder layers (checkpointing and sharding work per layer) and which LoRA can target. Tied
weights appear once, as in ``sum(p.numel() for p in model.parameters())``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from ..spec.choices import Method
from .families import DESCRIPTIONS, Family

if TYPE_CHECKING:  # annotations only: ModelSpec reads its parameter count from here
    from ..spec.training import TrainingSpec
    from .spec import ModelSpec

__all__ = [
    "NF4_BLOCK", "ParamTensor", "as_built", "buffer_inventory", "count_params", "idle_tensors", "idle_trainable", "idle_weights",
    "lora_inventory", "lora_modules",
    "lora_moe_params", "nf4_bytes", "on_stage", "param_inventory", "quantized", "routed_expert", "trainable_tensors",
    "weight_tensors",
]


class ParamTensor(NamedTuple):
    """One parameter tensor (or `count` identical ones, one per layer)."""

    name: str  #: Hugging Face name without the layer index, e.g. ``layers.self_attn.q_proj.weight``
    shape: tuple[int, ...]
    #: how many tensors of this shape (n_layers for per-layer tensors)
    count: int  # type: ignore[assignment]  # a public field that shadows tuple.count on purpose
    matmul: bool  #: used as a matmul weight (autocast makes a 16-bit copy of it)
    in_layer: bool  #: inside a repeated transformer layer
    #: which layers hold it: ``""`` every layer; ``"moe"`` / ``"dense"`` only the layers with that MLP
    #: (a model whose MoE layers and dense layers differ; `count` is then the number of those layers)
    kind: str = ""
    #: kept in fp32 whatever the model's dtype (deepseek_v3's router: ``_keep_in_fp32_modules_strict``)
    fp32: bool = False
    #: a norm's weight or bias (``nn.LayerNorm`` where ``ModelSpec.norm == "layernorm"``, else an RMSNorm)
    norm: bool = False
    #: held but never run by a text-only step (a multimodal checkpoint's vision tower: `vision_inventory`)
    idle: bool = False

    @property
    def numel(self) -> int:
        """Elements in one tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def routed_expert(p: ParamTensor) -> bool:
    """Is `p` a routed expert stack (or its bias or LoRA adapter): what expert parallelism splits between
    ranks and shards over its own data-parallel group (shared experts and routers are dense)."""
    return p.name.startswith("layers.mlp.experts.")


def _linear(prefix: str, out_f: int, in_f: int, bias: bool, count: int, in_layer: bool = True,
            kind: str = "") -> list[ParamTensor]:
    items = [ParamTensor(f"{prefix}.weight", (out_f, in_f), count, True, in_layer, kind)]
    if bias:
        items.append(ParamTensor(f"{prefix}.bias", (out_f,), count, False, in_layer, kind))
    return items


def _norm(prefix: str, dim: int, bias: bool, count: int, in_layer: bool = True) -> list[ParamTensor]:
    items = [ParamTensor(f"{prefix}.weight", (dim,), count, False, in_layer, norm=True)]
    if bias:
        items.append(ParamTensor(f"{prefix}.bias", (dim,), count, False, in_layer, norm=True))
    return items


def _gpt2_params(m: ModelSpec) -> list[ParamTensor]:
    """``GPT2LMHeadModel``: Conv1D weights are (in, out)."""
    L, h, V, f = m.n_layers, m.hidden, m.vocab, m.ffn
    items: list[ParamTensor] = []
    items += [ParamTensor("wte.weight", (V, h), 1, False, False), ParamTensor("wpe.weight", (m.max_positions, h), 1, False, False)]
    items += _norm("layers.ln_1", h, True, L)
    # Conv1D stores (in, out); its bias is (out,)
    a = m.q_dim  # the heads' width: hidden, or a tensor-parallel rank's share of it
    items += [ParamTensor("layers.attn.c_attn.weight", (h, 3 * a), L, True, True), ParamTensor("layers.attn.c_attn.bias", (3 * a,), L, False, True)]
    items += [ParamTensor("layers.attn.c_proj.weight", (a, h), L, True, True), ParamTensor("layers.attn.c_proj.bias", (h,), L, False, True)]
    items += _norm("layers.ln_2", h, True, L)
    items += [ParamTensor("layers.mlp.c_fc.weight", (h, f), L, True, True), ParamTensor("layers.mlp.c_fc.bias", (f,), L, False, True)]
    items += [ParamTensor("layers.mlp.c_proj.weight", (f, h), L, True, True), ParamTensor("layers.mlp.c_proj.bias", (h,), L, False, True)]
    items += _norm("ln_f", h, True, 1, False)
    if not m.tie_embeddings:
        items += _linear("lm_head", V, h, False, 1, False)
    return items


def _gpt_neox_params(m: ModelSpec) -> list[ParamTensor]:
    """``GPTNeoXForCausalLM``."""
    L, h, V, f = m.n_layers, m.hidden, m.vocab, m.ffn
    items: list[ParamTensor] = []
    items.append(ParamTensor("embed_in.weight", (V, h), 1, False, False))
    items += _norm("layers.input_layernorm", h, True, L)
    items += _norm("layers.post_attention_layernorm", h, True, L)
    items += _linear("layers.attention.query_key_value", 3 * m.q_dim, h, m.qkv_bias, L)  # q_dim: a rank's heads
    items += _linear("layers.attention.dense", h, m.q_dim, m.out_bias, L)
    items += _linear("layers.mlp.dense_h_to_4h", f, h, True, L)
    items += _linear("layers.mlp.dense_4h_to_h", h, f, True, L)
    items += _norm("final_layer_norm", h, True, 1, False)
    if not m.tie_embeddings:
        items += _linear("embed_out", V, h, False, 1, False)
    return items


def _opt_params(m: ModelSpec) -> list[ParamTensor]:
    """``OPTForCausalLM`` (learned positions offset by 2; OPT-350m's projections)."""
    L, h, V, f = m.n_layers, m.hidden, m.vocab, m.ffn
    items: list[ParamTensor] = []
    proj = m.word_embed_proj_dim or h
    items.append(ParamTensor("embed_tokens.weight", (V, proj), 1, False, False))
    items.append(ParamTensor("embed_positions.weight", (m.max_positions + 2, h), 1, False, False))
    if proj != h:
        items += _linear("project_out", proj, h, False, 1, False)
        items += _linear("project_in", h, proj, False, 1, False)
    for name in ("k_proj", "v_proj", "q_proj"):  # q_dim: the heads' width (a tensor-parallel rank's share)
        items += _linear(f"layers.self_attn.{name}", m.q_dim, h, m.qkv_bias, L)
    items += _linear("layers.self_attn.out_proj", h, m.q_dim, m.qkv_bias, L)
    items += _norm("layers.self_attn_layer_norm", h, True, L)
    items += _linear("layers.fc1", f, h, m.mlp_bias, L)
    items += _linear("layers.fc2", h, f, m.mlp_bias, L)
    items += _norm("layers.final_layer_norm", h, True, L)
    if m.pre_norm:
        items += _norm("final_layer_norm", h, True, 1, False)
    if not m.tie_embeddings:
        items += _linear("lm_head", V, proj, False, 1, False)
    return items


def _bert_params(m: ModelSpec) -> list[ParamTensor]:
    """``BertForMaskedLM`` (an untied decoder keeps its own bias), or with ``num_labels``
    ``BertForSequenceClassification``: the pooler and the classifier instead of the MLM head."""
    L, h, V, f = m.n_layers, m.hidden, m.vocab, m.ffn
    items: list[ParamTensor] = []
    items.append(ParamTensor("embeddings.word_embeddings.weight", (V, h), 1, False, False))
    items.append(ParamTensor("embeddings.position_embeddings.weight", (m.max_positions, h), 1, False, False))
    if m.type_vocab:
        items.append(ParamTensor("embeddings.token_type_embeddings.weight", (m.type_vocab, h), 1, False, False))
    items += _norm("embeddings.LayerNorm", h, True, 1, False)
    for name in ("query", "key", "value"):  # q_dim: the heads' width (a tensor-parallel rank's share)
        items += _linear(f"layers.attention.self.{name}", m.q_dim, h, True, L)
    items += _linear("layers.attention.output.dense", h, m.q_dim, True, L)
    items += _norm("layers.attention.output.LayerNorm", h, True, L)
    items += _linear("layers.intermediate.dense", f, h, True, L)
    items += _linear("layers.output.dense", h, f, True, L)
    items += _norm("layers.output.LayerNorm", h, True, L)
    if m.num_labels:
        items += _linear("pooler.dense", h, h, True, 1, False)
        items += _linear("classifier", m.num_labels, h, True, 1, False)
        return items
    items += _linear("cls.predictions.transform.dense", h, h, True, 1, False)
    items += _norm("cls.predictions.transform.LayerNorm", h, True, 1, False)
    items.append(ParamTensor("cls.predictions.bias", (V,), 1, False, False))
    if not m.tie_embeddings:
        items.append(ParamTensor("cls.predictions.decoder.weight", (V, h), 1, True, False))
        # untied, the decoder keeps its own bias (cls.predictions.bias then gets no gradient)
        items.append(ParamTensor("cls.predictions.decoder.bias", (V,), 1, False, False))
    return items


def _gqa_params(m: ModelSpec, n: int) -> list[ParamTensor]:
    """The "gqa" attention module of `n` layers: q/k/v projections (or one fused ``qkv_proj``, which
    registers after ``o_proj``, as Phi-3 does) and ``o_proj``."""
    h, q, kv = m.hidden, m.q_dim, m.kv_dim
    if m.fused_qkv:
        return [*_linear("layers.self_attn.o_proj", h, q, m.out_bias, n),
                *_linear("layers.self_attn.qkv_proj", q + 2 * kv, h, m.qkv_bias, n)]
    items = [*_linear("layers.self_attn.q_proj", q, h, m.qkv_bias, n), *_linear("layers.self_attn.k_proj", kv, h, m.qkv_bias, n),
             *_linear("layers.self_attn.v_proj", kv, h, m.qkv_bias, n), *_linear("layers.self_attn.o_proj", h, q, m.out_bias, n)]
    return items


def _qk_norm_params(m: ModelSpec, n: int) -> list[ParamTensor]:
    """The q/k RMSNorm weights a description's ``qk_norm`` adds after ``o_proj`` (registered last in
    ``Olmo2Attention`` / ``Gemma3Attention`` / ``Qwen3Attention.__init__``): the projection widths
    (``"full"``) or one head (``"head"``, ``"head_view"``)."""
    mode = DESCRIPTIONS[m.family].qk_norm
    if not mode:
        return []
    q, k = (m.q_dim, m.kv_dim) if mode == "full" else (m.head_dim, m.head_dim)
    return [*_norm("layers.self_attn.q_norm", q, False, n), *_norm("layers.self_attn.k_norm", k, False, n)]


def _gated_params(m: ModelSpec, n: int, kind: str) -> list[ParamTensor]:
    """The "gated" MLP of `n` layers: gate and up projections (or one fused ``gate_up_proj``), down."""
    h, f = m.hidden, m.ffn
    if DESCRIPTIONS[m.family].fused_gate_up:
        up = _linear("layers.mlp.gate_up_proj", 2 * f, h, m.mlp_bias, n, kind=kind)
    else:
        up = [*_linear("layers.mlp.gate_proj", f, h, m.mlp_bias, n, kind=kind),
              *_linear("layers.mlp.up_proj", f, h, m.mlp_bias, n, kind=kind)]
    return [*up, *_linear("layers.mlp.down_proj", h, f, m.mlp_bias, n, kind=kind)]


def _starcoder2_mlp_params(m: ModelSpec, n: int, kind: str) -> list[ParamTensor]:
    """The "starcoder2" MLP of `n` layers: ``c_fc`` and ``c_proj`` (biases from ``use_bias``)."""
    return [*_linear("layers.mlp.c_fc", m.ffn, m.hidden, m.mlp_bias, n, kind=kind),
            *_linear("layers.mlp.c_proj", m.hidden, m.ffn, m.mlp_bias, n, kind=kind)]


def _mixtral_moe_params(m: ModelSpec, n: int, kind: str) -> list[ParamTensor]:
    """The "mixtral" MoE block of `n` layers: the router's weight and the fused 3-D expert stacks."""
    E, El, h, ef = m.n_experts, m.held_experts, m.hidden, m.expert_width
    return [ParamTensor("layers.mlp.gate.weight", (E, h), n, True, True, kind),
            ParamTensor("layers.mlp.experts.gate_up_proj", (El, 2 * ef, h), n, True, True, kind),
            ParamTensor("layers.mlp.experts.down_proj", (El, h, ef), n, True, True, kind)]


def _sinks_params(m: ModelSpec, n: int) -> list[ParamTensor]:
    """The "sinks" attention module of `n` layers (``GptOssAttention``): its own ``sinks`` (one logit per
    query head, registered on the module itself, so listed first), then q/k/v/o with their biases."""
    return [ParamTensor("layers.self_attn.sinks", (m.n_heads,), n, False, True), *_gqa_params(m, n)]


def _gpt_oss_moe_params(m: ModelSpec, n: int, kind: str) -> list[ParamTensor]:
    """The "gpt_oss" MoE block of `n` layers (``GptOssMLP``): the router's weight and bias, then the
    expert stacks stored (in, out) (``is_transposed=True``) with a bias per expert: ``gate_up_proj``
    (E, h, 2f) with its gate and up columns interleaved, ``down_proj`` (E, f, h)."""
    E, El, h, ef = m.n_experts, m.held_experts, m.hidden, m.expert_width
    return [ParamTensor("layers.mlp.router.weight", (E, h), n, True, True, kind),
            ParamTensor("layers.mlp.router.bias", (E,), n, False, True, kind),
            ParamTensor("layers.mlp.experts.gate_up_proj", (El, h, 2 * ef), n, True, True, kind),
            ParamTensor("layers.mlp.experts.gate_up_proj_bias", (El, 2 * ef), n, False, True, kind),
            ParamTensor("layers.mlp.experts.down_proj", (El, ef, h), n, True, True, kind),
            ParamTensor("layers.mlp.experts.down_proj_bias", (El, h), n, False, True, kind)]


def _mla_params(m: ModelSpec, n: int) -> list[ParamTensor]:
    """The "mla" attention module of `n` layers (``DeepseekV3Attention``, registration order): ``q_proj``
    or the low-rank ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa`` (the kv latent
    and the shared rope key), ``kv_a_layernorm``, ``kv_b_proj`` (every head's nope key and value),
    ``o_proj``; ``attention_bias`` adds biases to q_a, kv_a and o."""
    h, H = m.hidden, m.n_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    a = "layers.self_attn."
    if m.q_lora_rank:
        q = [*_linear(a + "q_a_proj", m.q_lora_rank, h, m.qkv_bias, n), *_norm(a + "q_a_layernorm", m.q_lora_rank, False, n),
             *_linear(a + "q_b_proj", H * qk, m.q_lora_rank, False, n)]
    else:
        q = _linear(a + "q_proj", H * qk, h, False, n)
    return [*q, *_linear(a + "kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, h, m.qkv_bias, n),
            *_norm(a + "kv_a_layernorm", m.kv_lora_rank, False, n),
            *_linear(a + "kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False, n),
            *_linear(a + "o_proj", h, H * m.v_head_dim, m.out_bias, n)]


def _deepseek_moe_params(m: ModelSpec, n: int, kind: str) -> list[ParamTensor]:
    """The "deepseek" MoE block of `n` layers (``DeepseekV3MoE``): the expert stacks (as mixtral's), the
    router's fp32 weight (``DeepseekV3TopkRouter``, kept in fp32: ``_keep_in_fp32_modules_strict``) and the
    shared experts, a gated MLP ``n_shared_experts`` experts wide."""
    E, El, h, ef = m.n_experts, m.held_experts, m.hidden, m.expert_width
    sf = ef * m.n_shared_experts
    items = [ParamTensor("layers.mlp.experts.gate_up_proj", (El, 2 * ef, h), n, True, True, kind),
             ParamTensor("layers.mlp.experts.down_proj", (El, h, ef), n, True, True, kind),
             ParamTensor("layers.mlp.gate.weight", (E, h), n, True, True, kind, fp32=True)]
    if sf:
        items += [*_linear("layers.mlp.shared_experts.gate_proj", sf, h, False, n, kind=kind),
                  *_linear("layers.mlp.shared_experts.up_proj", sf, h, False, n, kind=kind),
                  *_linear("layers.mlp.shared_experts.down_proj", h, sf, False, n, kind=kind)]
    return items


def _pre_norm_params(m: ModelSpec, n: int) -> list[ParamTensor]:
    """The "pre" layer's norms: before attention and before the MLP."""
    return [*_norm("layers.input_layernorm", m.hidden, m.norm_bias, n),
            *_norm("layers.post_attention_layernorm", m.hidden, m.norm_bias, n)]


def _post_norm_params(m: ModelSpec, n: int) -> list[ParamTensor]:
    """The "post" layer's norms (``Olmo2DecoderLayer``): after attention and after the MLP."""
    return [*_norm("layers.post_attention_layernorm", m.hidden, m.norm_bias, n),
            *_norm("layers.post_feedforward_layernorm", m.hidden, m.norm_bias, n)]


def _sandwich_norm_params(m: ModelSpec, n: int) -> list[ParamTensor]:
    """The "sandwich" layer's four norms (``Gemma2DecoderLayer`` / ``Gemma3DecoderLayer``)."""
    return [t for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm") for t in _norm(f"layers.{name}", m.hidden, m.norm_bias, n)]


#: Each part's parameters, by the name a description gives it (the parts of `trainmem_nb.recipes.decoder`).
_ATTENTION_PARAMS: dict[str, Callable[[ModelSpec, int], list[ParamTensor]]] = {"gqa": _gqa_params}
_ATTENTION_PARAMS["sinks"] = _sinks_params
_ATTENTION_PARAMS["mla"] = _mla_params
_MLP_PARAMS: dict[str, Callable[[ModelSpec, int, str], list[ParamTensor]]] = {"gated": _gated_params}
def _qwen3_moe_params(m: ModelSpec, n: int, kind: str) -> list[ParamTensor]:
    """The "qwen3_moe" block of `n` layers: Qwen3MoeSparseMoeBlock registers the experts, then the router."""
    router, *stacks = _mixtral_moe_params(m, n, kind)
    return [*stacks, router]


_MLP_PARAMS["starcoder2"] = _starcoder2_mlp_params
_MOE_PARAMS: dict[str, Callable[[ModelSpec, int, str], list[ParamTensor]]] = {
    "mixtral": _mixtral_moe_params, "qwen3_moe": _qwen3_moe_params, "gpt_oss": _gpt_oss_moe_params,
    "deepseek": _deepseek_moe_params}
_LAYER_PARAMS: dict[str, Callable[[ModelSpec, int], list[ParamTensor]]] = {
    "pre": _pre_norm_params, "post": _post_norm_params, "sandwich": _sandwich_norm_params}


def _decoder_params(m: ModelSpec) -> list[ParamTensor]:
    """A composed decoder (`trainmem_nb.recipes.decoder`), as its description's parts build it: the
    embeddings, each layer's attention, MoE block (MoE layers) or dense MLP (dense layers; tagged by
    layer kind where a model has both) and norms, the final norm and the head."""
    d = DESCRIPTIONS[m.family]
    L, h, V = m.n_layers, m.hidden, m.vocab
    n_moe = sum(k.moe for k in m.layer_kinds)
    n_dense = L - n_moe
    moe, dense = ("moe", "dense") if n_moe and n_dense else ("", "")
    items = [ParamTensor("embed_tokens.weight", (V, h), 1, False, False)]
    items += _ATTENTION_PARAMS[d.attention](m, L)
    items += _qk_norm_params(m, L)
    if n_moe:
        items += _MOE_PARAMS[d.moe](m, n_moe, moe)
    if n_dense:
        items += _MLP_PARAMS[d.mlp](m, n_dense, dense)
    items += _LAYER_PARAMS[d.layer](m, L)
    items += _norm("norm", h, m.norm_bias, 1, False)
    if m.num_labels:  # GenericForSequenceClassification: ``score``, no LM head (tied or not)
        items += _linear("score", m.num_labels, h, False, 1, False)
    elif not m.tie_embeddings:
        items += _linear("lm_head", V, h, False, 1, False)
    return items


def _phi_params(m: ModelSpec) -> list[ParamTensor]:
    """``PhiForCausalLM`` (modeling_phi.py): per layer ``self_attn`` (q/k/v/dense with biases),
    ``mlp`` (fc1, fc2), one ``input_layernorm``; ``final_layernorm``; an ``lm_head`` with a bias,
    which stays the head's own when its weight is tied to ``embed_tokens``."""
    L, h, V, f, q, kv = m.n_layers, m.hidden, m.vocab, m.ffn, m.q_dim, m.kv_dim
    items = [ParamTensor("embed_tokens.weight", (V, h), 1, False, False)]
    items += [*_linear("layers.self_attn.q_proj", q, h, m.qkv_bias, L), *_linear("layers.self_attn.k_proj", kv, h, m.qkv_bias, L),
              *_linear("layers.self_attn.v_proj", kv, h, m.qkv_bias, L), *_linear("layers.self_attn.dense", h, q, m.out_bias, L)]
    if m.qk_layernorm:  # PhiAttention: nn.LayerNorm(hidden // heads) for the query and the key
        items += [*_norm("layers.self_attn.q_layernorm", h // m.n_heads, True, L),
                  *_norm("layers.self_attn.k_layernorm", h // m.n_heads, True, L)]
    items += [*_linear("layers.mlp.fc1", f, h, m.mlp_bias, L), *_linear("layers.mlp.fc2", h, f, m.mlp_bias, L)]
    items += _norm("layers.input_layernorm", h, True, L)
    items += _norm("final_layernorm", h, True, 1, False)
    if not m.tie_embeddings:
        items.append(ParamTensor("lm_head.weight", (V, h), 1, True, False))
    if m.lm_head_bias:
        items.append(ParamTensor("lm_head.bias", (V,), 1, False, False))
    return items


#: The inventory of each recipe's models (`trainmem_nb.model.families.Description.recipe`).
_INVENTORIES = {"decoder": _decoder_params, "gpt2": _gpt2_params, "gpt_neox": _gpt_neox_params, "opt": _opt_params,
                "bert": _bert_params, "phi": _phi_params, "biased_decoder": _decoder_params}


@lru_cache(maxsize=512)
def param_inventory(m: ModelSpec) -> tuple[ParamTensor, ...]:
    """All parameter tensors of `m` in the order the model registers them.

    >>> from trainmem_nb.model.presets import get_model
    >>> sum(p.numel * p.count for p in param_inventory(get_model("gpt2")))
    124439808
    """
    return tuple(_INVENTORIES[DESCRIPTIONS[m.family].recipe](m))


def count_params(m: ModelSpec) -> int:
    """Total parameters of `m` (tied weights once), its idle vision tower included."""
    return sum(p.numel * p.count for p in (*param_inventory(m), *vision_inventory(m)))


@lru_cache(maxsize=256)
def vision_inventory(m: ModelSpec) -> tuple[ParamTensor, ...]:
    """A multimodal Gemma 3 checkpoint's vision tower and projector (``Gemma3Model.vision_tower``, a
    ``SiglipVisionModel``: modeling_siglip.py; ``Gemma3MultiModalProjector``: modeling_gemma3.py), in
    ``named_parameters()`` order; every tensor `idle`: a text-only step never runs them. Empty without one."""
    v = m.vision
    if v is None:
        return ()
    h, f, n = v.hidden, v.intermediate, v.n_layers
    pre = "vision_tower.vision_model."
    items = [ParamTensor(f"{pre}embeddings.patch_embedding.weight", (h, v.channels, v.patch_size, v.patch_size), 1,
                         False, False),
             ParamTensor(f"{pre}embeddings.patch_embedding.bias", (h,), 1, False, False),
             ParamTensor(f"{pre}embeddings.position_embedding.weight", (v.n_patches, h), 1, False, False)]
    layer = f"{pre}encoder.layers."
    items += _norm(f"{layer}layer_norm1", h, True, n, False)  # SiglipEncoderLayer.__init__ order
    for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):  # SiglipAttention.__init__ order
        items += _linear(f"{layer}self_attn.{proj}", h, h, True, n, False)
    items += _norm(f"{layer}layer_norm2", h, True, n, False)
    items += [*_linear(f"{layer}mlp.fc1", f, h, True, n, False), *_linear(f"{layer}mlp.fc2", h, f, True, n, False)]
    items += _norm(f"{pre}post_layernorm", h, True, 1, False)
    if v.head:  # SiglipMultiheadAttentionPoolingHead: nn.MultiheadAttention keeps q/k/v as one parameter
        items += [ParamTensor(f"{pre}head.probe", (1, 1, h), 1, False, False),
                  ParamTensor(f"{pre}head.attention.in_proj_weight", (3 * h, h), 1, False, False),
                  ParamTensor(f"{pre}head.attention.in_proj_bias", (3 * h,), 1, False, False),
                  *_linear(f"{pre}head.attention.out_proj", h, h, True, 1, False),
                  *_norm(f"{pre}head.layernorm", h, True, 1, False),
                  *_linear(f"{pre}head.mlp.fc1", f, h, True, 1, False),
                  *_linear(f"{pre}head.mlp.fc2", h, f, True, 1, False)]
    items += [ParamTensor("multi_modal_projector.mm_input_projection_weight", (h, m.hidden), 1, False, False),
              *_norm("multi_modal_projector.mm_soft_emb_norm", h, False, 1, False)]
    return tuple(p._replace(idle=True) for p in items)


def idle_weights(m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, float]]:
    """The weights a text-only step holds but never runs, as ``(tensor, bytes per element)``: the vision tower
    in the model's dtype (NF4 under QLoRA: transformers' bitsandbytes integration replaces its nn.Linear
    layers too) and the LoRA adapters peft puts on its linear layers (`lora_targets` match them as they
    match the language model's: ``'qv'`` its q/v projections, ``'all-linear'`` all of them). None of them
    gets a gradient, so none has optimizer state."""
    inv = vision_inventory(m)
    if not inv:
        return []
    qlora = t.method is Method.QLORA
    out = [(p, nf4_bytes(p.numel, t.qlora_double_quant) / p.numel if qlora and quantized(p) else t.param_bytes)
           for p in inv]
    if t.method is Method.FULL:
        return out
    linears = [p for p in inv if p.matmul and len(p.shape) == 2 and p.name.endswith(".weight")]
    text = t.lora_targets.strip().lower()
    if text == "qv":
        names = list(DESCRIPTIONS[m.family].lora_qv)
    elif text in ("all-linear", "all_linear", "all"):
        names = [p.name[:-len(".weight")] for p in linears]
    else:
        names = [n.strip() for n in t.lora_targets.split(",") if n.strip()]
    for p in linears:
        mod = p.name[:-len(".weight")]
        if any(mod == n or mod.endswith("." + n) for n in names):
            out += [(ParamTensor(f"{mod}.lora_A.weight", (t.lora_rank, p.shape[1]), p.count, True, False, idle=True),
                     t.adapter_bytes),
                    (ParamTensor(f"{mod}.lora_B.weight", (p.shape[0], t.lora_rank), p.count, True, False, idle=True),
                     t.adapter_bytes)]
    return out


def idle_tensors(m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, float, bool]]:
    """`idle_weights` as `weight_tensors` gives weights, one entry per tensor (a repeated one's `count` split),
    frozen (none gets a gradient): what an engine that lays them out itself takes, in ``named_parameters()``
    order."""
    return [(p._replace(count=1), dt, False) for p, dt in idle_weights(m, t) for _ in range(p.count)]


def idle_trainable(m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, float]]:
    """The idle weights (`idle_weights`) that still require a gradient: the whole vision tower under full
    fine-tuning (nothing freezes it), peft's adapters on its linears under LoRA. Autograd never reaches them,
    but an engine that lays out memory for every such parameter up front (DDP's gradient buckets) counts them."""
    full = t.method is Method.FULL
    return [(p, dt) for p, dt in idle_weights(m, t) if full or ".lora_" in p.name]


@lru_cache(maxsize=512)
def buffer_inventory(m: ModelSpec) -> tuple[tuple[str, int, int], ...]:
    """Registered buffers as ``(name, bytes of one, count)``: rotary ``inv_freq`` (fp32), BERT's
    ``position_ids``/``token_type_ids`` (int64), Gemma's ``embed_scale``; tiny but allocated."""
    fam = m.family
    out: list[tuple[str, int, int]] = []
    d = DESCRIPTIONS[fam]
    if m.positions == "rotary" and d.rotary_per_kind:
        # Gemma3RotaryEmbedding: ``{layer_type}_inv_freq`` and its ``_original_inv_freq`` clone for each
        # layer type the model has (modeling_gemma3.py, Gemma3RotaryEmbedding.__init__)
        kinds = len({k.attention for k in m.layer_kinds})
        out.append(("rotary_emb.inv_freq", 4 * (m.rotary_dims // 2), 2 * kinds))
    elif m.positions == "rotary":
        # one rotary module at model level holds inv_freq and original_inv_freq (a clone):
        # (rotary_dims // 2,) fp32 each
        out.append(("rotary_emb.inv_freq", 4 * (m.rotary_dims // 2), 2))
    if d.embed_scale:
        out.append(("embed_tokens.embed_scale", 4, 1))
    if fam is Family.DEEPSEEK_V3:  # each MoE layer's router: e_score_correction_bias (E,) fp32
        out.append(("layers.mlp.gate.e_score_correction_bias", 4 * m.n_experts, sum(k.moe for k in m.layer_kinds)))
    if fam is Family.BERT:
        out.append(("embeddings.position_ids", 8 * m.max_positions, 1))
        out.append(("embeddings.token_type_ids", 8 * m.max_positions, 1))
    if m.vision is not None:  # SiglipVisionEmbeddings: ``position_ids = nn.Buffer(torch.arange(num_positions)...)``
        out.append(("vision_tower.vision_model.embeddings.position_ids", 8 * m.vision.n_patches, 1))
    return tuple(out)


#: Router weights: used by ``F.linear`` but held by custom modules (not ``nn.Linear``), so neither peft's
#: ``all-linear`` nor the bitsandbytes integration replaces them (mixtral's ``gate``, gpt_oss's ``router``).
_ROUTERS = ("mlp.gate.weight", "mlp.router.weight")


def lora_modules(m: ModelSpec, targets: str) -> tuple[str, ...]:
    """The in-layer modules LoRA adapts: ``'qv'``, ``'all-linear'`` (every 2-D matmul weight in the
    layers, as peft's ``all-linear`` picks nn.Linear/Conv1D layers but not the output head), or
    comma-separated names matched as suffixes like peft's ``target_modules``. Mixtral's router and
    experts are parameters, not linear layers: see `lora_moe_params`."""
    from ..errors import SpecError

    text = targets.strip().lower()
    linears = [p.name[len("layers."):-len(".weight")] for p in param_inventory(m)
               if p.in_layer and p.matmul and len(p.shape) == 2 and p.name.endswith(".weight")
               and not p.name.endswith(_ROUTERS)]
    if m.family in (Family.QWEN3_MOE, Family.DEEPSEEK_V3):
        # peft maps the v4 expert names onto the 3-D experts and drops them from target_modules, so a dense
        # layer's MLP projections of the same names are not adapted (`_convert_peft_config_moe`), nor are
        # deepseek_v3's shared experts (measured with peft 0.21: only the attention's linears keep adapters)
        mlp = ("gate_proj", "up_proj", "down_proj")
        linears = [mod for mod in linears if mod not in {f"mlp.{n}" for n in mlp} | {f"mlp.shared_experts.{n}" for n in mlp}]
    if text == "qv":  # the family's names that this model has (deepseek_v3: q_proj or q_b_proj)
        qv = DESCRIPTIONS[m.family].lora_qv
        return tuple(mod for mod in qv if mod in linears) or qv
    if text in ("all-linear", "all_linear", "all"):
        return tuple(linears)
    names = [n.strip() for n in targets.split(",") if n.strip()]
    chosen = tuple(mod for mod in linears if any(mod == n or mod.endswith("." + n) for n in names))
    if not chosen and not lora_moe_params(m, targets) and not lora_outer_modules(m, targets):
        moe = " (mixtral: also gate, w1+w3, w2)" if m.is_moe else ""
        outer = [mod for mod, _ in lora_outer_modules(m, "all-linear")]
        beside = f"; outside them: {', '.join(outer)}" if outer else ""
        raise SpecError(
            f"lora_targets={targets!r} matches no linear layer of {m.family.value}; "
            f"its layers have: {', '.join(sorted({x.split('.')[-1] for x in linears}))}{moe}{beside} "
            f"(or use 'qv', 'all-linear')"
        )
    return chosen


def lora_outer_modules(m: ModelSpec, targets: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The linear layers outside the transformer layers that LoRA adapts, with their (out, in) shape:
    peft's ``all-linear`` takes every nn.Linear but the output head (``get_output_embeddings()``), so
    also BERT's ``cls.predictions.transform.dense`` and OPT-350m's ``project_in`` / ``project_out``;
    explicit names match them as suffixes, as for the in-layer ones."""
    text = targets.strip().lower()
    if text == "qv":
        return ()
    outer = [(p.name[:-len(".weight")], p.shape) for p in param_inventory(m)
             if not p.in_layer and p.matmul and len(p.shape) == 2 and p.name.endswith(".weight")
             and p.name not in DESCRIPTIONS[m.family].heads]
    if text in ("all-linear", "all_linear", "all"):
        return tuple(outer)
    names = [n.strip() for n in targets.split(",") if n.strip()]
    return tuple((mod, shape) for mod, shape in outer if any(mod == n or mod.endswith("." + n) for n in names))


#: transformers 5 stores Mixtral's router as a custom module and its experts as fused 3-D
#: parameters; peft 0.21 maps the v4 module names a LoRA config may target onto them
#: (peft/utils/transformers_weight_conversion.py ``_MOE_TARGET_MODULE_MAPPING``): ``gate`` → the
#: router's ``gate.weight``, ``w1`` and ``w3`` (both or neither) → ``experts.gate_up_proj``, ``w2`` →
#: ``experts.down_proj``. ``all-linear`` includes all of them (they were nn.Linear in v4).
_MOE_V4_NAMES = {"gate": "mlp.gate", "w1": "mlp.experts.gate_up_proj", "w3": "mlp.experts.gate_up_proj",
                 "w2": "mlp.experts.down_proj"}
#: Qwen3-MoE's v4 names (transformers' conversion pattern maps qwen3_moe to qwen2_moe; peft's
#: ``_MOE_TARGET_MODULE_MAPPING["qwen2_moe"]``): ``gate_proj`` and ``up_proj`` fuse into ``gate_up_proj``.
_QWEN3_MOE_V4_NAMES = {"gate": "mlp.gate", "gate_proj": "mlp.experts.gate_up_proj",
                       "up_proj": "mlp.experts.gate_up_proj", "down_proj": "mlp.experts.down_proj"}


def lora_moe_params(m: ModelSpec, targets: str) -> tuple[str, ...]:
    """The MoE parameters peft's ``ParamWrapper`` adapts for `targets` (mixtral, qwen3_moe and deepseek_v3,
    whose v4 names peft maps as qwen2_moe's), in the order
    of peft's ``target_parameters`` (sorted: ``down_proj``, ``gate.weight``, ``gate_up_proj``).

    >>> from trainmem_nb.model.spec import ModelSpec
    >>> moe = ModelSpec(family="mixtral", n_layers=1, hidden=64, n_heads=4, ffn=128, vocab=100, n_experts=4)
    >>> lora_moe_params(moe, "all-linear")
    ('mlp.experts.down_proj', 'mlp.gate', 'mlp.experts.gate_up_proj')
    >>> lora_moe_params(moe, "qv")
    ()
    """
    from ..errors import SpecError

    if not m.is_moe or m.family not in (Family.MIXTRAL, Family.QWEN3_MOE, Family.DEEPSEEK_V3):
        return ()
    v4 = _MOE_V4_NAMES if m.family is Family.MIXTRAL else _QWEN3_MOE_V4_NAMES
    fused = {"w1", "w3"} if m.family is Family.MIXTRAL else {"gate_proj", "up_proj"}
    text = targets.strip().lower()
    if text == "qv":
        return ()
    if text in ("all-linear", "all_linear", "all"):
        names = set(v4)
    else:
        names = {n.strip().rsplit(".", 1)[-1] for n in targets.split(",") if n.strip()} & set(v4)
        if len(names & fused) == 1:
            one, other = sorted(names & fused)[0], sorted(fused - names)[0]
            raise SpecError(f"lora_targets={targets!r}: peft cannot target {one} without {other}: they are fused "
                            "into experts.gate_up_proj")
    chosen = {v4[n] for n in names}
    return tuple(p for p in ("mlp.experts.down_proj", "mlp.gate", "mlp.experts.gate_up_proj") if p in chosen)


@lru_cache(maxsize=512)
def lora_inventory(m: ModelSpec, targets: str, rank: int) -> tuple[ParamTensor, ...]:
    """LoRA adapter tensors: ``lora_A`` (rank, in) and ``lora_B`` (out, rank) per adapted layer, then
    peft's ``ParamWrapper`` adapters of mixtral's router and experts (`lora_moe_params`), in the order
    ``named_parameters()`` lists them (router; ``gate_up_proj``, wrapped innermost; ``down_proj``).

    A 3-D expert parameter (E, out, in) gets ``lora_A`` (E*r, in) and ``lora_B`` (out, E*r)
    (``ParamWrapper.update_layer``: one rank-r adapter per expert, stacked); ``gate_up_proj`` fuses v4's
    ``w1`` and ``w3``, so peft gives it rank 2r and alpha 2*alpha (the same scaling). The router's
    (E, h) weight gets a plain (r, h) / (E, r) pair.

    >>> from trainmem_nb.model.presets import get_model
    >>> m = get_model("mixtral-8x7b")
    >>> sum(p.numel for p in lora_inventory(m, "all-linear", 8))  # one layer; measured with peft 0.21
    5619776
    """
    base = {p.name[len("layers."):].removesuffix(".weight"): p for p in param_inventory(m) if p.in_layer}
    out: list[ParamTensor] = []
    for mod in lora_modules(m, targets):
        b = base[mod]
        in_f, out_f = (b.shape[0], b.shape[1]) if m.family is Family.GPT2 else (b.shape[1], b.shape[0])  # Conv1D is (in, out)
        out.append(ParamTensor(f"layers.{mod}.lora_A.weight", (rank, in_f), b.count, True, True, b.kind))
        out.append(ParamTensor(f"layers.{mod}.lora_B.weight", (out_f, rank), b.count, True, True, b.kind))
    for mod, (out_f, in_f) in lora_outer_modules(m, targets):
        out.append(ParamTensor(f"{mod}.lora_A.weight", (rank, in_f), 1, True, False))
        out.append(ParamTensor(f"{mod}.lora_B.weight", (out_f, rank), 1, True, False))
    moe = lora_moe_params(m, targets)
    E, h, f = m.n_experts, m.hidden, m.expert_width
    router: list[ParamTensor] = []
    if "mlp.gate" in moe:
        g = base["mlp.gate"]
        router.append(ParamTensor("layers.mlp.gate.lora_A.weight", (rank, h), g.count, True, True, g.kind))
        router.append(ParamTensor("layers.mlp.gate.lora_B.weight", (E, rank), g.count, True, True, g.kind))
    stacks: list[ParamTensor] = []
    for name, r, in_f, out_f in (("mlp.experts.gate_up_proj", 2 * rank, h, 2 * f), ("mlp.experts.down_proj", rank, f, h)):
        if name in moe:
            e = base[name]
            El = e.shape[0]  # the experts this rank holds (expert parallelism: n_experts / ep)
            stacks.append(ParamTensor(f"layers.{name}.lora_A.weight", (El * r, in_f), e.count, True, True, e.kind))
            stacks.append(ParamTensor(f"layers.{name}.lora_B.weight", (out_f, El * r), e.count, True, True, e.kind))
    # Qwen3MoeSparseMoeBlock and DeepseekV3MoE register their experts before their router
    out += [*stacks, *router] if m.family in (Family.QWEN3_MOE, Family.DEEPSEEK_V3) else [*router, *stacks]
    return tuple(out)


#: bitsandbytes NF4 (QLoRA, Dettmers et al. 2023; bitsandbytes/functional.py quantize_4bit): two
#: 4-bit values per byte, one absmax per block of 64; with double quantization the absmaxes are
#: stored as uint8 with one fp32 absmax per 256 of them plus a 256-entry fp32 code and an fp32 offset.
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
NF4_NESTED_CODE_BYTES = 256 * 4


def nf4_bytes(numel: int, double_quant: bool = True) -> float:
    """Device bytes of one NF4-quantized weight: packed values and quantization state, each storage
    rounded to the CUDA allocator's 512-B blocks."""
    def rnd(n: int) -> int:
        return -(-n // 512) * 512 if n > 0 else 0

    blocks = -(-numel // NF4_BLOCK)
    total = rnd(-(-numel // 2))
    if double_quant:
        total += rnd(blocks) + rnd(-(-blocks // NF4_NESTED_BLOCK) * 4) + rnd(NF4_NESTED_CODE_BYTES) + rnd(4)
    else:
        total += rnd(blocks * 4)
    return float(total)


def quantized(p: ParamTensor, head: bool = False) -> bool:
    """Does QLoRA quantize `p`? transformers' bitsandbytes integration replaces the ``nn.Linear``
    layers inside the transformer blocks; embeddings, norms and the LM head (``lm_head`` is in
    ``get_keys_to_not_convert``) stay in the model's dtype, as do mixtral's 3-D expert tensors and its
    router's weight (``MixtralTopKRouter`` is not an nn.Linear in transformers 5). With `head`
    (`TrainingSpec.qlora_head`: Lightning Fabric's BitsandbytesPrecision replaces every ``nn.Linear``) the
    untied head's weight too."""
    if head and p.name == "lm_head.weight":
        return True
    return ((p.in_layer or p.idle) and p.matmul and len(p.shape) == 2 and not p.name.endswith((".bias", *_ROUTERS))
            and ".lora_" not in p.name)


def as_built(m: ModelSpec, t: TrainingSpec) -> ModelSpec:
    """The model as the training code builds it: with `TrainingSpec.untied_head` a tied checkpoint's head is a
    weight of its own (litgpt), so the estimate counts, trains and quantizes it apart from the embedding."""
    if t.untied_head and m.tie_embeddings:
        return m.model_copy(update={"tie_embeddings": False})  # validated once; only the tie changes
    return m


def weight_tensors(m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, int, bool]]:
    """Every weight tensor of the training run as ``(tensor, bytes per element, trainable)``:
    the base model in the recipe's dtype (frozen under LoRA; NF4 under QLoRA, a fractional element
    size) plus LoRA adapters, which peft keeps in fp32 on a 16-bit base (``autocast_adapter_dtype=True``) unless
    ``lora_dtype='base'``."""
    full = t.method is Method.FULL
    if t.method is Method.QLORA:
        qout = [(p, nf4_bytes(p.numel, t.qlora_double_quant) / p.numel if quantized(p, t.qlora_head)
                 else (4 if p.fp32 else t.param_bytes),
                 False) for p in param_inventory(m)]
        qout += [(p, t.adapter_bytes, True) for p in lora_inventory(m, t.lora_targets, t.lora_rank)]
        # NF4 weights' bytes per element are fractional: the tape's `dt` is typed int (a float works at run time)
        return qout  # type: ignore[return-value]
    out = [(p, 4 if p.fp32 else t.param_bytes, full and _gets_gradient(p, m)) for p in param_inventory(m)]
    if not full:
        out += [(p, t.adapter_bytes, True) for p in lora_inventory(m, t.lora_targets, t.lora_rank)]
    return out


def _gets_gradient(p: ParamTensor, m: ModelSpec) -> bool:
    """Does full fine-tuning give `p` a gradient? An untied BERT head's decoder has its own bias, so
    ``cls.predictions.bias`` takes no part in the loss: it gets no ``.grad``, hence no optimizer state
    (torch.optim's ``_init_group`` skips parameters whose grad is None) and nothing for zero_grad to free."""
    return not (m.family is Family.BERT and not m.tie_embeddings and p.name == "cls.predictions.bias")


def trainable_tensors(m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, int]]:
    """The tensors the optimizer updates, with their bytes per element."""
    return [(p, dt) for p, dt, trainable in weight_tensors(m, t) if trainable]


def on_stage(p: ParamTensor, m: ModelSpec, first: bool, last: bool) -> bool:
    """Does a pipeline stage (the `first` and/or `last` one) hold `p`? Layers are split beforehand;
    the first stage holds the embeddings, the last the final norm and head, and with tied embeddings
    the last one holds a copy of the embedding matrix as its head (Megatron-LM keeps both in sync)."""
    if p.in_layer or (first and last):
        return True
    d = DESCRIPTIONS[m.family]
    if p.name.startswith(d.input_side):
        return first or (last and m.tie_embeddings and p.name == d.embedding)
    return last
