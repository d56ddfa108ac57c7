"""Every parameter tensor of a model, as Hugging Face's ``named_parameters()`` lists it.

The inventory is what weights, gradients and optimizer states are made of: counts per tensor (the CUDA
allocator rounds each tensor to 512 B), which are matmul weights (autocast copies them to 16 bit), which
sit in the decoder layers (checkpointing and sharding work per layer) and which LoRA can target. Tied
weights appear once, as in ``sum(p.numel() for p in model.parameters())``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from .specs import Family, ModelSpec

__all__ = ["ParamTensor", "param_inventory", "count_params", "buffer_inventory"]


class ParamTensor(NamedTuple):
    """One parameter tensor (or `count` identical ones, one per layer)."""

    name: str  #: Hugging Face name without the layer index, e.g. ``layers.self_attn.q_proj.weight``
    shape: tuple[int, ...]
    count: int  #: how many tensors of this shape (n_layers for per-layer tensors)
    matmul: bool  #: used as a matmul weight (autocast makes a 16-bit copy of it)
    in_layer: bool  #: inside a repeated transformer layer

    @property
    def numel(self) -> int:
        """Elements in one tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def _linear(prefix: str, out_f: int, in_f: int, bias: bool, count: int, in_layer: bool = True) -> list[ParamTensor]:
    items = [ParamTensor(f"{prefix}.weight", (out_f, in_f), count, True, in_layer)]
    if bias:
        items.append(ParamTensor(f"{prefix}.bias", (out_f,), count, False, in_layer))
    return items


def _norm(prefix: str, dim: int, bias: bool, count: int, in_layer: bool = True) -> list[ParamTensor]:
    items = [ParamTensor(f"{prefix}.weight", (dim,), count, False, in_layer)]
    if bias:
        items.append(ParamTensor(f"{prefix}.bias", (dim,), count, False, in_layer))
    return items


