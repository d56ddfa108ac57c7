"""One config reader per model family: `ModelSpec` keyword arguments from a Hugging Face ``config.json``,
with the keys and defaults of the family's ``configuration_*.py`` in transformers 5.x (the defaults matter:
a config that omits a key gets what ``from_pretrained`` would give it). `trainmem_nb.model.hf_config`
dispatches to them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import SpecError, show_value, whole_number
from .families import DESCRIPTIONS, Family

__all__ = ["READERS"]


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = ..., family: Family) -> Any:
    """The first present, non-null key, else `default`; a clear error if none and no default."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is ...:
        raise SpecError(f"config.json for model_type {family.value!r} has no {keys[0]!r}; it is required")
    return default


#: The largest integer any config.json field is read as (int32, what torch shapes and HF configs use);
#: beyond it a value is a typo or an overflow, refused before any arithmetic.
_CONFIG_INT_MAX = 2**31 - 1


def _int(cfg: Mapping[str, Any], *keys: str, family: Family, default: Any = ..., minimum: int = 1) -> int:
    """A finite integer field (numpy integers and whole floats too; never a bool, text, NaN or Infinity)."""
    value = _get(cfg, *keys, default=default, family=family)
    return whole_number(value, f"config.json {_present(cfg, keys)}", minimum, _CONFIG_INT_MAX)


def _float(cfg: Mapping[str, Any], *keys: str, family: Family, default: float) -> float:
    """A finite real field (never a bool, text, NaN or Infinity)."""
    value = _get(cfg, *keys, default=default, family=family)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise SpecError(f"config.json {_present(cfg, keys)}={show_value(value)} must be a finite number")
    return float(value)


