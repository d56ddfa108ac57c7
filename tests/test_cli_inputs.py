"""The CLI: bad input gets one line naming the flag, the value and what is valid, and exit 2; the
README's multi-GPU line resolves the engine as the API does; no flag is abbreviated; estimate can give
a fit verdict; and nothing from inside the package ever reaches the user as a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainmem_nb.cli.main import main

TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 100, "num_hidden_layers": 2}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors exit from inside parse_args
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    return lines[0]


def test_cli_zero3_without_engine_means_deepspeed_like_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "estimate", "--model", "llama-2-13b", "--gpus", "8", "--zero", "3",
                         "--checkpointing", "full", "--micro-batch", "4", "--seq-len", "4096", "--json")
    assert code == 0, err
    assert json.loads(out)["parallel"]["engine"] == "deepspeed"
    import trainmem_nb as tm

    api = tm.estimate("llama-2-13b", gpus=8, zero=3, checkpointing="full", micro_batch=4, seq_len=4096)
    assert json.loads(out)["peak_allocated_bytes"] == api.peak_allocated_bytes


def test_fsdp_without_a_zero_stage_shards_fully_as_fsdp_does(capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP1's sharding_strategy defaults to FULL_SHARD and FSDP2 always shards: engine='fsdp' alone is zero 3,
    on the CLI and in the API; zero=0 (NO_SHARD) and zero=2 are still there when asked for."""
    import trainmem_nb as tm

    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--gpus", "4", "--engine", "fsdp", "--seq-len", "128",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["parallel"]["zero"] == 3
    full = tm.estimate("gpt2", gpus=4, engine="fsdp", seq_len=128)
    assert full.parallel.zero == 3 and json.loads(out)["peak_allocated_bytes"] == full.peak_allocated_bytes
    assert tm.estimate("gpt2", gpus=4, engine="fsdp", zero=0, seq_len=128).parallel.zero == 0
    assert tm.estimate("gpt2", gpus=4, engine="fsdp", zero=0, seq_len=128).peak_allocated_bytes > \
        full.peak_allocated_bytes
    from trainmem_nb.spec.parallel import ParallelSpec, build_parallel

    # a spec's NO_SHARD survives keywords beside it (its zero 0 is a default ParallelSpec leaves out of a dump)
    assert build_parallel(ParallelSpec(engine="fsdp", zero=0, gpus=2), gpus=4).zero == 0


def test_cli_without_zero_or_offload_still_means_ddp(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--gpus", "2", "--seq-len", "128", "--json")
    assert code == 0 and json.loads(out)["parallel"]["engine"] == "ddp"


def test_cli_does_not_abbreviate_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--seq", "128")
    assert "unrecognized arguments: --seq" in one_error_line(code, err)
    code, _, err = run(capsys, "plan", "--model", "gpt2", "--gpu", "H100", "--no-p")
    assert "--no-p" in one_error_line(code, err)


def test_estimate_gpu_prints_the_fit_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "512", "--gpu", "H100")
    assert code == 0, err
    assert out.splitlines()[-1].startswith("fits H100 SXM 80GB with")
    code, out, err = run(capsys, "estimate", "--model", "llama-2-7b", "--seq-len", "2048", "--gpu", "T4", "--json")
    assert code == 0, err
    verdict = json.loads(out)["fit"]
    assert verdict["verdict"] == "oom" and verdict["gpu"] == "T4 16GB" and verdict["message"].startswith("OOM on")


