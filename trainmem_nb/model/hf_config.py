"""Read Hugging Face ``config.json`` files into `ModelSpec` fields, and shape a bare parameter count.

Each family's keys and defaults follow its ``configuration_*.py`` in transformers 5.x (the defaults
matter: a config that omits ``tie_word_embeddings`` gets the family's default, as ``from_pretrained``
would).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import SpecError, did_you_mean
from .families import DESCRIPTIONS, Family
from .hf_readers import READERS
from .hf_writers import WRITERS, to_hf_config

__all__ = ["READERS", "SUPPORTED_MODEL_TYPES", "WRITERS", "UnsupportedModelType", "shape_for_params",
           "spec_kwargs_from_hf", "stand_in_kwargs", "to_hf_config"]

#: ``model_type`` values we read, mapped to their family (each family's description lists its own).
SUPPORTED_MODEL_TYPES: dict[str, Family] = {t: d.family for d in DESCRIPTIONS.values() for t in d.model_types}


class UnsupportedModelType(SpecError):
    """A ``config.json`` whose ``model_type`` no family reads; `ModelSpec.from_hf_config` adds how to
    estimate it anyway."""


# Largest values a real config has had, times a generous margin: beyond these a config is a typo.
_ABSURD = {"layers": 2000, "hidden": 262_144, "heads": 16_384, "vocab": 4_194_304}


def spec_kwargs_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`ModelSpec` keyword arguments from a Hugging Face config dict: the family's reader (`READERS`),
    then what every family shares (tied embeddings, sanity bounds).

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
        raise UnsupportedModelType(
            f"model_type={model_type!r} is not supported{did_you_mean(model_type, list(SUPPORTED_MODEL_TYPES))}; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    labels = _check_head(cfg, family)
    kw: dict[str, Any] = {"family": family, **READERS[family](cfg, family)}
    if labels:
        kw["num_labels"] = labels
    tie = cfg.get("tie_word_embeddings", DESCRIPTIONS[family].tie_default)
    if not isinstance(tie, bool):
        raise SpecError(f"config.json has tie_word_embeddings={tie!r}; it must be true or false")
    kw["tie_embeddings"] = tie
    for key, limit in (("n_layers", _ABSURD["layers"]), ("hidden", _ABSURD["hidden"]),
                       ("n_heads", _ABSURD["heads"]), ("vocab", _ABSURD["vocab"])):
        if kw.get(key, 0) > limit:
            raise SpecError(f"config.json gives {key}={kw[key]}, beyond any real model (> {limit}); check the file")
    return kw


def stand_in_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Llama of an unsupported config's own dimensions (LlamaConfig's keys: ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``, ``vocab_size``), or None when
    the config does not name them, or names experts (a dense stand-in would count a fraction of an MoE
    model): the stand-in an error suggests, never used silently."""
    if any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")):
        return None
    try:
        kw = READERS[Family.LLAMA](cfg, Family.LLAMA)
    except SpecError:
        return None
    return {**kw, "family": Family.LLAMA, "tie_embeddings": bool(cfg.get("tie_word_embeddings") is True)}


#: Heads Hugging Face puts on a backbone instead of the language-model head each family's step models
#: (``architectures`` in config.json names the class a checkpoint was saved from).
_OTHER_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice",
                "ForNextSentencePrediction")


def _check_head(cfg: Mapping[str, Any], family: Family) -> int:
    """The labels of a sequence-classification head the step models (``BertForSequenceClassification``:
    ``num_labels``, else ``len(id2label)``, else transformers' default 2), 0 for the LM head; refuse a
    checkpoint saved with a task head the step does not model (it would be counted as the family's LM
    head, whose (batch, seq, vocab) logits a classifier does not have)."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list):
        return 0
    other = [a for a in archs if isinstance(a, str) and a.endswith(_OTHER_HEADS)]
    lm = any(isinstance(a, str) and a.endswith(("ForCausalLM", "ForMaskedLM", "ForConditionalGeneration")) for a in archs)
    classifies = family is Family.BERT or DESCRIPTIONS[family].composed
    if other and not lm and classifies and other[0].endswith("ForSequenceClassification"):
        return _num_labels(cfg)
    if other and not lm:
        head = DESCRIPTIONS[family].hf_class
        raise SpecError(
            f"config.json's architectures {other}: a {other[0].split('For', 1)[1]} head is not modelled; the estimate "
            f"models {head}, whose (batch, seq, vocab) logits a classifier does not have. To estimate it with the "
            f"{head} head (an upper bound on the head's memory), remove 'architectures' from the config")
    return 0


def _num_labels(cfg: Mapping[str, Any]) -> int:
    """transformers' ``PretrainedConfig.num_labels``: ``num_labels`` if given, else ``len(id2label)``, else 2
    (configuration_utils.py: ``self.id2label = ...`` from ``num_labels=kwargs.pop("num_labels", 2)``)."""
    n = cfg.get("num_labels")
    if n is None and isinstance(cfg.get("id2label"), Mapping):
        n = len(cfg["id2label"])
    n = 2 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 16:
        raise SpecError(f"config.json has num_labels={n!r}; it must be an integer from 1 to 65536")
    return n


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
