"""Defaults are what users run, and what the numbers cannot say is said next to the verdict: LoRA and
QLoRA default to a 16-bit frozen base (as peft users load it), a mixed-precision LoRA's fp32 base and
QLoRA's unquantized MoE experts get a note."""

from __future__ import annotations

import json

import pytest

import trainmem_nb as tm
from trainmem_nb.cli.main import main
from trainmem_nb.spec.training import TrainingSpec, build_training


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_default_precision_is_a_bf16_base_with_fp32_adapters(method: str) -> None:
    t = TrainingSpec(method=method)
    assert t.precision.value == "bf16-true" and t.lora_dtype.value == "fp32" and t.param_bytes == 2
    default = tm.estimate("llama-2-7b", seq_len=512, method=method)
    explicit = tm.estimate("llama-2-7b", seq_len=512, method=method, precision="bf16-true")
    assert default.peak_allocated_bytes == explicit.peak_allocated_bytes
    assert TrainingSpec().precision.value == "bf16-mixed"  # full fine-tuning keeps HF Trainer's bf16=True recipe


def test_a_rebuilt_spec_follows_its_new_method() -> None:
    lora = TrainingSpec(method="lora")
    assert build_training(lora, method="full").precision.value == "bf16-mixed"
    chosen = TrainingSpec(method="lora", precision="bf16-mixed")
    assert build_training(chosen, micro_batch=2).precision.value == "bf16-mixed"  # a choice is kept


def test_cli_lora_default_follows_the_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "gpt2", "--seq-len", "128", "--method", "lora", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["precision"] == "bf16-true"
    assert main(["estimate", "--model", "gpt2", "--seq-len", "128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["precision"] == "bf16-mixed"


def test_mixed_precision_lora_notes_the_fp32_base_next_to_the_verdict() -> None:
    est = tm.estimate("llama-2-7b", seq_len=2048, method="lora", precision="bf16-mixed")
    verdict = tm.fit(est, "A100 40GB")
    assert any("frozen base is counted in fp32" in n and "bf16-true" in n for n in verdict.notes)
    assert "note: lora with precision='bf16-mixed'" in est.summary()
    quiet = tm.fit(tm.estimate("llama-2-7b", seq_len=2048, method="lora"), "A100 40GB")
    assert not any("fp32" in n for n in quiet.notes)


def test_qlora_on_moe_notes_the_unquantized_experts() -> None:
    est = tm.estimate("mixtral-8x7b", seq_len=512, method="qlora")
    notes = tm.fit(est, "H100").notes
    (note,) = [n for n in notes if "experts" in n]
    assert "fused 3-D parameters" in note and "not NF4" in note and "GiB" in note
    assert not any("experts" in n for n in tm.fit(tm.estimate("llama-2-7b", seq_len=512, method="qlora"), "H100").notes)
    rows = tm.plan("mixtral-8x7b", gpu="H100", seq_len=512, method="qlora", prices=False, max_gpus=8).rows
    assert rows and all(any("not NF4" in w for w in r["warnings"]) for r in rows if r["verdict"] != "oom")
