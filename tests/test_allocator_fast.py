"""The caching allocator's default path in C (`trainmem_nb.engine.allocator.fast`) gives the bytes the
Python allocator gives: on random traces, on the steps of several families, past a card's capacity and on
a double free; and the test command builds it."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainmem_nb.engine.allocator import parse_alloc_conf
from trainmem_nb.engine.allocator.fast import NATIVE, default_path, replay_trace
from trainmem_nb.engine.trace import step_starts, trace_arrays
from trainmem_nb.model.presets import get_model
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step, program_key
from trainmem_nb.step.load import loading_events

MiB = 1 << 20
needs_native = pytest.mark.skipif(not NATIVE, reason="the C replay is not built here")


def test_the_test_command_builds_the_c_replay() -> None:
    """`pip install -e .` compiles it where a C compiler is found (setup.py); without it every replay
    takes the Python path, about twenty times slower, so the test command must not lose it silently."""
    assert NATIVE, "trainmem_nb/engine/allocator/_fastreplay.c was not built: install a C compiler, reinstall"


# sizes that exercise every rule: under 512 B, the small pool and its 2 MiB segments, the 20 MiB
# segments for 1-10 MiB requests (split if more than 1 MiB remains), 2 MiB rounding above 10 MiB, size 0
_SIZES = st.one_of(st.integers(0, 600), st.integers(600, MiB), st.integers(MiB + 1, 10 * MiB),
                   st.integers(10 * MiB, 80 * MiB), st.sampled_from([512, MiB, 2 * MiB, 10 * MiB, 20 * MiB]))


@st.composite
def _traces(draw: st.DrawFn) -> tuple[array, array, array, int]:
    """A loading trace, then ops over a table of sizes freeing live allocations at random."""
    load: list[int] = []
    live: list[int] = []
    for made in range(draw(st.integers(0, 12))):
        load.append(draw(_SIZES))
        live.append(made)
    if live and draw(st.booleans()):
        load.append(~live.pop(draw(st.integers(0, len(live) - 1))))
    sizes = draw(st.lists(_SIZES, min_size=1, max_size=12))
    ops: list[int] = []
    live, made = [], 0  # ops free what ops made, numbered from 0 after loading's
    for _ in range(draw(st.integers(1, 150))):
        if live and draw(st.integers(0, 2)) == 0:
            ops.append(~live.pop(draw(st.integers(0, len(live) - 1))))
        else:
            ops.append(draw(st.integers(0, len(sizes) - 1)))
            live.append(made)
            made += 1
    watch = draw(st.integers(-1, len(load) + len(ops)))
    return array("q", load), array("q", ops), array("q", sizes), watch


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_traces(), st.sampled_from(["", "garbage_collection_threshold:0.6", "max_split_size_mb:20",
                                   "max_split_size_mb:40,max_non_split_rounding_mb:64", "expandable_segments:True",
                                   "expandable_segments:True,max_split_size_mb:20",
                                   "expandable_segments:True,large_segment_size_mb:32"]))
def test_the_c_replay_gives_the_python_allocators_bytes_on_random_traces(trace: tuple, conf: str) -> None:
    load, ops, sizes, watch = trace
    config = parse_alloc_conf(conf or None)
    assert default_path(config)
    assert replay_trace(load, ops, sizes, config, watch) == replay_trace(load, ops, sizes, config, watch,
                                                                        native=False)


@needs_native
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_traces(), st.data(), st.sampled_from(["", "max_split_size_mb:20", "expandable_segments:True"]))
def test_the_c_replay_gives_the_python_allocators_bytes_with_several_streams(trace: tuple, data: st.DataObject,
                                                                              conf: str) -> None:
    """Each malloc on one of three streams (an engine's communication streams): each stream's pools apart."""
    load, ops, sizes, watch = trace
    streams = array("q", [data.draw(st.integers(0, 2)) if o >= 0 else 0 for o in ops])
    config = parse_alloc_conf(conf or None)
    assert replay_trace(load, ops, sizes, config, watch, streams=streams) == replay_trace(
        load, ops, sizes, config, watch, native=False, streams=streams)


@needs_native
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_traces(), st.integers(0, 200 * MiB), st.sampled_from(["", "max_split_size_mb:20", "expandable_segments:True"]))
def test_past_the_capacity_the_python_allocator_decides(trace: tuple, capacity: int, conf: str) -> None:
    """A new segment beyond the card's memory takes the out-of-memory retry path (free the cache, try
    again), which only the Python allocator has: the C replay hands over and the bytes are the same."""
    load, ops, sizes, watch = trace
    config = parse_alloc_conf(conf or None)
    assert replay_trace(load, ops, sizes, config, watch, capacity) == replay_trace(
        load, ops, sizes, config, watch, capacity, native=False)


@needs_native
@pytest.mark.parametrize("name,opts", [
    ("llama-3.2-1b", {}),
    ("qwen3-0.6b", {"method": "lora", "checkpointing": "full"}),
    ("gemma-3-1b", {"precision": "bf16-true", "attention": "eager"}),
    ("gpt2", {"optimizer": "sgd", "grad_accum": 2}),
    ("qwen3-30b-a3b", {"method": "qlora"}),
])
def test_the_c_replay_gives_the_python_allocators_bytes_on_real_steps(name: str, opts: dict) -> None:
    m = get_model(name)
    if name == "qwen3-30b-a3b":  # its trace, but four layers of it
        m = m.model_copy(update={"n_layers": 4})
    t = TrainingSpec(micro_batch=2, seq_len=256, **opts)
    unrolled = compile_step(m, program_key(t, m), unrolled=True)
    load = array("q", loading_events(m, t))
    for b, s in ((1, 128), (2, 256), (3, 1000)):
        ops, sizes = trace_arrays(unrolled, b, s, first_step=True)
        second = len(load) + step_starts(unrolled, first_step=True)[-1]
        for conf in ("", "max_split_size_mb:24", "expandable_segments:True"):
            config = parse_alloc_conf(conf or None)
            fast = replay_trace(load, ops, sizes, config, second)
            assert fast is not None and fast.watched is not None
            assert fast == replay_trace(load, ops, sizes, config, second, native=False)


@needs_native
def test_an_fsdp2_step_replays_its_streams_the_same_on_both_paths() -> None:
    """FSDP2's all-gather outputs and sharded gradients are on their own streams (`trace_streams`)."""
    from trainmem_nb.engine.trace import trace_streams
    from trainmem_nb.parallel.layout import _hooks
    from trainmem_nb.spec.parallel import build_parallel

    m = get_model("llama-3.2-1b").model_copy(update={"n_layers": 3})
    t = TrainingSpec(micro_batch=1, seq_len=256, precision="bf16-mixed", device="cuda")
    hooks = _hooks(m, t, build_parallel(None, gpus=8, engine="fsdp", zero=3))
    unrolled = compile_step(m, program_key(t, m), hooks, unrolled=True)
    for first_step in (False, True):  # one stream per op, and only a malloc is on another than the default one
        ops, _sizes = trace_arrays(unrolled, 1, 256, first_step=first_step)
        on = trace_streams(unrolled, first_step=first_step)
        assert on is not None and len(on) == len(ops) and all(o >= 0 for o, s in zip(ops, on, strict=True) if s)
    streams = trace_streams(unrolled)
    assert streams is not None and set(streams) == {0, 1, 2}
    ops, sizes = trace_arrays(unrolled, 1, 256)
    config = parse_alloc_conf(None)
    fast = replay_trace(array("q"), ops, sizes, config, 10, streams=streams)
    assert fast == replay_trace(array("q"), ops, sizes, config, 10, native=False, streams=streams)
    assert fast != replay_trace(array("q"), ops, sizes, config, 10)  # one stream would reuse across them


