"""One config writer per model family: the Hugging Face config dict that builds exactly a `ModelSpec`
(the inverse of its reader, `trainmem_nb.model.hf_readers`), so that the measure extra can build any spec
with the real model code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import SpecError
from .families import DESCRIPTIONS, Family

__all__ = ["WRITERS", "to_hf_config"]


def to_hf_config(m: Any) -> dict[str, Any]:
    """The Hugging Face config dict that builds exactly `m` (a `ModelSpec`); the inverse of
    `spec_kwargs_from_hf` (the family's writer, `WRITERS`), used to measure any spec with the real
    model code.

    >>> from trainmem_nb.model.spec import ModelSpec
    >>> m = ModelSpec(family="gpt2", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=100, max_positions=128)
    >>> ModelSpec.from_hf_config(to_hf_config(m), name=m.name) == m
    True
    """
    out = {**WRITERS[m.family](m), "tie_word_embeddings": m.tie_embeddings}
    if m.num_labels:  # the family's sequence-classification class (BertForSequenceClassification, ...)
        base = DESCRIPTIONS[m.family].hf_class.replace("ForCausalLM", "").replace("ForMaskedLM", "")
        out.update(architectures=[f"{base}ForSequenceClassification"], num_labels=m.num_labels)
    return out


def _write_biases(m: Any) -> dict[str, bool]:
    """The family's bias switches (`Description.biases`); `ModelSpec` validation keeps the fields each sets alike."""
    return {key: getattr(m, fields[0]) for key, fields in DESCRIPTIONS[m.family].biases}


def _write_gpt2(m: Any) -> dict[str, Any]:
    return {"model_type": "gpt2", "n_layer": m.n_layers, "n_embd": m.hidden, "n_head": m.n_heads,
            "n_inner": m.ffn, "vocab_size": m.vocab, "n_positions": m.max_positions,
            "activation_function": m.activation, "attn_pdrop": m.attn_dropout,
            "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.embd_dropout}


def _write_opt(m: Any) -> dict[str, Any]:
    return {"model_type": "opt", "hidden_size": m.hidden, "ffn_dim": m.ffn, "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "vocab_size": m.vocab, "max_position_embeddings": m.max_positions,
            "word_embed_proj_dim": m.word_embed_proj_dim or m.hidden, "do_layer_norm_before": m.pre_norm,
            "activation_function": m.activation, "dropout": m.hidden_dropout,
            "attention_dropout": m.attn_dropout, **_write_biases(m)}


def _write_bert(m: Any) -> dict[str, Any]:
    return {"model_type": "bert", "hidden_size": m.hidden, "intermediate_size": m.ffn,
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "vocab_size": m.vocab,
            "max_position_embeddings": m.max_positions, "type_vocab_size": m.type_vocab,
            "hidden_act": m.activation, "hidden_dropout_prob": m.hidden_dropout,
            "attention_probs_dropout_prob": m.attn_dropout}


def _write_gpt_neox(m: Any) -> dict[str, Any]:
    return {"model_type": "gpt_neox", "hidden_size": m.hidden, "intermediate_size": m.ffn,
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "vocab_size": m.vocab,
            "max_position_embeddings": m.max_positions, "hidden_act": m.activation,
            "attention_dropout": m.attn_dropout, "hidden_dropout": m.hidden_dropout,
            "use_parallel_residual": m.parallel_residual, "rotary_pct": m.rotary_pct, **_write_biases(m)}


def _write_decoder(m: Any) -> dict[str, Any]:
    return {"model_type": m.family.value, "hidden_size": m.hidden, "intermediate_size": m.ffn,
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "vocab_size": m.vocab, "max_position_embeddings": m.max_positions,
            "hidden_act": m.activation, "attention_dropout": m.attn_dropout, **_write_biases(m)}


def _write_windowed(m: Any) -> dict[str, Any]:
    return {**_write_decoder(m), "sliding_window": m.sliding_window or None}


def _write_qwen2(m: Any) -> dict[str, Any]:
    return {**_write_decoder(m), "use_sliding_window": bool(m.sliding_window), "sliding_window": m.sliding_window or None}


def _write_phi3(m: Any) -> dict[str, Any]:
    return {**_write_windowed(m), "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.embd_dropout,
            "partial_rotary_factor": m.rotary_pct}


def _write_mixtral(m: Any) -> dict[str, Any]:
    return {**_write_windowed(m), "num_local_experts": m.n_experts, "num_experts_per_tok": m.experts_top_k}


def _write_phi(m: Any) -> dict[str, Any]:
    return {"model_type": "phi", "hidden_size": m.hidden, "intermediate_size": m.ffn,
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
            "vocab_size": m.vocab, "max_position_embeddings": m.max_positions, "hidden_act": m.activation,
            "attention_dropout": m.attn_dropout, "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.embd_dropout,
            "partial_rotary_factor": m.rotary_pct, "qk_layernorm": m.qk_layernorm}


def _write_starcoder2(m: Any) -> dict[str, Any]:
    return {**_write_windowed(m), "residual_dropout": m.hidden_dropout, "embedding_dropout": m.embd_dropout}


def _write_gemma_sliding(m: Any) -> dict[str, Any]:
    """Gemma2Config / Gemma3TextConfig keys: explicit layer types, the window, scaling and soft-caps."""
    # without layer_types the configuration computes the family's default pattern, as the spec does
    out = {**_write_decoder(m), "model_type": "gemma3_text" if m.family is Family.GEMMA3 else "gemma2",
           "hidden_activation": m.activation, "sliding_window": m.sliding_window,
           "layer_types": list(m.layer_types) or None,
           # Gemma2Config types it int (a strict dataclass field)
           "query_pre_attn_scalar": round(m.query_pre_attn_scalar) if m.query_pre_attn_scalar else m.head_dim,
           "attn_logit_softcapping": m.attn_softcap or None, "final_logit_softcapping": m.final_softcap or None}
    v = getattr(m, "vision", None)
    if v is not None:  # a multimodal checkpoint: Gemma3Config with the language model as its text_config
        return {"model_type": "gemma3", "text_config": out,
                "vision_config": {"model_type": "siglip_vision_model", "hidden_size": v.hidden,
                                  "intermediate_size": v.intermediate, "num_hidden_layers": v.n_layers,
                                  "num_attention_heads": v.n_heads,
                                  "image_size": v.image_size, "patch_size": v.patch_size, "num_channels": v.channels,
                                  "vision_use_head": v.head}}
    return out


def _write_gpt_oss(m: Any) -> dict[str, Any]:
    types = list(m.layer_types) or ["full_attention"] * m.n_layers  # the spec's default kind (`_layer_kinds`)
    return {**_write_decoder(m), "sliding_window": m.sliding_window or None, "layer_types": types,
            "num_local_experts": m.n_experts, "num_experts_per_tok": m.experts_top_k}


def _write_deepseek_v3(m: Any) -> dict[str, Any]:
    dense = len(m.dense_layers)
    if tuple(m.dense_layers) != tuple(range(dense)):
        raise SpecError(f"deepseek_v3 makes its first layers dense (first_k_dense_replace); dense_layers="
                        f"{m.dense_layers} is not a prefix 0..k-1")
    return {**{k: v for k, v in _write_decoder(m).items() if k != "head_dim"},
            "moe_intermediate_size": m.expert_width, "n_routed_experts": m.n_experts,
            "num_experts_per_tok": m.experts_top_k, "n_shared_experts": m.n_shared_experts,
            "n_group": m.n_expert_groups, "topk_group": m.topk_groups, "norm_topk_prob": m.norm_topk_prob,
            "first_k_dense_replace": dense, "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
            "qk_rope_head_dim": m.qk_rope_head_dim, "qk_nope_head_dim": m.qk_nope_head_dim,
            "v_head_dim": m.v_head_dim, "rope_interleave": True}


def _write_layer_types(m: Any) -> dict[str, Any]:
    """``use_sliding_window``, ``sliding_window`` and the explicit ``layer_types`` (Qwen3's default
    pattern from ``max_window_layers`` is not needed when they are given)."""
    types = list(m.layer_types) or ["full_attention"] * m.n_layers
    return {"use_sliding_window": bool(m.sliding_window), "sliding_window": m.sliding_window or None,
            "layer_types": types}


def _write_qwen3(m: Any) -> dict[str, Any]:
    return {**_write_decoder(m), **_write_layer_types(m)}


def _write_smollm3(m: Any) -> dict[str, Any]:
    return {**_write_decoder(m), **_write_layer_types(m),
            "no_rope_layers": [int(i not in m.nope_layers) for i in range(m.n_layers)]}


def _write_granite(m: Any) -> dict[str, Any]:
    # multipliers other than 1.0 (the released models' 12, 0.22, 0.015625 and 8 for 2B) give the same memory
    return {**_write_decoder(m), "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0}


def _write_qwen3_moe(m: Any) -> dict[str, Any]:
    return {**_write_decoder(m), "num_experts": m.n_experts,
            "num_experts_per_tok": m.experts_top_k, "moe_intermediate_size": m.expert_width,
            "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": list(m.dense_layers),
            "use_sliding_window": bool(m.sliding_window), "sliding_window": m.sliding_window or None}


#: The config writer of every family (`to_hf_config`).
WRITERS: dict[Family, Callable[[Any], dict[str, Any]]] = {
    Family.LLAMA: _write_decoder, Family.MISTRAL: _write_windowed, Family.QWEN2: _write_qwen2,
    Family.GEMMA: _write_decoder, Family.PHI3: _write_phi3, Family.MIXTRAL: _write_mixtral, Family.GPT2: _write_gpt2,
    Family.OPT: _write_opt, Family.BERT: _write_bert, Family.GPT_NEOX: _write_gpt_neox,
    Family.OLMO2: _write_decoder, Family.GEMMA2: _write_gemma_sliding, Family.GEMMA3: _write_gemma_sliding,
    Family.QWEN3: _write_qwen3, Family.SMOLLM3: _write_smollm3, Family.GRANITE: _write_granite,
    Family.QWEN3_MOE: _write_qwen3_moe, Family.PHI: _write_phi, Family.STARCODER2: _write_starcoder2,
    Family.GPT_OSS: _write_gpt_oss, Family.DEEPSEEK_V3: _write_deepseek_v3,
}
