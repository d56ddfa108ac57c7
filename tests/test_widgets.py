"""The explorer's callbacks in plain Python (no kernel, no browser): controls drive the estimate, the
planner's verdict and the chart; invalid combinations show a message and keep the last good chart."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import ipywidgets as w  # noqa: E402

import trainmem_nb as tm  # noqa: E402
from trainmem_nb.model.presets import get_preset  # noqa: E402
from trainmem_nb.planning import fit as planner  # noqa: E402
from trainmem_nb.ui.explorer import Explorer  # noqa: E402


@pytest.fixture
def app() -> Explorer:
    return tm.explore("llama-3.2-1b", gpu="A100 80GB", micro_batch=2, seq_len=1024, checkpointing="none")


def _upload(content: bytes, name: str = "config.json") -> tuple[dict[str, Any], ...]:
    """What the browser sends when a file is picked in a FileUpload widget (ipywidgets 8)."""
    return ({"name": name, "type": "application/json", "size": len(content), "content": memoryview(content),
             "last_modified": datetime(2024, 1, 1)},)


def _expected(app: Explorer) -> tuple[tm.MemoryEstimate, Any, int]:
    """The estimate, fit and largest micro-batch the public API gives for the app's controls."""
    opts = app.options()
    est = tm.estimate(app.model_spec(), **opts)
    rest = {k: v for k, v in opts.items() if k != "micro_batch"}
    gpu = app.controls["gpu"].value
    return est, planner.fit(est, gpu, headroom=app.headroom), planner.max_micro_batch(app.model_spec(), gpu,
                                                                                    app.headroom, **rest)


def test_the_explorer_draws_a_chart_and_a_verdict_when_created(app: Explorer) -> None:
    assert bytes(app.chart.value).startswith(b"\x89PNG")
    est, fit, mmb = _expected(app)
    assert app.estimate is not None and app.estimate.peak_allocated_bytes == est.peak_allocated_bytes
    assert app.verdict == f"{fit.message}; largest micro-batch {mmb}"
    assert app.message == "" and app.message_html.value == ""
    assert app.redraws == 1


def test_moving_the_micro_batch_slider_redraws_with_the_new_numbers(app: Explorer) -> None:
    before = bytes(app.chart.value)
    app.controls["micro_batch"].value = 16
    est, fit, _ = _expected(app)
    assert app.estimate.training.micro_batch == 16
    assert app.estimate.peak_allocated_bytes == est.peak_allocated_bytes
    assert app.verdict.startswith(fit.message)
    assert bytes(app.chart.value) != before
    assert app.redraws == 2
    assert app.fit.needed_bytes == fit.needed_bytes


def test_the_explorer_starts_as_plain_pytorch_and_a_zero_stage_beyond_one_picks_deepspeed(app: Explorer) -> None:
    """Without an engine the explorer follows the API's rule: plain PyTorch (DDP), and ZeRO-2/3 mean DeepSpeed
    (on one GPU an engine is modelled as it runs, so the first view is a plain training loop's)."""
    assert app.estimate.parallel.engine.value == "ddp" and app.estimate.parallel.single_device
    assert app.estimate.peak_allocated_bytes == tm.estimate(app.estimate.model, app.estimate.training).peak_allocated_bytes
    app.controls["zero"].value = 2
    assert app.message == "" and app.estimate.parallel.engine.value == "deepspeed"
    assert tm.explore("gpt2", seq_len=512, zero=3).estimate.parallel.engine.value == "deepspeed"


def test_an_invalid_combination_shows_its_message_and_keeps_the_last_good_chart(app: Explorer) -> None:
    app.set(gpus=2, engine="megatron", zero=1)
    good_chart, good_est, good_verdict = bytes(app.chart.value), app.estimate, app.verdict
    app.controls["zero"].value = 3  # Megatron shards only the optimizer states (zero <= 1)
    assert "engine='megatron' shards optimizer states only" in app.message
    assert "engine=&#x27;megatron&#x27;" in app.message_html.value
    assert bytes(app.chart.value) == good_chart and app.estimate is good_est and app.last_verdict == good_verdict
    assert app.verdict == "" and "no verdict" in app.verdict_html.value  # never a stale "fits" above the error
    app.controls["zero"].value = 1  # valid again: the message goes, the chart follows
    assert app.message == "" and app.message_html.value == ""
    assert app.estimate.parallel.engine.value == "megatron" and app.estimate.parallel.zero == 1


def test_set_moves_several_controls_with_a_single_redraw(app: Explorer) -> None:
    app.set(micro_batch=4, seq_len=4096, precision="bf16-true", optimizer="sgd")
    assert app.redraws == 2
    t = app.estimate.training
    assert (t.micro_batch, t.seq_len, t.precision.value, t.optimizer.value) == (4, 4096, "bf16-true", "sgd")
    with pytest.raises(KeyError, match="unknown control 'batch'"):
        app.set(batch=2)


