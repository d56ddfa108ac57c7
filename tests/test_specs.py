"""Bad input gets a message naming the field, the value and what is valid."""

from __future__ import annotations

import json

import pytest

from trainmem_nb import SpecError, TrainingSpec, estimate
from trainmem_nb.model.spec import ModelSpec


def test_heads_not_dividing_hidden_names_both_and_suggests_divisors() -> None:
    with pytest.raises(SpecError, match=r"n_heads=3 does not divide hidden=100; choose n_heads from .*4"):
        ModelSpec(family="llama", n_layers=2, hidden=100, n_heads=3, ffn=64, vocab=10)


def test_kv_heads_not_dividing_heads_is_rejected() -> None:
    with pytest.raises(SpecError, match=r"n_kv_heads=3 does not divide n_heads=8"):
        ModelSpec(family="llama", n_layers=2, hidden=256, n_heads=8, n_kv_heads=3, ffn=64, vocab=10)


@pytest.mark.parametrize("field", ["n_layers", "hidden", "n_heads", "ffn", "vocab"])
@pytest.mark.parametrize("value", [0, -4])
def test_zero_or_negative_sizes_name_the_field(field: str, value: int) -> None:
    kw = dict(family="llama", n_layers=2, hidden=256, n_heads=4, ffn=64, vocab=10)
    kw[field] = value
    with pytest.raises(SpecError, match=rf"{field}={value}: Input should be greater than or equal to 1"):
        estimate(kw)


@pytest.mark.parametrize(("option", "value", "hint"), [
    ("precision", "bf16mixed", "bf16-mixed"),
    ("optimizer", "adamw8bit", "adamw-8bit"),
    ("checkpointing", "ful", "full"),
])
def test_unknown_choice_lists_valid_values_with_did_you_mean(option: str, value: str, hint: str) -> None:
    with pytest.raises(SpecError, match=rf"{option}='{value}' is not supported \(did you mean '{hint}'\?\); valid values:"):
        TrainingSpec.model_validate({option: value})


def test_sequence_beyond_positions_is_rejected_with_the_limit() -> None:
    with pytest.raises(SpecError, match=r"seq_len=2048 exceeds gpt2's max_positions=1024"):
        estimate("gpt2", seq_len=2048)


def test_unknown_training_option_gets_did_you_mean() -> None:
    with pytest.raises(SpecError, match=r"unknown training option 'micro_bacth' \(did you mean 'micro_batch'\?\)"):
        estimate("gpt2", micro_bacth=2)


def test_unsupported_model_type_names_the_supported_ones_and_how_to_estimate_anyway() -> None:
    with pytest.raises(SpecError, match=r"model_type='t5' is not supported; supported model types: llama, mistral.*"
                                        r"deepseek_v3; to estimate anyway, pass its parameter count"):
        ModelSpec.from_hf_config({"model_type": "t5", "d_model": 512})


def test_an_unsupported_config_with_llamas_keys_is_offered_a_stand_in_of_its_own_dimensions() -> None:
    cfg = {"model_type": "internlm2", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "intermediate_size": 14336, "vocab_size": 92544}
    stand_in = ModelSpec.from_hf_config({**cfg, "model_type": "llama"}).n_params
    with pytest.raises(SpecError, match=r"a Llama of its dimensions \(32 layers, hidden 4096, ffn 14336, vocab 92544\) "
                                        rf"has {stand_in / 1e9:.3g}B parameters.*params={stand_in / 1e9:.3g}e9") as e:
        ModelSpec.from_hf_config(cfg)
    assert "\n" not in str(e.value)
    # a mixture-of-experts config gets no dense stand-in (it would count a fraction of the model)
    with pytest.raises(SpecError, match=r"to estimate anyway, pass its parameter count"):
        ModelSpec.from_hf_config({**cfg, "model_type": "qwen2_moe", "num_experts": 60, "moe_intermediate_size": 1408})


@pytest.mark.parametrize("arch", ["LlamaForTokenClassification", "BertForTokenClassification"])
def test_a_checkpoint_saved_with_a_task_head_is_refused_not_counted_as_the_lm_head(arch: str) -> None:
    from trainmem_nb.model.presets import get_preset

    cfg = dict(get_preset("bert-base" if arch.startswith("Bert") else "llama-3.2-1b").config, architectures=[arch])
    with pytest.raises(SpecError, match=r"architectures \['" + arch + r"'\]: a .* head is not modelled.*remove "
                                        r"'architectures'"):
        ModelSpec.from_hf_config(cfg)
    lm = dict(cfg, architectures=["BertForMaskedLM" if arch.startswith("Bert") else "LlamaForCausalLM"])
    assert ModelSpec.from_hf_config(lm) == ModelSpec.from_hf_config({k: v for k, v in cfg.items() if k != "architectures"})


def test_malformed_config_json_reports_the_parse_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(SpecError, match=r"is not valid JSON: Expecting value at line 1"):
        ModelSpec.from_hf_config(path)


