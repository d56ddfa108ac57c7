"""`trainmem measure` on the command line: the JSON contract, and one clear line (exit 2) for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainmem_nb.cli.main import main


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


def test_cli_does_not_import_torch_until_measure_runs() -> None:
    proc = _python(
        "import sys\n"
        "from trainmem_nb.cli.main import build_parser\n"
        "parser = build_parser()\n"
        "parser.parse_args(['measure', '--model', 'gpt2'])\n"
        "import trainmem_nb.measure.dataset, trainmem_nb.measure.validate\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_missing_torch_says_how_to_install_the_extra() -> None:
    proc = _python(
        "import sys\n"
        "sys.modules['torch'] = None  # what an environment without torch looks like to `import torch`\n"
        "from trainmem_nb.cli.main import main\n"
        "sys.exit(main(['measure', '--model', 'gpt2', '--seq-len', '64']))\n"
    )
    assert_one_line_error(proc.returncode, proc.stderr, 'pip install "trainmem_nb[measure]"')


pytorch = pytest.mark.torch


def _tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256,
                                "n_positions": 128}))
    return path


@pytorch
def test_measure_json_follows_the_estimate_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    out_file = tmp_path / "m.json"
    code, out, _ = run_cli(["measure", "--hf-config", str(_tiny_config(tmp_path)), "--micro-batch", "2",
                            "--seq-len", "32", "--precision", "fp32", "--device", "fake", "--json",
                            "--out", str(out_file)], capsys)
    assert code == 0
    data = json.loads(out)
    assert sum(data["breakdown_bytes"].values()) == data["peak_allocated_bytes"]
    assert data["peak_phase"] in ("forward", "backward", "optimizer")
    assert data["measured_with"]["device"] == "fake"
    assert "timeline" not in data
    stored = json.loads(out_file.read_text())
    assert stored["timeline"] and stored["peak_allocated_bytes"] == data["peak_allocated_bytes"]


@pytorch
def test_measure_prints_a_table_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    code, out, _ = run_cli(["measure", "--hf-config", str(_tiny_config(tmp_path)), "--seq-len", "32",
                            "--device", "cpu"], capsys)
    assert code == 0
    assert "peak allocated" in out and "measured on cpu" in out


BAD_INPUT: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "cuda without a GPU": (["--model", "gpt2", "--device", "cuda"], ("device='cuda'", "--device fake")),
    "optimizer outside torch.optim": (["--model", "gpt2", "--optimizer", "lion"], ("cannot be measured here",)),
    "8-bit optimizer": (["--model", "gpt2", "--optimizer", "adamw-8bit"], ("cannot be measured here",)),
    "cpu step too big for RAM": (["--model", "llama-2-70b", "--device", "cpu"], ("RAM", "--device fake")),
    "flash attention without CUDA": (["--model", "gpt2", "--attention", "flash"], ("flash-attn",)),
    "qlora": (["--model", "gpt2", "--method", "qlora"], ("bitsandbytes",)),
    "calibration without cuda": (["--model", "gpt2", "--save-calibration", "x.json"], ("--device cuda",)),
    "unknown precision": (["--model", "gpt2", "--precision", "bf17"], ("precision",)),
    "a parallel layout": (["--model", "gpt2", "--gpus", "8", "--tp", "2"], ("one device", "--gpus", "--tp")),
    # refused up front as the estimate refuses it (it failed inside torchao with an AssertionError)
    "fp8 recipe of another engine": (["--model", "gpt2", "--fp8", "delayed"], ("DelayedScaling", "engine='megatron'")),
}


@pytorch
@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    args, needles = BAD_INPUT[case]
    if "--device" in args and "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = run_cli(["measure", *args, "--seq-len", "64"], capsys)
    assert_one_line_error(code, err, *needles)


@pytorch
def test_unsupported_family_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "t5", "d_model": 64}))
    code, _, err = run_cli(["measure", "--hf-config", str(path)], capsys)
    assert_one_line_error(code, err, "model_type='t5'", "supported")


def _cuda_measurement() -> Any:
    """A cuda `Measurement` as the CUDA path builds it (its numbers are arbitrary but consistent)."""
    from trainmem_nb.engine.breakdown import DETAIL_KEYS
    from trainmem_nb.measure.result import Measurement
    from trainmem_nb.model.spec import ModelSpec
    from trainmem_nb.spec.training import TrainingSpec

    detail = dict.fromkeys(DETAIL_KEYS, 0)
    detail.update({"weights/params": 4 << 20, "gradients": 4 << 20, "optimizer_states": 8 << 20,
                   "activations/layers": 6 << 20, "transient/backward": 2 << 20, "overhead/workspaces": 1 << 20})
    peak = sum(detail.values())
    cuda = {"gpu_name": "Test GPU", "device_total": 80 << 30, "context": 500 << 20, "workspace_at_start": 1 << 20,
            "max_allocated": peak, "max_reserved": peak + (2 << 20)}
    return Measurement(
        model=ModelSpec(family="gpt2", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=256, max_positions=128),
        training=TrainingSpec(device="cuda", seq_len=64), mode="cuda", n_params=1, n_trainable_params=1,
        peak_allocated_bytes=peak, peak_reserved_bytes=peak + (2 << 20), device_total_bytes=peak + (502 << 20),
        peak_phase="backward", peak_at="", detail_bytes=detail, phase_peaks_bytes={},
        measured_with={"device": "cuda", "torch": "2.13.0+cu128", "date": "2026-01-01T00:00:00+00:00", "cuda": cuda},
    )


@pytorch
def test_saved_calibration_is_read_by_the_estimator(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from trainmem_nb.measure.cuda import write_calibration
    from trainmem_nb.spec.calibration import load_calibration

    m = _cuda_measurement()
    path = write_calibration(m, tmp_path / "cal.json")
    cal = load_calibration(path)
    cuda = m.measured_with["cuda"]
    assert cal is not None and cal.gpu_name == cuda["gpu_name"]
    assert cal.cuda_context_bytes == cuda["context"]
    assert cal.workspace_bytes == cuda["workspace_at_start"]
    churn = m.breakdown_bytes["activations"] + m.breakdown_bytes["transient"]
    assert cal.reserved_churn_fraction == pytest.approx((m.peak_reserved_bytes - m.peak_allocated_bytes) / churn)
    assert json.loads(path.read_text())["measurement"]["calibration"] == cal.model_dump(mode="json")


def test_a_calibrations_workspace_replaces_the_default_in_peak_breakdown_and_timeline() -> None:
    import trainmem_nb as tm
    from trainmem_nb.device import CUBLAS_WORKSPACE_BYTES

    kw = dict(micro_batch=1, seq_len=512, precision="bf16-mixed", device="cuda")
    default = tm.estimate("gpt2", **kw)
    extra = 32 << 20
    cal = {"gpu_name": "test", "cuda_context_bytes": 500 << 20, "reserved_churn_fraction": 0.1,
           "workspace_bytes": CUBLAS_WORKSPACE_BYTES["default"] + extra}
    calibrated = tm.estimate("gpt2", calibration=cal, **kw)
    assert calibrated.peak_allocated_bytes == default.peak_allocated_bytes + extra
    assert calibrated.detail_bytes["overhead/workspaces"] == default.detail_bytes["overhead/workspaces"] + extra
    assert max(p.total_bytes for p in calibrated.timeline()) == calibrated.peak_allocated_bytes


def test_calibration_needs_a_cuda_measurement() -> None:
    from dataclasses import replace

    from trainmem_nb.measure.calibration import calibration_from

    with pytest.raises(RuntimeError, match="device='cuda'"):
        calibration_from(replace(_cuda_measurement(), mode="fake"))