def _present(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    """The key the value came from (the first one present), for messages."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


def _sliding_window(cfg: Mapping[str, Any], use_default: bool) -> int:
    """The attention window in tokens, 0 for none: ``sliding_window`` is an integer or null, and
    ``use_sliding_window`` (Qwen2's switch, off by default there: `use_default`) true or false."""
    use = cfg.get("use_sliding_window", use_default)
    if not isinstance(use, bool):
        raise SpecError(f"config.json use_sliding_window={show_value(use)} must be true or false")
    window = cfg.get("sliding_window")
    if window is None or window is False:
        return 0
    if window is True:
        raise SpecError("config.json sliding_window=true must be a window size in tokens (an integer) or null")
    size = whole_number(window, "config.json sliding_window", 0, _CONFIG_INT_MAX)
    return size if use else 0


def _rope(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    params = cfg.get("rope_parameters") or {}
    return params if isinstance(params, Mapping) else {}


def _read_gpt2(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    hidden = _int(cfg, "n_embd", "hidden_size", family=f)
    return dict(
        n_layers=_int(cfg, "n_layer", "num_hidden_layers", family=f),
        hidden=hidden,
        n_heads=_int(cfg, "n_head", "num_attention_heads", family=f),
        ffn=_int(cfg, "n_inner", family=f, default=4 * hidden),
        vocab=_int(cfg, "vocab_size", family=f, default=50257),
        max_positions=_int(cfg, "n_positions", "max_position_embeddings", family=f, default=1024),
        activation=_get(cfg, "activation_function", default="gelu_new", family=f),
        attn_dropout=_float(cfg, "attn_pdrop", family=f, default=0.1),
        hidden_dropout=_float(cfg, "resid_pdrop", family=f, default=0.1),
        embd_dropout=_float(cfg, "embd_pdrop", family=f, default=0.1),
    )


def _read_opt(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    hidden = _int(cfg, "hidden_size", family=f)
    proj = _int(cfg, "word_embed_proj_dim", family=f, default=hidden)
    if cfg.get("_remove_final_layer_norm") or cfg.get("layer_norm_elementwise_affine") is False:
        raise SpecError("OPT configs with _remove_final_layer_norm or without layer-norm weights are not supported")
    return dict(
        n_layers=_int(cfg, "num_hidden_layers", family=f),
        hidden=hidden,
        n_heads=_int(cfg, "num_attention_heads", family=f),
        ffn=_int(cfg, "ffn_dim", family=f),
        vocab=_int(cfg, "vocab_size", family=f, default=50272),
        max_positions=_int(cfg, "max_position_embeddings", family=f, default=2048),
        activation=_get(cfg, "activation_function", default="relu", family=f),
        attn_dropout=_float(cfg, "attention_dropout", family=f, default=0.0),
        hidden_dropout=_float(cfg, "dropout", family=f, default=0.1),
        word_embed_proj_dim=0 if proj == hidden else proj,
        pre_norm=_flag(cfg, "do_layer_norm_before", True),
        **_biases(cfg, f),
    )


def _read_bert(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    return dict(
        n_layers=_int(cfg, "num_hidden_layers", family=f),
        hidden=_int(cfg, "hidden_size", family=f),
        n_heads=_int(cfg, "num_attention_heads", family=f),
        ffn=_int(cfg, "intermediate_size", family=f),
        vocab=_int(cfg, "vocab_size", family=f, default=30522),
        max_positions=_int(cfg, "max_position_embeddings", family=f, default=512),
        type_vocab=_int(cfg, "type_vocab_size", family=f, default=2, minimum=0),
        activation=_get(cfg, "hidden_act", default="gelu", family=f),
        attn_dropout=_float(cfg, "attention_probs_dropout_prob", family=f, default=0.1),
        hidden_dropout=_float(cfg, "hidden_dropout_prob", family=f, default=0.1),
        embd_dropout=_float(cfg, "hidden_dropout_prob", family=f, default=0.1),
    )


def _read_gpt_neox(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    return dict(
        n_layers=_int(cfg, "num_hidden_layers", family=f),
        hidden=_int(cfg, "hidden_size", family=f),
        n_heads=_int(cfg, "num_attention_heads", family=f),
        ffn=_int(cfg, "intermediate_size", family=f),
        vocab=_int(cfg, "vocab_size", family=f),
        max_positions=_int(cfg, "max_position_embeddings", family=f, default=2048),
        activation=_get(cfg, "hidden_act", default="gelu", family=f),
        attn_dropout=_float(cfg, "attention_dropout", family=f, default=0.0),
        hidden_dropout=_float(cfg, "hidden_dropout", family=f, default=0.0),
        parallel_residual=_flag(cfg, "use_parallel_residual", True),
        rotary_pct=cfg.get("rotary_pct", _rope(cfg).get("partial_rotary_factor", 0.25)),
        **_biases(cfg, f),
    )


def _read_decoder(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """What the llama-derived configs share (LlamaConfig's keys)."""
    hidden = _int(cfg, "hidden_size", family=f)
    heads = _int(cfg, "num_attention_heads", family=f)
    return dict(
        n_layers=_int(cfg, "num_hidden_layers", family=f),
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=_int(cfg, "num_key_value_heads", family=f, default=heads),
        head_dim=_int(cfg, "head_dim", family=f, default=0, minimum=0),
        ffn=_int(cfg, "intermediate_size", family=f),
        vocab=_int(cfg, "vocab_size", family=f),
        max_positions=_int(cfg, "max_position_embeddings", family=f, default=2048),
        activation=_get(cfg, "hidden_activation", "hidden_act", default="silu", family=f),
        attn_dropout=_float(cfg, "attention_dropout", family=f, default=0.0),
        **_biases(cfg, f),
    )


def _window(cfg: Mapping[str, Any], use_default: bool) -> dict[str, Any]:
    """``sliding_window`` when the config sets one and uses it (``use_sliding_window``, where it exists)."""
    window = _sliding_window(cfg, use_default)
    return {"sliding_window": window} if window > 0 else {}


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """A true/false config key (a string "false" is not true)."""
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(f"config.json {key}={show_value(value)} must be true or false")
    return value


def _biases(cfg: Mapping[str, Any], f: Family) -> dict[str, bool]:
    """The projection biases the family's config keys switch (`Description.biases`), each key's default
    the family's own; fields no key sets keep the family's value (the `ModelSpec` default)."""
    d = DESCRIPTIONS[f]
    out: dict[str, bool] = {}
    for key, fields in d.biases:
        value = _flag(cfg, key, bool(d.structure.get(fields[0], False)))
        out.update(dict.fromkeys(fields, value))
    return out


def _read_llama(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    return _read_decoder(cfg, f)


def _read_mistral(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    return {**_read_decoder(cfg, f), **_window(cfg, True)}


def _read_qwen2(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    return {**_read_decoder(cfg, f), **_window(cfg, False)}


def _read_gemma(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    kw = _read_decoder(cfg, f)
    if kw["activation"] == "gelu":
        kw["activation"] = "gelu_pytorch_tanh"  # transformers' GemmaConfig maps the legacy "gelu" to the tanh form
    return kw


def _read_phi3(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    return {**_read_decoder(cfg, f), **_window(cfg, True),
            "hidden_dropout": _float(cfg, "resid_pdrop", family=f, default=0.0),
            "embd_dropout": _float(cfg, "embd_pdrop", family=f, default=0.0),
            "rotary_pct": cfg.get("partial_rotary_factor", _rope(cfg).get("partial_rotary_factor", 1.0))}


def _read_mixtral(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    return {**_read_decoder(cfg, f), **_window(cfg, True),
            "n_experts": _int(cfg, "num_local_experts", family=f, default=8),
            "experts_top_k": _int(cfg, "num_experts_per_tok", family=f, default=2)}


def _read_phi(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """PhiConfig (configuration_phi.py): vocab 51200 (line 62), num_key_value_heads = heads when null
    (line 85), max_position_embeddings 2048 (line 72), hidden_act "gelu_new" (line 71), the dropouts 0.0
    (lines 68-70), partial_rotary_factor 0.5 (line 87: older config.json files give it at the top level),
    qk_layernorm False (line 78)."""
    heads = _int(cfg, "num_attention_heads", family=f)
    return dict(
        n_layers=_int(cfg, "num_hidden_layers", family=f),
        hidden=_int(cfg, "hidden_size", family=f),
        n_heads=heads,
        n_kv_heads=_int(cfg, "num_key_value_heads", family=f, default=heads),
        ffn=_int(cfg, "intermediate_size", family=f),
        vocab=_int(cfg, "vocab_size", family=f, default=51200),
        max_positions=_int(cfg, "max_position_embeddings", family=f, default=2048),
        activation=_get(cfg, "hidden_act", default="gelu_new", family=f),
        attn_dropout=_float(cfg, "attention_dropout", family=f, default=0.0),
        hidden_dropout=_float(cfg, "resid_pdrop", family=f, default=0.0),
        embd_dropout=_float(cfg, "embd_pdrop", family=f, default=0.0),
        rotary_pct=cfg.get("partial_rotary_factor", _rope(cfg).get("partial_rotary_factor", 0.5)),
        qk_layernorm=_flag(cfg, "qk_layernorm", False),
    )


def _read_starcoder2(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """Starcoder2Config (configuration_starcoder2.py): vocab 49152 (line 60), num_key_value_heads 2
    (line 65), hidden_act "gelu_pytorch_tanh" (line 66), max_position_embeddings 4096 (line 67),
    sliding_window None (line 75), attention/residual/embedding dropouts 0.0 (lines 76-78), use_bias True
    (line 79) for every projection; the rotary dims are the whole head (no partial factor)."""
    defaults = {"vocab_size": 49152, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                "hidden_act": "gelu_pytorch_tanh"}
    given = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
    return {**_read_decoder(given, f), **_window(cfg, True),
            "hidden_dropout": _float(cfg, "residual_dropout", family=f, default=0.0),
            "embd_dropout": _float(cfg, "embedding_dropout", family=f, default=0.0)}


def _read_olmo2(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """Olmo2Config (configuration_olmo2.py): ``attention_bias`` biases q/k/v and ``o_proj`` alike."""
    return _read_decoder(cfg, f)


def _softcap(cfg: Mapping[str, Any], key: str, default: float | None, f: Family) -> float:
    """A soft-capping value: absent means the configuration's default, null means none (0)."""
    if key not in cfg:
        return default or 0.0
    return 0.0 if cfg[key] is None else _float(cfg, key, family=f, default=0.0)


def _layer_types(cfg: Mapping[str, Any], n_layers: int, period: int, f: Family) -> tuple[str, ...]:
    """``layer_types`` as given, else the configuration's default: every `period`-th layer global
    (Gemma2Config / Gemma3TextConfig ``__post_init__``); none (the spec's own default, the family's
    `sliding_period`) when that is the family's default period."""
    types = cfg.get("layer_types")
    if types is None:
        if period == DESCRIPTIONS[f].sliding_period:
            return ()
        return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layers))
    if not isinstance(types, list) or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise SpecError(f"config.json layer_types={show_value(types)} must list 'full_attention' / "
                        f"'sliding_attention' per layer")
    return tuple(types)


def _read_gemma_sliding(cfg: Mapping[str, Any], f: Family, defaults: Mapping[str, Any], period: int,
                        softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
    """Gemma2Config / Gemma3TextConfig: the decoder keys with the configuration's defaults, the window
    and layer types, ``query_pre_attn_scalar`` and the two soft-capping values."""
    if cfg.get("use_bidirectional_attention"):
        raise SpecError("config.json use_bidirectional_attention=true (an encoder-style Gemma) is not supported")
    full = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
    kw = _read_decoder(full, f)
    if kw["activation"] == "gelu":
        kw["activation"] = "gelu_pytorch_tanh"
    window = cfg["sliding_window"] if "sliding_window" in cfg else defaults["sliding_window"]
    kw["sliding_window"] = 0 if window is None else whole_number(window, "config.json sliding_window", 1, _CONFIG_INT_MAX)
    kw["layer_types"] = _layer_types(cfg, kw["n_layers"], period, f)
    scalar = _float(full, "query_pre_attn_scalar", family=f, default=256.0)
    kw["query_pre_attn_scalar"] = 0.0 if scalar == kw["head_dim"] else scalar  # 0: head_dim ** -0.5
    kw["attn_softcap"] = _softcap(cfg, "attn_logit_softcapping", softcaps[0], f)
    kw["final_softcap"] = _softcap(cfg, "final_logit_softcapping", softcaps[1], f)
    return kw


#: Gemma2Config's defaults (configuration_gemma2.py, transformers 5.x): the keys official configs may omit.
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "sliding_window": 4096}
#: Gemma3TextConfig's defaults (configuration_gemma3.py): the multimodal configs' ``text_config`` omits most.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096}


def _read_gemma2(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """Gemma2Config: alternating sliding/global layers, soft-capping 50 (attention) and 30 (final logits)."""
    return _read_gemma_sliding(cfg, f, _GEMMA2_DEFAULTS, 2, (50.0, 30.0))


#: SiglipVisionConfig's defaults (configuration_siglip.py), which a ``gemma3`` config without a ``vision_config``
#: gets (Gemma3Config.sub_configs_defaults: ``siglip_vision_model``); the released checkpoints give their own.
_SIGLIP_VISION_DEFAULTS: dict[str, Any] = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                           "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "num_channels": 3,
                                           "vision_use_head": True}


def _read_gemma3(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """Gemma3TextConfig (``gemma3_text``), or a multimodal ``gemma3`` config: its ``text_config`` and its
    ``vision_config`` (the SigLIP tower a text-only step holds but never runs: `ModelSpec.vision`). Five
    sliding layers per global one (``sliding_window_pattern``, default 6), no soft-capping by default."""
    vision = None
    if cfg.get("model_type") == "gemma3":
        text = cfg.get("text_config") or {}
        if not isinstance(text, Mapping):
            raise SpecError("config.json text_config must be an object (the Gemma 3 language model's config)")
        vc = cfg.get("vision_config") or {}
        if not isinstance(vc, Mapping):
            raise SpecError("config.json vision_config must be an object (the Gemma 3 vision tower's config)")
        vc = {**_SIGLIP_VISION_DEFAULTS, **vc}
        try:
            vision = {"hidden": _int(vc, "hidden_size", family=f), "intermediate": _int(vc, "intermediate_size", family=f),
                      "n_layers": _int(vc, "num_hidden_layers", family=f),
                      "n_heads": _int(vc, "num_attention_heads", family=f), "image_size": _int(vc, "image_size", family=f),
                      "patch_size": _int(vc, "patch_size", family=f), "channels": _int(vc, "num_channels", family=f),
                      "head": bool(vc.get("vision_use_head"))}
        except SpecError as exc:  # name the nested key: the text model has a num_hidden_layers too
            raise SpecError(str(exc).replace("config.json ", "config.json vision_config.", 1)) from None
        cfg = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}
    period = _int(cfg, "sliding_window_pattern", family=f, default=6)
    kw = _read_gemma_sliding(cfg, f, _GEMMA3_DEFAULTS, period, (None, None))
    kw["attn_softcap"] = 0.0  # Gemma3Attention never passes attn_logit_softcapping to its attention function
    if vision is not None:
        kw["vision"] = vision
    return kw


def _patterned_layer_types(cfg: Mapping[str, Any], n_layers: int, default: Callable[[int], str]) -> tuple[str, ...]:
    """``layer_types`` (one ``"full_attention"`` / ``"sliding_attention"`` per layer), or the family's
    default pattern when the config omits it."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(default(i) for i in range(n_layers))
    if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
        raise SpecError(f"config.json layer_types={show_value(types)} must be a list of layer type names")
    bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if bad:
        raise SpecError(f"config.json layer_types has {bad[0]!r}; supported: full_attention, sliding_attention")
    return tuple(types)


def _read_gpt_oss(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """GptOssConfig (configuration_gpt_oss.py, transformers 5.24): head_dim 64 (line 56), sliding_window
    128 (59), attention_bias True (77), 128 experts (52), top-4 (67), vocab 201088 (53), 131072 positions
    (63); without layer_types, even layers slide and odd ones attend fully (``__post_init__``, line 85).
    ``intermediate_size`` is each expert's width; hidden_act is unused (the experts' clamped SwiGLU)."""
    kw = _read_decoder({"head_dim": 64, "vocab_size": 201088, "max_position_embeddings": 131072, **cfg}, f)
    window = _sliding_window({**cfg, "sliding_window": cfg.get("sliding_window", 128)}, True)
    types = _patterned_layer_types(cfg, kw["n_layers"], lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    return {**kw, "activation": "silu", "sliding_window": window,
            "layer_types": types,
            "n_experts": _int(cfg, "num_local_experts", "num_experts", family=f, default=128),
            "experts_top_k": _int(cfg, "num_experts_per_tok", family=f, default=4)}


def _read_deepseek_v3(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """DeepseekV3Config (configuration_deepseek_v3.py, transformers 5.24, lines 81-116): vocab 129280,
    intermediate_size 18432 (the dense layers), moe_intermediate_size 2048, 256 routed experts, top-8, one
    shared expert, n_group 8, topk_group 4, first_k_dense_replace 3, q_lora_rank 1536 (null: a plain
    q_proj), kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, 4096 positions,
    no attention bias, rope_interleave true; ``head_dim`` is the rope head dim (``__post_init__``)."""
    defaults = {"vocab_size": 129280, "max_position_embeddings": 4096}
    kw = _read_decoder({**defaults, **cfg, "head_dim": None}, f)
    if _flag(cfg, "rope_interleave", True) is not True:
        raise SpecError("deepseek_v3 with rope_interleave=false is not modelled (its rotary is the interleaved one "
                        "by default); remove the key or set it to true")
    rope = _int(cfg, "qk_rope_head_dim", family=f, default=64)
    n_layers = kw["n_layers"]
    k_dense = _int(cfg, "first_k_dense_replace", family=f, default=3, minimum=0)
    return {**kw, "head_dim": rope, "qk_rope_head_dim": rope,
            "qk_nope_head_dim": _int(cfg, "qk_nope_head_dim", family=f, default=128),
            "v_head_dim": _int(cfg, "v_head_dim", family=f, default=128),
            "kv_lora_rank": _int(cfg, "kv_lora_rank", family=f, default=512),
            "q_lora_rank": _int(cfg, "q_lora_rank", family=f, default=1536) if "q_lora_rank" not in cfg
            or cfg["q_lora_rank"] is not None else 0,
            "expert_ffn": _int(cfg, "moe_intermediate_size", family=f, default=2048),
            "n_experts": _int(cfg, "n_routed_experts", family=f, default=256),
            "experts_top_k": _int(cfg, "num_experts_per_tok", family=f, default=8),
            "n_shared_experts": _int(cfg, "n_shared_experts", family=f, default=1, minimum=0),
            "n_expert_groups": _int(cfg, "n_group", family=f, default=8),
            "topk_groups": _int(cfg, "topk_group", family=f, default=4),
            "norm_topk_prob": _flag(cfg, "norm_topk_prob", True),
            "dense_layers": tuple(range(min(k_dense, n_layers)))}


def _qwen_layer_types(cfg: Mapping[str, Any], n_layers: int, window: int, max_window_default: int) -> tuple[str, ...]:
    """Each layer's attention when a sliding window is in use (Qwen3Config.__post_init__,
    configuration_qwen3.py lines 90-96: ``layer_types`` as given, else ``sliding_attention`` from layer
    ``max_window_layers`` on); ``()`` when every layer attends fully (the spec's default)."""
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        start = _int(cfg, "max_window_layers", family=Family.QWEN3, default=max_window_default, minimum=0)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(
            t not in ("full_attention", "sliding_attention") for t in types):
        raise SpecError(f"config.json layer_types={show_value(types)} must list 'full_attention' or "
                        f"'sliding_attention' for each of the {n_layers} layers")
    return tuple(types) if "sliding_attention" in types else ()


def _read_qwen3(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """Qwen3Config (configuration_qwen3.py lines 61-83): head_dim defaults to 128 and
    num_key_value_heads to 32, not to the hidden size's split; ``attention_bias`` sets the bias of
    q/k/v/o; a window applies only with ``use_sliding_window``, to the layers of `_layer_types`."""
    kw = _read_decoder({"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768,
                        "vocab_size": 151936, **cfg}, f)
    window = _sliding_window(cfg, False)
    types = _qwen_layer_types(cfg, kw["n_layers"], window, 28)
    # a window no layer uses is kept (it round-trips through `_write_qwen3`) but changes nothing
    return {**kw, "sliding_window": window, "layer_types": types}


def _read_smollm3(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """SmolLM3Config (configuration_smollm3.py lines 71-113): ``no_rope_layers`` (1: the layer applies
    rotary) as given, else every ``no_rope_layer_interval``-th layer (default 4) without; 4 kv heads by
    default; with ``use_sliding_window`` and a window, the NoPE layers slide unless ``layer_types`` says."""
    kw = _read_decoder({"num_key_value_heads": 4, "max_position_embeddings": 32768, "vocab_size": 128256, **cfg}, f)
    n = kw["n_layers"]
    rope = cfg.get("no_rope_layers")
    if rope is None:
        every = _int(cfg, "no_rope_layer_interval", family=f, default=4)
        rope = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(rope, list) or len(rope) != n or any(r not in (0, 1) or isinstance(r, float) for r in rope):
        raise SpecError(f"config.json no_rope_layers={show_value(rope)} must give 1 (rotary) or 0 (none) for each "
                        f"of the {n} layers")
    window = _sliding_window(cfg, False)
    types = cfg.get("layer_types")
    if types is None and window:
        types = ["full_attention" if r else "sliding_attention" for r in rope]
    types = _qwen_layer_types({"layer_types": types}, n, window, 0) if types is not None else ()
    return {**kw, "nope_layers": tuple(i for i, r in enumerate(rope) if not r), "sliding_window": window,
            "layer_types": types}


def _read_granite(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """GraniteConfig (configuration_granite.py lines 63-85): llama's keys; ``attention_bias`` sets q/k/v/o
    biases. The four multipliers change values, not shapes: every step multiplies by them (read, not kept)."""
    kw = _read_decoder({"vocab_size": 32000, **cfg}, f)
    for key in ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier"):
        _float(cfg, key, family=f, default=1.0)
    return kw


def _read_qwen3_moe(cfg: Mapping[str, Any], f: Family) -> dict[str, Any]:
    """Qwen3MoeConfig (configuration_qwen3_moe.py lines 80-111): 128 experts of width
    ``moe_intermediate_size`` (768), 8 per token, ``norm_topk_prob`` off by default; a layer is MoE unless
    it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step`` is not 0 (Qwen3MoeDecoderLayer.__init__),
    dense layers having ``intermediate_size``; no head_dim default (hidden / heads); 4 kv heads."""
    kw = _read_decoder({"num_key_value_heads": 4, "max_position_embeddings": 32768, "vocab_size": 151936, **cfg}, f)
    n = kw["n_layers"]
    experts = _int(cfg, "num_experts", family=f, default=128)
    step = _int(cfg, "decoder_sparse_step", family=f, default=1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise SpecError(f"config.json mlp_only_layers={show_value(only)} must be a list of layer indices")
    width = _int(cfg, "moe_intermediate_size", family=f, default=768)
    return {**kw, "n_experts": experts, "experts_top_k": _int(cfg, "num_experts_per_tok", family=f, default=8),
            "expert_ffn": 0 if width == kw["ffn"] else width, "norm_topk_prob": _flag(cfg, "norm_topk_prob", False),
            "dense_layers": tuple(i for i in range(n) if i in only or (i + 1) % step),
            **_window(cfg, False)}


#: The config reader of every family.
READERS: dict[Family, Callable[[Mapping[str, Any], Family], dict[str, Any]]] = {
    Family.LLAMA: _read_llama, Family.MISTRAL: _read_mistral, Family.QWEN2: _read_qwen2, Family.GEMMA: _read_gemma,
    Family.PHI3: _read_phi3, Family.MIXTRAL: _read_mixtral, Family.GPT2: _read_gpt2, Family.OPT: _read_opt,
    Family.BERT: _read_bert, Family.GPT_NEOX: _read_gpt_neox, Family.OLMO2: _read_olmo2, Family.GEMMA2: _read_gemma2,
    Family.GEMMA3: _read_gemma3, Family.PHI: _read_phi, Family.STARCODER2: _read_starcoder2,
    Family.QWEN3: _read_qwen3, Family.SMOLLM3: _read_smollm3, Family.GRANITE: _read_granite,
    Family.QWEN3_MOE: _read_qwen3_moe, Family.GPT_OSS: _read_gpt_oss, Family.DEEPSEEK_V3: _read_deepseek_v3,
}