@lru_cache(maxsize=512)
def param_inventory(m: ModelSpec) -> tuple[ParamTensor, ...]:
    """All parameter tensors of `m` in the order the model registers them.

    >>> from trainmem_nb.presets import get_model
    >>> sum(p.numel * p.count for p in param_inventory(get_model("gpt2")))
    124439808
    """
    L, h, V, f = m.n_layers, m.hidden, m.vocab, m.ffn
    fam = m.family
    items: list[ParamTensor] = []
    if fam is Family.GPT2:
        items += [ParamTensor("wte.weight", (V, h), 1, False, False), ParamTensor("wpe.weight", (m.max_positions, h), 1, False, False)]
        items += _norm("layers.ln_1", h, True, L)
        # Conv1D stores (in, out); its bias is (out,)
        items += [ParamTensor("layers.attn.c_attn.weight", (h, 3 * h), L, True, True), ParamTensor("layers.attn.c_attn.bias", (3 * h,), L, False, True)]
        items += [ParamTensor("layers.attn.c_proj.weight", (h, h), L, True, True), ParamTensor("layers.attn.c_proj.bias", (h,), L, False, True)]
        items += _norm("layers.ln_2", h, True, L)
        items += [ParamTensor("layers.mlp.c_fc.weight", (h, f), L, True, True), ParamTensor("layers.mlp.c_fc.bias", (f,), L, False, True)]
        items += [ParamTensor("layers.mlp.c_proj.weight", (f, h), L, True, True), ParamTensor("layers.mlp.c_proj.bias", (h,), L, False, True)]
        items += _norm("ln_f", h, True, 1, False)
        if not m.tie_embeddings:
            items += _linear("lm_head", V, h, False, 1, False)
        return tuple(items)
    if fam is Family.GPT_NEOX:
        items.append(ParamTensor("embed_in.weight", (V, h), 1, False, False))
        items += _norm("layers.input_layernorm", h, True, L)
        items += _norm("layers.post_attention_layernorm", h, True, L)
        items += _linear("layers.attention.query_key_value", 3 * h, h, m.qkv_bias, L)
        items += _linear("layers.attention.dense", h, h, m.out_bias, L)
        items += _linear("layers.mlp.dense_h_to_4h", f, h, True, L)
        items += _linear("layers.mlp.dense_4h_to_h", h, f, True, L)
        items += _norm("final_layer_norm", h, True, 1, False)
        if not m.tie_embeddings:
            items += _linear("embed_out", V, h, False, 1, False)
        return tuple(items)
    if fam is Family.OPT:
        proj = m.word_embed_proj_dim or h
        items.append(ParamTensor("embed_tokens.weight", (V, proj), 1, False, False))
        items.append(ParamTensor("embed_positions.weight", (m.max_positions + 2, h), 1, False, False))
        if proj != h:
            items += _linear("project_out", proj, h, False, 1, False)
            items += _linear("project_in", h, proj, False, 1, False)
        for name in ("k_proj", "v_proj", "q_proj", "out_proj"):
            items += _linear(f"layers.self_attn.{name}", h, h, m.qkv_bias, L)
        items += _norm("layers.self_attn_layer_norm", h, True, L)
        items += _linear("layers.fc1", f, h, m.mlp_bias, L)
        items += _linear("layers.fc2", h, f, m.mlp_bias, L)
        items += _norm("layers.final_layer_norm", h, True, L)
        if m.pre_norm:
            items += _norm("final_layer_norm", h, True, 1, False)
        if not m.tie_embeddings:
            items += _linear("lm_head", V, proj, False, 1, False)
        return tuple(items)
    if fam is Family.BERT:
        items.append(ParamTensor("embeddings.word_embeddings.weight", (V, h), 1, False, False))
        items.append(ParamTensor("embeddings.position_embeddings.weight", (m.max_positions, h), 1, False, False))
        if m.type_vocab:
            items.append(ParamTensor("embeddings.token_type_embeddings.weight", (m.type_vocab, h), 1, False, False))
        items += _norm("embeddings.LayerNorm", h, True, 1, False)
        for name in ("query", "key", "value"):
            items += _linear(f"layers.attention.self.{name}", h, h, True, L)
        items += _linear("layers.attention.output.dense", h, h, True, L)
        items += _norm("layers.attention.output.LayerNorm", h, True, L)
        items += _linear("layers.intermediate.dense", f, h, True, L)
        items += _linear("layers.output.dense", h, f, True, L)
        items += _norm("layers.output.LayerNorm", h, True, L)
        items += _linear("cls.predictions.transform.dense", h, h, True, 1, False)
        items += _norm("cls.predictions.transform.LayerNorm", h, True, 1, False)
        items.append(ParamTensor("cls.predictions.bias", (V,), 1, False, False))
        if not m.tie_embeddings:
            items.append(ParamTensor("cls.predictions.decoder.weight", (V, h), 1, True, False))
        return tuple(items)
    # llama-style decoders: llama, mistral, qwen2, gemma, phi3, mixtral
    q, kv = m.q_dim, m.kv_dim
    items.append(ParamTensor("embed_tokens.weight", (V, h), 1, False, False))
    if fam is Family.PHI3:
        items += _linear("layers.self_attn.o_proj", h, q, m.out_bias, L)
        items += _linear("layers.self_attn.qkv_proj", q + 2 * kv, h, m.qkv_bias, L)
        items += _linear("layers.mlp.gate_up_proj", 2 * f, h, m.mlp_bias, L)
        items += _linear("layers.mlp.down_proj", h, f, m.mlp_bias, L)
    else:
        items += _linear("layers.self_attn.q_proj", q, h, m.qkv_bias, L)
        items += _linear("layers.self_attn.k_proj", kv, h, m.qkv_bias, L)
        items += _linear("layers.self_attn.v_proj", kv, h, m.qkv_bias, L)
        items += _linear("layers.self_attn.o_proj", h, q, m.out_bias, L)
        if m.is_moe:
            E = m.n_experts
            items.append(ParamTensor("layers.mlp.gate.weight", (E, h), L, True, True))
            items.append(ParamTensor("layers.mlp.experts.gate_up_proj", (E, 2 * f, h), L, True, True))
            items.append(ParamTensor("layers.mlp.experts.down_proj", (E, h, f), L, True, True))
        else:
            items += _linear("layers.mlp.gate_proj", f, h, m.mlp_bias, L)
            items += _linear("layers.mlp.up_proj", f, h, m.mlp_bias, L)
            items += _linear("layers.mlp.down_proj", h, f, m.mlp_bias, L)
    items += _norm("layers.input_layernorm", h, False, L)
    items += _norm("layers.post_attention_layernorm", h, False, L)
    items += _norm("norm", h, False, 1, False)
    if not m.tie_embeddings:
        items += _linear("lm_head", V, h, False, 1, False)
    return tuple(items)


def count_params(m: ModelSpec) -> int:
    """Total parameters of `m` (tied weights once)."""
    return sum(p.numel * p.count for p in param_inventory(m))


@lru_cache(maxsize=512)
def buffer_inventory(m: ModelSpec) -> tuple[tuple[str, int, int], ...]:
    """Registered buffers as ``(name, bytes of one, count)``: rotary ``inv_freq`` (fp32), BERT's
    ``position_ids``/``token_type_ids`` (int64), Gemma's ``embed_scale``; tiny but allocated."""
    fam = m.family
    out: list[tuple[str, int, int]] = []
    if m.positions == "rotary":
        # one rotary module at model level holds inv_freq and original_inv_freq (a clone):
        # (rotary_dims // 2,) fp32 each
        out.append(("rotary_emb.inv_freq", 4 * (m.rotary_dims // 2), 2))
    if fam is Family.GEMMA:
        out.append(("embed_tokens.embed_scale", 4, 1))
    if fam is Family.BERT:
        out.append(("embeddings.position_ids", 8 * m.max_positions, 1))
        out.append(("embeddings.token_type_ids", 8 * m.max_positions, 1))
    return tuple(out)