def test_estimate_gpu_with_an_unknown_name_fails_before_estimating(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(*run(capsys, "estimate", "--model", "gpt2", "--gpu", "H1OO")[::2])
    assert "unknown gpu 'H1OO'" in line and "did you mean" in line


@pytest.mark.parametrize("flag", ["--model", "--hf-config", "--params"])
def test_cli_empty_model_or_config_names_the_flag(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    line = one_error_line(*run(capsys, "estimate", flag, "")[::2])
    assert f"argument {flag}: is empty" in line


@pytest.mark.parametrize(("argv", "text"), [
    (["plan", "--model", "gpt2", "--gpu", ""], "argument --gpu: is empty"),
    (["plan", "--model", "gpt2", "--gpu", "H100,"], "--gpu 'H100,' has an empty name"),
    (["plan", "--model", "gpt2", "--gpu", "H100", "--tokens", ""], "argument --tokens: is empty"),
    (["plan", "--model", "gpt2", "--gpu", "H100", "--provider", ""], "argument --provider: is empty"),
])
def test_plan_empty_names_are_refused(capsys: pytest.CaptureFixture[str], argv: list[str], text: str) -> None:
    assert text in one_error_line(*run(capsys, *argv)[::2])


@pytest.mark.parametrize("top", ["0", "-1", "x"])
def test_plan_top_must_be_positive(capsys: pytest.CaptureFixture[str], top: str) -> None:
    assert "argument --top:" in one_error_line(*run(capsys, "plan", "--model", "gpt2", "--gpu", "H100", "--top", top)[::2])


@pytest.mark.parametrize(("flag", "value"), [("--params", "-7e9"), ("--dropout", "-inf")])
def test_cli_negative_values_get_a_hint_naming_the_flag(capsys: pytest.CaptureFixture[str], flag: str,
                                                        value: str) -> None:
    argv = ["estimate", flag, value] if flag == "--params" else ["estimate", "--model", "gpt2", flag, value]
    line = one_error_line(*run(capsys, *argv)[::2])
    assert f"argument {flag}: expected one argument" in line and f"write {flag}=VALUE" in line
    line = one_error_line(*run(capsys, *argv[:-2], f"{flag}={value}")[::2])  # then the value check names it
    assert f"{flag.lstrip('-')}=" in line, line


@pytest.mark.parametrize(("argv", "text"), [
    (["--storage-gbs", "0"], "--storage-gbs=0.0: Input should be greater than 0"),
    (["--storage-gbs", "-1"], "--storage-gbs=-1.0"), (["--storage-gbs", "inf"], "--storage-gbs=Infinity"),
    (["--spot-rate", "nan"], "--spot-rate=NaN"), (["--spot-rate", "-1"], "--spot-rate=-1.0"),
    (["--mfu", "5"], "--mfu=5.0 must be a fraction"), (["--headroom", "nan"], "--headroom=NaN"),
    (["--provider", "acmecloud"], "provider='acmecloud' sells nothing"),
    (["--tp", "8", "--no-prices"], "tp=8 does not divide gpt2's n_heads=12"),
])
def test_plan_assumptions_are_refused_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      text: str) -> None:
    line = one_error_line(*run(capsys, "plan", "--model", "gpt2", "--seq-len", "512", "--gpu", "H100",
                               "--tokens", "1e9", *argv)[::2])
    assert text in line, line


def test_gpus_table_shows_unknown_tflops_as_a_dash(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "gpus")
    assert code == 0
    rows = {line[:30].strip(): line for line in out.splitlines()}
    a10g = rows["A10G 24GB"].split()
    assert a10g[4] == "-"  # name (2 words), usable (2 words), then bf16 TFLOPS
    assert rows["T4 16GB"].split()[4] == "-"  # no bf16 at all
    assert rows["H100 SXM 80GB"].split()[5] != "-"


def _binary(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_bytes(bytes(range(256)) * 8)
    return path


@pytest.mark.parametrize(("argv", "flag"), [
    (["estimate", "--hf-config", "{}"], "--hf-config"),
    (["estimate", "--model", "gpt2", "--calibration", "{}"], "calibration"),
    (["plan", "--model", "gpt2", "--gpu-file", "{}"], "--gpu-file"),
    (["plan", "--model", "gpt2", "--gpu", "H100", "--prices", "{}"], "--prices"),
    (["validate", "--from-dataset", "{}"], "--from-dataset"),
])
@pytest.mark.parametrize("kind", ["binary", "deep"])
def test_every_file_option_names_the_file_when_it_is_binary_or_too_deep(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], flag: str, kind: str) -> None:
    name = "f.csv" if flag == "--gpu-file" and kind == "binary" else "f.json"
    if kind == "binary":
        path = _binary(tmp_path, name)
    else:
        path = tmp_path / name
        path.write_text("[" * 100_000 + "]" * 100_000)
    if flag == "--from-dataset" and kind == "deep":
        path = tmp_path / "cases.jsonl"
        path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    line = one_error_line(*run(capsys, *[str(path) if a == "{}" else a for a in argv])[::2])
    assert flag in line and path.name in line, line
    assert ("binary" in line or "UTF-8" in line) if kind == "binary" else "nests deeper" in line, line


def test_config_json_infinity_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(TINY)[:-1] + ', "num_hidden_layers": Infinity}')
    line = one_error_line(*run(capsys, "estimate", "--hf-config", str(path))[::2])
    assert "config.json num_hidden_layers=Infinity must be an integer" in line


def test_gpu_file_with_infinite_memory_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "g.csv"
    path.write_text("name,memory_gib,bf16_dense_tflops\nmycard,inf,100\n")
    line = one_error_line(*run(capsys, "plan", "--model", "gpt2", "--seq-len", "512", "--no-prices",
                               "--gpu-file", str(path), "--gpu", "mycard")[::2])
    assert line.endswith("--gpu-file g.csv row 2 (mycard): memory_gib='inf' must be a finite number")


