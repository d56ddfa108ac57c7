"""What each model family is, in one place: one `Description` per family.

A description says how Hugging Face builds the family (the class a training run instantiates, its
transformer block), its structural defaults (norm, MLP kind, biases, positions: the `ModelSpec`
fields a config may override), which modules LoRA's ``'qv'`` adapts, which config keys set its
dropouts, and, for the decoders composed from parts (``recipe="decoder"``, the families Hugging Face
builds from llama, mistral, gemma and mixtral), which part each of its modules is. Every module that
needs to know something about a family reads it here: parameter inventories, config readers, recipes,
launch configs, measurement, FLOPs.

>>> describe("gemma").norm, describe("gemma").embed_scale, describe("gemma").layer_class
('gemma', True, 'GemmaDecoderLayer')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..spec.base import _Choice

__all__ = ["ACTIVATIONS", "BIAS_FIELDS", "DESCRIPTIONS", "Description", "Family", "describe"]


class Family(_Choice):
    """Model families, each as Hugging Face transformers implements it (its `Description`)."""

    LLAMA = "llama"  #: RMSNorm, SwiGLU, RoPE, GQA; also Llama 2/3, TinyLlama
    MISTRAL = "mistral"  #: llama layout with a sliding attention window
    QWEN2 = "qwen2"  #: llama layout with q/k/v biases
    GEMMA = "gemma"  #: GeGLU, (1+w) RMSNorm computed in fp32, scaled embeddings, head_dim 256
    PHI3 = "phi3"  #: fused qkv_proj and gate_up_proj, residual dropout
    MIXTRAL = "mixtral"  #: llama attention, top-k routed mixture-of-experts MLP
    GPT2 = "gpt2"  #: LayerNorm, Conv1D fused c_attn, gelu_new, learned positions, tied head
    GPT_NEOX = "gpt_neox"  #: Pythia; fused qkv, partial rotary, parallel residual
    OPT = "opt"  #: LayerNorm, ReLU MLP, learned positions (offset 2), tied head
    BERT = "bert"  #: encoder, post-LayerNorm, masked-LM head tied to the word embeddings
    QWEN3 = "qwen3"  #: llama layout with per-head q/k RMSNorm before rotary, head_dim 128 by default
    SMOLLM3 = "smollm3"  #: llama layout without rotary on every 4th layer (NoPE), tied embeddings
    GRANITE = "granite"  #: llama layout with embedding, residual and logit multipliers (IBM Granite 3.x)
    QWEN3_MOE = "qwen3_moe"  #: Qwen3 attention, top-k routed experts (renormalised if norm_topk_prob), dense layers
    PHI = "phi"  #: phi-1.5/phi-2: one LayerNorm feeding parallel attention and MLP, partial rotary, biased head
    STARCODER2 = "starcoder2"  #: LayerNorm with bias, GELU c_fc/c_proj MLP, biases, GQA, rotary, sliding window
    OLMO2 = "olmo2"  #: norms after attention and MLP (no pre-norms), full-width q/k RMSNorm
    GEMMA2 = "gemma2"  #: sandwich norms, logit soft-capping, alternating sliding/global layers
    GEMMA3 = "gemma3"  #: sandwich norms, per-head q/k norms, 5:1 sliding/global, a rotary base per kind
    GPT_OSS = "gpt_oss"  #: attention sinks, alternating sliding/full layers, biased top-k MoE, clamped SwiGLU
    DEEPSEEK_V3 = "deepseek_v3"  #: multi-head latent attention, dense then MoE layers, grouped sigmoid routing, shared experts


#: Activation functions the recipes implement (Hugging Face ``ACT2FN`` names).
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")

_RMS_DECODER = {"norm": "rmsnorm", "mlp": "gated", "activation": "silu", "positions": "rotary"}
_LLAMA_INPUTS = ("embed_tokens.",)

#: The `ModelSpec` bias flags of the projections; a family's `Description.biases` says which config keys set them.
BIAS_FIELDS = ("qkv_bias", "out_bias", "mlp_bias")
#: ``attention_bias`` builds q/k/v and the output projection with or without bias, all alike
_ATTENTION_BIAS: tuple[tuple[str, tuple[str, ...]], ...] = (("attention_bias", ("qkv_bias", "out_bias")),)
#: LlamaConfig's two switches: ``attention_bias`` (q/k/v/o) and ``mlp_bias`` (gate/up/down)
_LLAMA_BIASES = (*_ATTENTION_BIAS, ("mlp_bias", ("mlp_bias",)))
#: the separate projections of a Llama-style layer that read one input and that Megatron's layers run as one
#: linear (megatron/core/models/gpt/gpt_layer_specs.py: ``linear_qkv``, the MLP's ``linear_fc1``)
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_FUSED_LLAMA = (_QKV, ("mlp.gate_proj", "mlp.up_proj"))


@dataclass(frozen=True)
class Description:
    """One model family as Hugging Face builds it: the facts every part of trainmem_nb reads."""

    family: Family
    #: ``model_type`` values of config.json files read as this family
    model_types: tuple[str, ...]
    #: the class a training run instantiates (``*ForCausalLM``; ``BertForMaskedLM`` for bert)
    hf_class: str
    #: its transformer block class: FSDP wraps (shards) one per block
    layer_class: str
    #: the recipe that runs its forward: ``"decoder"`` (composed from parts), ``"biased_decoder"`` (the
    #: same parts with biased projections as ``addmm``, `trainmem_nb.recipes.biased`) or a bespoke one by name
    recipe: str
    #: `ModelSpec` defaults for the family's structure (a config may override them)
    structure: Mapping[str, Any]
    #: ``tie_word_embeddings`` when a config omits it (the family's configuration_*.py)
    tie_default: bool
    #: the modules in a layer that ``lora_targets='qv'`` adapts (a fused q/k/v projection: that one)
    lora_qv: tuple[str, ...]
    #: config.json keys that set every dropout site of the model
    dropout_keys: tuple[str, ...]
    #: name prefixes of the parameters outside the layers that the first pipeline stage holds (the
    #: embeddings); the others outside the layers belong to the output side (final norm, head)
    input_side: tuple[str, ...] = _LLAMA_INPUTS
    #: output-head weights (``get_output_embeddings()``), which peft's ``all-linear`` does not adapt
    heads: tuple[str, ...] = ("lm_head.weight",)
    #: the token-embedding matrix (a tied head reuses it; the last pipeline stage then keeps a copy)
    embedding: str = "embed_tokens.weight"
    #: the attention's output projection (its module name in the layer), which reads the attention's result
    attention_output: str = "self_attn.o_proj"
    #: groups of a layer's projections that read one input, each in the order the forward runs them, that a
    #: Megatron-style layer runs as one fused linear (query/key/value; gate/up); a module in none is alone
    fused_projections: tuple[tuple[str, ...], ...] = _FUSED_LLAMA
    # -- the parts of a decoder composed by `trainmem_nb.recipes.decoder` ------------------------------
    #: the decoder layer's placement of norms and residuals (`trainmem_nb.recipes.layers.LAYERS`):
    #: ``"pre"`` (a norm before attention and before the MLP, each added to the residual stream), ``"post"``
    #: (a norm on each sublayer's output before its residual add, none before: OLMo 2) or ``"sandwich"``
    #: (both: input, post-attention, pre-feedforward and post-feedforward norms, Gemma 2/3)
    layer: str = "pre"
    #: the attention module (`trainmem_nb.recipes.attention.ATTENTIONS`): ``"gqa"`` (q/k/v projections,
    #: grouped-query attention, ``o_proj``)
    attention: str = "gqa"
    #: the dense MLP (`trainmem_nb.recipes.mlp.MLPS`): ``"gated"`` (``down(act(gate(x)) * up(x))``) or
    #: ``"starcoder2"`` (``c_proj(act(c_fc(x)))``)
    mlp: str = "gated"
    #: the mixture-of-experts block of MoE layers (`trainmem_nb.recipes.moe.MOES`): ``"mixtral"``
    #: (softmax top-k router, grouped_mm experts) or ``"qwen3_moe"`` (experts registered before the router,
    #: whose renormalisation is optional and whose weights are cast back to the logits' dtype)
    moe: str = "mixtral"
    #: RMSNorm variant (`trainmem_nb.recipes.norms.RMS_NORMS`): ``"llama"`` (normalise in fp32, cast back,
    #: then ``* weight``), ``"gemma"`` (``* (1 + weight)`` in fp32, then cast) or ``"olmo2"`` (``weight *``
    #: the fp32 normalised states, then cast back); unused by a model whose norm is ``nn.LayerNorm``
    #: (``ModelSpec.norm == "layernorm"``, with its bias when ``norm_bias``)
    norm: str = "llama"
    #: the token embeddings are multiplied by ``sqrt(hidden)`` (a buffer in the model's dtype)
    embed_scale: bool = False
    #: the model builds a sliding-window mask when its config has a window (mistral's
    #: ``create_sliding_window_causal_mask``); otherwise the mask is causal
    sliding_mask: bool = False
    #: how rotary embeddings are applied: ``"elementwise"`` (``x * cos + rotate_half(x) * sin`` in the
    #: projections' layout) or ``"cat"`` (rotary and pass-through parts concatenated: contiguous q/k), or
    #: ``"chunk"`` (gpt_oss: cos/sin of half the head, ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``)
    rotary: str = "elementwise"
    #: one ``gate_up_proj`` chunked into gate and up instead of two projections
    fused_gate_up: bool = False
    #: the config keys that switch projection biases, each with the `BIAS_FIELDS` it sets together (its
    #: default is the `structure`'s); a bias field no key sets is fixed by the modeling code (``bias=True`` or
    #: ``False`` in the module), so a spec must keep the family's value
    biases: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: dropout on the attention and MLP outputs before each residual add
    residual_dropout: bool = False
    #: attention kinds whose mask the model builds even when no layer uses it (Qwen3Model always
    #: builds ``causal_mask_mapping["full_attention"]``, then the sliding one if a layer slides; Gemma 2/3's
    #: and gpt_oss's ``causal_mask_mapping`` always hold a full and a sliding-window mask)
    always_masks: tuple[str, ...] = ()
    #: Granite's scalar multipliers, each a real multiply even at 1.0: ``inputs_embeds *
    #: embedding_multiplier``, ``residual + h * residual_multiplier`` after attention and after the MLP,
    #: ``logits / logits_scaling`` (``attention_multiplier`` is the attention's scale: no tensor of its own)
    multipliers: bool = False
    #: dropout at the end of the attention module (after ``o_proj``) and of the MLP (after its output
    #: projection), inside the modules (Starcoder2's ``residual_dropout``)
    module_dropout: bool = False
    #: dropout on the token embeddings before the layers, whose output is the first layer's input only:
    #: ``inputs_embeds`` stays bound until the model returns (Starcoder2's ``embedding_dropout``)
    embed_dropout: bool = False
    #: q/k RMSNorms in the attention: ``""`` none; ``"full"`` over the whole projection width before the
    #: heads view (OLMo 2: ``q_norm(q_proj(x))``); ``"head"`` per head on the (b, heads, s, d) views (Gemma 3);
    #: ``"head_view"`` per head on the projection's (b, s, heads, d) view, before the transpose and
    #: rotary (Qwen3: ``q_norm(q_proj(x).view(hidden_shape)).transpose(1, 2)``)
    qk_norm: str = ""
    #: the rotary module returns fp32 cos/sin (no cast to the hidden states' dtype) and
    #: ``apply_rotary_pos_emb`` casts its results back to q's and k's dtypes (OLMo 2)
    rotary_fp32: bool = False
    #: one rotary cos/sin pair per attention kind of the model's layer types (Gemma 3: a local and a
    #: global base)
    rotary_per_kind: bool = False
    #: without ``layer_types``, every n-th layer is global and the others slide (the configuration's
    #: default ``layer_types``: Gemma 2 alternates, 2; Gemma 3's ``sliding_window_pattern`` is 6); 0: the
    #: `sliding_mask` rule
    sliding_period: int = 0
    #: the soft-cappings its modeling code applies (``"attention"``: the attention logits, Gemma 2;
    #: ``"final"``: the output logits, Gemma 2 and 3); a spec's ``attn_softcap`` / ``final_softcap``
    #: must be 0 for a family without them
    softcaps: tuple[str, ...] = ()
    #: Hugging Face implements SDPA for it (``_supports_sdpa``); without, a run that asks for no
    #: implementation gets eager attention, so ``attention='sdpa'`` is run (and measured) as eager
    #: (Gemma 2), or refused where the eager path is what the model needs (gpt_oss's sinks)
    sdpa: bool = True
    #: the step simulates a repeating period of several layers once, after a prefix holding every kind
    #: and before the last layers (`trainmem_nb.model.layers.compress_between`), instead of three
    #: times: Gemma 3's 5:1 pattern, 14 simulated layers instead of 20 (checked against running every
    #: layer, tests/test_olmo2_gemma2_gemma3.py)
    period_once: bool = False
    #: its transformers 4.x head upcast the logits to fp32 as Llama's did (4.31-4.48: `CausalLMLoss`'s
    #: model-upcast and logits-shifted); GPT-2, OPT and GPT-NeoX shifted and cross-entropied them in the
    #: head's dtype until 4.49 moved every family to the shared ForCausalLMLoss (modeling_gpt2.py,
    #: modeling_opt.py, modeling_gpt_neox.py 4.30-4.48: ``shift_logits = lm_logits[..., :-1, :].contiguous()``,
    #: no ``.float()``)
    v4_upcast: bool = True

    @property
    def fused_group(self) -> dict[str, tuple[str, ...]]:
        """Each projection of a `fused_projections` group mapped to its group."""
        return {module: group for group in self.fused_projections for module in group}

    @property
    def composed(self) -> bool:
        """Is the forward composed from parts (`trainmem_nb.recipes.decoder`)?"""
        return self.recipe in ("decoder", "biased_decoder")


DESCRIPTIONS: dict[Family, Description] = {
    Family.LLAMA: Description(
        Family.LLAMA, ("llama",), "LlamaForCausalLM", "LlamaDecoderLayer", "decoder", _RMS_DECODER,
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        biases=_LLAMA_BIASES),
    Family.MISTRAL: Description(
        Family.MISTRAL, ("mistral",), "MistralForCausalLM", "MistralDecoderLayer", "decoder", _RMS_DECODER,
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        sliding_mask=True),
    Family.QWEN2: Description(
        Family.QWEN2, ("qwen2",), "Qwen2ForCausalLM", "Qwen2DecoderLayer", "decoder",
        {**_RMS_DECODER, "qkv_bias": True},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",)),
    Family.GEMMA: Description(
        Family.GEMMA, ("gemma",), "GemmaForCausalLM", "GemmaDecoderLayer", "decoder",
        {**_RMS_DECODER, "activation": "gelu_pytorch_tanh", "tie_embeddings": True},
        tie_default=True, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        norm="gemma", embed_scale=True,
        biases=_ATTENTION_BIAS),
    Family.PHI3: Description(
        Family.PHI3, ("phi3",), "Phi3ForCausalLM", "Phi3DecoderLayer", "decoder", {**_RMS_DECODER, "fused_qkv": True},
        tie_default=False, lora_qv=("self_attn.qkv_proj",),
        dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop"),
        sliding_mask=True, rotary="cat", fused_gate_up=True, residual_dropout=True, fused_projections=()),
    Family.MIXTRAL: Description(
        Family.MIXTRAL, ("mixtral",), "MixtralForCausalLM", "MixtralDecoderLayer", "decoder",
        {**_RMS_DECODER, "n_experts": 8, "experts_top_k": 2},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        sliding_mask=True),
    Family.GPT2: Description(
        Family.GPT2, ("gpt2",), "GPT2LMHeadModel", "GPT2Block", "gpt2",
        {"norm": "layernorm", "mlp": "dense", "activation": "gelu_new", "positions": "learned", "fused_qkv": True,
         "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True, "tie_embeddings": True},
        tie_default=True, lora_qv=("attn.c_attn",), dropout_keys=("attn_pdrop", "resid_pdrop", "embd_pdrop"),
        input_side=("wte.", "wpe."), embedding="wte.weight", v4_upcast=False, attention_output="attn.c_proj",
        fused_projections=()),
    Family.GPT_NEOX: Description(
        Family.GPT_NEOX, ("gpt_neox",), "GPTNeoXForCausalLM", "GPTNeoXLayer", "gpt_neox",
        {"norm": "layernorm", "mlp": "dense", "activation": "gelu", "positions": "rotary", "rotary_pct": 0.25,
         "fused_qkv": True, "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True,
         "parallel_residual": True},
        tie_default=False, lora_qv=("attention.query_key_value",), dropout_keys=("attention_dropout", "hidden_dropout"),
        input_side=("embed_in.",), heads=("embed_out.weight",), embedding="embed_in.weight", v4_upcast=False,
        attention_output="attention.dense", fused_projections=(),
        biases=_ATTENTION_BIAS),
    Family.OPT: Description(
        Family.OPT, ("opt",), "OPTForCausalLM", "OPTDecoderLayer", "opt",
        {"norm": "layernorm", "mlp": "dense", "activation": "relu", "positions": "learned", "qkv_bias": True,
         "out_bias": True, "mlp_bias": True, "norm_bias": True, "tie_embeddings": True},
        tie_default=True, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("dropout", "attention_dropout"),
        input_side=("embed_tokens.", "embed_positions.", "project_in."), v4_upcast=False,
        attention_output="self_attn.out_proj", fused_projections=(_QKV,),
        biases=(("enable_bias", BIAS_FIELDS),)),
    Family.BERT: Description(
        Family.BERT, ("bert",), "BertForMaskedLM", "BertLayer", "bert",
        {"norm": "layernorm", "mlp": "dense", "activation": "gelu", "positions": "learned", "qkv_bias": True,
         "out_bias": True, "mlp_bias": True, "norm_bias": True, "tie_embeddings": True, "max_positions": 512,
         "pre_norm": False},
        tie_default=True, lora_qv=("attention.self.query", "attention.self.value"),
        dropout_keys=("hidden_dropout_prob", "attention_probs_dropout_prob"),
        input_side=("embeddings.",), heads=("cls.predictions.decoder.weight",),
        embedding="embeddings.word_embeddings.weight", attention_output="attention.output.dense",
        fused_projections=(("attention.self.query", "attention.self.key", "attention.self.value"),)),
    # modeling_qwen3.py (transformers 5.x): Qwen3Attention's q_norm/k_norm; Qwen3Config's head_dim=128,
    # tie_word_embeddings=False (configuration_qwen3.py lines 67, 73)
    Family.QWEN3: Description(
        Family.QWEN3, ("qwen3",), "Qwen3ForCausalLM", "Qwen3DecoderLayer", "decoder", _RMS_DECODER,
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        qk_norm="head_view", always_masks=("full",),
        biases=_ATTENTION_BIAS),
    # modeling_smollm3.py: SmolLM3Attention applies rotary only where config.no_rope_layers[i] is 1;
    # SmolLM3Config ties the embeddings by default (configuration_smollm3.py line 94)
    Family.SMOLLM3: Description(
        Family.SMOLLM3, ("smollm3",), "SmolLM3ForCausalLM", "SmolLM3DecoderLayer", "decoder", _RMS_DECODER,
        tie_default=True, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        always_masks=("full",),
        biases=_LLAMA_BIASES),
    # modeling_granite.py: GraniteModel.forward, GraniteDecoderLayer.forward, GraniteForCausalLM.forward
    Family.GRANITE: Description(
        Family.GRANITE, ("granite",), "GraniteForCausalLM", "GraniteDecoderLayer", "decoder", _RMS_DECODER,
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        multipliers=True,
        biases=_LLAMA_BIASES),
    # modeling_qwen3_moe.py: Qwen3MoeSparseMoeBlock (experts, then the gate), Qwen3MoeTopKRouter; one mask for
    # all layers, sliding when the config uses its window (Qwen3MoeModel.forward)
    Family.QWEN3_MOE: Description(
        Family.QWEN3_MOE, ("qwen3_moe",), "Qwen3MoeForCausalLM", "Qwen3MoeDecoderLayer", "decoder",
        {**_RMS_DECODER, "n_experts": 128, "experts_top_k": 8, "norm_topk_prob": False},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        qk_norm="head_view", sliding_mask=True, moe="qwen3_moe",
        biases=_ATTENTION_BIAS),
    # modeling_phi.py: PhiAttention's q/k/v/dense all have bias=True, PhiMLP's fc1/fc2 nn.Linear's
    # default bias, both LayerNorms affine with bias, lm_head bias=True; configuration_phi.py:
    # hidden_act "gelu_new" (line 71), partial_rotary_factor 0.5 (line 87), tie_word_embeddings False (line 76)
    Family.PHI: Description(
        Family.PHI, ("phi",), "PhiForCausalLM", "PhiDecoderLayer", "phi",
        {"norm": "layernorm", "mlp": "dense", "activation": "gelu_new", "positions": "rotary", "rotary_pct": 0.5,
         "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True, "parallel_residual": True,
         "lm_head_bias": True},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"),
        dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop"), rotary="cat",
        attention_output="self_attn.dense", fused_projections=(_QKV,)),
    # modeling_starcoder2.py: nn.LayerNorm (with bias) around a Starcoder2MLP (c_fc, act, c_proj, dropout),
    # q/k/v/o and c_fc/c_proj biases from use_bias (configuration_starcoder2.py line 79: True), hidden_act
    # "gelu_pytorch_tanh" (line 66), tie_word_embeddings True (line 80), the sliding-window mask whenever
    # sliding_window is set (Starcoder2Model.forward), an unbiased lm_head
    Family.STARCODER2: Description(
        Family.STARCODER2, ("starcoder2",), "Starcoder2ForCausalLM", "Starcoder2DecoderLayer", "biased_decoder",
        {"norm": "layernorm", "norm_bias": True, "mlp": "dense", "activation": "gelu_pytorch_tanh",
         "positions": "rotary", "qkv_bias": True, "out_bias": True, "mlp_bias": True, "tie_embeddings": True},
        tie_default=True, lora_qv=("self_attn.q_proj", "self_attn.v_proj"),
        dropout_keys=("attention_dropout", "residual_dropout", "embedding_dropout"),
        mlp="starcoder2", sliding_mask=True, module_dropout=True, embed_dropout=True, fused_projections=(_QKV,),
        biases=(("use_bias", BIAS_FIELDS),)),
    Family.OLMO2: Description(
        Family.OLMO2, ("olmo2",), "Olmo2ForCausalLM", "Olmo2DecoderLayer", "decoder", _RMS_DECODER,
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        layer="post", norm="olmo2", qk_norm="full", rotary_fp32=True,
        biases=_ATTENTION_BIAS),
    Family.GEMMA2: Description(
        Family.GEMMA2, ("gemma2",), "Gemma2ForCausalLM", "Gemma2DecoderLayer", "decoder",
        # Gemma2Config's defaults (configuration_gemma2.py: soft-capping 50.0 / 30.0, sliding_window 4096)
        {**_RMS_DECODER, "activation": "gelu_pytorch_tanh", "tie_embeddings": True, "attn_softcap": 50.0,
         "final_softcap": 30.0, "sliding_window": 4096},
        tie_default=True, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        layer="sandwich", norm="gemma", embed_scale=True, sliding_mask=True, always_masks=("full", "sliding"), sliding_period=2,
        # Gemma2PreTrainedModel._supports_sdpa = False ("sdpa does not support softcapping", modeling_gemma2.py)
        softcaps=("attention", "final"), sdpa=False,
        biases=_ATTENTION_BIAS),
    Family.GEMMA3: Description(
        Family.GEMMA3, ("gemma3_text", "gemma3"), "Gemma3ForCausalLM", "Gemma3DecoderLayer", "decoder",
        # Gemma3TextConfig's default window (configuration_gemma3.py: sliding_window 4096)
        {**_RMS_DECODER, "activation": "gelu_pytorch_tanh", "tie_embeddings": True, "sliding_window": 4096},
        tie_default=True, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        layer="sandwich", norm="gemma", embed_scale=True, sliding_mask=True, always_masks=("full", "sliding"), qk_norm="head",
        # Gemma3Attention passes no softcap to its attention function: only the final logits are capped
        rotary_per_kind=True, sliding_period=6, softcaps=("final",), period_once=True,
        biases=_ATTENTION_BIAS),
    # modeling_gpt_oss.py (transformers 5.24): q/k/v/o biases (configuration_gpt_oss.py attention_bias=True),
    # per-head sinks, eager attention only (``_supports_sdpa = False``), layer_types alternating sliding/full
    # attention, a biased router and biased expert stacks (grouped_mm), half-width rotary cos/sin. The released
    # checkpoints store the experts in MXFP4; training dequantizes them (Mxfp4Config(dequantize=True)), so the
    # model here holds every weight in the training dtype (bf16 or fp32), as from_config builds it
    Family.GPT_OSS: Description(
        Family.GPT_OSS, ("gpt_oss",), "GptOssForCausalLM", "GptOssDecoderLayer", "decoder",
        {**_RMS_DECODER, "qkv_bias": True, "out_bias": True, "n_experts": 128, "experts_top_k": 4},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        attention="sinks", moe="gpt_oss", norm="olmo2", rotary="chunk", sdpa=False,
        always_masks=("full", "sliding"),
        biases=_ATTENTION_BIAS),
    # modeling_deepseek_v3.py (transformers 5.24): multi-head latent attention (low-rank q with q_a_layernorm,
    # compressed kv with kv_a_layernorm, a shared rope key, interleaved rotary), first_k_dense_replace dense
    # layers then DeepseekV3MoE (sigmoid group-limited router, grouped_mm experts, shared experts)
    Family.DEEPSEEK_V3: Description(
        Family.DEEPSEEK_V3, ("deepseek_v3",), "DeepseekV3ForCausalLM", "DeepseekV3DecoderLayer", "decoder",
        {**_RMS_DECODER, "n_experts": 256, "experts_top_k": 8, "n_shared_experts": 1, "n_expert_groups": 8,
         "topk_groups": 4},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj"),
        dropout_keys=("attention_dropout",), attention="mla", moe="deepseek", norm="deepseek",
        # Megatron's MLA keeps its q and kv down projections apart (transformer_config.py: mla_down_proj_fusion
        # False); the dense layers' and the shared experts' gate/up are each one linear_fc1
        fused_projections=(("mlp.gate_proj", "mlp.up_proj"),
                           ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
        biases=_ATTENTION_BIAS),
}


def describe(family: Family | str) -> Description:
    """The description of `family` (a `Family` or its name)."""
    return DESCRIPTIONS[Family.parse(family, "family")]
