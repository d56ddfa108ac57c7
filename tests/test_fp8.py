"""fp8 training (`TrainingSpec.fp8`): torchao's Float8Linear in eager mode, tensorwise and rowwise, modelled
from its source and checked against steps measured with torchao on real CPU tensors."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

import trainmem_nb as tm
from trainmem_nb.errors import SpecError
from trainmem_nb.measure.dataset import load_cases
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step, program_key

FP8_CASES = [c for c in load_cases() if c.measurement.training.fp8.value != "none"]
SMALL = ModelSpec(name="llama-fp8-test", family="llama", n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512,
                  vocab=1024)
#: 16 experts: the router's (16, 64) weight has fp8-able dimensions, but it is no nn.Linear in transformers 5
MOE16 = ModelSpec(name="qwen3-moe-fp8-16e", family="qwen3_moe", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
                  head_dim=32, ffn=128, vocab=512, n_experts=16, experts_top_k=2, expert_ffn=64)


def _labels(model: ModelSpec, **options: object) -> list[str]:
    t = TrainingSpec(micro_batch=2, seq_len=64, device="cpu", **options)  # type: ignore[arg-type]
    return [label for seg in compile_step(model, program_key(t, model)).segments for *_rest, label in seg.events]


def test_the_dataset_has_measured_fp8_steps_of_both_recipes_and_several_families() -> None:
    assert len(FP8_CASES) >= 12
    assert {c.measurement.training.fp8.value for c in FP8_CASES} == {"tensorwise", "rowwise"}
    assert len({c.measurement.model.family for c in FP8_CASES}) >= 6


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.id)
def test_every_measured_fp8_step_is_reproduced_to_the_byte_in_every_category(case: object) -> None:
    m = case.measurement  # type: ignore[attr-defined]
    e = tm.estimate(m.model, m.training)
    assert (e.peak_allocated_bytes, e.peak_phase) == (m.peak_allocated_bytes, m.peak_phase)
    assert e.breakdown_bytes == m.breakdown_bytes


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_adds_cast_temporaries_and_keeps_what_bf16_saves(recipe: str) -> None:
    wide = SMALL.model_copy(update={"vocab": 128, "ffn": 2048})  # the MLP's casts, not the head, set the peak
    options = dict(micro_batch=4, seq_len=128, precision="bf16-true", optimizer="none", device="cpu")
    base = tm.estimate(wide, **options)
    fp8 = tm.estimate(wide, fp8=recipe, **options)
    # Float8Linear saves the bf16 input and weight, as nn.Linear does: nothing saved changes
    assert fp8.saved_activations_bytes == base.saved_activations_bytes
    assert fp8.peak_allocated_bytes > base.peak_allocated_bytes  # the casts' fp32 copies in backward
    with_fp8 = _labels(SMALL, precision="bf16-true", fp8=recipe)
    assert any(label.endswith("input fp8") for label in with_fp8)
    assert not any("fp8" in label for label in _labels(SMALL, precision="bf16-true"))


def test_rowwise_applies_its_scales_after_the_backward_matmuls_and_rounds_them_to_powers_of_two() -> None:
    rowwise = _labels(SMALL, precision="bf16-true", fp8="rowwise")
    tensorwise = _labels(SMALL, precision="bf16-true", fp8="tensorwise")
    assert any("scale outer product" in label for label in rowwise)
    assert any(label.endswith("exp2") for label in rowwise)
    assert not any("scale outer product" in label or label.endswith("exp2") for label in tensorwise)


def test_the_output_head_and_dimensions_scaled_mm_cannot_take_stay_in_high_precision() -> None:
    labels = _labels(SMALL, precision="bf16-true", fp8="tensorwise")
    assert not any(label.startswith("lm_head") and "fp8" in label for label in labels)
    odd = SMALL.model_copy(update={"ffn": 520})  # 520 % 16 != 0: the MLP projections are not converted
    odd_labels = _labels(odd, precision="bf16-true", fp8="tensorwise")
    assert not any(label.startswith("mlp.") and "fp8" in label for label in odd_labels)
    assert any(label.startswith("self_attn.q_proj") and "fp8" in label for label in odd_labels)


def test_precision_fp8_means_a_bf16_model_with_tensorwise_fp8_unless_a_recipe_is_named() -> None:
    t = TrainingSpec(precision="fp8")
    assert (t.precision.value, t.fp8.value) == ("bf16-true", "tensorwise")
    assert TrainingSpec(precision="fp8", fp8="rowwise").fp8.value == "rowwise"
    assert TrainingSpec().fp8.value == "none" == TrainingSpec(fp8=None).fp8.value
    with pytest.raises(SpecError, match="contradict"):
        TrainingSpec(precision="fp8", fp8="none")


@pytest.mark.parametrize(("options", "text"), [
    ({"fp8": "tensorwise"}, "not under autocast"),  # the default bf16-mixed on one device
    ({"fp8": "tensorwise", "precision": "fp16-mixed"}, "or 'bf16-mixed' with FSDP2"),
    ({"precision": "fp8", "method": "lora"}, "use method='full'"),
    ({"precision": "fp8", "checkpointing": "selective"}, "use checkpointing='none' or 'full'"),
    ({"fp8": "columnwise"}, "valid values: none, tensorwise, rowwise, delayed"),
    ({"fp8": "rowwise", "parallel": {"engine": "megatron", "gpus": 2, "tp": 2}}, "use fp8='delayed' or 'tensorwise'"),
    ({"fp8": "delayed", "precision": "bf16-true"}, "modelled under engine='megatron'"),
    ({"fp8": "delayed", "parallel": {"engine": "fsdp", "gpus": 2, "zero": 3}}, "modelled under engine='megatron'"),
    ({"precision": "fp8", "parallel": {"engine": "fsdp", "gpus": 2, "zero": 3, "tp": 2}}, "use tp=1"),
    ({"precision": "fp8", "fsdp_version": 1, "parallel": {"engine": "fsdp", "gpus": 2, "zero": 3}}, "fsdp_version=2"),
])
def test_fp8_where_it_is_not_modelled_is_refused_saying_what_works(options: dict, text: str) -> None:
    with pytest.raises(SpecError, match=text.replace("(", r"\(").replace(")", r"\)")):
        tm.estimate("llama-3.2-1b", **options)


def test_fp8_composes_with_data_parallel_sharding() -> None:
    e = tm.estimate("llama-3.2-1b", precision="fp8", parallel={"engine": "fsdp", "gpus": 4, "zero": 3})
    assert e.training.fp8.value == "tensorwise" and e.peak_allocated_bytes > 0


def test_the_notes_say_what_eager_fp8_keeps_and_that_gpt2_converts_nothing() -> None:
    summary = tm.estimate("llama-3.2-1b", precision="fp8").summary()
    assert "bf16-true with tensorwise fp8 matmuls" in summary
    assert "saves the bf16 input and weight" in summary and "(not modelled)" in summary
    assert "fp8_all_gather=True) halves the gathered weights" in summary
    gathered = tm.estimate("llama-3.2-1b", precision="fp8", fp8_all_gather=True,
                           parallel={"engine": "fsdp", "gpus": 2, "zero": 3}).summary()
    assert "the float8 all-gather is counted" in gathered
    assert "Conv1D" in tm.estimate("gpt2", precision="fp8", seq_len=512).summary()


def test_a_gpu_without_fp8_gets_a_note_and_one_with_it_does_not() -> None:
    est = tm.estimate("llama-3.2-1b", precision="fp8", micro_batch=1, seq_len=1024)
    assert any("no fp8 tensor cores" in n for n in tm.fit(est, "A100 80GB").notes)
    assert not any("no fp8 tensor cores" in n for n in tm.fit(est, "H100").notes)


def test_the_cli_takes_fp8_as_a_precision_and_as_a_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    from trainmem_nb.cli.main import main

    assert main(["estimate", "--model", "llama-3.2-1b", "--precision", "fp8", "--json"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert (training["precision"], training["fp8"]) == ("bf16-true", "tensorwise")
    assert main(["estimate", "--model", "llama-3.2-1b", "--precision", "bf16-true", "--fp8", "rowwise", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["fp8"] == "rowwise"


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs the measure extra's torchao")
@pytest.mark.parametrize(("recipe", "device"), [("tensorwise", "cpu"), ("rowwise", "cpu"), ("rowwise", "fake")])
def test_a_live_torchao_step_matches_the_estimate_to_the_byte(recipe: str, device: str) -> None:
    # the tracker records what torchao's Float8TrainingTensor wraps, and the copies it makes inside _scaled_mm;
    # under fake tensors too (torchao's training casts never read a value back)
    from trainmem_nb.measure.api import measure

    m = SMALL.model_copy(update={"n_layers": 1})
    options = dict(micro_batch=2, seq_len=32, precision="bf16-true", fp8=recipe, optimizer="none")
    measured = measure(m, device=device, **options)
    e = tm.estimate(m, device="cpu", **options)
    assert (e.peak_allocated_bytes, e.breakdown_bytes) == (measured.peak_allocated_bytes, measured.breakdown_bytes)


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs the measure extra's torchao")
@pytest.mark.parametrize(("options", "zero"), [
    ({"fp8": "tensorwise"}, 3),
    ({"fp8": "rowwise", "checkpointing": "full"}, 2),
    ({"fp8": "tensorwise", "fp8_all_gather": True}, 3),
    ({"fp8": "tensorwise", "fp8_all_gather": True, "checkpointing": "full", "grad_accum": 2}, 3),
    ({"fp8": "tensorwise", "fp8_all_gather": True}, 2),
    ({"fp8": "tensorwise", "fp8_all_gather": True, "model": "moe16"}, 3),  # a router (not nn.Linear) wide enough
    # torchtitan's: fp32 shards, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    ({"fp8": "tensorwise", "precision": "bf16-mixed"}, 3),
    ({"fp8": "tensorwise", "precision": "bf16-mixed", "fp8_all_gather": True, "checkpointing": "full"}, 3),
    ({"fp8": "rowwise", "precision": "bf16-mixed", "grad_accum": 2}, 2),
])
def test_an_fsdp2_rank_training_in_fp8_matches_a_measured_step_to_the_byte(options: dict, zero: int) -> None:
    # FSDP2 gathers the bf16 weights and each rank's Float8Linear casts them as on one device; or, with the
    # float8 all-gather, each rank casts its shards (amax all-reduced) and gathers fp8 data with its scale
    from trainmem_nb.estimator.simulate import simulate
    from trainmem_nb.measure.fsdp import run_fsdp_step
    from trainmem_nb.measure.step import summarize
    from trainmem_nb.spec.parallel import ParallelSpec

    options = dict(options)
    m = MOE16 if options.pop("model", "") == "moe16" else SMALL.model_copy(update={"n_layers": 3})
    t = TrainingSpec.model_validate({"micro_batch": 2, "seq_len": 64, "device": "cpu", "precision": "bf16-true",
                                     **options})  # the fp32 shards of bf16-mixed are cast before the gather
    p = ParallelSpec(gpus=4, engine="fsdp", zero=zero)
    measured = summarize(run_fsdp_step(m, t, p, rank=0, device="cpu"), timeline_points=0)
    est = simulate(m, t, None, p, backend="nccl")  # the fake process group allocates like NCCL
    assert (est.peak_allocated_bytes, est.peak_phase) == (measured["peak"], measured["peak_phase"])
    assert est.detail_bytes == {k: v for k, v in measured["detail"].items() if v}


def test_the_float8_all_gather_halves_the_gathered_layer_weights_and_skips_their_casts() -> None:
    m = SMALL.model_copy(update={"n_layers": 4})
    options = dict(micro_batch=2, seq_len=64, precision="fp8", device="cpu")
    t0, t1 = (TrainingSpec(fp8_all_gather=ag, **options) for ag in (False, True))  # type: ignore[arg-type]
    from trainmem_nb.parallel.layout import _hooks
    from trainmem_nb.spec.parallel import ParallelSpec

    p = ParallelSpec(gpus=4, engine="fsdp", zero=3)
    bf16, fp8 = (dict(_hooks(m, t, p, "nccl").units)["layer"] for t in (t0, t1))
    hooks = _hooks(m, t1, p, "nccl")
    assert sum(q.fp8 for q in fp8) == 7  # q, k, v, o, gate, up, down; not the norms
    plain = _hooks(m, t0, p, "nccl")
    assert sum(hooks._gathered_bytes(q) for q in fp8 if q.fp8) * 2 == sum(
        plain._gathered_bytes(b) for q, b in zip(fp8, bf16, strict=True) if q.fp8)
    labels = {label for seg in compile_step(m, program_key(t1, m), hooks).segments for *_r, label in seg.events}
    assert not any(label.startswith("self_attn.q_proj weight") for label in labels)  # cast before the gather
    assert any(label.startswith("float8 all-gather") for label in labels)


def test_the_float8_all_gather_is_refused_where_nothing_is_gathered_that_way() -> None:
    with pytest.raises(SpecError, match="FSDP2's float8 all-gather"):
        tm.estimate("llama-3.2-1b", precision="fp8", fp8_all_gather=True)
    with pytest.raises(SpecError, match="tensorwise scales only"):
        TrainingSpec(precision="fp8", fp8="rowwise", fp8_all_gather=True)
    with pytest.raises(SpecError, match="needs fp8 training"):
        TrainingSpec(fp8_all_gather=True)


def test_the_planner_keeps_fp8_in_every_option_and_leaves_out_gpus_without_it() -> None:
    pl = tm.plan("llama-3.2-1b", gpu=["H100", "A100 80GB"], tokens=1e7, seq_len=1024, precision="fp8")
    assert pl.rows and {(r["precision"], r["fp8"]) for r in pl.rows} == {("bf16-true", "tensorwise")}
    assert {r["gpu"] for r in pl.rows} == {"H100 SXM 80GB"}
    assert any("no fp8 tensor cores" in r["reason"] for r in pl.rejected if r["gpu"].startswith("A100"))
    assert not any(r["engine"] == "deepspeed" for r in pl.rows)  # not modelled with fp8
    assert any(r["engine"] == "megatron" for r in pl.rows)  # Transformer Engine's fp8


def test_an_fp8_launch_export_writes_the_torchrun_line_with_the_flags_that_switch_fp8_on(tmp_path: Any) -> None:
    from trainmem_nb.planning.launch import accelerate_fsdp_config, deepspeed_config, write_launch_files

    option = {"n_gpus": 8, "engine": "fsdp", "zero": 3, "family": "llama", "precision": "bf16-true",
              "fp8": "tensorwise", "fp8_all_gather": True}
    written = write_launch_files(option, tmp_path / "out")
    assert [p.name for p in written] == ["launch.sh"]
    assert "--float8.enable_fsdp_float8_all_gather" in written[0].read_text()
    for make in (deepspeed_config, accelerate_fsdp_config):
        with pytest.raises(SpecError, match="torchao's Float8 training"):
            make(option)


def test_fp8_on_cuda_needs_micro_batch_tokens_in_multiples_of_16() -> None:
    with pytest.raises(SpecError, match="multiple of 16"):
        TrainingSpec(precision="fp8", micro_batch=1, seq_len=30)
    assert TrainingSpec(precision="fp8", micro_batch=1, seq_len=30, device="cpu").fp8.value == "tensorwise"


def test_measuring_the_float8_all_gather_on_one_device_is_refused() -> None:
    pytest.importorskip("torch")
    from trainmem_nb.measure.step import check_measurable

    with pytest.raises(RuntimeError, match="single device gathers nothing"):
        check_measurable(SMALL, TrainingSpec(precision="fp8", fp8_all_gather=True, device="cpu"), "cpu")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_folded_program_merges_scalar_temporaries_without_changing_a_byte(recipe: str) -> None:
    # the folded program (peaks) merges runs of scalar temporaries; the unrolled one (the allocator's replay)
    # keeps every malloc: their peaks and breakdowns agree at every shape
    from trainmem_nb.engine.program import evaluate

    t = TrainingSpec(micro_batch=2, seq_len=64, precision="fp8", fp8=recipe, device="cpu")
    key = program_key(t, SMALL)
    folded, unrolled = compile_step(SMALL, key), compile_step(SMALL, key, unrolled=True)
    for b, s in ((1, 16), (2, 64), (4, 512)):
        one, other = evaluate(folded, b, s), evaluate(unrolled, b, s)
        assert (one.peak, one.detail) == (other.peak, other.detail)
    if recipe == "tensorwise":
        count = sum(len(seg.events) * seg.repeat for seg in folded.segments)
        assert count < sum(len(seg.events) * seg.repeat for seg in unrolled.segments)


# -- Transformer Engine's fp8 under Megatron (`trainmem_nb.engine.ops.te_fp8`) ------------------------------------
MEGATRON_TP2 = {"engine": "megatron", "gpus": 2, "tp": 2}


def _te(model: ModelSpec, **options: Any) -> Any:
    return tm.estimate(model, micro_batch=2, seq_len=128, parallel=MEGATRON_TP2, **options)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_fp8_keeps_an_fp8_weight_and_its_transpose_for_every_block_linear(recipe: str) -> None:
    m, tp = SMALL, 2
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    per_layer = (m.hidden * q + 2 * m.hidden * kv + q * m.hidden + 3 * m.hidden * m.ffn) // tp  # a rank's slices
    fp8 = _te(m, fp8=recipe).detail_bytes
    assert fp8["weights/fp8_workspaces"] == 2 * m.n_layers * per_layer  # one byte each, data and transpose
    assert _te(m).detail_bytes.get("weights/fp8_workspaces", 0) == 0


def test_te_fp8_saves_each_linear_input_as_a_one_byte_transpose_instead_of_its_16_bit_input() -> None:
    m, tp, tokens = SMALL, 2, 2 * 128
    bf16, fp8 = _te(m), _te(m, fp8="delayed")
    # per layer and token: the two norm outputs (read by q/k/v and by gate/up) and the MLP's product (down_proj's
    # input, ffn / tp wide) drop from 2 bytes to 1; o_proj's input stays saved in 16 bits by attention and gains
    # its 1-byte transpose
    per_token = m.hidden + m.hidden + m.ffn // tp - m.n_heads * m.head_dim // tp
    assert bf16.saved_activations_bytes - fp8.saved_activations_bytes == m.n_layers * tokens * per_token
    # current scaling: Megatron has o_proj save its original input (attention's output, saved anyway), no fp8 copy
    current = _te(m, fp8="tensorwise")
    assert bf16.saved_activations_bytes - current.saved_activations_bytes == m.n_layers * tokens * (
        m.hidden + m.hidden + m.ffn // tp)
    ckpt = {"checkpointing": "full"}  # only the layers' inputs are kept: nothing for fp8 to change
    assert _te(m, fp8="delayed", **ckpt).saved_activations_bytes == _te(m, **ckpt).saved_activations_bytes


def test_te_fp8_shares_one_cast_of_an_input_among_the_projections_that_read_it() -> None:
    t = TrainingSpec(micro_batch=2, seq_len=64, fp8="delayed")
    from trainmem_nb.parallel.layout import _hooks
    from trainmem_nb.spec.parallel import ParallelSpec

    hooks = _hooks(SMALL, t, ParallelSpec(**MEGATRON_TP2))
    labels = [label for seg in compile_step(SMALL, program_key(t, SMALL), hooks).segments for *_r, label in seg.events]
    casts = {label for label in labels if label.endswith("input fp8 transpose")}
    # q, k and v read one norm output (Megatron's fused linear_qkv), gate and up another (linear_fc1)
    assert casts == {f"{mod} input fp8 transpose" for mod in ("self_attn.q_proj", "self_attn.o_proj",
                                                                "mlp.gate_proj", "mlp.down_proj")}
    # the fused GEMM's row-wise input lives until the group's whole output is made: v_proj's, up_proj's
    forward = [(k, label) for seg in compile_step(SMALL, program_key(t, SMALL), hooks).segments
               if seg.phase == "forward" for _c, k, _sz, label in seg.events]
    for first, last in (("self_attn.q_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        assert forward.index((1, last)) < forward.index((-1, f"{first} input fp8"))
    assert not any(label.endswith((" amax", " scaled")) for label in labels)  # none of torchao's cast chains


def test_te_fp8_is_refused_for_a_mixture_of_experts_model_under_megatron() -> None:
    with pytest.raises(SpecError, match="grouped expert linears"):
        tm.estimate(MOE16, micro_batch=2, seq_len=64, fp8="delayed", parallel=MEGATRON_TP2)


def test_te_fp8_under_sequence_parallelism_splits_one_byte_norm_outputs() -> None:
    from trainmem_nb.parallel.layout import _sequence_parallel_saving_per_token
    from trainmem_nb.spec.parallel import ParallelSpec

    p = ParallelSpec(engine="megatron", gpus=2, tp=2, sp=True)
    bf16 = _sequence_parallel_saving_per_token(SMALL, TrainingSpec(), p)
    fp8 = _sequence_parallel_saving_per_token(SMALL, TrainingSpec(fp8="delayed"), p)
    assert bf16 - fp8 == SMALL.n_layers * 2 * SMALL.hidden * (1 - 1 / 2)  # two norm outputs, one byte less each


def test_te_fp8_is_explained_in_the_notes_and_exported_with_megatrons_flags(tmp_path: Any) -> None:
    from trainmem_nb.planning.launch import write_launch_files

    est = _te(SMALL, fp8="delayed")
    assert "Transformer Engine's DelayedScaling" in est.summary()
    assert "with delayed fp8 matmuls (Transformer Engine), adamw (Megatron's)" in est.summary()
    assert "saves its 16-bit input" in _te(SMALL, fp8="tensorwise").summary()  # linear_proj's original input
    written = write_launch_files(est, tmp_path / "out")
    assert "--fp8-recipe delayed" in written[0].read_text()


def test_a_blackwell_fit_notes_that_te_keeps_one_fp8_copy_of_each_weight() -> None:
    est = tm.estimate("llama-3.2-1b", micro_batch=1, seq_len=1024, fp8="delayed", parallel=MEGATRON_TP2)
    assert any("Transformer Engine keeps one fp8 copy" in n for n in tm.fit(est, "B200").notes)
    assert not any("Transformer Engine keeps one fp8 copy" in n for n in tm.fit(est, "H100").notes)


def test_the_cli_takes_te_fp8_under_megatron(capsys: pytest.CaptureFixture[str]) -> None:
    from trainmem_nb.cli.main import main

    assert main(["estimate", "--model", "llama-3.2-1b", "--engine", "megatron", "--gpus", "2", "--tp", "2",
                 "--fp8", "delayed", "--seq-len", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["training"]["fp8"] == "delayed" and out["detail_bytes"]["weights/fp8_workspaces"] > 0
