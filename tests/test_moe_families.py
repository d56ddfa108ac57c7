"""gpt_oss and deepseek_v3: what their configs mean, and the options transformers 5.24 cannot run for them."""

from __future__ import annotations

import pytest

import trainmem_nb as tm
from trainmem_nb.errors import SpecError
from trainmem_nb.model.hf_config import to_hf_config
from trainmem_nb.model.params import lora_modules, param_inventory
from trainmem_nb.model.presets import get_model
from trainmem_nb.model.spec import ModelSpec


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "deepseek-v3"])
def test_presets_round_trip_through_their_hugging_face_config(name: str) -> None:
    m = get_model(name)
    assert ModelSpec.from_hf_config(to_hf_config(m), name=m.name) == m


def test_gpt_oss_config_defaults_alternate_sliding_and_full_layers() -> None:
    m = ModelSpec.from_hf_config({"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 64,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64})
    assert [k.attention for k in m.layer_kinds] == ["sliding", "full", "sliding", "full"]
    assert (m.sliding_window, m.head_dim, m.n_experts, m.experts_top_k, m.qkv_bias) == (128, 64, 128, 4, True)


def test_deepseek_v3_first_k_dense_replace_layers_are_dense_and_the_router_stays_fp32() -> None:
    m = get_model("deepseek-v3")
    assert [k.moe for k in m.layer_kinds[:4]] == [False, False, False, True]
    router = next(p for p in param_inventory(m) if p.name == "layers.mlp.gate.weight")
    assert router.fp32 and router.count == 58


def test_gpt_oss_runs_sdpa_as_eager_and_refuses_flash_and_selective_checkpointing_with_the_reason() -> None:
    """GptOssPreTrainedModel._supports_sdpa = False: Hugging Face runs the eager attention (with its sinks)
    when none is asked for, so attention='sdpa' is counted as eager and says so, as for Gemma 2."""
    sdpa = tm.estimate("gpt-oss-20b", micro_batch=1, seq_len=128)
    eager = tm.estimate("gpt-oss-20b", micro_batch=1, seq_len=128, attention="eager")
    assert sdpa.peak_allocated_bytes == eager.peak_allocated_bytes > 0
    assert "no SDPA path" in sdpa.summary()
    with pytest.raises(SpecError, match="sinks"):
        tm.estimate("gpt-oss-20b", micro_batch=1, seq_len=128, attention="flash")
    with pytest.raises(SpecError, match="mutated"):
        tm.estimate("gpt-oss-20b", micro_batch=1, seq_len=128, attention="eager", checkpointing="selective")


def test_deepseek_v3_lora_targets_the_attention_and_refuses_the_expert_conversion() -> None:
    m = get_model("deepseek-v3")
    assert lora_modules(m, "qv") == ("self_attn.q_b_proj", "self_attn.kv_b_proj")
    with pytest.raises(SpecError, match="ParamWrapper"):
        tm.estimate(m, micro_batch=1, seq_len=128, method="lora", lora_targets="all-linear")


def test_gpt_oss_all_linear_lora_adapts_the_attention_projections_only() -> None:
    assert lora_modules(get_model("gpt-oss-20b"), "all-linear") == (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
