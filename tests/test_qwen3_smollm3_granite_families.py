"""Qwen3, Qwen3-MoE, SmolLM3 and Granite: config reading and writing, parameter inventories equal to the
models transformers builds, and every measured step of these families reproduced to the byte."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from trainmem_nb.estimator.api import estimate
from trainmem_nb.measure.dataset import load_cases
from trainmem_nb.model.hf_config import to_hf_config
from trainmem_nb.model.params import count_params, param_inventory
from trainmem_nb.model.spec import ModelSpec

FAMILIES = ("qwen3", "smollm3", "granite", "qwen3_moe")

#: Small specs of each family: GQA/MQA, tied, biases, windows and layer patterns where the family has them.
SPECS: dict[str, dict[str, Any]] = {
    "qwen3-gqa": dict(family="qwen3", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, ffn=256, vocab=1024),
    "qwen3-tied-bias": dict(family="qwen3", n_layers=2, hidden=128, n_heads=4, n_kv_heads=1, head_dim=32, ffn=256,
                            vocab=1024, tie_embeddings=True, qkv_bias=True, out_bias=True),
    "qwen3-window": dict(family="qwen3", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
                         vocab=512, sliding_window=16,
                         layer_types=("full_attention", "sliding_attention", "sliding_attention")),
    "smollm3-nope": dict(family="smollm3", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=512,
                         nope_layers=(3,)),
    "smollm3-bias-window": dict(family="smollm3", n_layers=4, hidden=128, n_heads=4, ffn=256, vocab=512,
                                nope_layers=(1, 3), qkv_bias=True, out_bias=True, mlp_bias=True, sliding_window=16,
                                layer_types=("full_attention", "sliding_attention") * 2, tie_embeddings=False),
    "granite-gqa": dict(family="granite", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=512),
    "granite-tied-bias": dict(family="granite", n_layers=2, hidden=128, n_heads=4, ffn=256, vocab=512,
                              tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True),
    "qwen3_moe": dict(family="qwen3_moe", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128,
                      vocab=512, n_experts=4, experts_top_k=2, expert_ffn=64),
    "qwen3_moe-norm-dense": dict(family="qwen3_moe", n_layers=3, hidden=64, n_heads=4, n_kv_heads=2, ffn=128,
                                 vocab=512, n_experts=4, experts_top_k=2, norm_topk_prob=True, dense_layers=(1,),
                                 sliding_window=16),
}

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _spec(name: str) -> ModelSpec:
    return ModelSpec.model_validate({"name": name, **SPECS[name]})


@pytest.mark.parametrize("name", SPECS)
def test_config_writer_round_trips_through_the_reader(name: str) -> None:
    m = _spec(name)
    assert ModelSpec.from_hf_config(to_hf_config(m), name=name) == m


def test_qwen3_config_defaults_follow_qwen3config() -> None:
    # configuration_qwen3.py: head_dim=128 and num_key_value_heads=32 whatever the hidden size
    m = ModelSpec.from_hf_config({"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
                                  "num_hidden_layers": 2, "num_attention_heads": 32})
    assert (m.head_dim, m.n_kv_heads, m.vocab, m.tie_embeddings, m.sliding_window) == (128, 32, 151936, False, 0)


def test_qwen3_sliding_window_applies_from_max_window_layers_when_used() -> None:
    cfg = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "sliding_window": 64}
    assert ModelSpec.from_hf_config(cfg).sliding_window == 0  # use_sliding_window defaults to False
    m = ModelSpec.from_hf_config({**cfg, "use_sliding_window": True, "max_window_layers": 2})
    assert [k.attention for k in m.layer_kinds] == ["full", "full", "sliding", "sliding"]


def test_smollm3_drops_rotary_on_every_fourth_layer_by_default() -> None:
    m = ModelSpec.from_hf_config({"model_type": "smollm3", "hidden_size": 128, "intermediate_size": 256,
                                  "num_hidden_layers": 8, "num_attention_heads": 4})
    assert (m.nope_layers, m.n_kv_heads, m.tie_embeddings, m.layer_types) == ((3, 7), 4, True, ())
    windowed = ModelSpec.from_hf_config({**to_hf_config(m), "layer_types": None, "use_sliding_window": True,
                                         "sliding_window": 32})
    assert [k.attention for k in windowed.layer_kinds][:4] == ["full", "full", "full", "sliding"]


def test_granite_multipliers_allocate_a_tensor_each_whatever_their_value() -> None:
    # inputs_embeds * embedding_multiplier, h * residual_multiplier (twice a layer), logits / logits_scaling
    from trainmem_nb.spec.training import TrainingSpec
    from trainmem_nb.step.compile import compile_step

    prog = compile_step(_spec("granite-gqa"), TrainingSpec(device="cpu", micro_batch=2, seq_len=64))
    labels = [label for seg in prog.segments if seg.phase == "forward" for _c, sign, _sz, label in seg.events
              if sign > 0]
    assert sum("embedding_multiplier" in x for x in labels) == 1
    assert sum("residual_multiplier" in x for x in labels) == 2 * 2
    assert sum("logits_scaling" in x for x in labels) == 1


def test_qwen3_moe_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step() -> None:
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
           "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
           "mlp_only_layers": [3]}
    m = ModelSpec.from_hf_config(cfg)
    assert m.dense_layers == (0, 2, 3, 4) and m.expert_width == 768 and not m.norm_topk_prob
    assert [k.moe for k in m.layer_kinds] == [False, True, False, False, False, True]


def test_qwen3_moe_all_linear_lora_adapts_experts_and_router_like_peft() -> None:
    from trainmem_nb.model.params import lora_modules, lora_moe_params

    m = _spec("qwen3_moe-norm-dense")
    assert lora_moe_params(m, "all-linear") == ("mlp.experts.down_proj", "mlp.gate", "mlp.experts.gate_up_proj")
    # peft turns gate_proj/up_proj/down_proj into expert parameters: the dense layer's MLP is left alone
    assert lora_modules(m, "all-linear") == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj")


def test_qwen3_layers_hold_per_head_q_and_k_norms() -> None:
    names = {p.name: p.shape for p in param_inventory(_spec("qwen3-gqa"))}
    assert names["layers.self_attn.q_norm.weight"] == (64,) and names["layers.self_attn.k_norm.weight"] == (64,)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
@pytest.mark.parametrize("name", SPECS)
def test_parameter_inventory_equals_the_model_transformers_builds(name: str) -> None:
    import re
    import warnings

    from trainmem_nb.measure.models import hf_param_shapes

    m = _spec(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shapes = hf_param_shapes({**to_hf_config(m), "pad_token_id": None})  # small vocabularies: no pad row
    hf: dict[tuple[str, tuple[int, ...]], int] = {}
    for full, shape in shapes.items():
        key = (re.sub(r"^model\.", "", re.sub(r"\.\d+\.", ".", full)), shape)
        hf[key] = hf.get(key, 0) + 1
    ours = {(p.name, p.shape): p.count for p in param_inventory(m)}
    assert ours == hf
    assert count_params(m) == sum(n * _numel(s) for (_, s), n in hf.items())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("family", FAMILIES)
def test_every_measured_step_of_the_family_is_reproduced_to_the_byte(family: str) -> None:
    cases = [c for c in load_cases() if c.model.family.value == family]
    assert len(cases) >= 6
    for c in cases:
        m = c.measurement
        e = estimate(m.model, m.training)
        assert (e.peak_allocated_bytes, e.peak_phase) == (m.peak_allocated_bytes, m.peak_phase), c.id
