"""Invariants over random valid configurations: no errors, no negative or NaN bytes, memory monotone in
batch and sequence length, checkpointing never raises the activations kept for backward.

Selective checkpointing is left out of the last invariant on purpose: its policy caches every matmul
output, including a frozen base layer's that plain autograd never keeps (LoRA), so it can keep more
than no checkpointing on small models; the estimator reproduces this measured behaviour.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmem_nb import estimate
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.recipes.registry import RECIPES
from trainmem_nb.spec.training import TrainingSpec

FAMILIES = sorted(f.value for f in RECIPES)
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
    return ModelSpec.model_validate(kw)


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
    _valid_numbers(estimate(m, micro_batch=b, seq_len=s, **opts).to_dict())


@SETTINGS
@given(models(), trainings, st.integers(1, 3), st.integers(1, 200), st.integers(1, 3), st.integers(1, 200))
def test_memory_is_monotone_in_batch_and_sequence(m: ModelSpec, opts: dict, b: int, s: int, db: int, ds: int) -> None:
    base = estimate(m, micro_batch=b, seq_len=s, **opts)
    more_batch = estimate(m, micro_batch=b + db, seq_len=s, **opts)
    more_seq = estimate(m, micro_batch=b, seq_len=s + ds, **opts)
    assert more_batch.peak_allocated_bytes >= base.peak_allocated_bytes
    assert more_seq.peak_allocated_bytes >= base.peak_allocated_bytes
    assert more_batch.saved_activations_bytes >= base.saved_activations_bytes


@SETTINGS
@given(models(), trainings, st.integers(1, 4), st.integers(16, 300))
def test_full_checkpointing_never_raises_saved_activations(m: ModelSpec, opts: dict, b: int, s: int) -> None:
    none = estimate(m, micro_batch=b, seq_len=s, **{**opts, "checkpointing": "none"}).saved_activations_bytes
    full = estimate(m, micro_batch=b, seq_len=s, **{**opts, "checkpointing": "full"}).saved_activations_bytes
    assert full <= none


@SETTINGS
@given(models(), trainings, st.integers(1, 4), st.integers(16, 300))
def test_checkpointing_policies_keep_nested_sets_full_then_op_then_selective(m: ModelSpec, opts: dict, b: int,
                                                                           s: int) -> None:
    """Each policy keeps a subset of the next one's tensors: full keeps each layer's input; selective-op
    also every other mm and the attention outputs; selective every matmul and attention output."""
    kept = {ck: estimate(m, micro_batch=b, seq_len=s, **{**opts, "checkpointing": ck}).saved_activations_bytes
            for ck in ("full", "selective-op", "selective")}
    assert kept["full"] <= kept["selective-op"] <= kept["selective"]


@st.composite
def layouts(draw: st.DrawFn, m: ModelSpec) -> dict:
    """A valid parallel layout for `m`: tp divides the heads, pp at most the layers."""
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if m.n_heads % d == 0 and m.n_kv_heads % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2, 3) if d <= m.n_layers]))
    cp, dp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    engine = draw(st.sampled_from(["ddp", "fsdp", "deepspeed", "megatron"]))
    zero = draw(st.sampled_from({"ddp": [0, 1], "fsdp": [0, 2, 3], "deepspeed": [0, 1, 2, 3], "megatron": [0, 1]}[engine]))
    offload = draw(st.sampled_from(["none", "optimizer"])) if engine == "deepspeed" and zero else "none"
    return dict(gpus=tp * pp * cp * dp, tp=tp, pp=pp, cp=cp, engine=engine, zero=zero, offload=offload,
                sp=tp > 1 and draw(st.booleans()))


@SETTINGS
@given(st.data(), models(), trainings, st.integers(1, 3), st.integers(8, 200))
def test_every_parallel_layout_gives_sane_per_rank_numbers_and_the_worst_rank_leads(
        data: st.DataObject, m: ModelSpec, opts: dict, b: int, s: int) -> None:
    layout = data.draw(layouts(m))
    s -= s % (2 * layout["cp"])  # context parallelism cuts each sequence into 2 * cp equal chunks
    e = estimate(m, micro_batch=b, seq_len=s, **{**opts, "method": "full"}, **layout)
    d = e.to_dict()
    _valid_numbers(d)
    assert len(e.per_rank) == layout["pp"]
    assert e.device_total_bytes == max(r.device_total_bytes for r in e.per_rank)
    for r in e.per_rank:
        assert r.peak_allocated_bytes == sum(r.detail_bytes.values()) > 0
        assert r.host_bytes >= 0


def test_training_spec_round_trips_through_json() -> None:
    t = TrainingSpec(micro_batch=3, precision="bf16-true", optimizer="lion", checkpointing="selective")
    assert TrainingSpec.model_validate_json(t.model_dump_json()) == t