def test_config_missing_a_required_key_says_which() -> None:
    with pytest.raises(SpecError, match=r"config.json for model_type 'llama' has no 'hidden_size'"):
        ModelSpec.from_hf_config({"model_type": "llama", "num_hidden_layers": 2})


def test_absurd_config_is_rejected() -> None:
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 999_999, "num_attention_heads": 32,
           "intermediate_size": 11008, "vocab_size": 32000}
    with pytest.raises(SpecError, match=r"n_layers=999999, beyond any real model"):
        ModelSpec.from_hf_config(cfg)


def test_config_value_of_wrong_type_is_named() -> None:
    cfg = {"model_type": "gpt2", "n_layer": "twelve", "n_embd": 768, "n_head": 12}
    with pytest.raises(SpecError, match=r"config.json n_layer='twelve' must be an integer"):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize(("extra", "message"), [
    ({"model_type": 5}, r"config.json has model_type=5, not a name; supported model types: llama"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings='yes'; it must be true or false"),
])
def test_config_model_type_and_flags_of_the_wrong_type_are_named(extra: dict, message: str) -> None:
    cfg = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, **extra}
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_a_bare_parameter_count_below_the_smallest_shape_names_the_minimum_which_works() -> None:
    from trainmem_nb.model.hf_config import _smallest_shape_params

    smallest = int(_smallest_shape_params())
    with pytest.raises(SpecError, match=rf"must be between {smallest:,} \("):
        ModelSpec.from_params(1e6)
    assert ModelSpec.from_params(smallest).n_layers == 1  # the number the message names is accepted
    with pytest.raises(SpecError):
        ModelSpec.from_params(smallest - 1)


def test_config_read_from_a_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}))
    m = ModelSpec.from_hf_config(tmp_path)
    assert (m.family.value, m.n_layers, m.ffn, m.tie_embeddings) == ("gpt2", 2, 256, True)


def test_gemma_legacy_gelu_maps_to_tanh_gelu_as_transformers_does() -> None:
    cfg = {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "intermediate_size": 128, "vocab_size": 10, "hidden_act": "gelu", "head_dim": 32}
    assert ModelSpec.from_hf_config(cfg).activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize(("family", "biases", "message"), [
    ("qwen3", {"qkv_bias": True}, "switches qkv_bias and out_bias together"),   # attention_bias sets all four
    ("llama", {"out_bias": True}, "config.json attention_bias"),
    ("starcoder2", {"mlp_bias": False}, "use_bias"),
    ("mistral", {"mlp_bias": True}, "always builds its projections with mlp_bias=False"),
    ("qwen2", {"qkv_bias": False}, "qkv_bias=True"),                            # q/k/v bias=True in the module
    ("gpt2", {"out_bias": False}, "out_bias=True"),
])
def test_bias_layouts_the_familys_modeling_code_cannot_build_are_refused(family: str, biases: dict, message: str) -> None:
    # the measure extra builds a spec from its config: a layout no config expresses would measure another model
    with pytest.raises(SpecError, match=message):
        ModelSpec(family=family, n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=100, **biases)


def test_bias_layouts_a_config_key_switches_are_accepted_and_written_back() -> None:
    from trainmem_nb.model.hf_config import to_hf_config

    m = ModelSpec(family="llama", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=100, qkv_bias=True, out_bias=True)
    assert {k: to_hf_config(m)[k] for k in ("attention_bias", "mlp_bias")} == {"attention_bias": True, "mlp_bias": False}
    assert ModelSpec.from_hf_config(to_hf_config(m), name=m.name) == m


def test_params_count_builds_a_plausible_llama_shape() -> None:
    m = ModelSpec.from_params(7e9)
    assert abs(m.n_params / 7e9 - 1) < 0.05
    assert m.hidden % m.n_heads == 0 and m.family.value == "llama"


@pytest.mark.parametrize("bad", [0, -1, float("nan"), 1e20, "seven"])
def test_bad_parameter_counts_are_rejected(bad: object) -> None:
    with pytest.raises(SpecError, match=r"params="):
        ModelSpec.from_params(bad)  # type: ignore[arg-type]


def test_specs_are_frozen() -> None:
    t = TrainingSpec()
    with pytest.raises(Exception, match="frozen"):
        t.micro_batch = 4  # type: ignore[misc]


def test_flash_attention_on_cpu_is_refused_with_an_alternative() -> None:
    with pytest.raises(SpecError, match=r"attention='flash' .* runs only on CUDA; use attention='sdpa'"):
        estimate("gpt2", seq_len=128, attention="flash", device="cpu")


def test_lora_targets_that_match_nothing_list_the_layers() -> None:
    with pytest.raises(SpecError, match=r"lora_targets='c_attn' matches no linear layer of llama; its layers have:"):
        estimate("tinyllama-1.1b", seq_len=128, method="lora", lora_targets="c_attn")
