"""gpt_oss and deepseek_v3: what their configs mean, and the options transformers 5.24 cannot run for them."""

from __future__ import annotations

import pytest

import trainmem_nb as tm
from trainmem_nb.errors import SpecError
from trainmem_nb.model.hf_config import to_hf_config
from trainmem_nb.model.params import lora_modules, lora_moe_params, param_inventory
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


def test_deepseek_v3_all_linear_lora_adapts_attention_router_and_expert_stacks_only() -> None:
    """peft 0.21 maps the v4 MLP names onto the router and the 3-D expert stacks (ParamWrapper) and drops them
    from target_modules: the dense layers' MLPs and the shared experts keep no adapter."""
    m = get_model("deepseek-v3")
    assert lora_modules(m, "qv") == ("self_attn.q_b_proj", "self_attn.kv_b_proj")
    assert lora_modules(m, "all-linear") == ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                                             "self_attn.kv_b_proj", "self_attn.o_proj")
    assert lora_moe_params(m, "all-linear") == ("mlp.experts.down_proj", "mlp.gate", "mlp.experts.gate_up_proj")
    assert tm.estimate(m, micro_batch=1, seq_len=128, method="lora", lora_targets="all-linear").peak_allocated_bytes > 0


DEEPSEEK_TINY = dict(family="deepseek_v3", n_layers=3, hidden=128, n_heads=4, head_dim=16, ffn=256, vocab=1000,
                     n_experts=8, experts_top_k=2, expert_ffn=32, n_shared_experts=1, n_expert_groups=4, topk_groups=2,
                     q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                     dense_layers=(0,))


@pytest.mark.torch
@pytest.mark.parametrize("opts", [dict(precision="fp32"), dict(), dict(precision="bf16-mixed", checkpointing="full")],
                         ids=["fp32", "bf16-true", "bf16-mixed-ckpt"])
def test_deepseek_v3_all_linear_lora_step_matches_peft_measured(opts: dict[str, object]) -> None:
    """The adapters peft makes and the step's peak, against the real model wrapped by peft 0.21 (fake tensors)."""
    pytest.importorskip("peft")
    from trainmem_nb.measure.api import measure

    m = ModelSpec.model_validate(DEEPSEEK_TINY)
    kw = dict(micro_batch=1, seq_len=32, method="lora", lora_targets="all-linear", **opts)
    measured = measure(m, device="fake", **kw)
    est = tm.estimate(m, device="cpu", **kw)
    assert est.n_trainable_params == measured.n_trainable_params
    assert est.peak_allocated_bytes == measured.peak_allocated_bytes


def test_gpt_oss_all_linear_lora_adapts_the_attention_projections_only() -> None:
    assert lora_modules(get_model("gpt-oss-20b"), "all-linear") == (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
