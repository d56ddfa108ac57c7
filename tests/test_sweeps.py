"""Sweeps: one tidy row per combination, numbers identical to `estimate()` for each row."""

from __future__ import annotations

import pytest

pd = pytest.importorskip("pandas")

import trainmem_nb as tm  # noqa: E402
from trainmem_nb import SpecError  # noqa: E402
from trainmem_nb.engine.breakdown import TOP_KEYS  # noqa: E402
from trainmem_nb.model.presets import resolve_model  # noqa: E402
from trainmem_nb.model.spec import ModelSpec  # noqa: E402


@pytest.mark.parametrize("opts", [
    dict(precision="bf16-mixed", checkpointing="none", attention="sdpa", device="cuda"),
    dict(precision="fp32", checkpointing="full", attention="eager", dropout=0.1, device="cpu"),
    dict(precision="bf16-true", checkpointing="selective", method="lora", optimizer="sgd", device="cuda"),
    # paged optimizer states live in unified memory: outside the allocated peak, inside the device total
    dict(precision="bf16-mixed", checkpointing="full", optimizer="paged-adamw", device="cuda"),
])
def test_every_row_equals_the_single_estimate(opts: dict) -> None:
    df = tm.sweep("tinyllama-1.1b", micro_batch=[1, 2, 5], seq_len=[1, 33, 512], **opts)
    assert len(df) == 9
    for row in df.itertuples(index=False):
        e = tm.estimate("tinyllama-1.1b", micro_batch=row.micro_batch, seq_len=row.seq_len, **opts)
        assert row.peak_allocated_bytes == e.peak_allocated_bytes
        assert row.peak_reserved_bytes == e.peak_reserved_bytes
        assert row.device_total_bytes == e.device_total_bytes
        assert row.peak_phase == e.peak_phase
        assert row.saved_activations_bytes == e.saved_activations_bytes
        for key in TOP_KEYS:
            assert getattr(row, f"{key}_bytes") == e.breakdown_bytes[key]


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("model", ["llama-2-7b", "gpt2", "mistral-7b"])
def test_qloras_fractional_weight_sizes_round_in_a_sweep_as_in_the_estimate(model: str, double_quant: bool) -> None:
    """An NF4 weight's size is numel x a fractional byte count, a hair above its integer value: a sweep
    rounded it up to the next 512-B block where `estimate` rounds to the nearest byte first (49,152 B apart
    on llama-2-7b)."""
    o = dict(method="qlora", lora_rank=4, qlora_double_quant=double_quant, device="cpu")
    df = tm.sweep(model, micro_batch=[1, 2], seq_len=[100], **o)
    for row in df.itertuples(index=False):
        e = tm.estimate(model, micro_batch=row.micro_batch, seq_len=row.seq_len, **o)
        assert (row.peak_allocated_bytes, row.weights_bytes) == (e.peak_allocated_bytes, e.breakdown_bytes["weights"])


def test_rows_across_a_sliding_window_and_grad_accum_equal_the_single_estimate() -> None:
    """The sweep computes one program key per option set and batch-shape class (b == 1, s >= window):
    every row still equals its own `estimate` with seq_len below, at and above the window, b = 1 and
    b > 1, and one to three micro-batches."""
    m = ModelSpec.model_validate({**resolve_model("mistral-7b").model_dump(), "sliding_window": 256})
    opts = dict(precision="bf16-mixed", device="cuda")
    df = tm.sweep(m, micro_batch=[1, 3], seq_len=[128, 256, 512], grad_accum=[1, 2, 3], **opts)
    assert len(df) == 18
    for row in df.itertuples(index=False):
        e = tm.estimate(m, micro_batch=row.micro_batch, seq_len=row.seq_len, grad_accum=row.grad_accum, **opts)
        where = (row.micro_batch, row.seq_len, row.grad_accum)
        assert row.peak_allocated_bytes == e.peak_allocated_bytes, where
        assert row.peak_reserved_bytes == e.peak_reserved_bytes, where
        assert row.device_total_bytes == e.device_total_bytes, where
        assert row.peak_phase == e.peak_phase, where
        assert row.saved_activations_bytes == e.saved_activations_bytes, where
        for key in TOP_KEYS:
            assert getattr(row, f"{key}_bytes") == e.breakdown_bytes[key], (where, key)


def test_columns_are_the_options_then_the_figures_and_lists_of_models_sweep() -> None:
    df = tm.sweep(["gpt2", "tinyllama-1.1b"], micro_batch=[1, 2], seq_len=256, precision=["fp32", "bf16-mixed"])
    assert list(df.columns[:5]) == ["model", "micro_batch", "seq_len", "precision", "peak_allocated_bytes"]
    assert len(df) == 8 and set(df["model"]) == {"gpt2", "tinyllama-1.1b"}
    assert df.attrs["swept"] == ["model", "micro_batch", "precision"]


def test_a_bad_swept_value_is_reported_before_any_work() -> None:
    with pytest.raises(SpecError, match=r"micro_batch=0"):
        tm.sweep("gpt2", micro_batch=[1, 0], seq_len=128)
    with pytest.raises(SpecError, match="empty list"):
        tm.sweep("gpt2", micro_batch=[], seq_len=128)


def test_a_sweeps_shapes_replayed_side_by_side_give_each_ones_own_bytes() -> None:
    """`replay_steps` runs the C replay on several threads (it releases the GIL): each shape's result equals
    replaying it alone, duplicates included, whatever order the threads finish in."""
    from trainmem_nb.spec.training import TrainingSpec
    from trainmem_nb.step.compile import compile_step, program_key
    from trainmem_nb.step.reserved import _REPLAYS, replay_step, replay_steps

    m = resolve_model("tinyllama-1.1b")
    t = TrainingSpec(micro_batch=2, seq_len=100, precision="bf16-mixed")
    unrolled = compile_step(m, program_key(t, m), unrolled=True)
    shapes = [(b, s, "") for b in (2, 3) for s in (64, 100, 257)] + [(2, 100, "expandable_segments:True"), (2, 64, "")]
    _REPLAYS.clear()
    together = replay_steps(unrolled, shapes)
    _REPLAYS.clear()
    assert together == [replay_step(unrolled, b, s, conf) for b, s, conf in shapes]


def test_a_parallel_option_is_refused_by_name_not_called_a_training_option() -> None:
    with pytest.raises(tm.SpecError, match=r"'gpus' is a parallel layout option: loop over tm\.estimate"):
        tm.sweep("gpt2", seq_len=[512], gpus=[1, 2, 3], zero=[0, 3])
