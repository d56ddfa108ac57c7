"""The planner's assumptions and arguments are checked in one place: a bad value is refused with its
name, the value and what is valid, never turned into a negative, NaN or infinite figure or ignored;
an impossible layout says why; and ``gpus`` means the GPU count in `plan` as in `estimate`."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trainmem_nb as tm
from trainmem_nb.errors import SpecError
from trainmem_nb.planning.search import MAX_PIPELINE_BUBBLE, pipeline_grad_accum, plan
from trainmem_nb.spec.parallel import ParallelSpec

BASE = dict(gpu=["H100"], seq_len=512, tokens=1e9)
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(("field", "value"), [
    ("spot_interruptions_per_node_hour", -1), ("spot_interruptions_per_node_hour", NAN),
    ("storage_gbs", -1), ("storage_gbs", 0), ("storage_gbs", INF),
    ("inter_node_gbs", -5), ("inter_node_gbs", 0),
    ("restart_minutes", NAN), ("restart_minutes", -1),
    ("checkpoint_interval_hours", -1), ("checkpoint_interval_hours", 0), ("checkpoint_interval_hours", INF),
    ("keep_checkpoints", -1), ("keep_checkpoints", NAN), ("keep_checkpoints", 1.5),
    ("tokens", -1), ("tokens", INF), ("tokens", [1e9]),
    ("target_global_batch", 2.5), ("target_global_batch", 0),
    ("max_gpus", NAN), ("max_gpus", 0), ("max_gpus", "8"),
    ("scale_out", -1), ("headroom", 2), ("headroom", NAN), ("headroom", None),
    ("n_gpus", 2.5), ("gpus", 0),
])
def test_plan_refuses_each_bad_assumption_with_field_and_value(field: str, value: object) -> None:
    with pytest.raises(SpecError, match=rf"^{field}\b"):
        plan("gpt2", **{**BASE, field: value})


@pytest.mark.parametrize("mfu", [{"H100": 5}, {"H100 SXM 80GB": 0}, {"hopper": NAN}, 5, -0.1, True])
def test_plan_mfu_dict_keys_resolve_like_gpu_names_and_values_are_range_checked(mfu: object) -> None:
    with pytest.raises(SpecError, match=r"^mfu(\[.+\])?=\S+ must be a fraction in \(0, 1\]"):
        plan("gpt2", **BASE, mfu=mfu)


def test_plan_mfu_given_by_alias_is_used_not_ignored() -> None:
    half = plan("gpt2", **BASE, mfu={"H100": 0.2}, prices=False, n_gpus=1).rows[0]
    default = plan("gpt2", **BASE, prices=False, n_gpus=1).rows[0]
    assert half["mfu_assumed"] == 0.2 and half["mfu_source"] == "given"
    assert half["step_time_s"] > default["step_time_s"]


@pytest.mark.parametrize(("argument", "value"), [("prices", {"H1OO": 2.0}), ("mfu", {"H1OO": 0.4})])
def test_plan_refuses_unknown_gpu_in_prices_and_mfu_with_did_you_mean(argument: str, value: object) -> None:
    with pytest.raises(SpecError, match=r"unknown gpu 'H1OO' \(did you mean"):
        plan("gpt2", **BASE, **{argument: value})


def test_plan_refuses_non_finite_prices() -> None:
    with pytest.raises(SpecError, match=r"^prices\['H100'\]=Infinity must be a finite number"):
        plan("gpt2", **BASE, prices={"H100": INF})


def test_plan_refuses_unknown_provider_with_did_you_mean() -> None:
    with pytest.raises(SpecError, match=r"provider='AWSS' sells nothing in the prices \(did you mean 'AWS'\?\)"):
        plan("gpt2", **BASE, provider="AWSS")
    with pytest.raises(SpecError, match="there are none"):
        plan("gpt2", **BASE, provider="AWS", prices=False)


@pytest.mark.parametrize(("kwargs", "text"), [
    (dict(prices=5), "prices must be a file path"), (dict(catalog=5), "catalog must be a file path"),
    (dict(provider=5), "provider=5 must name a provider"), (dict(catalog=[{"name": "x"}]), "catalog: GPU 'x' needs"),
    (dict(gpu=5), "gpu=5 must name GPU types"), (dict(gpu=[None]), "gpu: None is not a GPU name"),
    (dict(gpu=[]), r"gpu=\[\] names no GPU"), (dict(parallel=5), "parallel must be a ParallelSpec"),
])
def test_plan_refuses_wrong_types_naming_the_argument(kwargs: dict, text: str) -> None:
    with pytest.raises(SpecError, match=text):
        plan("gpt2", **{**BASE, **kwargs})


def test_plan_gpu_count_has_the_same_meaning_as_in_estimate() -> None:
    p = plan("gpt2", gpu="H100", gpus=8, seq_len=512, prices=False)
    assert p.rows and {r["n_gpus"] for r in p.rows} == {8}
    assert tm.estimate("gpt2", seq_len=512, gpus=8).parallel.gpus == 8
    alias = plan("gpt2", gpu="H100", n_gpus=8, seq_len=512, prices=False)
    assert [r["layout"] for r in alias.rows] == [r["layout"] for r in p.rows]


def test_plan_gpu_types_given_as_gpus_say_where_they_go() -> None:
    with pytest.raises(SpecError, match=r"gpus=\['H100'\] is the GPU count in plan\(\), as in estimate\(\); name GPU "
                                        r"types with gpu=\['H100'\]"):
        plan("gpt2", gpus=["H100"], seq_len=512)
    with pytest.raises(SpecError, match="both give the GPU count"):
        plan("gpt2", gpus=8, n_gpus=4, seq_len=512)


def test_plan_with_an_impossible_fixed_layout_says_why() -> None:
    with pytest.raises(SpecError, match=r"tp=8 does not divide gpt2's n_heads=12; use tp in"):
        plan("gpt2", gpu="H100", seq_len=512, prices=False, tp=8)
    with pytest.raises(SpecError, match=r"tp\*pp\*cp = 8\*1\*1 = 8 does not divide gpus=4"):
        plan("llama-3.2-1b", gpu="H100", seq_len=512, prices=False, tp=8, gpus=4)


def test_plan_with_max_gpus_below_the_layout_says_so() -> None:
    with pytest.raises(SpecError, match=r"max_gpus=4 is below tp\*pp\*cp=8"):
        plan("llama-3.2-1b", gpu="H100", seq_len=512, prices=False, tp=8, max_gpus=4)


def test_plan_whose_every_option_fails_for_a_layout_reason_raises_it() -> None:
    # tp=8 is a valid layout for llama-3.2-1b, but the RTX 4090's nodes hold fewer GPUs than one tp group
    gpus_per_node = tm.get_gpu("RTX 4090").gpus_per_node
    if gpus_per_node >= 8:
        pytest.skip("the catalog's RTX 4090 boxes hold a tp=8 group")
    with pytest.raises(SpecError, match="no layout as given can run: tp=8 exceeds"):
        plan("llama-3.2-1b", gpu="RTX 4090", seq_len=512, prices=False, tp=8)


def test_fewest_gpus_raises_for_an_invalid_layout_and_returns_none_only_when_nothing_fits() -> None:
    with pytest.raises(SpecError, match="tp=8 does not divide gpt2's n_heads=12"):
        tm.fewest_gpus("gpt2", "H100", seq_len=512, tp=8)
    assert tm.fewest_gpus("llama-2-70b", "T4", seq_len=4096, max_gpus=2, engine="ddp") is None


def test_a_layout_whose_model_parallelism_is_no_power_of_two_is_searched_on_its_multiples() -> None:
    """tp=4 with pp=3 runs on 12 GPUs, which no power of two is a multiple of: plan and fewest_gpus find it
    (they used to answer "fits none", audit 2026-12-01 D21)."""
    rows = plan("gpt2", gpu="H100", seq_len=512, prices=False, tp=4, pp=3).rows
    assert rows and min(r["n_gpus"] for r in rows) == 12 and all(r["n_gpus"] % 12 == 0 for r in rows)
    assert tm.fewest_gpus("gpt2", "H100", seq_len=512, tp=4, pp=3).gpus == 12


@pytest.mark.parametrize("max_gpus", [-1, 0, NAN, "8"])
def test_fewest_gpus_max_gpus_must_be_positive(max_gpus: object) -> None:
    with pytest.raises(SpecError, match=r"^max_gpus=\S+ must be an integer from 1"):
        tm.fewest_gpus("gpt2", "H100", seq_len=512, max_gpus=max_gpus)


@pytest.mark.parametrize("limit", [NAN, 0, -1, "8", 2.5])
def test_max_micro_batch_limit_must_be_a_positive_integer(limit: object) -> None:
    with pytest.raises(SpecError, match=r"^limit=\S+ must be an integer from 1"):
        tm.max_micro_batch("gpt2", "H100", seq_len=512, limit=limit)


@pytest.mark.parametrize("estimate", [None, "gpt2", {"peak": 1}, 5])
def test_fit_takes_an_estimate_and_says_so(estimate: object) -> None:
    with pytest.raises(SpecError, match=r"^fit\(\) takes a MemoryEstimate from tm\.estimate"):
        tm.fit(estimate, "H100")


@pytest.mark.parametrize("headroom", [None, [0.1], NAN, 1.0, -0.1, "0.1x"])
def test_fit_headroom_must_be_a_fraction(headroom: object) -> None:
    est = tm.estimate("gpt2", seq_len=64)
    with pytest.raises(SpecError, match=r"^headroom=.* (must be a fraction in \[0, 1\)|is not a number|must be a finite number)"):
        tm.fit(est, "H100", headroom=headroom)


def test_a_gpu_that_is_not_a_name_is_refused() -> None:
    with pytest.raises(SpecError, match=r"^gpu=5 must be a GPU name"):
        tm.fit(tm.estimate("gpt2", seq_len=64), 5)


def test_sweep_empty_list_and_none_name_the_option() -> None:
    with pytest.raises(SpecError, match=r"^micro_batch=\[\]: an empty list sweeps nothing"):
        tm.sweep("gpt2", micro_batch=[], seq_len=512)
    with pytest.raises(SpecError, match=r"^micro_batch=\[None\]: None is not a value to sweep"):
        tm.sweep("gpt2", micro_batch=[None], seq_len=512)
    assert len(tm.sweep("gpt2", micro_batch=[1], seq_len=128, dropout=[None, 0.1])) == 2  # None: the config's


@settings(max_examples=25, deadline=None)
@given(storage=st.floats(0.01, 1e4), spot=st.floats(0, 10), restart=st.floats(0, 600), keep=st.integers(1, 20),
       interval=st.one_of(st.none(), st.floats(0.01, 1e3)), mfu=st.floats(0.01, 1.0))
def test_plan_json_is_strict_json_for_every_accepted_input(storage: float, spot: float, restart: float, keep: int,
                                                           interval: float | None, mfu: float) -> None:
    p = plan("gpt2", gpu="H100", seq_len=256, tokens=1e8, n_gpus=1, storage_gbs=storage,
             spot_interruptions_per_node_hour=spot, restart_minutes=restart, keep_checkpoints=keep,
             checkpoint_interval_hours=interval, mfu=mfu)
    text = json.dumps(p.to_dict(), allow_nan=False)
    for row in json.loads(text)["options"]:
        for key in ("checkpoint_write_s", "time_hours", "storage_bytes", "comm_time_s"):
            assert row[key] is None or row[key] >= 0, (key, row[key])


def test_plan_without_a_target_batch_keeps_the_pipeline_bubble_small_or_warns() -> None:
    p = plan("llama-3.1-405b", gpu="H100", seq_len=2048, tokens=1e12, prices=False)
    piped = [r for r in p.rows if r["pp"] > 1]
    assert piped, "the search has pipeline options for a 405B model"
    for r in piped:
        assert r["bubble_fraction"] <= MAX_PIPELINE_BUBBLE
        assert r["grad_accum"] >= pipeline_grad_accum(ParallelSpec(gpus=r["n_gpus"], nodes=r["nodes"],
                                                                   engine="megatron", tp=r["tp"], pp=r["pp"]))
    small = plan("llama-3.1-405b", gpu="H100", seq_len=2048, tokens=1e12, prices=False, grad_accum=1)
    flagged = [r for r in small.rows if r["pp"] > 1]
    assert flagged and all(any(w.startswith("pipeline bubble:") for w in r["warnings"]) for r in flagged)


def test_pipeline_grad_accum_keeps_the_bubble_under_the_ceiling() -> None:
    for pp in (2, 4, 8, 32):
        p = ParallelSpec(gpus=pp, pp=pp)
        ga = pipeline_grad_accum(p)
        assert (pp - 1) / ga <= MAX_PIPELINE_BUBBLE < (pp - 1) / max(1, ga - 1) or ga == 1
    assert pipeline_grad_accum(ParallelSpec(gpus=1)) == 1


def test_plan_repr_is_one_short_line() -> None:
    p = plan("gpt2", gpu="H100", seq_len=512, prices=False)
    text = repr(p)
    assert "\n" not in text and len(text) < 200
    assert text.startswith("<Plan gpt2:") and "H100 SXM 80GB" in text
    assert str(p) == p.summary()  # print() still shows the table
