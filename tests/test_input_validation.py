"""Every value a spec or a file gives is checked once, in one place: finite floats, integers that are
integers, flags that are flags, and files named (with the flag or argument that named them) when they
are binary, too deep, or hold a number no model has."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import trainmem_nb as tm
from trainmem_nb.errors import SpecError, parse_json, read_text_file
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.planning.gpus import load_gpus, load_prices
from trainmem_nb.spec.calibration import MAX_CALIBRATED_BYTES, Calibration, load_calibration
from trainmem_nb.spec.parallel import ParallelSpec
from trainmem_nb.spec.training import TrainingSpec

TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 100, "num_hidden_layers": 2}
BAD_NUMBERS = [float("inf"), float("-inf"), float("nan")]


# -- value types of every spec --------------------------------------------------------------------------

@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize(("spec", "field", "extra"), [
    (TrainingSpec, "lora_alpha", {}), (TrainingSpec, "dropout", {}), (TrainingSpec, "lora_dropout", {}),
    (ModelSpec, "rotary_pct", {"family": "llama", "n_layers": 1, "hidden": 64, "n_heads": 4, "ffn": 64, "vocab": 10}),
    (ModelSpec, "attn_dropout", {"family": "llama", "n_layers": 1, "hidden": 64, "n_heads": 4, "ffn": 64, "vocab": 10}),
    (Calibration, "reserved_churn_fraction", {}),
])
def test_every_float_option_refuses_inf_and_nan_with_field_and_value(spec: type, field: str, extra: dict,
                                                                      value: float) -> None:
    with pytest.raises(SpecError, match=rf"^{field}=(nan|inf|-inf|NaN|Infinity|-Infinity): .*finite"):
        spec.model_validate({**extra, field: value})


def test_lora_alpha_inf_never_reaches_the_json_contract() -> None:
    with pytest.raises(SpecError, match="lora_alpha=Infinity"):
        tm.estimate("gpt2", seq_len=128, method="lora", lora_alpha=float("inf"))


@pytest.mark.parametrize("value", [True, False, np.bool_(True), b"4", "4", 2.5, float("inf")])
@pytest.mark.parametrize("field", ["micro_batch", "seq_len", "grad_accum", "lora_rank", "gpus", "tp"])
def test_integer_options_refuse_bool_bytes_text_and_fractions(field: str, value: object) -> None:
    with pytest.raises(SpecError, match=rf"^{field}=\S+ must be (an integer|a finite whole number)"):
        tm.estimate("gpt2", **{"seq_len": 64, field: value})


def test_integer_options_accept_numpy_integers_and_whole_floats() -> None:
    est = tm.estimate("gpt2", micro_batch=np.int64(2), seq_len=np.int32(64), grad_accum=2.0)
    assert (est.training.micro_batch, est.training.seq_len, est.training.grad_accum) == (2, 64, 2)
    assert type(est.training.micro_batch) is int


@pytest.mark.parametrize("value", [1, 0, "yes", "True"])
def test_flags_refuse_numbers_and_text(value: object) -> None:
    with pytest.raises(SpecError, match=r"^sp=\S+ must be True or False"):
        ParallelSpec(gpus=2, tp=2, sp=value)
    with pytest.raises(SpecError, match=r"^first_step=\S+ must be True or False"):
        TrainingSpec(first_step=value)


def test_model_dimensions_refuse_bools() -> None:
    with pytest.raises(SpecError, match=r"^n_layers=True must be an integer, not a bool"):
        ModelSpec(family="llama", n_layers=True, hidden=64, n_heads=4, ffn=128, vocab=100)


def test_checkpointing_true_means_full_and_false_means_none() -> None:
    assert TrainingSpec(checkpointing=True).checkpointing.value == "full"
    assert TrainingSpec(checkpointing=False).checkpointing.value == "none"
    full = tm.estimate("gpt2", seq_len=256, checkpointing="full")
    assert tm.estimate("gpt2", seq_len=256, checkpointing=True).peak_allocated_bytes == full.peak_allocated_bytes


def test_lora_targets_accepts_a_peft_style_list() -> None:
    listed = tm.estimate("llama-3.2-1b", seq_len=128, method="lora", lora_targets=["q_proj", "v_proj"])
    assert listed.training.lora_targets == "q_proj,v_proj"
    joined = tm.estimate("llama-3.2-1b", seq_len=128, method="lora", lora_targets="q_proj,v_proj")
    assert listed.n_trainable_params == joined.n_trainable_params > 0


@pytest.mark.parametrize("targets", [[], ["q_proj", 3], [""], 5])
def test_lora_targets_that_name_no_module_are_refused_saying_what_is_expected(targets: object) -> None:
    with pytest.raises(SpecError, match=r"^lora_targets=.*list of module names"):
        TrainingSpec(method="lora", lora_targets=targets)


@pytest.mark.parametrize(("field", "value"), [("workspace_bytes", 10**30), ("cuda_context_bytes", MAX_CALIBRATED_BYTES + 1),
                                              ("cuda_context_bytes", True), ("total_memory_bytes", -1)])
def test_calibration_values_are_bounded(field: str, value: object) -> None:
    with pytest.raises(SpecError, match=rf"^calibration: {field}="):
        tm.estimate("gpt2", seq_len=64, calibration={field: value})


def test_a_huge_value_is_shortened_in_the_message() -> None:
    with pytest.raises(SpecError) as info:
        tm.estimate("gpt2", seq_len=64, calibration={"workspace_bytes": 10**400})
    assert len(str(info.value)) < 200 and "digit" in str(info.value)


# -- config.json numbers -------------------------------------------------------------------------------

LLAMA_INT_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim"]


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e400, True, "2", 2.5, 10**400, -3])
@pytest.mark.parametrize("key", LLAMA_INT_KEYS)
def test_config_int_fields_refuse_inf_nan_huge_bool_and_str_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(SpecError, match=rf"^config\.json {key}=\S.* must be an integer"):
        ModelSpec.from_hf_config({**TINY, key: value})


@pytest.mark.parametrize("key", ["attention_dropout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), True, "0.1"])
def test_config_float_fields_refuse_non_finite_bool_and_str(key: str, value: object) -> None:
    with pytest.raises(SpecError, match=rf"^config\.json {key}=\S+ must be a finite number"):
        ModelSpec.from_hf_config({**TINY, key: value})


def test_config_json_text_with_infinity_is_refused_not_an_overflow(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY)[:-1] + ', "num_hidden_layers": Infinity}')
    with pytest.raises(SpecError, match="num_hidden_layers=Infinity"):
        tm.estimate(hf_config=path)


def test_config_dict_accepts_numpy_integers() -> None:
    cfg = {**TINY, "num_hidden_layers": np.int64(3), "hidden_size": np.int32(64)}
    assert ModelSpec.from_hf_config(cfg).n_layers == 3


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_config_sliding_window_true_is_refused(model_type: str) -> None:
    cfg = {**TINY, "model_type": model_type, "sliding_window": True, "use_sliding_window": True}
    with pytest.raises(SpecError, match="sliding_window=true must be a window size"):
        ModelSpec.from_hf_config(cfg)


def test_config_sliding_window_null_or_false_means_none() -> None:
    for window in (None, False):
        assert ModelSpec.from_hf_config({**TINY, "model_type": "mistral", "sliding_window": window}).sliding_window == 0
    assert ModelSpec.from_hf_config({**TINY, "model_type": "mistral", "sliding_window": 32}).sliding_window == 32


# -- files: one reader, the file and the flag named -----------------------------------------------------

@pytest.fixture
def binary(tmp_path: Path) -> Path:
    path = tmp_path / "b.json"
    path.write_bytes(bytes(range(256)) * 4)
    return path


@pytest.fixture
def latin1(tmp_path: Path) -> Path:
    path = tmp_path / "l.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    return path


@pytest.fixture
def deep(tmp_path: Path) -> Path:
    path = tmp_path / "d.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return path


READERS = {
    "hf_config": lambda p: ModelSpec.from_hf_config(p),
    "calibration": lambda p: load_calibration(p),
    "gpu file": lambda p: load_gpus(p),
    "prices file": lambda p: load_prices(p),
}


@pytest.mark.parametrize("what", list(READERS))
def test_every_file_reader_names_the_file_when_it_is_binary_not_utf8_or_too_deep(
        what: str, binary: Path, latin1: Path, deep: Path) -> None:
    for path, why in ((binary, "binary"), (latin1, "not UTF-8"), (deep, "nests deeper")):
        with pytest.raises(SpecError) as info:
            READERS[what](path)
        message = str(info.value)
        assert message.startswith(what) and str(path.name) in message and why in message, message
        assert "\n" not in message and "codec" not in message and "recursion" not in message


def test_the_dataset_reader_names_the_file_and_line(tmp_path: Path) -> None:
    from trainmem_nb.measure.dataset import load_cases

    path = tmp_path / "cases.jsonl"
    path.write_text('{"id": 1}\n[1, 2\n')
    with pytest.raises(SpecError, match=r"^dataset .*cases\.jsonl line 1: not a measured case"):
        load_cases(path)
    path.write_bytes(b"\x00\x01\x02")
    with pytest.raises(SpecError, match=r"^dataset .*cases\.jsonl is a binary file"):
        load_cases(path)


def test_readers_refuse_a_folder_and_a_missing_file_naming_them(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"^x .* is a folder"):
        read_text_file(tmp_path, "x")
    with pytest.raises(SpecError, match=r"^x .*nope.json cannot be read"):
        read_text_file(tmp_path / "nope.json", "x")
    with pytest.raises(SpecError, match=r"^upload is not valid JSON: .* line 1"):
        parse_json(b"{broken", "upload")


@pytest.mark.parametrize(("cells", "column"), [
    ("mycard,inf,100", "memory_gib"), ("mycard,nan,100", "memory_gib"), ("mycard,-5,100", "memory_gib"),
    ("mycard,0,100", "memory_gib"), ("mycard,24,inf", "bf16_dense_tflops"), ("mycard,24,fast", "bf16_dense_tflops"),
])
def test_gpu_file_refuses_non_finite_or_non_positive_cells_naming_file_row_and_column(
        tmp_path: Path, cells: str, column: str) -> None:
    path = tmp_path / "g.csv"
    path.write_text("name,memory_gib,bf16_dense_tflops\n" + cells + "\n")
    with pytest.raises(SpecError, match=rf"^gpu file g\.csv row 2 \(mycard\): {column}="):
        load_gpus(path)


@pytest.mark.parametrize(("column", "value"), [("gpus_per_node", "inf"), ("gpus_per_node", "2.5"),
                                               ("nvidia_smi_total_mib", "nan"), ("nvlink_domain", "0")])
def test_gpu_file_integer_columns_must_be_whole_numbers(tmp_path: Path, column: str, value: str) -> None:
    path = tmp_path / "g.csv"
    path.write_text(f"name,memory_gib,{column}\nbox,24,{value}\n")
    with pytest.raises(SpecError, match=rf"^gpu file g\.csv row 2 \(box\): {column}="):
        load_gpus(path)


def test_gpu_file_without_a_memory_column_says_which_columns_would_do(tmp_path: Path) -> None:
    path = tmp_path / "g.csv"
    path.write_text("name,bf16_dense_tflops\nbox,100\n")
    with pytest.raises(SpecError, match=r"row 2 .*needs memory_bytes, nvidia_smi_total_mib or memory_gib"):
        load_gpus(path)


def test_own_prices_refuse_unknown_gpu_names_with_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"prices=\{'H1OO': \.\.\.\}: unknown gpu 'H1OO' \(did you mean"):
        load_prices({"H1OO": 2.0})
    path = tmp_path / "p.csv"
    path.write_text("gpu,on_demand_usd_per_gpu_hour\nNopeGPU,2\n")
    with pytest.raises(SpecError, match=r"^prices file p\.csv row 2 \(NopeGPU\): unknown gpu"):
        load_prices(path)


@pytest.mark.parametrize("price", [float("inf"), float("nan"), -1])
def test_own_prices_must_be_finite_and_not_negative(price: float) -> None:
    with pytest.raises(SpecError, match=r"^prices\['H100'\]="):
        load_prices({"H100": price})
