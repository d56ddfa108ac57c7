"""Presets: popular models by short name or repo id, with parameter counts equal to Hugging Face's."""

from __future__ import annotations

import importlib.util

import pytest

from trainmem_nb.model.params import count_params
from trainmem_nb.model.presets import get_model, get_preset, list_presets
from trainmem_nb.model.spec import ModelSpec

REQUIRED = ["gpt2", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "mistral-7b", "mixtral-8x7b",
            "qwen2.5-7b", "gemma-2b", "phi-3-mini", "pythia-1.4b", "tinyllama-1.1b", "bert-large"]


def test_at_least_twenty_presets_each_with_a_config_source() -> None:
    presets = list_presets()
    assert len(presets) >= 20
    for p in presets:
        assert p.source.startswith("https://huggingface.co/") and p.source.endswith("/config.json")
        assert p.n_params, f"{p.name} has no recorded Hugging Face parameter count"


#: The families of issue 12 and every Llama 3.x: people ask which config a preset is, so each says when it was copied.
DATED_FAMILIES = {"qwen3", "qwen3_moe", "gemma2", "gemma3", "gemma3_text", "olmo2", "phi", "starcoder2", "granite",
                  "smollm3", "gpt_oss", "deepseek_v3"}


def test_presets_of_the_new_families_and_llama_3_say_when_their_config_was_copied() -> None:
    import re

    dated = [p for p in list_presets()
             if p.config["model_type"] in DATED_FAMILIES or p.name.startswith("llama-3.")]
    assert len(dated) >= 35
    for p in dated:
        assert re.fullmatch(r"20\d\d(-[01]\d(-[0-3]\d)?)?", p.config_date), (p.name, p.config_date)
    undated = {p.name for p in list_presets() if not p.config_date}
    assert undated.isdisjoint(p.name for p in dated)


def test_the_presets_command_shows_each_presets_config_date(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from trainmem_nb.cli.main import main

    assert main(["presets"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("qwen3-8b "))
    assert row.split()[2:] == ["2025-04-29", "Qwen/Qwen3-8B"]
    assert main(["presets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["deepseek-v3"]["config_date"] == "2024-12-26" and rows["gpt2"]["config_date"] == ""


@pytest.mark.parametrize("name", REQUIRED)
def test_required_short_names_resolve(name: str) -> None:
    assert get_model(name).name == name


def test_hugging_face_repo_ids_and_case_resolve_to_the_same_model() -> None:
    assert get_preset("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert get_preset("Llama-2-7B-HF").name == "llama-2-7b"
    assert get_preset("mistralai/Mixtral-8x7B-v0.1").name == "mixtral-8x7b"


@pytest.mark.parametrize("preset", list_presets(), ids=lambda p: p.name)
def test_parameter_count_equals_the_recorded_hugging_face_count(preset) -> None:  # type: ignore[no-untyped-def]
    # the recorded count comes from transformers itself (scripts/record_preset_params.py)
    assert count_params(get_model(preset.name)) == preset.n_params


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the measure extra")
@pytest.mark.parametrize("preset", list_presets(), ids=lambda p: p.name)
def test_parameter_count_equals_transformers_built_on_meta(preset) -> None:  # type: ignore[no-untyped-def]
    import warnings

    from trainmem_nb.measure.models import hf_param_shapes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notices about legacy config keys
        shapes = hf_param_shapes(preset.config)
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    assert count_params(get_model(preset.name)) == total


def test_each_familys_named_projections_are_modules_of_its_presets() -> None:
    """The family description names modules by their place in a layer (the attention's output projection, the
    projections a Megatron-style layer fuses, ``lora_targets='qv'``): each must be a linear of the family's
    presets, or a typo would silently leave a mechanism off."""
    from trainmem_nb.model.families import DESCRIPTIONS
    from trainmem_nb.model.params import param_inventory

    modules: dict[str, set[str]] = {}
    for preset in list_presets():
        m = get_model(preset.name)
        # a mixture-of-experts model's dense layers (mlp_only_layers, first_k_dense_replace) hold a dense MLP;
        # multi-head latent attention without a low-rank q (q_lora_rank null) has a plain q_proj
        variants = [{"dense_layers": (0,)}] * bool(m.n_experts) + [{"q_lora_rank": 0}] * bool(m.q_lora_rank)
        for spec in (m, *(ModelSpec(**{**m.model_dump(), **v}) for v in variants)):
            modules.setdefault(m.family.value, set()).update(
                p.name[len("layers."):-len(".weight")] for p in param_inventory(spec)
                if p.in_layer and p.name.endswith(".weight"))
    for family, d in DESCRIPTIONS.items():
        if family.value not in modules:
            continue
        named = {d.attention_output, *d.lora_qv, *(mod for group in d.fused_projections for mod in group)}
        assert named <= modules[family.value], (family, named - modules[family.value])