@pytest.mark.parametrize("native", [True, False])
def test_a_double_free_is_refused_on_both_paths(native: bool) -> None:
    if native and not NATIVE:
        pytest.skip("the C replay is not built here")
    with pytest.raises(ValueError, match="double free"):
        replay_trace(array("q"), array("q", [0, ~0, ~0]), array("q", [4 * MiB]), parse_alloc_conf(None),
                     native=native)


@pytest.mark.parametrize("conf", ["roundup_power2_divisions:4", "per_process_memory_fraction:0.5",
                                  "expandable_segments:True,roundup_power2_divisions:4"])
def test_a_setting_the_c_replay_does_not_have_goes_to_the_python_allocator(conf: str) -> None:
    assert not default_path(parse_alloc_conf(conf))


def test_a_small_model_replays_the_same_on_both_paths_with_any_setting() -> None:
    m = ModelSpec(family="llama", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1000)
    t = TrainingSpec(micro_batch=2, seq_len=96)
    unrolled = compile_step(m, program_key(t, m), unrolled=True)
    ops, sizes = trace_arrays(unrolled, 2, 96, first_step=True)
    for conf in ("", "expandable_segments:True", "max_split_size_mb:20", "roundup_power2_divisions:4"):
        config = parse_alloc_conf(conf or None)
        assert replay_trace(array("q"), ops, sizes, config, 10) == replay_trace(array("q"), ops, sizes, config, 10,
                                                                                native=False)


