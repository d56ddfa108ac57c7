"""The families of issue 12 handled here: phi (phi-1.5, phi-2) and starcoder2.

Config readers and writers round-trip, parameter inventories equal the transformers models built on
the meta device (names, order and shapes), QLoRA's layout of biased projections, and the compiled step
equals a real Hugging Face step allocation by allocation (fake tensors).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from trainmem_nb.errors import SpecError
from trainmem_nb.model.hf_config import to_hf_config
from trainmem_nb.model.params import param_inventory, weight_tensors
from trainmem_nb.model.presets import get_model
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

PHI_SHAPES = [
    dict(family="phi", name="phi-mha", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512),
    dict(family="phi", name="phi-gqa-tied", n_layers=2, hidden=128, n_heads=8, n_kv_heads=4, ffn=256, vocab=512,
         tie_embeddings=True, rotary_pct=0.4, hidden_dropout=0.1, embd_dropout=0.05, attn_dropout=0.02),
    dict(family="phi", name="phi-qk-layernorm", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=512,
         qk_layernorm=True),
]


@pytest.mark.parametrize("shape", PHI_SHAPES, ids=lambda s: str(s["name"]))
def test_phi_config_writer_round_trips_through_the_reader(shape: dict[str, object]) -> None:
    m = ModelSpec.model_validate(shape)
    assert ModelSpec.from_hf_config(to_hf_config(m), name=m.name) == m


def test_phi_partial_rotary_factor_comes_from_the_top_level_or_rope_parameters_else_one_half() -> None:
    base = {"model_type": "phi", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 1,
            "num_attention_heads": 4}
    assert ModelSpec.from_hf_config(base).rotary_pct == 0.5  # configuration_phi.py: setdefault 0.5
    assert ModelSpec.from_hf_config({**base, "partial_rotary_factor": 0.4}).rotary_pct == 0.4
    assert ModelSpec.from_hf_config({**base, "rope_parameters": {"partial_rotary_factor": 0.25}}).rotary_pct == 0.25
    m = ModelSpec.from_hf_config(base)
    assert (m.vocab, m.n_kv_heads, m.activation, m.tie_embeddings, m.lm_head_bias) == (51200, 4, "gelu_new", False, True)


def test_phi_qk_layernorm_is_read_and_adds_a_layernorm_per_head_for_query_and_key() -> None:
    cfg = {"model_type": "phi", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "qk_layernorm": True}
    m = ModelSpec.from_hf_config(cfg)
    assert m.qk_layernorm and ModelSpec.from_hf_config(to_hf_config(m), name=m.name) == m
    norms = {p.name: p.shape for p in param_inventory(m) if "_layernorm" in p.name and "self_attn" in p.name}
    assert norms == {f"layers.self_attn.{x}_layernorm.{w}": (16,) for x in "qk" for w in ("weight", "bias")}


def test_phi_presets_have_the_published_counts() -> None:
    assert get_model("microsoft/phi-1_5").n_params == 1_418_270_720
    assert get_model("microsoft/phi-2").n_params == 2_779_683_840
    assert get_model("phi-2").rotary_dims == 32  # int(80 * 0.4)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
@pytest.mark.parametrize("shape", PHI_SHAPES, ids=lambda s: str(s["name"]))
def test_phi_inventory_lists_transformers_parameters_in_order(shape: dict[str, object]) -> None:
    from trainmem_nb.measure.models import hf_param_shapes

    m = ModelSpec.model_validate(shape)
    hf = hf_param_shapes(to_hf_config(m))
    ours = []
    for p in param_inventory(m):
        if p.in_layer:
            ours += [(f"model.layers.{i}.{p.name[len('layers.'):]}", p.shape) for i in range(p.count)]
        else:
            ours.append((p.name if p.name.startswith("lm_head") else f"model.{p.name}", p.shape))
    layer = sorted(((n, s) for n, s in ours if ".layers." in n), key=lambda x: int(x[0].split(".")[2]))
    outer = [x for x in ours if ".layers." not in x[0]]
    assert dict(ours) == hf
    assert [n for n, _ in (outer[:1] + layer + outer[1:])] == list(hf)


def test_phi_qlora_quantizes_every_projection_and_keeps_biases_and_the_head_in_16_bit() -> None:
    m = get_model("phi-2").layer_slice(0, 2)
    t = TrainingSpec(method="qlora", precision="bf16-true", lora_targets="qv", micro_batch=1, seq_len=64)
    layout = {p.name: dt for p, dt, _trainable in weight_tensors(m, t)}
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2"):
        assert layout[f"layers.{proj}.weight"] < 1  # NF4: about half a byte per element
        assert layout[f"layers.{proj}.bias"] == 2  # bitsandbytes keeps the bias in the model's dtype
    assert layout["lm_head.weight"] == 2 and layout["lm_head.bias"] == 2 and layout["embed_tokens.weight"] == 2
    # every biased projection, adapted or not, runs bitsandbytes' 4-bit matmul (dequantize, then F.linear)
    prog = compile_step(m, t)
    labels = {label for seg in prog.segments for *_rest, label in seg.events}
    for proj in ("self_attn.k_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2", "self_attn.q_proj.base_layer"):
        assert f"{proj} dequantize_4bit" in labels, proj


def _first_divergence():  # type: ignore[no-untyped-def]
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        from check_traces import first_divergence
    finally:
        sys.path.remove(str(scripts))
    return first_divergence


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
@pytest.mark.parametrize("opts", [
    dict(micro_batch=2),
    dict(micro_batch=2, attention="eager", precision="bf16-mixed", checkpointing="full"),
    dict(micro_batch=1, method="lora", lora_targets="all-linear", checkpointing="selective", dropout=0.1),
], ids=["sdpa-fp32", "eager-bf16-ckpt", "lora-selective-dropout"])
@pytest.mark.parametrize("shape", PHI_SHAPES[1:], ids=lambda s: str(s["name"]))
def test_phi_step_equals_the_hf_step_allocation_by_allocation(shape: dict[str, object], opts: dict[str, object]) -> None:
    m = ModelSpec.model_validate(shape)
    t = TrainingSpec.model_validate({"device": "cpu", "seq_len": 64, **opts})
    assert _first_divergence()(m, t) is None


STARCODER2_SHAPES = [
    dict(family="starcoder2", name="sc2-window", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=512, vocab=512,
         sliding_window=32, attn_dropout=0.1, hidden_dropout=0.1, embd_dropout=0.1),
    dict(family="starcoder2", name="sc2-untied-nobias", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512,
         tie_embeddings=False, qkv_bias=False, out_bias=False, mlp_bias=False),
]


@pytest.mark.parametrize("shape", STARCODER2_SHAPES, ids=lambda s: str(s["name"]))
def test_starcoder2_config_writer_round_trips_through_the_reader(shape: dict[str, object]) -> None:
    m = ModelSpec.model_validate(shape)
    assert ModelSpec.from_hf_config(to_hf_config(m), name=m.name) == m


def test_starcoder2_reader_takes_configuration_starcoder2_defaults() -> None:
    m = ModelSpec.from_hf_config({"model_type": "starcoder2", "hidden_size": 64, "intermediate_size": 256,
                                  "num_hidden_layers": 1, "num_attention_heads": 4})
    assert (m.vocab, m.n_kv_heads, m.max_positions, m.sliding_window) == (49152, 2, 4096, 0)
    assert (m.norm, m.norm_bias, m.activation, m.tie_embeddings) == ("layernorm", True, "gelu_pytorch_tanh", True)
    assert (m.qkv_bias, m.out_bias, m.mlp_bias) == (True, True, True)
    off = ModelSpec.from_hf_config({"model_type": "starcoder2", "hidden_size": 64, "intermediate_size": 256,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "use_bias": False})
    assert (off.qkv_bias, off.out_bias, off.mlp_bias, off.norm_bias) == (False, False, False, True)


def test_starcoder2_spec_refuses_biases_one_use_bias_cannot_express() -> None:
    with pytest.raises(SpecError, match="use_bias"):
        ModelSpec(family="starcoder2", n_layers=1, hidden=64, n_heads=4, ffn=256, vocab=100, mlp_bias=False)


def test_starcoder2_presets_have_the_published_counts_and_window() -> None:
    assert get_model("bigcode/starcoder2-3b").n_params == 3_030_371_328
    assert get_model("bigcode/starcoder2-7b").n_params == 7_173_923_840
    assert get_model("bigcode/starcoder2-15b").n_params == 15_957_889_024  # its lm_head is untied
    assert {get_model(f"starcoder2-{s}").sliding_window for s in ("3b", "7b", "15b")} == {4096}
    assert all(k.attention == "sliding" for k in get_model("starcoder2-3b").layer_kinds)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
@pytest.mark.parametrize("shape", STARCODER2_SHAPES, ids=lambda s: str(s["name"]))
def test_starcoder2_inventory_equals_transformers_parameters(shape: dict[str, object]) -> None:
    from trainmem_nb.measure.models import hf_param_shapes

    m = ModelSpec.model_validate(shape)
    hf = hf_param_shapes(to_hf_config(m))
    ours = {}
    for p in param_inventory(m):
        if p.in_layer:
            ours.update({f"model.layers.{i}.{p.name[len('layers.'):]}": p.shape for i in range(p.count)})
        else:
            ours[p.name if p.name.startswith("lm_head") else f"model.{p.name}"] = p.shape
    assert ours == hf


def test_starcoder2_qlora_quantizes_every_biased_projection() -> None:
    m = get_model("starcoder2-3b").layer_slice(0, 2)
    t = TrainingSpec(method="qlora", precision="bf16-true", lora_targets="qv", micro_batch=1, seq_len=64)
    layout = {p.name: dt for p, dt, _trainable in weight_tensors(m, t)}
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj"):
        assert layout[f"layers.{proj}.weight"] < 1 and layout[f"layers.{proj}.bias"] == 2
    prog = compile_step(m, t)
    labels = {label for seg in prog.segments for *_rest, label in seg.events}
    for proj in ("self_attn.k_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj", "self_attn.v_proj.base_layer"):
        assert f"{proj} dequantize_4bit" in labels, proj


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
@pytest.mark.parametrize("opts", [
    dict(micro_batch=2),
    dict(micro_batch=2, attention="eager", precision="bf16-mixed", checkpointing="full"),
    dict(micro_batch=1, method="lora", lora_targets="all-linear", checkpointing="selective"),
], ids=["sdpa-window-fp32", "eager-bf16-ckpt", "lora-selective"])
def test_starcoder2_step_equals_the_hf_step_allocation_by_allocation(opts: dict[str, object]) -> None:
    m = ModelSpec.model_validate(STARCODER2_SHAPES[0])  # window 32 < seq 64: SDPA gets the explicit mask
    t = TrainingSpec.model_validate({"device": "cpu", "seq_len": 64, **opts})
    assert _first_divergence()(m, t) is None


# Found while adding these families: two divergences of the composed decoder (`recipe="decoder"`), now fixed.
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
def test_decoder_biased_projections_under_full_checkpointing_match_hf() -> None:
    """at::linear runs a biased 3-D linear as ``addmm``, whose bias gradient the engine reduces after the node
    returns, so after a checkpointed node's recomputed saved tensors are released."""
    m = ModelSpec(family="llama", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=1024, vocab=1000,
                  qkv_bias=True, out_bias=True, mlp_bias=True)
    t = TrainingSpec(device="cpu", seq_len=64, micro_batch=1, checkpointing="full")
    assert _first_divergence()(m, t) is None


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the measure extra")
def test_decoder_eager_mqa_under_autocast_copies_the_expanded_value() -> None:
    """One kv head, b > 1, autocast: the value is already 16-bit, so autocast's cast leaves it an expanded view
    (``repeat_kv``) that ``matmul`` copies; the rotated fp32 key is cast, which copies it."""
    m = ModelSpec(family="gemma", n_layers=3, hidden=256, n_heads=4, n_kv_heads=1, head_dim=64, ffn=512, vocab=1000)
    t = TrainingSpec(device="cpu", seq_len=64, micro_batch=2, attention="eager", precision="bf16-mixed")
    assert _first_divergence()(m, t) is None
