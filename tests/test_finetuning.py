"""Fine-tuning recipes: LoRA targets and adapter dtype, QLoRA's NF4 storage and dequantize buffers,
8-bit optimizer states (bitsandbytes' layouts, from its source; no CUDA kernels run here)."""

from __future__ import annotations

import pytest

import trainmem_nb as tm
from trainmem_nb.params import NF4_BLOCK, nf4_bytes, param_inventory, quantized
from trainmem_nb.presets import get_model

KW = dict(micro_batch=1, seq_len=512, precision="bf16-true", device="cuda")


def test_nf4_weight_is_half_a_byte_per_value_plus_its_block_scales() -> None:
    n = 4096 * 4096
    single = nf4_bytes(n, double_quant=False)
    double = nf4_bytes(n, double_quant=True)
    assert single == n // 2 + n // NF4_BLOCK * 4  # packed values + one fp32 absmax per block of 64
    assert n // 2 < double < single  # double quantization stores the scales in 8 bits


def test_qlora_quantizes_the_blocks_linears_and_keeps_embeddings_norms_and_head_16_bit() -> None:
    m = get_model("llama-2-7b")
    est = tm.estimate(m, method="qlora", **KW)
    expected = 0
    for p in param_inventory(m):
        one = nf4_bytes(p.numel) if quantized(p) else -(-p.numel * 2 // 512) * 512
        expected += one * p.count
    adapters = est.detail_bytes["weights/params"] - expected
    assert 0 < adapters < 0.01 * expected  # the LoRA adapters (fp32) on top
    lora = tm.estimate(m, method="lora", **KW)
    assert est.detail_bytes["weights/params"] < 0.3 * lora.detail_bytes["weights/params"]
    assert not any(quantized(p) for p in param_inventory(m) if "embed" in p.name or "norm" in p.name or "lm_head" in p.name)


def test_qlora_dequantizes_each_weight_into_a_temporary_16_bit_buffer() -> None:
    est = tm.estimate("llama-2-7b", method="qlora", **KW)
    labels = [p.label for p in est.timeline(max_points=100_000)]
    assert any("dequantize_4bit (backward)" in label for label in labels)
    assert sum("dequantize_4bit" in label for label in labels) > 10


def test_single_quantization_needs_more_memory_than_double() -> None:
    double = tm.estimate("llama-2-7b", method="qlora", **KW)
    single = tm.estimate("llama-2-7b", method="qlora", qlora_double_quant=False, **KW)
    assert single.detail_bytes["weights/params"] > double.detail_bytes["weights/params"]


def test_all_linear_trains_more_adapters_than_query_and_value() -> None:
    qv = tm.estimate("llama-2-7b", method="lora", **KW)
    every = tm.estimate("llama-2-7b", method="lora", lora_targets="all-linear", **KW)
    assert every.n_trainable_params > 3 * qv.n_trainable_params > 0
    assert every.n_params - every.n_trainable_params == qv.n_params - qv.n_trainable_params


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_adapters_are_fp32_on_a_16_bit_base_and_only_they_have_optimizer_state(method: str) -> None:
    est = tm.estimate("llama-2-7b", method=method, **KW)
    assert est.detail_bytes["optimizer_states"] >= 2 * 4 * est.n_trainable_params  # two fp32 moments
    assert est.detail_bytes["optimizer_states"] < 2 * 4 * est.n_trainable_params * 1.05


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_adapters_in_the_base_dtype_halve_their_weights_gradients_and_states(method: str) -> None:
    kw = dict(KW, method=method, precision="bf16-true", lora_targets="all-linear")
    fp32 = tm.estimate("llama-2-7b", **kw)
    base = tm.estimate("llama-2-7b", lora_dtype="base", **kw)
    assert base.n_trainable_params == fp32.n_trainable_params
    assert base.breakdown_bytes["optimizer_states"] * 2 == pytest.approx(fp32.breakdown_bytes["optimizer_states"], rel=1e-3)
    assert base.peak_allocated_bytes < fp32.peak_allocated_bytes
    with pytest.raises(tm.SpecError, match="lora_dtype"):
        tm.estimate("llama-2-7b", lora_dtype="bf17", **kw)


def test_8bit_adamw_keeps_about_a_quarter_of_adamws_state() -> None:
    kw = dict(micro_batch=1, seq_len=512, precision="bf16-mixed", device="cuda")
    fp32_states = tm.estimate("llama-3.2-1b", optimizer="adamw", **kw).detail_bytes["optimizer_states"]
    int8_states = tm.estimate("llama-3.2-1b", optimizer="adamw-8bit", **kw).detail_bytes["optimizer_states"]
    assert 0.25 <= int8_states / fp32_states < 0.27  # 1 byte per value + an fp32 absmax per 256 (bitsandbytes)
