"""Popular models by short name or Hugging Face repo id, from the data file ``data/presets.json``.

Each preset is the architecture part of a model's ``config.json`` with its source URL; nothing is
downloaded. Names are case-insensitive: ``"llama-2-7b"``, ``"meta-llama/Llama-2-7b-hf"`` and
``"Llama-2-7b-hf"`` are the same model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple

from ..errors import SpecError, did_you_mean
from .spec import ModelSpec

__all__ = ["Preset", "get_model", "get_preset", "list_presets", "resolve_model"]


class Preset(NamedTuple):
    """A named model: its config subset, where and when that config comes from, and its recorded HF count."""

    name: str
    hf_id: str
    aliases: tuple[str, ...]
    source: str
    config: Mapping[str, Any]
    n_params: int | None  #: ``sum(p.numel())`` of the transformers class, recorded by a script
    config_date: str = ""  #: ``YYYY-MM-DD`` (or ``YYYY-MM``, ``YYYY``) of the config copied; "" when not recorded
    config_note: str = ""  #: which commit or release that date is, where it needs words


@lru_cache(maxsize=1)
def _load() -> tuple[dict[str, Preset], list[Preset]]:
    raw = json.loads(resources.files("trainmem_nb").joinpath("data/presets.json").read_text())
    by_key: dict[str, Preset] = {}
    ordered: list[Preset] = []
    for entry in raw["presets"]:
        p = Preset(
            entry["name"], entry["hf_id"], tuple(entry.get("aliases", ())), entry["source"],
            entry["config"], entry.get("n_params"), entry.get("config_date", ""), entry.get("config_note", ""),
        )
        ordered.append(p)
        for key in (p.name, p.hf_id, p.hf_id.split("/")[-1], *p.aliases):
            by_key[key.lower()] = p
    return by_key, ordered


def list_presets() -> list[Preset]:
    """All presets in the data file's order."""
    return list(_load()[1])


def get_preset(name: str) -> Preset:
    """The preset for a short name, alias or Hugging Face repo id (case-insensitive)."""
    by_key, ordered = _load()
    try:
        return by_key[name.strip().lower()]
    except KeyError:
        names = [p.name for p in ordered]
        raise SpecError(
            f"model={name!r} is not a known preset{did_you_mean(name, names + [p.hf_id for p in ordered])}; "
            f"known presets: {', '.join(names)} (or pass a config.json with hf_config=, or params=N)"
        ) from None


@lru_cache(maxsize=256)
def get_model(name: str) -> ModelSpec:
    """The validated `ModelSpec` of a preset.

    >>> get_model("llama-2-7b").n_params
    6738415616
    """
    p = get_preset(name)
    return ModelSpec.from_hf_config(p.config, name=p.name)


def resolve_model(model: str | ModelSpec | Mapping[str, Any] | int | float) -> ModelSpec:
    """Any way of naming a model → a `ModelSpec`: a preset name or repo id (a repo id no preset names is
    read from the Hub: `trainmem_nb.model.hub`), a spec, an HF config dict (with ``model_type``), a spec
    dict (with ``family``), or a parameter count."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        try:
            return get_model(model)
        except SpecError:
            from .hub import is_repo_id, model_from_hub

            if not is_repo_id(model):
                raise
            return model_from_hub(model.strip())
    if isinstance(model, Mapping):
        if "model_type" in model:
            return ModelSpec.from_hf_config(model)
        from ..spec.base import _validate

        return _validate(ModelSpec, model)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return ModelSpec.from_params(model)
    raise SpecError(
        f"model must be a preset name, a ModelSpec, a config dict or a parameter count; got {type(model).__name__}"
    )
