"""Layer patterns: a model's layers as a prefix, a repeating period and a suffix, and a step that
simulates one period in the middle yet gives the bytes of every layer run one by one."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainmem_nb as tm
from trainmem_nb.engine.program import evaluate
from trainmem_nb.errors import SpecError
from trainmem_nb.model.layers import LayerKind, compress
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step, program_key
from trainmem_nb.step.layers import layer_plan

S, F = LayerKind("sliding"), LayerKind("full")
DENSE, MOE = LayerKind(), LayerKind(moe=True)


def test_a_uniform_stack_simulates_its_first_a_middle_and_its_last_layer() -> None:
    p = compress((F,) * 32)
    assert (p.prefix, p.period, p.repeats, p.suffix, p.simulated) == ((), (F,), 32, (), 3)


def test_gemma3s_five_sliding_then_one_global_repeats_as_one_period_with_its_remainder_as_suffix() -> None:
    kinds = ((S,) * 5 + (F,)) * 10 + (S, S)
    p = compress(kinds)
    assert (len(p.prefix), p.period, p.repeats, p.suffix) == (0, (S,) * 5 + (F,), 10, (S, S))
    assert p.n_layers == len(kinds) == 62


def test_dense_layers_before_the_moe_ones_are_a_prefix() -> None:
    p = compress((DENSE,) * 3 + (MOE,) * 58)  # DeepSeek-V3: first_k_dense_replace = 3
    assert (p.prefix, p.period, p.repeats, p.simulated) == ((DENSE,) * 3, (MOE,), 58, 6)


def test_short_or_irregular_stacks_are_simulated_layer_by_layer() -> None:
    assert compress((F, S)).prefix == (F, S)
    irregular = (F, S, S, F, S, F, F, S)
    assert compress(irregular).prefix == irregular and compress(irregular).simulated == 8


def _mistral(n_layers: int, **kw: object) -> ModelSpec:
    return ModelSpec.model_validate(dict(family="mistral", name="pattern", n_layers=n_layers, hidden=64, n_heads=4,
                                         n_kv_heads=2, ffn=128, vocab=256, sliding_window=16, **kw))


def test_layer_types_must_give_one_kind_per_layer_and_sliding_needs_a_window() -> None:
    with pytest.raises(SpecError, match="layer_types has 2 entries for n_layers=3"):
        _mistral(3, layer_types=("full_attention", "sliding_attention"))
    with pytest.raises(SpecError, match="sliding_window is 0"):
        ModelSpec(family="mistral", n_layers=1, hidden=64, n_heads=4, ffn=128, vocab=256,
                  layer_types=("sliding_attention",))
    with pytest.raises(SpecError, match=r"dense_layers has layer 5, outside 0\.\.3"):
        ModelSpec(family="mixtral", n_layers=4, hidden=64, n_heads=4, ffn=128, vocab=256, n_experts=4,
                  dense_layers=(5,))


def test_a_pipeline_stage_holds_its_slice_of_the_real_layer_list() -> None:
    m = _mistral(6, layer_types=("sliding_attention",) * 5 + ("full_attention",))
    stage = m.layer_slice(3, 6)
    assert stage.n_layers == 3 and [k.attention for k in stage.layer_kinds] == ["sliding", "sliding", "full"]
    moe = ModelSpec(family="mixtral", n_layers=6, hidden=64, n_heads=4, ffn=128, vocab=256, n_experts=4,
                    dense_layers=(0, 1, 2))
    assert [k.moe for k in moe.layer_slice(2, 4).layer_kinds] == [False, True]


def test_parameters_of_dense_and_moe_layers_are_counted_per_kind() -> None:
    mixed = ModelSpec(family="mixtral", n_layers=6, hidden=64, n_heads=4, ffn=128, vocab=256, n_experts=4,
                      expert_ffn=32, dense_layers=(0, 1))
    from trainmem_nb.model.params import param_inventory

    inv = {p.name: p for p in param_inventory(mixed)}
    assert inv["layers.mlp.experts.gate_up_proj"].count == 4 and inv["layers.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert inv["layers.mlp.gate_proj.weight"].count == 2 and inv["layers.mlp.gate_proj.weight"].kind == "dense"
    assert inv["layers.self_attn.q_proj.weight"].count == 6 and inv["layers.self_attn.q_proj.weight"].kind == ""
    dense_mlp = 3 * 64 * 128
    experts = 4 * 64 + 4 * (2 * 32 * 64) + 4 * (64 * 32)
    uniform = ModelSpec(family="mixtral", n_layers=6, hidden=64, n_heads=4, ffn=128, vocab=256, n_experts=4,
                        expert_ffn=32)
    assert mixed.n_params - uniform.n_params == 2 * (dense_mlp - experts)


def test_the_plan_labels_the_repeated_period_with_the_layers_it_stands_for() -> None:
    plan = layer_plan(_mistral(14, layer_types=(("sliding_attention",) * 2 + ("full_attention",)) * 4
                               + ("sliding_attention",) * 2))
    assert len(plan.kinds) == 11 and plan.block == (3, 6) and plan.reps == 2
    assert plan.labels[3] == "layers 3-8 (2 x sliding / sliding / full)"


_KINDS = st.sampled_from(["sliding_attention", "full_attention"])


@st.composite
def _patterned(draw: st.DrawFn) -> tuple[ModelSpec, TrainingSpec]:
    period = draw(st.lists(_KINDS, min_size=1, max_size=3))
    reps = draw(st.integers(3, 5))
    prefix = draw(st.lists(_KINDS, max_size=2))
    suffix = draw(st.lists(_KINDS, max_size=2))
    types = tuple(prefix + period * reps + suffix)
    moe = draw(st.booleans())
    m = ModelSpec.model_validate(dict(
        family="mixtral" if moe else "mistral", name="pattern", n_layers=len(types), hidden=32, n_heads=4,
        n_kv_heads=2, ffn=64, vocab=128, sliding_window=8, layer_types=types, **(
            {"n_experts": 4, "experts_top_k": 2, "dense_layers": tuple(range(len(prefix)))} if moe else {})))
    t = TrainingSpec.model_validate(dict(
        micro_batch=draw(st.integers(1, 3)), seq_len=draw(st.sampled_from([4, 12, 24])),
        precision=draw(st.sampled_from(["fp32", "bf16-mixed"])), attention=draw(st.sampled_from(["sdpa", "eager"])),
        checkpointing=draw(st.sampled_from(["none", "full", "selective"])), device="cpu"))
    return m, t


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_patterned())
def test_repeating_one_period_gives_the_bytes_of_running_every_layer(case: tuple[ModelSpec, TrainingSpec]) -> None:
    m, t = case
    key = program_key(t, m)
    folded = evaluate(compile_step(m, key), t.micro_batch, t.seq_len)
    unrolled = evaluate(compile_step(m, key, unrolled=True), t.micro_batch, t.seq_len)
    assert (folded.peak, folded.peak_phase, folded.detail) == (unrolled.peak, unrolled.peak_phase, unrolled.detail)


def test_a_patterned_model_estimates_with_masks_per_attention_kind() -> None:
    m = _mistral(8, layer_types=("sliding_attention", "full_attention") * 4)
    est = tm.estimate(m, micro_batch=2, seq_len=32, attention="eager", device="cpu", precision="fp32")
    assert est.peak_allocated_bytes > 0
    assert sum(est.breakdown_bytes.values()) == est.peak_allocated_bytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), b=st.integers(1, 9), s=st.sampled_from([17, 512, 1023, 4096]))
def test_a_segment_split_into_blocks_anywhere_evaluates_to_the_same_bytes_as_in_one_piece(seed: int, b: int,
                                                                                          s: int) -> None:
    """`evaluate` composes a segment from its blocks (`Segment.cuts`, a period's layers, each distinct one
    computed once): any cuts, none or one per event, give the peak, its event, phase and breakdown of the
    whole segment."""
    import dataclasses
    import random

    from trainmem_nb.engine.program import _segment
    from trainmem_nb.model.presets import get_model

    rng = random.Random(seed)
    m = get_model(rng.choice(["gemma-3-1b", "smollm3-3b", "gpt2", "llama-3.2-1b"]))
    t = TrainingSpec(micro_batch=2, seq_len=s, precision=rng.choice(["fp32", "bf16-mixed"]),
                     checkpointing=rng.choice(["none", "full"]))
    prog = compile_step(m, program_key(t, m))

    def recut(seg, how: str):  # type: ignore[no-untyped-def]
        n = len(seg.events)
        cuts = {"none": (), "every": tuple(range(1, n)), "random": tuple(rng.sample(range(n + 1), min(n, 5)))}[how]
        return _segment(seg.phase, seg.label, seg.repeat, seg.events, seg.tokens, cuts)

    whole = evaluate(dataclasses.replace(prog, segments=tuple(recut(g, "none") for g in prog.segments)), b, s)
    for how in ("every", "random"):
        split = dataclasses.replace(prog, segments=tuple(recut(g, how) for g in prog.segments))
        assert evaluate(split, b, s) == whole
    assert evaluate(prog, b, s) == whole
