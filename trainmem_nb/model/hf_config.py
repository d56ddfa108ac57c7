"""Read Hugging Face ``config.json`` files into `ModelSpec` fields, and shape a bare parameter count.

Each family's keys and defaults follow its ``configuration_*.py`` in transformers 5.x (the defaults
matter: a config that omits ``tie_word_embeddings`` gets the family's default, as ``from_pretrained``
would).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from ..errors import SpecError, did_you_mean, show_value, whole_number
from .families import Family

__all__ = ["SUPPORTED_MODEL_TYPES", "shape_for_params", "spec_kwargs_from_hf", "to_hf_config"]

#: ``model_type`` values we read, mapped to our family (aliases for close variants of one layout).
SUPPORTED_MODEL_TYPES: dict[str, Family] = {
    "llama": Family.LLAMA,
    "mistral": Family.MISTRAL,
    "qwen2": Family.QWEN2,
    "gemma": Family.GEMMA,
    "phi3": Family.PHI3,
    "mixtral": Family.MIXTRAL,
    "gpt2": Family.GPT2,
    "gpt_neox": Family.GPT_NEOX,
    "opt": Family.OPT,
    "bert": Family.BERT,
}

# transformers' per-family default for ``tie_word_embeddings`` (configuration_*.py).
_TIE_DEFAULT = {
    Family.LLAMA: False, Family.MISTRAL: False, Family.QWEN2: False, Family.GEMMA: True, Family.PHI3: False,
    Family.MIXTRAL: False, Family.GPT2: True, Family.GPT_NEOX: False, Family.OPT: True, Family.BERT: True,
}

# Largest values a real config has had, times a generous margin: beyond these a config is a typo.
_ABSURD = {"layers": 2000, "hidden": 262_144, "heads": 16_384, "vocab": 4_194_304}


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


def _sliding_window(cfg: Mapping[str, Any], family: Family) -> int:
    """The attention window in tokens, 0 for none: ``sliding_window`` is an integer or null, and
    ``use_sliding_window`` (Qwen2's switch, off by default there) true or false."""
    use = cfg.get("use_sliding_window", family is not Family.QWEN2)
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


def spec_kwargs_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`ModelSpec` keyword arguments from a Hugging Face config dict.

    >>> kw = spec_kwargs_from_hf({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4})
    >>> kw["family"].value, kw["ffn"], kw["vocab"]
    ('gpt2', 256, 50257)
    """
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        found = "has no 'model_type'" if model_type is None else f"has model_type={model_type!r}, not a name"
        raise SpecError(f"config.json {found}; supported model types: " + ", ".join(SUPPORTED_MODEL_TYPES))
    family = SUPPORTED_MODEL_TYPES.get(model_type)
    if family is None:
        raise SpecError(
            f"model_type={model_type!r} is not supported{did_you_mean(model_type, list(SUPPORTED_MODEL_TYPES))}; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    f = family
    kw: dict[str, Any] = {"family": family}
    if family is Family.GPT2:
        hidden = _int(cfg, "n_embd", "hidden_size", family=f)
        kw.update(
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
    elif family is Family.OPT:
        hidden = _int(cfg, "hidden_size", family=f)
        proj = _int(cfg, "word_embed_proj_dim", family=f, default=hidden)
        bias = bool(_get(cfg, "enable_bias", default=True, family=f))
        kw.update(
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
            pre_norm=bool(_get(cfg, "do_layer_norm_before", default=True, family=f)),
            qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        )
        if cfg.get("_remove_final_layer_norm") or cfg.get("layer_norm_elementwise_affine") is False:
            raise SpecError("OPT configs with _remove_final_layer_norm or without layer-norm weights are not supported")
    elif family is Family.BERT:
        kw.update(
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
    elif family is Family.GPT_NEOX:
        rotary = cfg.get("rotary_pct", _rope(cfg).get("partial_rotary_factor", 0.25))
        bias = bool(_get(cfg, "attention_bias", default=True, family=f))
        kw.update(
            n_layers=_int(cfg, "num_hidden_layers", family=f),
            hidden=_int(cfg, "hidden_size", family=f),
            n_heads=_int(cfg, "num_attention_heads", family=f),
            ffn=_int(cfg, "intermediate_size", family=f),
            vocab=_int(cfg, "vocab_size", family=f),
            max_positions=_int(cfg, "max_position_embeddings", family=f, default=2048),
            activation=_get(cfg, "hidden_act", default="gelu", family=f),
            attn_dropout=_float(cfg, "attention_dropout", family=f, default=0.0),
            hidden_dropout=_float(cfg, "hidden_dropout", family=f, default=0.0),
            parallel_residual=bool(_get(cfg, "use_parallel_residual", default=True, family=f)),
            rotary_pct=rotary,
            qkv_bias=bias, out_bias=bias,
        )
    else:  # llama-style decoders
        hidden = _int(cfg, "hidden_size", family=f)
        heads = _int(cfg, "num_attention_heads", family=f)
        act = _get(cfg, "hidden_activation", "hidden_act", default="silu", family=f)
        if family is Family.GEMMA and act == "gelu":
            act = "gelu_pytorch_tanh"  # transformers' GemmaConfig maps the legacy "gelu" to the tanh form
        kw.update(
            n_layers=_int(cfg, "num_hidden_layers", family=f),
            hidden=hidden,
            n_heads=heads,
            n_kv_heads=_int(cfg, "num_key_value_heads", family=f, default=heads),
            head_dim=_int(cfg, "head_dim", family=f, default=0, minimum=0),
            ffn=_int(cfg, "intermediate_size", family=f),
            vocab=_int(cfg, "vocab_size", family=f),
            max_positions=_int(cfg, "max_position_embeddings", family=f, default=2048),
            activation=act,
            attn_dropout=_float(cfg, "attention_dropout", family=f, default=0.0),
        )
        if family is Family.LLAMA:
            bias = bool(cfg.get("attention_bias", False))
            kw.update(qkv_bias=bias, out_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
        if family is Family.PHI3:
            kw.update(
                hidden_dropout=_float(cfg, "resid_pdrop", family=f, default=0.0),
                embd_dropout=_float(cfg, "embd_pdrop", family=f, default=0.0),
                rotary_pct=cfg.get("partial_rotary_factor", _rope(cfg).get("partial_rotary_factor", 1.0)),
            )
        if family is Family.MIXTRAL:
            kw.update(
                n_experts=_int(cfg, "num_local_experts", family=f, default=8),
                experts_top_k=_int(cfg, "num_experts_per_tok", family=f, default=2),
            )
        if family in (Family.MISTRAL, Family.MIXTRAL, Family.QWEN2, Family.PHI3):
            window = _sliding_window(cfg, family)
            if window > 0:
                kw["sliding_window"] = window
    tie = cfg.get("tie_word_embeddings", _TIE_DEFAULT[family])
    if not isinstance(tie, bool):
        raise SpecError(f"config.json has tie_word_embeddings={tie!r}; it must be true or false")
    kw["tie_embeddings"] = tie
    for key, limit in (("n_layers", _ABSURD["layers"]), ("hidden", _ABSURD["hidden"]),
                       ("n_heads", _ABSURD["heads"]), ("vocab", _ABSURD["vocab"])):
        if kw.get(key, 0) > limit:
            raise SpecError(f"config.json gives {key}={kw[key]}, beyond any real model (> {limit}); check the file")
    return kw


# Llama-2/3 shape ratios: hidden = 128 * layers is 7B's and 13B's aspect; ffn ~ 8/3 hidden rounded to
# 256 (Touvron et al. 2023, Table 2 and the released configs); head_dim 128; 32000-token vocabulary.
_HEAD_DIM = 128
_VOCAB = 32_000


def _llama_like_params(layers: int, hidden: int, ffn: int, kv_heads: int, heads: int) -> int:
    kv = kv_heads * _HEAD_DIM
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return layers * per_layer + 2 * _VOCAB * hidden + hidden


def shape_for_params(n_params: int | float, family: str | Family = "llama", name: str | None = None) -> dict[str, Any]:
    """A Llama-shaped `ModelSpec` dict whose parameter count is close to `n_params`.

    >>> shape_for_params(7e9)["hidden"]
    4096
    """
    fam = Family.parse(family, "family")
    if fam not in (Family.LLAMA, Family.MISTRAL, Family.QWEN2):
        raise SpecError(f"a bare parameter count scales llama-style shapes; family={fam.value!r} is not one "
                        f"(use llama, mistral or qwen2)")
    try:
        target = float(n_params)
    except (TypeError, ValueError):
        raise SpecError(f"params={n_params!r} is not a number") from None
    smallest = _smallest_shape_params()
    if not math.isfinite(target) or target < smallest or target > 1e13:
        raise SpecError(f"params={n_params!r} must be between {int(smallest):,} (one layer of hidden 128 with a "
                        f"{_VOCAB:,}-token vocabulary) and 1e13 parameters")
    best: tuple[float, dict[str, Any]] | None = None
    for hidden in range(128, 32_768 + 1, 128):
        heads = max(1, hidden // _HEAD_DIM)
        kv_heads = 8 if hidden >= 8192 and heads % 8 == 0 else heads
        ffn = max(256, round(hidden * 8 / 3 / 256) * 256)
        per_layer = _llama_like_params(1, hidden, ffn, kv_heads, heads) - _llama_like_params(0, hidden, ffn, kv_heads, heads)
        fixed = _llama_like_params(0, hidden, ffn, kv_heads, heads)
        layers = round((target - fixed) / per_layer)
        if layers < 1:
            continue
        aspect = abs(math.log((hidden / layers) / 128.0))
        err = abs(_llama_like_params(layers, hidden, ffn, kv_heads, heads) - target) / target
        score = err * 10 + aspect
        if best is None or score < best[0]:
            best = (score, {
                "family": fam, "n_layers": layers, "hidden": hidden, "n_heads": heads, "n_kv_heads": kv_heads,
                "ffn": ffn, "vocab": _VOCAB, "max_positions": 131_072,
            })
    if best is None:
        raise SpecError(f"params={n_params!r} is too small for a transformer shape")
    shape = best[1]
    shape["name"] = name or f"llama-like-{_human_count(target)}"
    return shape


def _smallest_shape_params() -> float:
    """The smallest count `shape_for_params` can build: where its one-layer, hidden-128 shape rounds to a layer."""
    hidden = 128
    heads = hidden // _HEAD_DIM
    ffn = max(256, round(hidden * 8 / 3 / 256) * 256)
    fixed = _llama_like_params(0, hidden, ffn, heads, heads)
    return float(math.ceil(fixed + 0.5 * (_llama_like_params(1, hidden, ffn, heads, heads) - fixed)) + 1)


def _human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def to_hf_config(m: Any) -> dict[str, Any]:
    """The Hugging Face config dict that builds exactly `m` (a `ModelSpec`); the inverse of
    `spec_kwargs_from_hf`, used to measure any spec with the real model code.

    >>> from trainmem_nb.errors import ModelSpec
    >>> m = ModelSpec(family="gpt2", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=100, max_positions=128)
    >>> ModelSpec.from_hf_config(to_hf_config(m), name=m.name) == m
    True
    """
    fam = m.family
    tie = {"tie_word_embeddings": m.tie_embeddings}
    if fam is Family.GPT2:
        return {"model_type": "gpt2", "n_layer": m.n_layers, "n_embd": m.hidden, "n_head": m.n_heads,
                "n_inner": m.ffn, "vocab_size": m.vocab, "n_positions": m.max_positions,
                "activation_function": m.activation, "attn_pdrop": m.attn_dropout,
                "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.embd_dropout, **tie}
    if fam is Family.OPT:
        return {"model_type": "opt", "hidden_size": m.hidden, "ffn_dim": m.ffn, "num_hidden_layers": m.n_layers,
                "num_attention_heads": m.n_heads, "vocab_size": m.vocab, "max_position_embeddings": m.max_positions,
                "word_embed_proj_dim": m.word_embed_proj_dim or m.hidden, "do_layer_norm_before": m.pre_norm,
                "activation_function": m.activation, "dropout": m.hidden_dropout,
                "attention_dropout": m.attn_dropout, "enable_bias": m.qkv_bias, **tie}
    if fam is Family.BERT:
        return {"model_type": "bert", "hidden_size": m.hidden, "intermediate_size": m.ffn,
                "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "vocab_size": m.vocab,
                "max_position_embeddings": m.max_positions, "type_vocab_size": m.type_vocab,
                "hidden_act": m.activation, "hidden_dropout_prob": m.hidden_dropout,
                "attention_probs_dropout_prob": m.attn_dropout, **tie}
    if fam is Family.GPT_NEOX:
        return {"model_type": "gpt_neox", "hidden_size": m.hidden, "intermediate_size": m.ffn,
                "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "vocab_size": m.vocab,
                "max_position_embeddings": m.max_positions, "hidden_act": m.activation,
                "attention_dropout": m.attn_dropout, "hidden_dropout": m.hidden_dropout,
                "use_parallel_residual": m.parallel_residual, "rotary_pct": m.rotary_pct,
                "attention_bias": m.qkv_bias, **tie}
    cfg: dict[str, Any] = {
        "model_type": fam.value, "hidden_size": m.hidden, "intermediate_size": m.ffn,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim, "vocab_size": m.vocab, "max_position_embeddings": m.max_positions,
        "hidden_act": m.activation, "attention_dropout": m.attn_dropout, **tie,
    }
    if fam is Family.LLAMA:
        cfg.update(attention_bias=m.qkv_bias, mlp_bias=m.mlp_bias)
    if fam is Family.PHI3:
        cfg.update(resid_pdrop=m.hidden_dropout, embd_pdrop=m.embd_dropout, partial_rotary_factor=m.rotary_pct)
    if fam is Family.MIXTRAL:
        cfg.update(num_local_experts=m.n_experts, num_experts_per_tok=m.experts_top_k)
    if fam in (Family.MISTRAL, Family.MIXTRAL, Family.PHI3):
        cfg["sliding_window"] = m.sliding_window or None
    if fam is Family.QWEN2:
        cfg.update(use_sliding_window=bool(m.sliding_window), sliding_window=m.sliding_window or None)
    return cfg
