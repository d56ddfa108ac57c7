"""Build Hugging Face models from a config dict, with random init and nothing downloaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["IDLE_MODULES", "hf_config_object", "hf_model_class", "hf_param_shapes", "instantiate"]

#: The modules of a multimodal Gemma 3 model that a text-only step never runs (no gradient, no optimizer state),
#: as parts of a parameter's name (peft wraps the model: ``base_model.model.model.vision_tower...``).
IDLE_MODULES = frozenset({"vision_tower", "multi_modal_projector"})


def hf_config_object(config: Mapping[str, Any], **overrides: Any) -> Any:
    """A transformers ``PretrainedConfig`` for `config` (a config.json dict), with `overrides` applied."""
    from transformers import AutoConfig

    data = dict(config)
    model_type = data.pop("model_type")
    data.update(overrides)
    return AutoConfig.for_model(model_type, **data)


def hf_model_class(model_type: str, architectures: Any = None) -> Any:
    """The class a training run instantiates for `model_type`: its family's description names it
    (``*ForCausalLM`` for decoders, ``BertForMaskedLM`` for bert), or the sequence-classification class
    `architectures` (a config's list) names (``BertForSequenceClassification``)."""
    import transformers

    from ..model.families import describe
    from ..model.hf_config import SUPPORTED_MODEL_TYPES

    if isinstance(architectures, list) and architectures and str(architectures[0]).endswith("ForSequenceClassification"):
        return getattr(transformers, architectures[0])
    if model_type == "gemma3":  # a multimodal config: AutoModelForCausalLM builds the whole model (modeling_auto.py)
        return transformers.Gemma3ForConditionalGeneration
    return getattr(transformers, describe(SUPPORTED_MODEL_TYPES[model_type]).hf_class)


def hf_param_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter (tied ones once) of the model built on the meta device (of a
    multimodal Gemma 3 config, Gemma3ForConditionalGeneration: its vision tower and projector too)."""
    import torch

    cfg = hf_config_object(config)
    cls = hf_model_class(config["model_type"], config.get("architectures"))
    with torch.device("meta"):
        model = cls.from_config(cfg) if hasattr(cls, "from_config") else cls(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def instantiate(config: Any, model_type: str, attn_implementation: str, dtype: Any) -> Any:
    """A randomly initialised model of `config` (no download), in `dtype`, with that attention kernel.

    Decoders go through ``AutoModelForCausalLM.from_config``; ``BertForMaskedLM`` has no
    ``from_config`` of its own, so it goes through ``_from_config``, which that method wraps.
    """
    cls = hf_model_class(model_type, getattr(config, "architectures", None))
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    return make(config, attn_implementation=attn_implementation, dtype=dtype)
