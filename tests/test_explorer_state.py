"""The explorer never loses what the user made and never shows a stale verdict: typed custom dimensions
survive a look at a preset, a bad upload keeps the good one, an error replaces the green "fits", bad
constructor values are refused at once, and no exception ever escapes a callback."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import trainmem_nb as tm  # noqa: E402
from trainmem_nb.ui.explorer import Explorer  # noqa: E402
from trainmem_nb.ui.explorer_text import summary_html  # noqa: E402

GOOD = (b'{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"intermediate_size":128,'
        b'"vocab_size":100,"num_hidden_layers":2,"_name_or_path":"good-tiny"}')


def _upload(content: bytes, name: str) -> tuple[dict[str, Any], ...]:
    return ({"name": name, "type": "application/json", "size": len(content), "content": memoryview(content),
             "last_modified": datetime(2024, 1, 1)},)


@pytest.fixture
def app() -> Explorer:
    return tm.explore("llama-3.2-1b", gpu="h100-80gb", micro_batch=1, seq_len=2048)


def test_explorer_keeps_typed_custom_dimensions_across_a_preset_visit(app: Explorer) -> None:
    app.set(source="custom")
    typed = dict(n_layers=7, hidden=1536, n_heads=12, n_kv_heads=4, ffn=4096, vocab=50000)
    app.set(**typed)
    assert app.message == "" and app.estimate.model.n_layers == 7
    app.set(source="preset")
    app.set(preset="mistral-7b")
    app.set(source="custom")
    assert {k: app.controls[k].value for k in typed} == typed
    assert app.estimate.model.hidden == 1536 and app.message == ""


def test_custom_dimensions_start_from_the_model_shown_until_edited(app: Explorer) -> None:
    app.set(source="custom")
    assert app.controls["hidden"].value == tm.get_model("llama-3.2-1b").hidden
    app.set(source="preset", preset="gpt2")
    app.set(source="custom")  # nothing typed yet: the custom model still follows the model shown
    assert app.controls["hidden"].value == tm.get_model("gpt2").hidden


def test_custom_after_an_empty_upload_source_starts_from_the_model_last_drawn(app: Explorer) -> None:
    """The config.json source with nothing uploaded holds no model: a switch on to custom starts from the model
    last drawn (ties, biases and positions kept), not from its bare dimensions (which lost the tied head)."""
    before = app.estimate
    app.set(source="upload")
    assert app.message  # nothing uploaded: said in the UI
    app.set(source="custom")
    assert app.message == "" and app.estimate.n_params == before.n_params
    assert app.estimate.peak_allocated_bytes == before.peak_allocated_bytes


def test_explorer_keeps_the_last_good_upload_when_a_bad_one_arrives(app: Explorer) -> None:
    app.controls["upload"].value = _upload(GOOD, "good.json")
    assert app.controls["source"].value == "upload" and app.estimate.model.name == "good-tiny"
    app.controls["upload"].value = _upload(b"{broken", "bad.json")
    label = app._upload_label.value
    assert "bad.json: " in label and "not valid JSON" in label and "still using good-tiny" in label
    assert app.controls["source"].value == "upload" and app.message == ""
    assert app.model_spec().name == "good-tiny"


@pytest.mark.parametrize("bad", [GOOD.replace(b':2,', b':NaN,'), GOOD.replace(b':2,', b':Infinity,'),
                                 GOOD.replace(b':2,', b':1e400,'), b"[" * 100_000 + b"]" * 100_000,
                                 bytes(range(256)), b"\xff\xfe{}"])
def test_explorer_upload_of_non_finite_or_deep_json_shows_an_error_and_raises_nothing(app: Explorer,
                                                                                      bad: bytes) -> None:
    app.controls["upload"].value = _upload(bad, "n.json")  # an exception here would escape the observer
    label = app._upload_label.value
    assert label.startswith("n.json: ") and "unexpected" not in label
    assert app.estimate.model.name == "llama-3.2-1b" and app.message == ""


def test_explorer_error_replaces_the_verdict_instead_of_showing_a_stale_fit(app: Explorer) -> None:
    assert app.verdict.startswith("fits H100 SXM 80GB") and "#2d7a3e" in app.verdict_html.value
    good = app.verdict
    app.set(tp=8, gpus=1)
    assert "does not divide gpus=1" in app.message
    assert app.verdict == "" and "fits" not in app.verdict_html.value and "#2d7a3e" not in app.verdict_html.value
    assert "no verdict" in app.verdict_html.value and "last valid" in app.message_html.value
    assert app.last_verdict == good and "trainmem-stale" in app.chart._dom_classes
    app.set(tp=1)
    assert app.verdict == good and "trainmem-stale" not in app.chart._dom_classes


@pytest.mark.parametrize(("kwargs", "text"), [
    (dict(headroom=float("nan")), "headroom=NaN"), (dict(headroom=2), "headroom=2 must be a fraction"),
    (dict(dpi=0), "dpi=0 must be an integer from 10"), (dict(dpi="x"), "dpi='x'"),
])
def test_explore_refuses_bad_headroom_and_dpi(kwargs: dict, text: str) -> None:
    with pytest.raises(tm.SpecError, match=text.replace("(", r"\(")):
        tm.explore("gpt2", **kwargs)


def test_explore_keeps_large_start_values() -> None:
    app = tm.explore("gpt2", gpu="H100", seq_len=128, micro_batch=100, grad_accum=200)
    assert app.controls["micro_batch"].value == 100 and app.controls["grad_accum"].value == 200
    assert app.estimate.training.micro_batch == 100 and app.estimate.training.grad_accum == 200


def test_a_failure_inside_a_callback_becomes_a_message(app: Explorer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(app, "_sync_lora", broken)
    app.controls["method"].value = "lora"  # the observer must not raise
    assert app.message.startswith("unexpected ZeroDivisionError: boom") and app.verdict == ""


def test_the_summary_says_where_the_reserved_bytes_come_from(app: Explorer) -> None:
    # on CUDA the caching allocator is replayed: the summary gives its cached-but-unused bytes and the
    # largest free block at the reserved peak; on CPU reserved is the allocated peak, with no note
    est = app.estimate
    assert est.reserved_from == "replay"
    assert (f"allocator replayed: {tm.format_bytes(est.fragmentation_bytes)} cached but unused"
            in app.summary_html.value)
    cpu = tm.estimate("llama-3.2-1b", micro_batch=1, seq_len=256, device="cpu")
    assert cpu.reserved_from == "allocated" and "replayed" not in summary_html(cpu)


def test_the_loss_toggle_estimates_with_that_loss_or_says_why_not(app: Explorer) -> None:
    before = app.estimate.peak_allocated_bytes
    app.set(loss_impl="liger", seq_len=8192)
    assert app.estimate.training.loss_impl.value == "liger" and app.message == ""
    assert app.estimate.peak_allocated_bytes < tm.estimate("llama-3.2-1b", seq_len=8192).peak_allocated_bytes
    app.set(model="gpt2", seq_len=1024)  # a bespoke head: the message says so, the explorer keeps working
    assert "loss_impl='liger' on gpt2 is not modelled" in app.message
    app.set(loss_impl="standard")
    assert app.message == "" and app.estimate.model.name == "gpt2" and before > 0


def test_choosing_transformer_engines_delayed_fp8_runs_it_under_megatron(app: Explorer) -> None:
    app.set(gpus=2, tp=2)
    app.controls["fp8"].value = "delayed"  # TE's recipe: the engine follows, the estimate has its workspaces
    assert app.message == "" and app.controls["engine"].value == "megatron"
    assert app.estimate.training.fp8.value == "delayed" and app.estimate.detail_bytes["weights/fp8_workspaces"] > 0
    app.controls["engine"].value = "fsdp"  # torchao has no delayed scaling: said in the UI, the chart kept
    assert "modelled under engine='megatron'" in app.message


def test_an_engine_picked_by_hand_or_by_fp8_takes_the_nearest_zero_stage_it_has() -> None:
    """Transformer Engine's recipe moves the engine to Megatron, whose distributed optimizer is ZeRO 1: a ZeRO 3
    left there was an error the user had not made; ddp takes 0 and FSDP 3 likewise."""
    app = tm.explore("llama-3-8b", gpus=8, zero=3)
    app.set(fp8="delayed")
    assert (app.controls["engine"].value, app.controls["zero"].value, app.message) == ("megatron", 1, "")
    app.set(fp8="none", engine="deepspeed", zero=3)
    app.set(engine="ddp")
    assert (app.controls["zero"].value, app.message) == (0, "")
    app.set(engine="fsdp")
    assert (app.controls["zero"].value, app.message) == (3, "")
