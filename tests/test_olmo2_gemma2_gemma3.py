"""OLMo 2, Gemma 2 and Gemma 3 as transformers 5.x builds them: configs read and written back, parameter
counts equal to the real classes', layer patterns, and the options their modeling code supports."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

import trainmem_nb as tm
from trainmem_nb.device import round_block
from trainmem_nb.errors import SpecError
from trainmem_nb.model.hf_config import to_hf_config
from trainmem_nb.model.layers import compress
from trainmem_nb.model.params import buffer_inventory, count_params, lora_modules
from trainmem_nb.model.presets import get_model, get_preset
from trainmem_nb.model.spec import ModelSpec

SPECS: dict[str, dict[str, Any]] = {
    "olmo2-mha": dict(family="olmo2", n_layers=2, hidden=128, n_heads=4, ffn=256, vocab=500),
    "olmo2-gqa-bias-tied": dict(family="olmo2", n_layers=3, hidden=128, n_heads=8, n_kv_heads=2, ffn=352, vocab=500,
                                qkv_bias=True, out_bias=True, tie_embeddings=True),
    "gemma2-caps": dict(family="gemma2", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, ffn=256,
                        vocab=500, sliding_window=16),
    "gemma2-nocap-untied": dict(family="gemma2", n_layers=3, hidden=128, n_heads=4, n_kv_heads=1, head_dim=32,
                                ffn=256, vocab=500, sliding_window=16, attn_softcap=0.0, final_softcap=0.0,
                                tie_embeddings=False, query_pre_attn_scalar=48.0),
    "gemma3-5to1": dict(family="gemma3", n_layers=8, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
                        vocab=500, sliding_window=16),
    "gemma3-attention-bias": dict(family="gemma3", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32,
                                  ffn=256, vocab=500, sliding_window=16, qkv_bias=True, out_bias=True),
    "gemma3-final-cap": dict(family="gemma3", n_layers=2, hidden=128, n_heads=2, n_kv_heads=1, head_dim=64, ffn=256,
                             vocab=500, sliding_window=16, final_softcap=30.0,
                             layer_types=("full_attention", "sliding_attention")),
    # a multimodal config: Gemma3ForConditionalGeneration, its SigLIP tower and projector (one with the pooling head)
    "gemma3-vision": dict(family="gemma3", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
                          vocab=500, sliding_window=16,
                          vision=dict(hidden=64, intermediate=96, n_layers=2, n_heads=4, image_size=48, patch_size=8)),
    "gemma3-vision-head": dict(family="gemma3", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
                               vocab=500, sliding_window=16,
                               vision=dict(hidden=32, intermediate=64, n_layers=1, n_heads=2, image_size=16,
                                           patch_size=4, channels=1, head=True)),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_config_written_for_a_spec_reads_back_as_the_same_spec(name: str) -> None:
    m = ModelSpec.model_validate({"name": name, **SPECS[name]})
    assert ModelSpec.from_hf_config(to_hf_config(m), name=name) == m


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the measure extra")
@pytest.mark.parametrize("name", sorted(SPECS))
def test_parameter_count_equals_the_transformers_class_built_on_meta(name: str) -> None:
    from trainmem_nb.measure.models import hf_param_shapes

    m = ModelSpec.model_validate({"name": name, **SPECS[name]})
    shapes = hf_param_shapes(to_hf_config(m))
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    assert count_params(m) == total


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_configs_attention_bias_builds_biased_q_k_v_and_o_projections(model_type: str) -> None:
    # GemmaConfig, Gemma2Config and Gemma3TextConfig have attention_bias (default False), which every
    # *Attention passes to q/k/v/o_proj; it was ignored (read as no biases)
    cfg = {"model_type": model_type, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500}
    plain = ModelSpec.from_hf_config(cfg)
    biased = ModelSpec.from_hf_config({**cfg, "attention_bias": True})
    assert (plain.qkv_bias, plain.out_bias) == (False, False)
    assert (biased.qkv_bias, biased.out_bias, biased.mlp_bias) == (True, True, False)
    assert count_params(biased) - count_params(plain) == 2 * (128 + 2 * 64 + 128)


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the measure extra")
def test_gemma3_with_attention_biases_matches_its_measured_step() -> None:
    from trainmem_nb.measure.api import measure

    m = ModelSpec.model_validate({"name": "gemma3-attention-bias", **SPECS["gemma3-attention-bias"]})
    kw: dict[str, Any] = dict(micro_batch=2, seq_len=32, device="cpu", precision="fp32", dropout=0.0)
    est, measured = tm.estimate(m, **kw), measure(m, **kw)
    assert (est.n_params, est.peak_allocated_bytes) == (measured.n_params, measured.peak_allocated_bytes)


def test_multimodal_gemma3_config_is_read_as_its_language_model_and_vision_tower() -> None:
    # gemma-3-4b's config.json nests the language model in text_config (Gemma3TextConfig's defaults fill the keys
    # it omits: 8 heads, 4 kv heads, head_dim 256, a 262,208-token vocabulary) and the SigLIP tower in vision_config
    preset = get_preset("gemma-3-4b")
    assert preset.config["model_type"] == "gemma3"
    m = get_model("gemma-3-4b")
    assert (m.family.value, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab) == ("gemma3", 8, 4, 256, 262_208)
    assert m.vision is not None and (m.vision.hidden, m.vision.n_layers, m.vision.n_patches) == (1152, 27, 4096)
    assert m.n_params == preset.n_params  # what transformers builds (test_presets checks it on the meta device)
    text_only = ModelSpec.model_validate({**m.model_dump(), "vision": None})
    assert m.n_params > 4.2e9 and text_only.n_params < 3.9e9  # "4B": 4.3B with its 0.4B vision tower


def test_a_text_only_step_holds_the_vision_tower_as_weights_without_gradients_or_state() -> None:
    m = get_model("gemma-3-4b")
    text_only = ModelSpec.model_validate({**m.model_dump(), "vision": None})
    from trainmem_nb.model.params import vision_inventory

    tower = sum(round_block(p.numel * 2) * p.count for p in vision_inventory(m)) + round_block(8 * 4096)  # + position_ids
    for method in ("full", "lora"):
        opts = dict(seq_len=512, method=method, precision="bf16-true", optimizer="sgd-momentum")
        with_tower, without = tm.estimate(m, **opts), tm.estimate(text_only, **opts)
        extra = {k: with_tower.breakdown_bytes[k] - without.breakdown_bytes[k] for k in ("weights", "gradients",
                                                                                         "optimizer_states")}
        adapters = extra["weights"] - tower  # peft's adapters on the tower's q/v projections (fp32)
        assert extra["gradients"] == extra["optimizer_states"] == 0
        assert adapters == (0 if method == "full" else 27 * 2 * 2 * round_block(16 * 1152 * 4))
    assert tm.estimate(m, seq_len=512, method="qlora").breakdown_bytes["weights"] < tm.estimate(
        m, seq_len=512, method="lora").breakdown_bytes["weights"]
    assert "vision tower" in tm.estimate(m, seq_len=512).summary()


def test_gemma3_five_to_one_pattern_compresses_to_a_period_of_six() -> None:
    m = get_model("gemma-3-27b")
    kinds = m.layer_kinds
    assert [k.attention for k in kinds[:6]] == ["sliding"] * 5 + ["full"]
    p = compress(kinds)
    assert (len(p.prefix), len(p.period), p.repeats, len(p.suffix)) == (0, 6, 10, 2)


def test_gemma2_without_layer_types_alternates_sliding_and_global_layers() -> None:
    m = ModelSpec(family="gemma2", n_layers=4, hidden=128, n_heads=4, ffn=256, vocab=100, sliding_window=8)
    assert [k.attention for k in m.layer_kinds] == ["sliding", "full", "sliding", "full"]
    assert (m.attn_softcap, m.final_softcap) == (50.0, 30.0)  # Gemma2Config's defaults


def test_gemma2_sdpa_is_estimated_as_the_eager_attention_transformers_runs() -> None:
    m = get_model("gemma-2-2b")
    sdpa = tm.estimate(m, micro_batch=1, seq_len=512, attention="sdpa")
    eager = tm.estimate(m, micro_batch=1, seq_len=512, attention="eager")
    assert sdpa.peak_allocated_bytes == eager.peak_allocated_bytes


def test_soft_capping_is_refused_where_the_modeling_code_has_none() -> None:
    base: dict[str, Any] = dict(n_layers=2, hidden=128, n_heads=4, ffn=256, vocab=100)
    with pytest.raises(SpecError, match="attn_softcap"):
        ModelSpec(family="llama", attn_softcap=50.0, **base)
    with pytest.raises(SpecError, match="attn_softcap"):
        ModelSpec(family="gemma3", attn_softcap=50.0, **base)
    assert ModelSpec(family="gemma3", final_softcap=30.0, **base).final_softcap == 30.0


def test_gemma3_holds_one_rotary_frequency_pair_per_layer_type() -> None:
    buffers = dict((name, (size, count)) for name, size, count in buffer_inventory(get_model("gemma-3-1b")))
    assert buffers["rotary_emb.inv_freq"] == (4 * 128, 4)  # sliding and full: inv_freq + original_inv_freq each
    assert "embed_tokens.embed_scale" in buffers


def test_lora_all_linear_adapts_projections_not_the_qk_norms() -> None:
    for name in ("olmo-2-1b", "gemma-3-1b"):
        mods = lora_modules(get_model(name), "all-linear")
        assert "self_attn.q_proj" in mods and not any("norm" in m for m in mods)


_PATTERN_OPTIONS = [
    dict(precision="fp32"),
    dict(precision="bf16-mixed", checkpointing="full", method="lora", lora_rank=4),
    dict(precision="bf16-mixed", checkpointing="selective-op", dropout=0.1),
    dict(precision="bf16-true", checkpointing="selective", attention="eager", device="cuda"),
]


@pytest.mark.parametrize("family,n_layers", [("gemma2", 9), ("gemma3", 14), ("gemma3", 26)])
@pytest.mark.parametrize("opts", _PATTERN_OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_the_folded_sliding_global_pattern_gives_the_bytes_of_running_every_layer(
        family: str, n_layers: int, opts: dict[str, Any]) -> None:
    from trainmem_nb.engine.program import evaluate
    from trainmem_nb.spec.training import TrainingSpec
    from trainmem_nb.step.compile import compile_step, program_key

    m = ModelSpec(family=family, n_layers=n_layers, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128,
                  vocab=256, sliding_window=8)
    t = TrainingSpec.model_validate({"micro_batch": 2, "seq_len": 12, "device": "cpu", **opts})
    key = program_key(t, m)
    folded, unrolled = compile_step(m, key), compile_step(m, key, unrolled=True)
    for b, s in ((2, 12), (3, 17)):
        f, u = evaluate(folded, b, s), evaluate(unrolled, b, s)
        assert (f.peak, f.peak_phase, f.detail, f.phase_peaks) == (u.peak, u.peak_phase, u.detail, u.phase_peaks)


def test_notes_say_gemma2_sdpa_is_counted_as_eager_and_gemma3_vision_is_left_out() -> None:
    from trainmem_nb.estimator.notes import estimate_notes
    from trainmem_nb.spec.training import TrainingSpec

    sdpa, eager = TrainingSpec(attention="sdpa"), TrainingSpec(attention="eager")
    assert any("no SDPA path" in n for n in estimate_notes(get_model("gemma-2-2b"), sdpa))
    assert not any("no SDPA path" in n for n in estimate_notes(get_model("gemma-2-2b"), eager))
    assert not any("no SDPA path" in n for n in estimate_notes(get_model("gemma-3-4b"), sdpa))
    assert any("vision tower" in n for n in estimate_notes(get_model("gemma-3-4b"), sdpa))


def test_gemma3_simulates_its_period_once_after_a_prefix_holding_both_kinds() -> None:
    from trainmem_nb.step.layers import layer_plan

    plan = layer_plan(get_model("gemma-3-1b"))  # 26 layers: 0-5, then 6-11 standing for 6-23, then 24-25
    assert (len(plan.kinds), plan.block, plan.reps) == (14, (6, 12), 3)
    assert plan.labels[6].startswith("layers 6-23 (3 x")


@pytest.mark.parametrize(("vision_config", "message"), [
    (3, r"vision_config must be an object"),
    ({"num_hidden_layers": "x"}, r"vision_config\.num_hidden_layers='x' must be an integer"),
    ({"hidden_size": 100, "num_attention_heads": 12}, r"n_heads=12 does not divide its hidden=100"),
    ({"image_size": 8, "patch_size": 16}, r"patch_size=16 is larger than its image_size=8"),
])
def test_a_bad_vision_config_is_refused_with_what_to_change(vision_config: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_hf_config({"model_type": "gemma3", "vision_config": vision_config})
    with pytest.raises(SpecError, match=r"vision .* is modelled for gemma3, not llama"):
        ModelSpec(family="llama", n_layers=2, hidden=64, n_heads=4, ffn=128, vocab=100,
                  vision={"hidden": 64, "intermediate": 64, "n_layers": 1, "n_heads": 4, "image_size": 16, "patch_size": 4})
