"""Fine-tuning recipes: LoRA targets and adapter dtype, QLoRA's NF4 storage and dequantize buffers,
8-bit optimizer states (bitsandbytes' layouts, from its source; no CUDA kernels run here)."""

from __future__ import annotations

import pytest

import trainmem_nb as tm
from trainmem_nb.model.params import NF4_BLOCK, nf4_bytes, param_inventory, quantized
from trainmem_nb.model.presets import get_model

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


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_deepspeed_keeps_qloras_nf4_weights_packed_and_zero3_partitions_them(zero: int) -> None:
    """DeepSpeed's module.bfloat16() leaves bitsandbytes' packed 4-bit storage alone: below ZeRO-3 a rank holds
    the single device's NF4 weights (the adapters cast to bf16 as well); ZeRO-3 partitions the packed values
    and keeps each weight's quantization state whole. QLoRA under DeepSpeed used to read as LoRA."""
    m = get_model("llama-2-7b")
    single = tm.estimate(m, method="qlora", **KW).detail_bytes["weights/params"]
    lora = tm.estimate(m, method="lora", gpus=2, engine="deepspeed", zero=zero, **KW).detail_bytes["weights/params"]
    ds = tm.estimate(m, method="qlora", gpus=2, engine="deepspeed", zero=zero, **KW).detail_bytes["weights/params"]
    assert ds < 0.35 * lora
    packed = sum(-(-p.numel // 2) * p.count for p in param_inventory(m) if quantized(p))
    state = sum((nf4_bytes(p.numel) - -(-p.numel // 2 // 512) * 512) * p.count for p in param_inventory(m) if quantized(p))
    if zero < 3:
        assert ds == pytest.approx(single, rel=0.01)
    else:
        assert single - packed / 2 - 0.15 * single < ds < single - packed / 2 and ds > state


def test_qlora_with_megatron_is_refused_with_what_works() -> None:
    with pytest.raises(tm.SpecError, match=r"Megatron-LM has no 4-bit.*method='lora' with megatron"):
        tm.estimate("llama-2-7b", method="qlora", gpus=2, engine="megatron", **KW)


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


def test_mixtral_all_linear_adapts_the_router_and_the_3d_experts_as_peft_0_21_does() -> None:
    # peft 0.21 + transformers 5 measured it (validation/cases.jsonl, mixtral-8x7b-1L lora8-all-linear):
    # 212,992 in q/k/v/o, 32,832 in the router, E*2r-rank gate_up_proj and E*r-rank down_proj adapters
    m = get_model("mixtral-8x7b")
    one = tm.ModelSpec.model_validate({**m.model_dump(), "n_layers": 1, "name": "mixtral-8x7b-1L"})
    every = tm.estimate(one, method="lora", lora_rank=8, lora_alpha=16, lora_targets="all-linear", **KW)
    assert every.n_trainable_params == 5_619_776
    qv = tm.estimate(one, method="lora", lora_rank=16, lora_targets="qv", **KW)
    assert qv.n_trainable_params == 212_992  # q and v only: no ParamWrapper
    experts = tm.estimate(one, method="lora", lora_rank=8, lora_targets="w1,w3,w2", **KW)
    assert experts.n_trainable_params == 5_619_776 - 212_992 - 32_832
    # every forward materializes the merged expert stacks (E, 2f, h) and (E, h, f), which grouped_mm saves
    # for backward, where the gradient of each stack is one more tensor of its size
    stacks = 3 * m.n_experts * m.ffn * m.hidden * 2
    assert every.peak_allocated_bytes - qv.peak_allocated_bytes > stacks


def test_mixtral_expert_adapters_follow_peft_limits() -> None:
    kw = dict(KW, method="lora", lora_targets="all-linear")
    with pytest.raises(tm.SpecError, match="lora_dropout"):
        tm.estimate("mixtral-8x7b", lora_dropout=0.05, **kw)
    with pytest.raises(tm.SpecError, match="w1"):
        tm.estimate("mixtral-8x7b", **dict(kw, lora_targets="w1"))


def test_qlora_on_mixtral_keeps_the_router_and_experts_16_bit_and_adapts_them() -> None:
    m = get_model("mixtral-8x7b")
    kept = [p.name for p in param_inventory(m) if p.in_layer and p.matmul and not quantized(p)]
    assert kept == ["layers.mlp.gate.weight", "layers.mlp.experts.gate_up_proj", "layers.mlp.experts.down_proj"]
    lora = tm.estimate(m, method="lora", lora_targets="all-linear", **KW)
    qlora = tm.estimate(m, method="qlora", lora_targets="all-linear", **KW)
    assert qlora.n_trainable_params == lora.n_trainable_params
    experts = 3 * m.n_experts * m.ffn * m.hidden * 2 * m.n_layers
    assert experts < qlora.detail_bytes["weights/params"] < lora.detail_bytes["weights/params"]


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


@pytest.mark.parametrize(("name", "outer"), [
    ("bert-base", ["cls.predictions.transform.dense"]),
    ("opt-350m", ["project_out", "project_in"]),
    ("llama-2-7b", []),  # the only linear outside the layers is the output head, which all-linear skips
])
def test_all_linear_also_adapts_the_linears_outside_the_layers_but_not_the_head(name: str, outer: list[str]) -> None:
    from trainmem_nb.model.params import lora_inventory

    m = get_model(name)
    adapters = [p.name for p in lora_inventory(m, "all-linear", 8) if not p.name.startswith("layers.")]
    assert adapters == [f"{mod}.lora_{ab}.weight" for mod in outer for ab in "AB"]
    assert all(p.name.startswith("layers.") for p in lora_inventory(m, "qv", 8))


def test_paged_adamw_states_of_large_tensors_are_unified_memory_not_allocator_bytes() -> None:
    from trainmem_nb.step.optimizers import BNB_PAGED_MIN_NUMEL

    kw = dict(micro_batch=1, seq_len=512, precision="bf16-true", device="cuda")
    adamw = tm.estimate("llama-3.2-1b", optimizer="adamw", **kw)
    paged = tm.estimate("llama-3.2-1b", optimizer="paged-adamw", **kw)
    m = get_model("llama-3.2-1b")
    small = sum(p.numel * p.count for p in param_inventory(m) if p.numel < BNB_PAGED_MIN_NUMEL)
    large = sum(p.numel * p.count for p in param_inventory(m) if p.numel >= BNB_PAGED_MIN_NUMEL)
    # the norms' states stay ordinary fp32 tensors; the matrices' go to cudaMallocManaged memory
    assert small * 8 <= paged.breakdown_bytes["optimizer_states"] < small * 8 + 512 * 200
    assert paged.overhead_bytes["paged_optimizer_states"] == large * 8
    assert paged.peak_allocated_bytes < adamw.peak_allocated_bytes
    assert paged.device_total_bytes >= paged.peak_reserved_bytes + large * 8
    cpu = tm.estimate("llama-3.2-1b", optimizer="paged-adamw", **{**kw, "device": "cpu"})
    assert "paged_optimizer_states" not in cpu.overhead_bytes  # bitsandbytes does not page on CPU


def test_paged_states_are_sharded_with_the_optimizer_under_fsdp() -> None:
    kw = dict(micro_batch=1, seq_len=512, precision="bf16-mixed", optimizer="paged-adamw", device="cuda")
    m = get_model("llama-3.2-1b")
    large = sum(p.numel * p.count for p in param_inventory(m) if p.numel >= 100_000)
    fsdp = tm.estimate(m, gpus=8, engine="fsdp", zero=3, **kw)
    assert fsdp.overhead_bytes["paged_optimizer_states"] == pytest.approx(large * 8 / 8, rel=0.01)  # 2 fp32 moments
    plain = tm.estimate(m, gpus=8, engine="fsdp", zero=3, **{**kw, "optimizer": "adamw"})
    assert fsdp.device_total_bytes > plain.device_total_bytes - plain.breakdown_bytes["optimizer_states"]
    for engine, extra in (("deepspeed", {"zero": 2}), ("megatron", {"tp": 2})):  # their own optimizers
        other = tm.estimate(m, gpus=8, engine=engine, **extra, **kw)
        assert "paged_optimizer_states" not in other.overhead_bytes