def test_the_size_slider_scales_a_llama_shape_from_100m_to_400b(app: Explorer) -> None:
    app.set(model=7e9)
    assert app.controls["source"].value == "size"
    n = app.estimate.n_params
    assert 6.5e9 < n < 7.5e9
    assert "parameters" in app._size_label.value and "layers" in app._size_label.value
    for target in (1e8, 4e11):
        app.controls["params"].value = target
        assert app.message == ""
        assert 0.9 * target < app.estimate.n_params < 1.1 * target


def test_the_size_source_offers_only_the_families_it_can_scale(app: Explorer) -> None:
    app.set(model=7e9)
    assert list(app.controls["size_family"].options) == ["llama", "mistral", "qwen2"]
    for family in app.controls["size_family"].options:
        app.controls["size_family"].value = family
        assert app.message == "" and app.estimate.model.family.value == family


def test_custom_dimensions_start_from_the_model_shown_and_are_validated(app: Explorer) -> None:
    shown = app.model_spec()
    app.controls["source"].value = "custom"
    assert app.controls["hidden"].value == shown.hidden and app.controls["n_layers"].value == shown.n_layers
    assert app.estimate.n_params == shown.n_params
    app.controls["n_layers"].value = 4
    assert app.estimate.model.n_layers == 4
    app.controls["hidden"].value = 1000  # 32 heads do not divide 1000
    assert "does not divide hidden=1000" in app.message


def test_a_config_json_upload_becomes_the_model_and_a_bad_file_says_why(app: Explorer) -> None:
    app.controls["source"].value = "upload"  # nothing uploaded yet: say so, keep the chart
    assert "upload a Hugging Face config.json" in app.message
    cfg = dict(get_preset("tinyllama-1.1b").config, _name_or_path="my-tinyllama")
    app.controls["upload"].value = _upload(json.dumps(cfg).encode())
    assert app.controls["source"].value == "upload"
    assert app.estimate.model.name == "my-tinyllama"
    assert app.estimate.n_params == tm.get_model("tinyllama-1.1b").n_params
    assert "my-tinyllama" in app._upload_label.value
    app.controls["upload"].value = _upload(b"{not json")
    assert "not valid JSON" in app._upload_label.value and "still using my-tinyllama" in app._upload_label.value
    assert app.message == "" and app.estimate.model.name == "my-tinyllama"  # the good upload is kept
    app.controls["upload"].value = _upload(json.dumps({"model_type": "t5"}).encode())
    assert "t5" in app._upload_label.value


def test_lora_rank_is_offered_only_for_lora_methods(app: Explorer) -> None:
    assert app.controls["lora_rank"].disabled
    app.controls["method"].value = "lora"
    assert not app.controls["lora_rank"].disabled
    app.controls["lora_rank"].value = 64
    assert app.estimate.training.lora_rank == 64 and app.estimate.n_trainable_params < app.estimate.n_params


def test_sliders_redraw_on_release_not_while_dragging(app: Explorer) -> None:
    for name, widget in app.controls.items():
        if isinstance(widget, (w.IntSlider, w.FloatLogSlider, w.SelectionSlider)):
            assert widget.continuous_update is False, name


def test_the_notebook_sees_a_short_stable_text_and_the_widget_view(app: Explorer) -> None:
    bundle = app._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    text = bundle["text/plain"]
    assert text.startswith("Explorer(llama-3.2-1b, micro_batch=2, seq_len=1024") and app.verdict in text
    assert "0x" not in text  # no object addresses: stable across runs


def test_explore_rejects_an_option_it_has_no_control_for() -> None:
    with pytest.raises(tm.SpecError, match="no control for 'dropout'"):
        tm.explore("gpt2", dropout=0.1)


# -- fuzz: every control through its extremes and through invalid combinations ---------------------------


def _values(widget: Any) -> list[Any]:
    """The extremes of a numeric control, every choice of a selection."""
    if isinstance(widget, w.FloatLogSlider):
        return [widget.base ** widget.min, widget.base ** widget.max]
    if isinstance(widget, (w.IntSlider, w.BoundedIntText)):
        return [widget.min, widget.max]
    if isinstance(widget, w.SelectionSlider):
        return [widget._options_values[0], widget._options_values[-1]]
    if isinstance(widget, (w.Dropdown, w.ToggleButtons)):
        return list(widget._options_values)
    if isinstance(widget, w.Checkbox):
        return [True, False]
    if isinstance(widget, w.FileUpload):
        cfg = json.dumps(get_preset("gpt2").config).encode()
        nan = b'{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"intermediate_size":128,' \
              b'"vocab_size":100,"num_hidden_layers":NaN}'
        return [_upload(cfg), _upload(b"[1, 2]"), _upload(b"\xff\xfe"), _upload(b'{"model_type": "llama"}'),
                _upload(nan), _upload(nan.replace(b"NaN", b"Infinity")), _upload(nan.replace(b"NaN", b"1e400")),
                _upload(b"[" * 100_000 + b"]" * 100_000), _upload(bytes(range(256))), _upload(cfg)]
    raise AssertionError(f"no fuzz values for {type(widget).__name__}")


