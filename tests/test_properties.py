"""Invariants over random valid configurations: no errors, no negative or NaN bytes, memory monotone in
batch and sequence length, checkpointing never raises the activations kept for backward; over random
parallel layouts, one accounting (every rank's timeline peaks at its peak, no negative category, saved
activations within the peak) and headline figures monotone in batch and sequence.

Selective checkpointing is left out of the last invariant on purpose: its policy caches every matmul
output, including a frozen base layer's that plain autograd never keeps (LoRA), so it can keep more
than no checkpointing on small models; the estimator reproduces this measured behaviour.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import trainmem_nb as tm
from trainmem_nb import estimate
from trainmem_nb.engine.program import activations_at_forward_end, timeline
from trainmem_nb.errors import SpecError
from trainmem_nb.model.families import DESCRIPTIONS
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec

FAMILIES = sorted(f.value for f in DESCRIPTIONS)
GQA = {"llama", "mistral", "qwen2", "gemma", "phi3", "mixtral"}


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    family = draw(st.sampled_from(FAMILIES))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    n_kv = draw(st.sampled_from([1, 2, 4]))
    n_heads = n_kv * draw(st.sampled_from([1, 2, 4])) if family in GQA else draw(st.sampled_from([2, 4, 8]))
    kw = dict(family=family, n_layers=draw(st.integers(1, 6)), hidden=n_heads * head_dim, n_heads=n_heads,
              ffn=draw(st.sampled_from([64, 128, 384])), vocab=draw(st.integers(8, 5000)),
              tie_embeddings=draw(st.booleans()), max_positions=4096)
    if family in GQA:
        kw["n_kv_heads"] = n_kv if n_heads % n_kv == 0 else n_heads
    if family == "mixtral":
        kw.update(n_experts=draw(st.integers(2, 4)), experts_top_k=1)
    if family == "gpt_oss":
        kw.update(n_experts=draw(st.integers(2, 4)), experts_top_k=1, n_kv_heads=n_heads, sliding_window=8,
                  layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(kw["n_layers"])))
    if family == "deepseek_v3":
        rope = draw(st.sampled_from([8, 16]))
        kw.update(head_dim=rope, qk_rope_head_dim=rope, qk_nope_head_dim=draw(st.sampled_from([8, 16])),
                  v_head_dim=draw(st.sampled_from([8, 24])), kv_lora_rank=16, q_lora_rank=draw(st.sampled_from([0, 32])),
                  n_experts=4, experts_top_k=1, n_expert_groups=2, topk_groups=1, expert_ffn=32,
                  n_shared_experts=draw(st.integers(0, 1)), dense_layers=(0,) if kw["n_layers"] > 1 else ())
    return ModelSpec.model_validate(kw)


def _runnable(m: ModelSpec, opts: dict) -> dict:
    """`opts` as the family runs them: gpt_oss attends only eagerly in transformers 5.24, and its in-place
    expert biases rule out the selective checkpointing policy (both refused with a SpecError)."""
    if m.family.value != "gpt_oss":
        return opts
    return {**opts, "attention": "eager",
            "checkpointing": "selective-op" if opts.get("checkpointing") == "selective" else opts.get("checkpointing", "none")}


trainings = st.fixed_dictionaries({
    "precision": st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"]),
    "optimizer": st.sampled_from(["adamw", "adam", "sgd", "sgd-momentum", "adafactor", "lion", "none"]),
    "checkpointing": st.sampled_from(["none", "selective", "selective-op", "full"]),
    "attention": st.sampled_from(["sdpa", "eager"]),
    "dropout": st.sampled_from([0.0, 0.1]),
    "device": st.sampled_from(["cuda", "cpu"]),
    "method": st.sampled_from(["full", "lora", "qlora"]),
    "grad_accum": st.sampled_from([1, 4]),
})

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_numbers(d: dict) -> None:
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "saved_activations_bytes"):
        assert isinstance(d[key], int) and d[key] >= 0, key
    for key, value in {**d["breakdown_bytes"], **d["detail_bytes"]}.items():
        assert isinstance(value, int) and value >= 0 and not math.isnan(value), key
    assert sum(d["breakdown_bytes"].values()) == d["peak_allocated_bytes"]


@SETTINGS
@given(models(), trainings, st.integers(1, 4), st.integers(1, 300))
def test_any_valid_configuration_gives_sane_numbers(m: ModelSpec, opts: dict, b: int, s: int) -> None:
    opts = _runnable(m, opts)
    _valid_numbers(estimate(m, micro_batch=b, seq_len=s, **opts).to_dict())


@SETTINGS
@given(models(), trainings, st.integers(1, 3), st.integers(1, 200), st.integers(1, 3), st.integers(1, 200))
def test_memory_is_monotone_in_batch_and_sequence(m: ModelSpec, opts: dict, b: int, s: int, db: int, ds: int) -> None:
    opts = _runnable(m, opts)
    base = estimate(m, micro_batch=b, seq_len=s, **opts)
    more_batch = estimate(m, micro_batch=b + db, seq_len=s, **opts)
    more_seq = estimate(m, micro_batch=b, seq_len=s + ds, **opts)
    assert more_batch.peak_allocated_bytes >= base.peak_allocated_bytes
    assert more_seq.peak_allocated_bytes >= base.peak_allocated_bytes
    assert more_batch.saved_activations_bytes >= base.saved_activations_bytes


@SETTINGS
@given(models(), trainings, st.integers(1, 4), st.integers(16, 300))
def test_full_checkpointing_never_raises_saved_activations(m: ModelSpec, opts: dict, b: int, s: int) -> None:
    opts = _runnable(m, opts)
    none = estimate(m, micro_batch=b, seq_len=s, **{**opts, "checkpointing": "none"}).saved_activations_bytes
    full = estimate(m, micro_batch=b, seq_len=s, **{**opts, "checkpointing": "full"}).saved_activations_bytes
    assert full <= none


@SETTINGS
@given(models(), trainings, st.integers(1, 4), st.integers(16, 300))
def test_checkpointing_policies_keep_nested_sets_full_then_op_then_selective(m: ModelSpec, opts: dict, b: int,
                                                                           s: int) -> None:
    """Each policy keeps a subset of the next one's tensors: full keeps each layer's input; selective-op
    also every other mm and the attention outputs; selective every matmul and attention output."""
    opts = _runnable(m, opts)
    assume(m.family.value != "gpt_oss")  # selective checkpointing is refused for it
    kept = {ck: estimate(m, micro_batch=b, seq_len=s, **{**opts, "checkpointing": ck}).saved_activations_bytes
            for ck in ("full", "selective-op", "selective")}
    assert kept["full"] <= kept["selective-op"] <= kept["selective"]


@st.composite
def layouts(draw: st.DrawFn, m: ModelSpec) -> dict:
    """A parallel layout for `m` with every kind of parallelism: tensor (and sequence) parallel over
    degrees that divide the heads, pipeline stages (1F1B, GPipe, interleaved), context parallel, expert
    parallel on mixture-of-experts models, data parallel, each engine with its ZeRO stages and offload.
    Mostly valid; what the layout checks refuse must be refused with a SpecError, never another error."""
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if m.n_heads % d == 0 and m.n_kv_heads % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2, 3) if d <= m.n_layers]))
    cp, dp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    engine = draw(st.sampled_from(["ddp", "fsdp", "deepspeed", "megatron"]))
    zero = draw(st.sampled_from({"ddp": [0, 1], "fsdp": [0, 2, 3], "deepspeed": [0, 1, 2, 3], "megatron": [0, 1]}[engine]))
    offload = "none"
    if engine == "deepspeed" and zero:
        offload = draw(st.sampled_from(["none", "optimizer", *(["optimizer+params"] if zero == 3 else [])]))
    elif engine == "fsdp" and zero == 3:
        offload = draw(st.sampled_from(["none", "optimizer+params"]))
    layout = dict(gpus=tp * pp * cp * dp, tp=tp, pp=pp, cp=cp, engine=engine, zero=zero, offload=offload,
                  sp=tp > 1 and draw(st.booleans()))
    if engine == "megatron":
        layout["grad_accum_fusion"] = draw(st.booleans())
        if not m.is_moe and draw(st.booleans()):  # Transformer Engine's fp8 (`_fp8_training` makes it runnable)
            layout["fp8"] = draw(st.sampled_from(["delayed", "tensorwise"]))
    if pp > 1:
        schedule = draw(st.sampled_from(["1f1b", "gpipe", "interleaved"]))
        if schedule == "interleaved" and m.n_layers % (2 * pp) == 0:
            layout.update(pp_schedule=schedule, virtual_stages=2)
        elif schedule == "gpipe":
            layout.update(pp_schedule=schedule)
    if m.is_moe:
        layout["ep"] = draw(st.sampled_from([e for e in (1, 2) if m.n_experts % e == 0 and dp % e == 0]))
    return layout


parallel_trainings = st.fixed_dictionaries({
    "precision": st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"]),
    "optimizer": st.sampled_from(["adamw", "sgd", "adafactor", "paged-adamw", "none"]),
    "checkpointing": st.sampled_from(["none", "selective", "full"]),
    "dropout": st.sampled_from([0.0, 0.1]),
    "device": st.sampled_from(["cuda", "cpu"]),
    "method": st.sampled_from(["full", "full", "lora"]),
    "grad_accum": st.sampled_from([1, 2, 3, 4]),
})

#: Parallel estimates compile one program per pipeline stage; 300 examples of each test take ~10 s on 2 cores.
PARALLEL_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fp8_training(opts: dict, layout: dict) -> dict:
    """`opts` where `layout` trains in fp8: a full fine-tune of a 16-bit model, checkpointing none or full, on the
    CPU device (CUDA's fp8 matmuls need a multiple of 16 tokens, which the shapes drawn here seldom are)."""
    if "fp8" not in layout:
        return opts
    ck = opts["checkpointing"] if opts["checkpointing"] in ("none", "full") else "none"
    return {**opts, "precision": "bf16-mixed", "method": "full", "checkpointing": ck, "device": "cpu"}


def _or_refused(m: ModelSpec, opts: dict) -> tm.MemoryEstimate | None:
    """The estimate, or None when the layout checks refuse the combination (with a SpecError: any
    other exception fails the test)."""
    try:
        e = estimate(m, **opts)
    except SpecError as exc:
        event(f"refused: {str(exc)[:40]}")
        return None
    event("estimated" + (" with fp8" if opts.get("fp8") else ""))
    return e


def _program_is_consistent(prog: Any, shape: tuple[int, int], peak: int) -> None:
    """One accounting: the timeline of a rank's program peaks at the rank's reported peak, no category
    is ever negative, and what it keeps for backward at the end of the forward pass is within the peak."""
    points = timeline(prog, *shape, max_points=10**7)
    assert max(p.total_bytes for p in points) == peak
    assert min(min(p.by_category) for p in points) >= 0, min(points, key=lambda p: min(p.by_category))
    assert all(p.total_bytes == sum(p.by_category) for p in points)
    assert activations_at_forward_end(prog, *shape) <= peak


@PARALLEL_SETTINGS
@given(st.data(), models(), parallel_trainings, st.integers(1, 3), st.integers(1, 48))
def test_every_parallel_layout_gives_self_consistent_per_rank_numbers(data: st.DataObject, m: ModelSpec, opts: dict,
                                                                     b: int, k: int) -> None:
    """Over random TP/SP/PP/CP/EP layouts, engines, ZeRO stages and offload: valid input gives sane
    integer bytes whose breakdown sums to the peak; every rank's timeline peaks at its reported peak
    and never shows a negative category; the saved activations stay within the peak; reserved covers
    allocated and the device total covers reserved; each headline figure is the worst rank's; and the
    JSON contract is deterministic."""
    layout = data.draw(layouts(m))
    opts = _fp8_training(_runnable(m, opts), layout)
    s = 2 * layout["cp"] * k  # context parallelism needs 2 * cp equal chunks of each sequence
    if layout["cp"] > 1 and data.draw(st.booleans()):  # one that does not divide is refused, clearly
        with pytest.raises(SpecError, match=r"cp=\d+ needs seq_len divisible by 2\*cp"):
            estimate(m, micro_batch=b, seq_len=s + 1, **opts, **layout)
    e = _or_refused(m, dict(micro_batch=b, seq_len=s, **opts, **layout))
    if e is None:
        return
    d = e.to_dict()
    _valid_numbers(d)
    assert json.dumps(d, sort_keys=True) == json.dumps(estimate(m, micro_batch=b, seq_len=s, **opts, **layout).to_dict(),
                                                       sort_keys=True)
    assert len(e.per_rank) == layout["pp"] == len(e.rank_programs)
    assert e.peak_allocated_bytes == max(r.peak_allocated_bytes for r in e.per_rank)
    assert e.peak_reserved_bytes == max(r.peak_reserved_bytes for r in e.per_rank)
    assert e.device_total_bytes == max(r.device_total_bytes for r in e.per_rank)
    assert e.rank_shape == (b, s // layout["cp"])
    assert e.saved_activations_bytes <= e.peak_allocated_bytes
    for r, prog in zip(e.per_rank, e.rank_programs, strict=True):
        assert r.peak_allocated_bytes == sum(r.detail_bytes.values()) > 0
        assert r.peak_allocated_bytes <= r.peak_reserved_bytes <= r.device_total_bytes
        assert r.host_bytes >= 0
        _program_is_consistent(prog, e.rank_shape, r.peak_allocated_bytes)


@PARALLEL_SETTINGS
@given(st.data(), models(), parallel_trainings, st.integers(1, 3), st.integers(1, 32), st.integers(1, 2),
       st.integers(1, 32))
def test_every_parallel_layouts_allocated_peak_is_monotone_in_batch_and_sequence(data: st.DataObject, m: ModelSpec,
                                                                           opts: dict, b: int, k: int, db: int,
                                                                           dk: int) -> None:
    """A larger micro-batch or a longer sequence never lowers the allocated peak or the saved activations
    of a parallel layout. Reserved bytes need not follow (the caching allocator's replay: a larger batch can
    fragment less), but never fall below the smaller step's allocated peak."""
    layout = data.draw(layouts(m))
    opts = _fp8_training(_runnable(m, opts), layout)
    chunk = 2 * layout["cp"]
    base = _or_refused(m, dict(micro_batch=b, seq_len=chunk * k, **opts, **layout))
    if base is None:
        return
    more_batch = estimate(m, micro_batch=b + db, seq_len=chunk * k, **opts, **layout)
    more_seq = estimate(m, micro_batch=b, seq_len=chunk * (k + dk), **opts, **layout)
    for field in ("peak_allocated_bytes", "saved_activations_bytes"):
        assert getattr(more_batch, field) >= getattr(base, field), field
        assert getattr(more_seq, field) >= getattr(base, field), field
    for bigger in (more_batch, more_seq):
        assert bigger.peak_reserved_bytes >= base.peak_allocated_bytes
        assert bigger.device_total_bytes >= bigger.peak_reserved_bytes


def test_training_spec_round_trips_through_json() -> None:
    t = TrainingSpec(micro_batch=3, precision="bf16-true", optimizer="lion", checkpointing="selective")
    assert TrainingSpec.model_validate_json(t.model_dump_json()) == t