@needs_native
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kinds", [64, 3])
def test_the_c_replay_gives_the_python_allocators_bytes_with_thousands_of_cached_blocks(seed: int, kinds: int) -> None:
    """Long traces that leave thousands of free blocks cached: of many distinct sizes (64 request sizes and
    their merges: more sizes than the C pools count through, so they search), or of a few sizes with
    hundreds of blocks each (3 sizes, 2 MiB multiples that never split: deep buckets searched by address)."""
    import random

    rng = random.Random(seed)
    if kinds == 3:
        sizes = array("q", [rng.randint(6, 32) * 2 * MiB for _ in range(kinds)])
    else:
        sizes = array("q", [rng.choice([rng.randint(1, MiB), rng.randint(MiB, 12 * MiB),
                                        rng.randint(12 * MiB, 64 * MiB)]) for _ in range(kinds)])
    ops, live, made = array("q"), [], 0
    for _ in range(20_000):
        if live and rng.random() < 0.45:
            ops.append(~live.pop(rng.randrange(len(live))))
        else:
            ops.append(rng.randrange(len(sizes)))
            live.append(made)
            made += 1
    for conf in ("", "max_split_size_mb:24", "expandable_segments:True"):
        config = parse_alloc_conf(conf or None)
        fast = replay_trace(array("q"), ops, sizes, config, 5_000)
        assert fast == replay_trace(array("q"), ops, sizes, config, 5_000, native=False)


def test_without_the_c_replay_an_estimate_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without a C compiler (no `_fastreplay`) estimates the same reserved bytes, in Python."""
    import trainmem_nb as tm
    from trainmem_nb.engine.allocator import fast
    from trainmem_nb.step import reserved

    def estimate() -> tuple[int, int, int]:
        reserved._REPLAYS.clear()
        est = tm.estimate("llama-3.2-1b", micro_batch=3, seq_len=700, method="lora")
        return est.peak_reserved_bytes, est.fragmentation_bytes, est.largest_free_block_bytes

    with_c = estimate()
    monkeypatch.setattr(fast, "_native", None)
    assert estimate() == with_c


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:20", "expandable_segments:True"])
def test_a_size_0_malloc_is_not_a_watched_point_on_any_path(conf: str) -> None:
    """torch never calls the allocator for 0 bytes: after only such a malloc nothing is watched, whichever
    path replays (the Python model's general path used to record it)."""
    config = parse_alloc_conf(conf or None)
    for native in (True, False):
        got = replay_trace(array("q"), array("q", [0]), array("q", [0]), config, 0, native=native)
        assert got.watched is None and got.reserved == 0