INVALID_COMBINATIONS: list[dict[str, Any]] = [
    {"engine": "megatron", "zero": 3, "gpus": 8},  # Megatron shards optimizer states only (zero last: an engine
    # picked takes the nearest stage it has)
    {"engine": "fsdp", "zero": 1, "gpus": 8},  # FSDP has no ZeRO-1
    {"tp": 8, "gpus": 4},  # tp does not divide gpus
    {"pp": 32, "gpus": 1},  # pp does not divide gpus
    {"model": "gpt2", "seq_len": 131072},  # beyond gpt2's positions
    {"source": "custom", "hidden": 1000, "n_heads": 32},  # heads do not divide hidden
    {"source": "custom", "n_kv_heads": 3, "n_heads": 32, "hidden": 4096},  # kv heads do not divide heads
]


def _answers(app: Explorer) -> None:
    """The app answered the last change: a message, or numbers that match the controls."""
    assert not app.message.startswith("unexpected"), app.message
    assert bytes(app.chart.value).startswith(b"\x89PNG")
    if app.message:
        assert app.message in app.message_html.value.replace("&#x27;", "'") or app.message_html.value
        assert app.verdict == "" and "no verdict" in app.verdict_html.value  # the error replaces the verdict
    else:
        t = app.estimate.training
        assert (t.micro_batch, t.seq_len, t.precision.value) == (
            app.controls["micro_batch"].value, app.controls["seq_len"].value, app.controls["precision"].value)
        assert app.verdict and app.verdict in app.verdict_html.value.replace("&#x27;", "'")


@pytest.mark.slow
def test_every_control_through_its_extremes_and_invalid_combinations_keeps_answering() -> None:
    app = tm.explore("gpt2", gpu="H100", micro_batch=1, seq_len=512)
    base = dict(model="llama-3.2-1b", micro_batch=1, seq_len=1024, gpus=1, zero=0, tp=1, pp=1, ep=1, engine="deepspeed",
                method="full", precision="bf16-mixed", fp8="none", fp8_all_gather=False, attention="sdpa")
    for name, widget in app.controls.items():
        values = _values(widget)
        if name == "preset":  # one preset per family: every preset is estimated in tests/test_presets.py
            values = list({label.split(" · ")[0]: value for label, value in reversed(widget.options)}.values())
        for value in values:
            if name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab", "family"):
                app.controls["source"].value = "custom" if name != "family" else app.controls["source"].value
            widget.value = value
            _answers(app)
        app.set(**base)
        _answers(app)
        assert app.message == "", (name, app.message)
    for combo in INVALID_COMBINATIONS:
        app.set(**base)
        good = bytes(app.chart.value)
        app.set(**combo)
        assert app.message, combo
        assert bytes(app.chart.value) == good, combo
        _answers(app)
    app.set(**base)
    assert app.message == "" and app.estimate.model.name == "llama-3.2-1b"


def test_checkpointing_buttons_offer_every_policy_by_value_with_what_it_keeps(app: Explorer) -> None:
    from trainmem_nb.spec.choices import CHECKPOINTING_HELP, Checkpointing

    control = app.controls["checkpointing"]
    assert [v for _label, v in control.options] == [c.value for c in Checkpointing]
    assert list(control.tooltips) == [CHECKPOINTING_HELP[c] for c in Checkpointing]
    control.value = "selective-op"
    assert app.message == "" and app.estimate.training.checkpointing is Checkpointing.SELECTIVE_OP


def test_the_expert_parallel_control_splits_an_moe_models_experts_and_refuses_a_dense_model() -> None:
    app = tm.explore("qwen3-30b-a3b", gpu="H100", micro_batch=1, seq_len=2048, gpus=16, engine="fsdp", zero=3)
    alone = app.estimate.peak_allocated_bytes
    app.controls["ep"].value = 8
    assert app.message == "" and app.estimate.parallel.ep == 8
    assert app.estimate.peak_allocated_bytes != alone
    app.controls["preset"].value = "llama-3-8b"
    assert "needs a mixture-of-experts model" in app.message and app.verdict == ""
