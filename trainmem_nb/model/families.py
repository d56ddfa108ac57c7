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

__all__ = ["ACTIVATIONS", "DESCRIPTIONS", "Description", "Family", "describe"]


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
    GPT_OSS = "gpt_oss"  #: attention sinks, alternating sliding/full layers, biased top-k MoE, clamped SwiGLU
    DEEPSEEK_V3 = "deepseek_v3"  #: multi-head latent attention, dense then MoE layers, grouped sigmoid routing, shared experts


#: Activation functions the recipes implement (Hugging Face ``ACT2FN`` names).
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")

_RMS_DECODER = {"norm": "rmsnorm", "mlp": "gated", "activation": "silu", "positions": "rotary"}
_LLAMA_INPUTS = ("embed_tokens.",)


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
    #: the recipe that runs its forward: ``"decoder"`` (composed from parts) or a bespoke one by name
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
    # -- the parts of a decoder composed by `trainmem_nb.recipes.decoder` ------------------------------
    #: the decoder layer's placement of norms and residuals (`trainmem_nb.recipes.layers.LAYERS`):
    #: ``"pre"`` (a norm before attention and before the MLP, each added to the residual stream)
    layer: str = "pre"
    #: the attention module (`trainmem_nb.recipes.attention.ATTENTIONS`): ``"gqa"`` (q/k/v projections,
    #: grouped-query attention, ``o_proj``)
    attention: str = "gqa"
    #: the dense MLP (`trainmem_nb.recipes.mlp.MLPS`): ``"gated"`` (``down(act(gate(x)) * up(x))``)
    mlp: str = "gated"
    #: the mixture-of-experts block of MoE layers (`trainmem_nb.recipes.moe.MOES`): ``"mixtral"``
    #: (softmax top-k router, grouped_mm experts)
    moe: str = "mixtral"
    #: RMSNorm variant (`trainmem_nb.recipes.norms.RMS_NORMS`): ``"llama"`` (normalise in fp32, cast back,
    #: then ``* weight``) or ``"gemma"`` (``* (1 + weight)`` in fp32, then cast)
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
    #: dropout on the attention and MLP outputs before each residual add
    residual_dropout: bool = False
    #: Hugging Face runs the family with ``attn_implementation="sdpa"`` (False: the model class refuses
    #: it, ``_supports_sdpa = False``, as gpt_oss does: its sinks need the eager path)
    sdpa: bool = True
    #: attention kinds whose mask the model builds whatever its layers use (gpt_oss's
    #: ``causal_mask_mapping`` always holds a full and a sliding-window mask)
    mask_kinds: tuple[str, ...] = ()

    @property
    def composed(self) -> bool:
        """Is the forward composed from parts (`trainmem_nb.recipes.decoder`)?"""
        return self.recipe == "decoder"


DESCRIPTIONS: dict[Family, Description] = {
    Family.LLAMA: Description(
        Family.LLAMA, ("llama",), "LlamaForCausalLM", "LlamaDecoderLayer", "decoder", _RMS_DECODER,
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",)),
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
        norm="gemma", embed_scale=True),
    Family.PHI3: Description(
        Family.PHI3, ("phi3",), "Phi3ForCausalLM", "Phi3DecoderLayer", "decoder", {**_RMS_DECODER, "fused_qkv": True},
        tie_default=False, lora_qv=("self_attn.qkv_proj",),
        dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop"),
        sliding_mask=True, rotary="cat", fused_gate_up=True, residual_dropout=True),
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
        input_side=("wte.", "wpe."), embedding="wte.weight"),
    Family.GPT_NEOX: Description(
        Family.GPT_NEOX, ("gpt_neox",), "GPTNeoXForCausalLM", "GPTNeoXLayer", "gpt_neox",
        {"norm": "layernorm", "mlp": "dense", "activation": "gelu", "positions": "rotary", "rotary_pct": 0.25,
         "fused_qkv": True, "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True,
         "parallel_residual": True},
        tie_default=False, lora_qv=("attention.query_key_value",), dropout_keys=("attention_dropout", "hidden_dropout"),
        input_side=("embed_in.",), heads=("embed_out.weight",), embedding="embed_in.weight"),
    Family.OPT: Description(
        Family.OPT, ("opt",), "OPTForCausalLM", "OPTDecoderLayer", "opt",
        {"norm": "layernorm", "mlp": "dense", "activation": "relu", "positions": "learned", "qkv_bias": True,
         "out_bias": True, "mlp_bias": True, "norm_bias": True, "tie_embeddings": True},
        tie_default=True, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("dropout", "attention_dropout"),
        input_side=("embed_tokens.", "embed_positions.", "project_in.")),
    Family.BERT: Description(
        Family.BERT, ("bert",), "BertForMaskedLM", "BertLayer", "bert",
        {"norm": "layernorm", "mlp": "dense", "activation": "gelu", "positions": "learned", "qkv_bias": True,
         "out_bias": True, "mlp_bias": True, "norm_bias": True, "tie_embeddings": True, "max_positions": 512,
         "pre_norm": False},
        tie_default=True, lora_qv=("attention.self.query", "attention.self.value"),
        dropout_keys=("hidden_dropout_prob", "attention_probs_dropout_prob"),
        input_side=("embeddings.",), heads=("cls.predictions.decoder.weight",),
        embedding="embeddings.word_embeddings.weight"),
    # modeling_gpt_oss.py (transformers 5.24): q/k/v/o biases (configuration_gpt_oss.py attention_bias=True),
    # per-head sinks, eager attention only (``_supports_sdpa = False``), layer_types alternating sliding/full
    # attention, a biased router and biased expert stacks (grouped_mm), half-width rotary cos/sin. The released
    # checkpoints store the experts in MXFP4; training dequantizes them (Mxfp4Config(dequantize=True)), so the
    # model here holds every weight in the training dtype (bf16 or fp32), as from_config builds it
    Family.GPT_OSS: Description(
        Family.GPT_OSS, ("gpt_oss",), "GptOssForCausalLM", "GptOssDecoderLayer", "decoder",
        {**_RMS_DECODER, "qkv_bias": True, "out_bias": True, "n_experts": 128, "experts_top_k": 4},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.v_proj"), dropout_keys=("attention_dropout",),
        attention="sinks", moe="gpt_oss", norm="gpt_oss", rotary="chunk", sdpa=False,
        mask_kinds=("full", "sliding")),
    # modeling_deepseek_v3.py (transformers 5.24): multi-head latent attention (low-rank q with q_a_layernorm,
    # compressed kv with kv_a_layernorm, a shared rope key, interleaved rotary), first_k_dense_replace dense
    # layers then DeepseekV3MoE (sigmoid group-limited router, grouped_mm experts, shared experts)
    Family.DEEPSEEK_V3: Description(
        Family.DEEPSEEK_V3, ("deepseek_v3",), "DeepseekV3ForCausalLM", "DeepseekV3DecoderLayer", "decoder",
        {**_RMS_DECODER, "n_experts": 256, "experts_top_k": 8, "n_shared_experts": 1, "n_expert_groups": 8,
         "topk_groups": 4},
        tie_default=False, lora_qv=("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj"),
        dropout_keys=("attention_dropout",), attention="mla", moe="deepseek", norm="deepseek"),
}


def describe(family: Family | str) -> Description:
    """The description of `family` (a `Family` or its name)."""
    return DESCRIPTIONS[Family.parse(family, "family")]
