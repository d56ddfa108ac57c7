"""The caching allocator replayed over a compiled step: the trace it reads, the reserved bytes, the
fragmentation and largest free block it reports, the allocator settings, loading, and fit on a card."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainmem_nb as tm
from trainmem_nb.engine.allocator import CachingAllocator
from trainmem_nb.engine.program import CAT_INDEX, _round, evaluate
from trainmem_nb.engine.trace import allocator_trace, step_starts
from trainmem_nb.errors import SpecError
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step, program_key
from trainmem_nb.step.load import load_peak_bytes, loading_events
from trainmem_nb.step.reserved import replay_step

SMALL = ModelSpec(family="llama", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1000)


def _live_peak(trace: tuple[int, ...]) -> int:
    """The most bytes alive over a trace, each request in 512-B blocks (as the estimate counts)."""
    sizes: list[int] = []
    live = best = 0
    for e in trace:
        if e >= 0:
            sizes.append(_round(e))
            live += sizes[-1]
            best = max(best, live)
        else:
            live -= sizes[~e]
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["gpt2", "llama", "mixtral", "bert", "opt", "gpt_neox", "phi3", "gemma"]),
       st.sampled_from(["bf16-mixed", "fp32", "bf16-true"]), st.sampled_from(["none", "full", "selective"]),
       st.sampled_from(["full", "lora", "qlora"]), st.sampled_from(["adamw", "sgd", "adafactor"]),
       st.integers(1, 3), st.integers(1, 96), st.sampled_from([1, 2]))
def test_the_allocator_trace_holds_exactly_the_bytes_the_estimate_counts(family: str, precision: str, ckpt: str,
                                                                        method: str, optimizer: str, b: int, s: int,
                                                                        accum: int) -> None:
    """Expanded event by event, the unrolled step reaches the estimate's allocated peak in both replayed
    steps, and the second step starts with what the first did (the steady state)."""
    extra = dict(n_experts=4, experts_top_k=2) if family == "mixtral" else {}
    m = ModelSpec(family=family, n_layers=3, hidden=64, n_heads=4, ffn=128, vocab=500, **extra)
    if method == "qlora" and precision == "fp32":
        precision = "bf16-true"
    t = TrainingSpec(micro_batch=b, seq_len=s, precision=precision, checkpointing=ckpt, method=method,
                     optimizer=optimizer, grad_accum=accum)
    unrolled = compile_step(m, program_key(t, m), unrolled=True)
    one, two = allocator_trace(unrolled, b, s, steps=1), allocator_trace(unrolled, b, s, steps=2)
    peak = evaluate(compile_step(m, program_key(t, m)), b, s).peak
    assert _live_peak(one) == _live_peak(two) == peak
    start = step_starts(unrolled, 2)
    assert two[:start[1]] == one  # the first step is the same trace, the second follows


def test_the_trace_frees_each_tensor_once_and_only_tensors_it_made() -> None:
    t = TrainingSpec(micro_batch=2, seq_len=64, checkpointing="full")
    trace = allocator_trace(compile_step(SMALL, program_key(t, SMALL), unrolled=True), 2, 64)
    made = sum(1 for e in trace if e >= 0)
    freed = [~e for e in trace if e < 0]
    assert len(freed) == len(set(freed)) and all(0 <= f < made for f in freed)


def test_a_loops_first_step_creates_the_optimizer_state_when_its_optimizer_runs() -> None:
    """``first_step=True``: the state is not allocated before the step but when the optimizer segment starts
    (one tensor per state, among the step's freed blocks), and stays; the second step is the steady one."""
    t = TrainingSpec(micro_batch=2, seq_len=64)
    unrolled = compile_step(SMALL, program_key(t, SMALL), unrolled=True)
    steady, loop = allocator_trace(unrolled, 2, 64), allocator_trace(unrolled, 2, 64, first_step=True)
    states = sum(n for cat, _sz, n in unrolled.init if cat == CAT_INDEX["optimizer_states"])
    s0, l0 = step_starts(unrolled)[0], step_starts(unrolled, first_step=True)[0]
    assert states > 0 and s0 - l0 == states  # fewer allocations before the first step
    assert _live_peak(steady) == _live_peak(loop)  # the state is alive at the optimizer's peak either way
    sizes = [round(sz.at(2, 64)) for cat, sz, n in unrolled.init if cat == CAT_INDEX["optimizer_states"]
             for _ in range(n)]
    first = list(loop[l0:step_starts(unrolled, first_step=True)[1]])
    at = next(i for i in range(len(first)) if first[i:i + states] == sizes)  # made together, in the init's order
    assert any(e < 0 for e in first[:at])  # after the forward and backward freed blocks
    # nothing the first step made outlives it but the state: both traces end with the same live bytes
    assert sum(1 for e in loop if e >= 0) - sum(1 for e in loop if e < 0) == (
        sum(1 for e in steady if e >= 0) - sum(1 for e in steady if e < 0))


def test_reserved_covers_allocated_and_fragmentation_is_what_the_cache_holds_unused() -> None:
    e = tm.estimate("llama-3.2-1b", micro_batch=2, seq_len=1024)
    assert e.peak_reserved_bytes >= e.peak_allocated_bytes
    assert 0 <= e.largest_free_block_bytes <= e.fragmentation_bytes <= e.peak_reserved_bytes
    assert e.peak_reserved_bytes % (2 << 20) == 0  # whole segments: 2 MiB small ones, large ones 2 MiB-rounded
    d = e.to_dict()
    for key in ("fragmentation_bytes", "largest_free_block_bytes", "load_peak_bytes"):
        assert isinstance(d[key], int) and d[key] >= 0
    cpu = tm.estimate("llama-3.2-1b", micro_batch=2, seq_len=1024, device="cpu")
    assert cpu.peak_reserved_bytes == cpu.peak_allocated_bytes and cpu.fragmentation_bytes == 0


def test_the_replay_is_the_allocators_own_for_the_trace_of_the_step() -> None:
    """The headline is the second replayed step's reserved peak on a fresh allocator fed the loading and
    the loop's first two steps: recomputed here from the allocator model directly."""
    t = TrainingSpec(micro_batch=2, seq_len=128)
    m = SMALL
    unrolled = compile_step(m, program_key(t, m), unrolled=True)
    load = loading_events(m, t)
    shift = sum(1 for e in load if e >= 0)
    step = allocator_trace(unrolled, 2, 128, first_step=True)
    events = load + tuple(e if e >= 0 else ~(~e + shift) for e in step)
    run = CachingAllocator().replay(events, timeline=True, memo=False)
    second = len(load) + step_starts(unrolled, first_step=True)[1]
    assert replay_step(unrolled, 2, 128, "", load).peak_reserved_bytes == max(run.reserved[second:])
    assert tm.estimate(m, micro_batch=2, seq_len=128).peak_reserved_bytes == max(run.reserved[second:])


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:20,roundup_power2_divisions:4"])
@pytest.mark.parametrize("method", ["full", "qlora"])
def test_one_pass_state_at_the_reserved_peak_equals_a_timeline_and_a_replay_to_that_point(conf: str,
                                                                                           method: str) -> None:
    """`replay_step` keeps the state at the second step's fullest reserved point in the one replay
    (``watch_from``); recomputed here the slow way: the reserved and allocated timeline, the point where
    the reserved peak holds the most allocated bytes, and a second replay up to it for its largest block."""
    from trainmem_nb.engine.allocator import parse_alloc_conf

    t = TrainingSpec(micro_batch=3, seq_len=96, method=method)
    unrolled = compile_step(SMALL, program_key(t, SMALL), unrolled=True)
    load = loading_events(SMALL, t)
    shift = sum(1 for e in load if e >= 0)
    events = load + tuple(e if e >= 0 else ~(~e + shift) for e in allocator_trace(unrolled, 3, 96))
    second = len(load) + step_starts(unrolled)[1]
    run = CachingAllocator(parse_alloc_conf(conf or None)).replay(events, timeline=True, memo=False)
    reserved, allocated = run.reserved[second:], run.allocated[second:]
    peak = max(reserved)
    at = second + min((-a, i) for i, (r, a) in enumerate(zip(reserved, allocated, strict=True)) if r == peak)[1]
    upto = CachingAllocator(parse_alloc_conf(conf or None))
    upto.replay(events[:at + 1], timeline=False, memo=False)
    got = replay_step(unrolled, 3, 96, conf, load)
    assert (got.peak_reserved_bytes, got.fragmentation_bytes, got.largest_free_block_bytes,
            got.peak_allocated_block_bytes) == (peak, peak - run.allocated[at], upto.largest_free_block(),
                                                max(allocated))


def test_alloc_conf_changes_the_replay_and_a_bad_one_is_refused_with_the_valid_keys() -> None:
    kw = dict(micro_batch=4, seq_len=1024)
    default = tm.estimate("tinyllama-1.1b", **kw)
    split = tm.estimate("tinyllama-1.1b", alloc_conf="max_split_size_mb:20,roundup_power2_divisions:4", **kw)
    assert default.peak_allocated_bytes == split.peak_allocated_bytes  # tensors are the same
    assert default.peak_reserved_bytes != split.peak_reserved_bytes
    with pytest.raises(SpecError, match=r"alloc_conf='expandable:True'.*valid keys are: .*expandable_segments"):
        tm.estimate("gpt2", alloc_conf="expandable:True")
    with pytest.raises(SpecError, match="garbage_collection_threshold"):
        tm.estimate("gpt2", alloc_conf="garbage_collection_threshold:1.5")


def test_the_cli_takes_alloc_conf_and_reports_the_new_fields() -> None:
    out = subprocess.run([sys.executable, "-m", "trainmem_nb.cli.main", "estimate", "--model", "gpt2", "--seq-len", "512",
                          "--alloc-conf", "expandable_segments:True", "--json"],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["training"]["alloc_conf"] == "expandable_segments:True"
    assert d["fragmentation_bytes"] >= 0 and d["largest_free_block_bytes"] >= 0 and d["load_peak_bytes"] > 0
    bad = subprocess.run([sys.executable, "-m", "trainmem_nb.cli.main", "estimate", "--model", "gpt2", "--seq-len", "512",
                          "--alloc-conf", "nope:1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Unrecognized key 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_qlora_loading_holds_one_16_bit_weight_beside_the_4_bit_ones_and_leaves_its_cache() -> None:
    m = ModelSpec(family="llama", n_layers=2, hidden=1024, n_heads=8, ffn=4096, vocab=100)
    t = TrainingSpec(micro_batch=1, seq_len=64, method="qlora")
    ev = loading_events(m, t)
    assert sum(1 for e in ev if e >= 0) == sum(1 for e in ev if e < 0)  # everything loaded is handed to the step
    full = TrainingSpec(micro_batch=1, seq_len=64, method="lora")
    # full-width loading allocates the weights and no more; QLoRA's peak is above its 4-bit weights by
    # at most the largest 16-bit weight being quantized (4096 x 1024 here) and its fp32 block absmax
    lora_est, qlora_est = tm.estimate(m, training=full), tm.estimate(m, training=t)
    assert load_peak_bytes(m, full) == lora_est.load_peak_bytes
    weights = qlora_est.detail_bytes["weights/params"]
    assert weights < qlora_est.load_peak_bytes <= weights + 4096 * 1024 * 2 + 4096 * 1024 // 64 * 4 + 512
    unrolled = compile_step(m, program_key(t, m), unrolled=True)
    with_load = replay_step(unrolled, 1, 64, "", loading_events(m, t))
    assert with_load.peak_reserved_bytes >= qlora_est.peak_allocated_bytes


def test_a_step_whose_cache_outgrows_the_card_still_fits_when_the_replay_on_the_card_runs() -> None:
    """On the card the allocator frees its cache and retries before failing: the fit replays there."""
    e = tm.estimate("tinyllama-1.1b", micro_batch=2, seq_len=1024)
    f = tm.fit(e, "A10G")
    assert f.needed_bytes > f.usable_bytes  # the cache grown with memory to spare would not fit the card
    assert f.verdict in ("fits", "tight") and "replayed" in f.message


def test_an_oom_from_fragmentation_says_the_tensors_fit_but_no_block_is_large_enough() -> None:
    e = tm.estimate("llama-3.2-1b", micro_batch=7, seq_len=2048, checkpointing="full")
    f = tm.fit(e, "A100 40GB")
    assert f.verdict == "oom"
    assert any("the tensors fit" in n and "no free block of" in n and "expandable_segments" in n for n in f.notes)


def test_sweep_rows_report_the_replayed_reserved_bytes_of_estimate() -> None:
    df = tm.sweep("tinyllama-1.1b", micro_batch=[1, 3], seq_len=[512, 1000],
                  alloc_conf=["", "expandable_segments:True"])
    for row in df.itertuples():
        e = tm.estimate("tinyllama-1.1b", micro_batch=row.micro_batch, seq_len=row.seq_len, alloc_conf=row.alloc_conf)
        assert row.peak_reserved_bytes == e.peak_reserved_bytes and row.device_total_bytes == e.device_total_bytes


def test_a_sweep_without_the_replay_leaves_reserved_empty_and_keeps_the_allocated_bytes() -> None:
    fast = tm.sweep("tinyllama-1.1b", micro_batch=[1, 2], seq_len=512, replay=False)
    full = tm.sweep("tinyllama-1.1b", micro_batch=[1, 2], seq_len=512)
    assert fast["peak_reserved_bytes"].isna().all() and fast["device_total_bytes"].isna().all()
    assert list(fast["peak_allocated_bytes"]) == list(full["peak_allocated_bytes"])
    assert str(fast["peak_reserved_bytes"].dtype) == "Int64"


def test_reserved_says_where_it_comes_from_and_a_step_beyond_the_replays_limits_is_not_replayed() -> None:
    """A step too long to replay (thousands of layers) or too large for any card (beyond 1 PiB) takes its
    reserved bytes from the churn model, says so, and answers without replaying millions of events."""
    from trainmem_nb.device import REPLAY_MAX_EVENTS

    assert tm.estimate(SMALL, micro_batch=1, seq_len=64).reserved_from == "replay"
    assert tm.estimate(SMALL, micro_batch=1, seq_len=64, device="cpu").reserved_from == "allocated"
    deep = SMALL.model_copy(update={"n_layers": 10_000})
    est = tm.estimate(deep, micro_batch=1, seq_len=64)
    assert est.reserved_from == "churn model" and est.to_dict()["reserved_from"] == "churn model"
    assert f"{REPLAY_MAX_EVENTS:,} allocator events" in est.summary() and "not replayed" in est.summary()
    assert est.peak_reserved_bytes >= est.peak_allocated_bytes and est.fragmentation_bytes == 0
    huge = ModelSpec(family="llama", n_layers=16, hidden=1 << 20, n_heads=8, ffn=1 << 21, vocab=1000)
    big = tm.estimate(huge, micro_batch=1, seq_len=64)
    assert big.peak_allocated_bytes > 1 << 50 and big.reserved_from == "churn model"
    assert tm.fit(big, "H100").verdict == "oom"


def test_the_snapshot_comparison_prints_a_gpu_runs_segments_beside_the_replays(tmp_path) -> None:
    """scripts/compare_snapshot.py on a measurement whose segments are the replay's own (what a GPU run that
    the model matched exactly would record) says so; one block changed, it says they differ; a measurement
    without segments is refused in one line."""
    from trainmem_nb.step.load import loading_events as load_of
    from trainmem_nb.step.reserved import replay_segments

    t = TrainingSpec(micro_batch=2, seq_len=128)
    unrolled = compile_step(SMALL, program_key(t, SMALL), unrolled=True)
    segs = replay_segments(unrolled, 2, 128, "", load_of(SMALL, t))
    assert segs and {s["segment_type"] for s in segs} <= {"large", "small"}
    est = tm.estimate(SMALL, t)
    data = {"model_spec": SMALL.model_dump(mode="json"), "training": t.model_dump(mode="json"),
            "measured_with": {"cuda": {"segments": segs, "max_reserved": est.peak_reserved_bytes}}}
    good = tmp_path / "good.json"
    good.write_text(json.dumps(data))
    changed = json.loads(json.dumps(data))
    changed["measured_with"]["cuda"]["segments"][0]["blocks"][0][1] = "inactive"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(changed))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**data, "measured_with": {"cuda": {}}}))
    run = subprocess.run([sys.executable, "scripts/compare_snapshot.py", str(good), str(bad)],
                         capture_output=True, text=True, check=True)
    first, second = run.stdout.split(f"{SMALL.name}: ")[1:]
    assert "the same segments and blocks" in first and "measured" in first and "replayed" in first
    assert "the segments differ" in second
    run = subprocess.run([sys.executable, "scripts/compare_snapshot.py", str(empty)], capture_output=True, text=True)
    assert run.returncode == 1 and "no allocator segments" in run.stderr and "Traceback" not in run.stderr
