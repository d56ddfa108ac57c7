"""The estimate's contract: JSON keys, a breakdown that sums to the peak, the CLI's output and errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import trainmem_nb as tm
from trainmem_nb.cli.main import main
from trainmem_nb.engine.breakdown import DETAIL_KEYS, TOP_KEYS

CONTRACT = {"n_params", "n_trainable_params", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes",
            "peak_phase", "breakdown_bytes"}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_json_contract_keys_and_breakdown_summing_to_the_peak(device: str) -> None:
    d = tm.estimate("llama-3-8b", micro_batch=2, seq_len=2048, precision="bf16-mixed", checkpointing="full",
                    device=device).to_dict()
    assert set(d) >= CONTRACT
    assert d["peak_phase"] in ("forward", "backward", "optimizer")
    assert set(d["breakdown_bytes"]) >= {"weights", "gradients", "optimizer_states", "activations", "transient"}
    assert sum(d["breakdown_bytes"].values()) == d["peak_allocated_bytes"]
    assert sum(d["detail_bytes"].values()) == d["peak_allocated_bytes"]
    assert set(d["detail_bytes"]) <= set(DETAIL_KEYS)
    assert all(isinstance(v, int) for v in d["breakdown_bytes"].values())
    json.dumps(d)  # serializable


def test_cuda_adds_reserved_cache_and_context_on_top_of_allocated() -> None:
    e = tm.estimate("llama-2-7b", micro_batch=1, seq_len=2048)
    assert e.peak_allocated_bytes < e.peak_reserved_bytes < e.device_total_bytes
    assert e.device_total_bytes - e.peak_reserved_bytes == e.overhead_bytes["cuda_context"]


def test_cpu_device_reports_tensor_bytes_only() -> None:
    e = tm.estimate("llama-2-7b", micro_batch=1, seq_len=2048, device="cpu")
    assert e.peak_allocated_bytes == e.peak_reserved_bytes == e.device_total_bytes
    assert e.breakdown_bytes["overhead"] == 0


def test_calibration_replaces_the_modelled_context() -> None:
    cal = {"gpu_name": "test", "cuda_context_bytes": 1 << 30, "reserved_churn_fraction": 0.0}
    e = tm.estimate("llama-2-7b", micro_batch=1, seq_len=2048, calibration=cal)
    assert e.device_total_bytes - e.peak_reserved_bytes == 1 << 30
    assert e.reserved_from == "calibration" and "from the calibration" in e.summary()


def test_the_timeline_reaches_the_peak_and_ends_with_states_only() -> None:
    e = tm.estimate("llama-2-13b", micro_batch=1, seq_len=1024, checkpointing="full")
    tl = e.timeline()
    assert max(p.total_bytes for p in tl) == e.peak_allocated_bytes
    assert tl[-1].by_category[TOP_KEYS.index("gradients")] == 0  # zero_grad freed them
    assert len(tl) <= 1500


def test_html_repr_shows_every_category_and_the_peak() -> None:
    html = tm.estimate("gpt2", micro_batch=2, seq_len=256)._repr_html_()
    for key in TOP_KEYS:
        assert f"<td>{key}</td>" in html
    assert "peak allocated" in html


def test_peak_and_phase_for_adamw_foreach_is_the_optimizer_step_on_small_batches() -> None:
    e = tm.estimate("llama-2-7b", micro_batch=1, seq_len=512, precision="bf16-mixed")
    assert e.peak_phase == "optimizer"
    b = e.breakdown_bytes
    # params + grads + two moments + one sqrt(exp_avg_sq) temporary: 20 bytes per parameter in fp32
    assert math.isclose(b["weights"] + b["gradients"] + b["optimizer_states"] + b["transient"],
                        20 * e.n_params, rel_tol=1e-4)


def test_cli_json_matches_the_python_api(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "llama-3-8b", "--micro-batch", "2", "--seq-len", "2048",
                 "--precision", "bf16-mixed", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    api = tm.estimate("llama-3-8b", micro_batch=2, seq_len=2048, precision="bf16-mixed").to_dict()
    assert cli == json.loads(json.dumps(api))


def test_cli_reads_an_hf_config_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4,
                                "num_attention_heads": 8, "intermediate_size": 1376, "vocab_size": 32000}))
    assert main(["estimate", "--hf-config", str(path), "--micro-batch", "4", "--seq-len", "1024",
                 "--precision", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_params"] == tm.estimate(hf_config=path).n_params


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "llama-3-8b", "--precision", "bf17"], "precision='bf17' is not supported"),
    (["--model", "nope-13b"], "model='nope-13b' is not a known preset"),
    (["--params", "lots"], "--params='lots' is not a number"),
    (["--model", "gpt2", "--micro-batch", "0"], "micro_batch=0"),
    (["--model", "gpt2", "--micro-batch", "abc"], "invalid int value: 'abc'"),  # argparse's own checks too
    (["--model", "gpt2", "--device", "tpu"], "invalid choice: 'tpu'"),
    ([], "one of the arguments --model --hf-config --params is required"),
])
def test_cli_bad_input_prints_one_line_and_exits_2(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainmem_nb.cli.main", "estimate", *args],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


def test_presets_command_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    assert "llama-2-70b" in capsys.readouterr().out


def test_estimate_sweep_and_default_calibration_share_one_compiled_program() -> None:
    from trainmem_nb.device import CUBLAS_WORKSPACE_BYTES
    from trainmem_nb.step.compile import compile_step

    compile_step.cache_clear()
    tm.estimate("gpt2", micro_batch=2, seq_len=256)
    tm.sweep("gpt2", micro_batch=[2, 3], seq_len=256)
    tm.estimate("gpt2", micro_batch=2, seq_len=256, calibration={
        "gpu_name": "same workspace", "cuda_context_bytes": 1 << 29, "reserved_churn_fraction": 0.1,
        "workspace_bytes": CUBLAS_WORKSPACE_BYTES["default"]})
    assert compile_step.cache_info().misses == 2  # the step, and its unrolled form for the allocator's replay


def test_fp16_mixed_keeps_grad_scaler_state_and_the_scaled_loss() -> None:
    kw = dict(micro_batch=1, seq_len=128, device="cuda")
    fp16 = tm.estimate("gpt2", precision="fp16-mixed", **kw)
    bf16 = tm.estimate("gpt2", precision="bf16-mixed", **kw)
    # _scale and _growth_tracker: two 0-dim tensors, one 512-B block each
    assert fp16.detail_bytes["optimizer_states"] - bf16.detail_bytes["optimizer_states"] == 2 * 512
    labels = " ".join(p.label for p in fp16.timeline(max_points=100_000))
    assert "GradScaler.scale(loss)" in labels and "GradScaler.unscale_: inv_scale" in labels
    deepspeed = tm.estimate("gpt2", precision="fp16-mixed", gpus=2, zero=2, **kw)  # its own loss scaler
    assert "GradScaler" not in " ".join(p.label for p in deepspeed.timeline(max_points=100_000))


def test_grad_scaler_runs_with_ddp_and_fsdp_after_backwards_last_collective_not_with_megatron() -> None:
    kw = dict(precision="fp16-mixed", micro_batch=1, seq_len=256, device="cuda")

    def labels(**layout: object) -> list[str]:
        return [s.label for s in tm.estimate("llama-3.2-1b", **kw, **layout).program.segments]

    assert "GradScaler.unscale_" in labels(gpus=2, engine="ddp")
    assert "GradScaler.unscale_" not in labels(gpus=2, engine="megatron", tp=2)
    pipelined = labels(gpus=4, engine="fsdp", zero=3, pp=2, grad_accum=2)
    unscale = pipelined.index("GradScaler.unscale_")
    assert all(not lab.startswith("reduce-scatter after the last micro-batch") for lab in pipelined[unscale:])
    assert pipelined[unscale + 1] == "optimizer step"
    assert "GradScaler.unscale_" not in labels(optimizer="none")  # no optimizer: no unscale_/update


def test_untied_bert_head_bias_gets_no_gradient_nor_optimizer_state() -> None:
    """Untied, BERT's decoder has its own bias and ``cls.predictions.bias`` takes no part in the loss:
    no ``.grad`` (zero_grad freed one below zero) and no AdamW state (``_init_group`` skips it)."""
    from trainmem_nb.model.spec import ModelSpec

    shape = dict(family="bert", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512)
    tied, untied = (tm.estimate(ModelSpec.model_validate({**shape, "tie_embeddings": tie}), micro_batch=1, seq_len=16,
                                precision="fp32", device="cpu") for tie in (True, False))
    assert untied.n_params - tied.n_params == 512 * 64 + 512  # decoder weight and its own bias
    assert untied.n_trainable_params - tied.n_trainable_params == 512 * 64  # cls.predictions.bias untrained
    assert min(min(p.by_category) for p in untied.timeline(max_points=10**6)) >= 0
