"""Build Hugging Face models from a config dict, with random init and nothing downloaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["hf_config_object", "hf_model_class", "hf_param_shapes", "instantiate"]


def hf_config_object(config: Mapping[str, Any], **overrides: Any) -> Any:
    """A transformers ``PretrainedConfig`` for `config` (a config.json dict), with `overrides` applied."""
    from transformers import AutoConfig

    data = dict(config)
    model_type = data.pop("model_type")
    data.update(overrides)
    return AutoConfig.for_model(model_type, **data)


def hf_model_class(model_type: str) -> Any:
    """The class a training run instantiates for `model_type`: its family's description names it
    (``*ForCausalLM`` for decoders, ``BertForMaskedLM`` for bert)."""
    import transformers

    from ..model.families import describe
    from ..model.hf_config import SUPPORTED_MODEL_TYPES

    return getattr(transformers, describe(SUPPORTED_MODEL_TYPES[model_type]).hf_class)


def hf_param_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter (tied ones once) of the model built on the meta device."""
    import torch

    cfg = hf_config_object(config)
    cls = hf_model_class(config["model_type"])
    with torch.device("meta"):
        model = cls.from_config(cfg) if hasattr(cls, "from_config") else cls(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def instantiate(config: Any, model_type: str, attn_implementation: str, dtype: Any) -> Any:
    """A randomly initialised model of `config` (no download), in `dtype`, with that attention kernel.

    Decoders go through ``AutoModelForCausalLM.from_config``; ``BertForMaskedLM`` has no
    ``from_config`` of its own, so it goes through ``_from_config``, which that method wraps.
    """
    cls = hf_model_class(model_type)
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    return make(config, attn_implementation=attn_implementation, dtype=dtype)