def test_an_unexpected_error_is_one_line_asking_for_a_report(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import trainmem_nb.estimator.api as api

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(api, "estimate", broken)
    monkeypatch.delenv("TRAINMEM_DEBUG", raising=False)
    code, _, err = run(capsys, "estimate", "--model", "gpt2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "internal error: ZeroDivisionError: division by zero" in err and "please report" in err


#: Bad inputs of every subcommand (the audit's kinds): each must be one line and exit 2, never the backstop.
BAD_INPUTS = [
    ["estimate", "--model", "nope-7b"], ["estimate", "--model", "gpt2", "--micro-batch", "0"],
    ["estimate", "--model", "gpt2", "--seq-len", "999999999"], ["estimate", "--model", "gpt2", "--precision", "fp8"],
    ["estimate", "--model", "gpt2", "--lora-alpha", "inf", "--method", "lora"],
    ["estimate", "--model", "gpt2", "--dropout", "nan"], ["estimate", "--model", "gpt2", "--gpus", "3", "--tp", "2"],
    ["estimate", "--model", "gpt2", "--engine", "horovod"], ["estimate", "--model", "gpt2", "--offload", "disk"],
    ["estimate", "--params", "abc"], ["estimate", "--params", "1e400"], ["estimate", "--params", "nan"],
    ["estimate", "--model", "gpt2", "--lora-targets", "nope", "--method", "lora"],
    ["estimate", "--model", "gpt2", "--calibration", "/nonexistent.json"],
    ["estimate", "--hf-config", "/nonexistent/config.json"],
    ["plan", "--model", "gpt2", "--gpu", "Z9000"], ["plan", "--model", "gpt2", "--gpu", "H100", "--tokens", "abc"],
    ["plan", "--model", "gpt2", "--gpu", "H100", "--tokens", "-5"],
    ["plan", "--model", "gpt2", "--gpu", "H100", "--target-global-batch", "0"],
    ["plan", "--model", "gpt2", "--gpu", "H100", "--max-gpus", "0"],
    ["plan", "--model", "gpt2", "--gpu", "H100", "--gpus", "3", "--tp", "2"],
    ["plan", "--model", "gpt2", "--gpu-file", "/nonexistent.csv"],
    ["plan", "--model", "gpt2", "--gpu", "H100", "--prices", "/nonexistent.csv"],
    ["validate", "--from-dataset", "/nonexistent.jsonl"], ["validate", "--tolerance", "x"],
]


@pytest.mark.parametrize("argv", BAD_INPUTS, ids=[" ".join(a[1:])[:60] for a in BAD_INPUTS])
def test_cli_never_prints_a_traceback(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    one_error_line(*run(capsys, *argv)[::2])


def test_debug_variable_shows_the_traceback_for_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainmem_nb.estimator.api as api

    monkeypatch.setattr(api, "estimate", lambda *a, **k: 1 / 0)
    monkeypatch.setenv("TRAINMEM_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["estimate", "--model", "gpt2"])
    assert os.environ["TRAINMEM_DEBUG"] == "1"


def test_measure_with_zero3_and_no_engine_says_it_is_modelled_only(capsys: pytest.CaptureFixture[str]) -> None:
    """As in estimate, ZeRO-3 without --engine means DeepSpeed, which one process cannot measure: say so."""
    line = one_error_line(*run(capsys, "measure", "--model", "gpt2", "--gpus", "8", "--zero", "3",
                               "--device", "fake")[::2])
    assert "modelled by `trainmem estimate` only" in line and "--engine" in line


def test_python_dash_m_runs_the_same_command_line() -> None:
    """``python -m trainmem_nb`` is the ``trainmem`` command (audit 2026-12-01: it had no ``__main__``)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "trainmem_nb", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: trainmem" in out.stdout


@pytest.mark.parametrize(("argv", "text"), [
    (["--lora-rank", "8"], "--lora-rank sets the LoRA adapters, which --method full has none of"),
    (["--lora-targets", "all-linear"], "--lora-targets sets the LoRA adapters"),
    (["--method", "lora", "--qlora-single-quant"], "--qlora-single-quant sets QLoRA's 4-bit base"),
    (["--headroom", "0.2"], "--headroom is the memory kept free on --gpu NAME"),
])
def test_a_flag_that_needs_another_is_refused_not_ignored(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                           text: str) -> None:
    """A LoRA flag without a LoRA method, a QLoRA flag without QLoRA, a headroom without a card: each changed
    nothing before, without a word."""
    line = one_error_line(*run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128", *argv)[::2])
    assert text in line, line
    code, _out, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128", "--method", "qlora", "--lora-rank",
                          "8", "--qlora-single-quant", "--gpu", "H100", "--headroom", "0.2")
    assert code == 0, err
