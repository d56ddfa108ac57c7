"""From an allocated peak to what the caching allocator reserves and what nvidia-smi shows.

On CUDA the step is replayed through a model of torch 2.13's caching allocator
(`trainmem_nb.engine.allocator`): the loading trace (`trainmem_nb.step.load`) and then two steps of the
unrolled program, allocation by allocation (`trainmem_nb.engine.trace`); the second step's reserved
peak is the headline (`replay_step`), and `replay_on_card` replays on a card's capacity, where the
allocator frees its cache and retries before it fails. A calibration from a GPU run overrides the
replay with its measured fraction of the churning bytes (activations and temporaries) kept reserved
beyond the live ones: the highest point over the step of ``allocated + fraction * churn``
(`trainmem_nb.engine.program.peak_with_churn`), rounded up to the allocator's large segments.
"""

from __future__ import annotations

import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import NamedTuple

from ..engine.program import Program
from ..spec.calibration import Calibration
from ..spec.choices import Device
from ..spec.training import TrainingSpec

__all__ = [
    'AllocatorReplay',
    'churn_fraction',
    'replay_on_card',
    'replay_segments',
    'replay_step',
    'replayable',
    'replayed',
    'replayed_reserved_and_total',
    'replaying',
    'reserved_and_total',
    'reserved_and_total_over_step',
    'screening',
]


def churn_fraction(calibration: Calibration | None) -> float:
    """The fraction of the churning bytes the allocator keeps reserved beyond the live ones (a
    calibration's, else `trainmem_nb.device.RESERVED_CHURN_FRACTION`)."""
    from ..device import RESERVED_CHURN_FRACTION

    return calibration.reserved_churn_fraction if calibration else RESERVED_CHURN_FRACTION


def reserved_and_total(t: TrainingSpec, peak: int, churn: int, calibration: Calibration | None,
                       unified: int = 0) -> tuple[int, int]:
    """The caching allocator's reserved bytes and the device total (nvidia-smi) at one point of a step
    with `peak` allocated bytes, ``churn`` of them activations and temporaries; ``unified``, CUDA
    unified memory outside the allocator (a paged optimizer's states, `paged_state_bytes`), which
    nvidia-smi counts while resident. CPU: both equal the peak."""
    if t.device is not Device.CUDA:
        return peak, peak
    return _segments_and_total(t, peak + churn_fraction(calibration) * churn, calibration, unified)


def reserved_and_total_over_step(t: TrainingSpec, peak: int, high_water: float, calibration: Calibration | None,
                                 unified: int = 0) -> tuple[int, int]:
    """Reserved bytes and device total of a step whose allocated peak is `peak` and whose highest
    ``allocated + churn_fraction(calibration) * churn`` over the step is `high_water`
    (`trainmem_nb.engine.program.peak_with_churn`). CPU: both equal the peak."""
    if t.device is not Device.CUDA:
        return peak, peak
    return _segments_and_total(t, max(high_water, peak), calibration, unified)


def cuda_context_bytes(t: TrainingSpec, calibration: Calibration | None) -> int:
    """The CUDA context nvidia-smi shows besides the allocator's segments: a calibration's measured one,
    else the modelled one, larger when the libraries' kernels load eagerly (``cuda_lazy_loading=False``:
    CUDA before 11.7, `trainmem_nb.device.CUDA_CONTEXT_EAGER_BYTES`)."""
    from ..device import CUDA_CONTEXT_BYTES, CUDA_CONTEXT_EAGER_BYTES

    if calibration:
        return calibration.cuda_context_bytes
    return CUDA_CONTEXT_BYTES if t.cuda_lazy_loading else CUDA_CONTEXT_EAGER_BYTES


def _segments_and_total(t: TrainingSpec, nbytes: float, calibration: Calibration | None,
                        unified: int) -> tuple[int, int]:
    from ..device import LARGE_SEGMENT_BYTES

    reserved = -(-int(nbytes) // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES
    return reserved, reserved + cuda_context_bytes(t, calibration) + unified


class AllocatorReplay(NamedTuple):
    """What torch 2.13's caching allocator does over a step (`replay_step`), steady state: the second of
    two replayed steps."""

    #: ``max_memory_reserved()``: the highest reserved bytes of the second step
    peak_reserved_bytes: int
    #: reserved minus allocated at that point: cached blocks no tensor uses (free segments, split remainders)
    fragmentation_bytes: int
    #: the largest cached free block at that point (what the next request can have without a new segment)
    largest_free_block_bytes: int
    #: ``max_memory_allocated()``: blocks, not tensors (a block too small to split is handed out whole)
    peak_allocated_block_bytes: int


_REPLAYS: OrderedDict[tuple[int, int, int, str, bool], tuple[Program, AllocatorReplay]] = OrderedDict()
_REPLAYS_LOCK = threading.Lock()


def replay_step(unrolled: Program, micro_batch: int, seq_len: int, alloc_conf: str = "",
                load: tuple[int, ...] = (), first_step: bool = True) -> AllocatorReplay:
    """Replay loading (`load`, `trainmem_nb.step.load.loading_events`) and then two steps of `unrolled`
    (``compile_step(..., unrolled=True)``) through the caching allocator (`trainmem_nb.engine.allocator`)
    configured by `alloc_conf` (``PYTORCH_CUDA_ALLOC_CONF`` syntax); memoised on the program (which
    fixes the model and what loading does), the batch shape and the configuration. `first_step`: the first
    of the two steps is a training loop's first, whose ``optimizer.step()`` creates the optimizer state
    among the step's cached blocks (on an H200 this history gave the measured reserved bytes within
    0.2 %, where state allocated at load was 3-12 % off; validation/gpu); False replays two steady steps
    (the parallel engines', which no multi-GPU measurement has checked yet)."""
    key = (id(unrolled), micro_batch, seq_len, alloc_conf, first_step)
    with _REPLAYS_LOCK:  # a sweep replays its shapes on several threads (`replay_steps`)
        hit = _REPLAYS.get(key)
        if hit is not None and hit[0] is unrolled:
            _REPLAYS.move_to_end(key)
            return hit[1]
    from ..engine.allocator import parse_alloc_conf
    from ..engine.allocator.fast import replay_trace
    from ..engine.trace import step_starts, trace_arrays, trace_streams

    ops, sizes = trace_arrays(unrolled, micro_batch, seq_len, first_step=first_step)
    second = len(load) + step_starts(unrolled, first_step=first_step)[-1]
    # the reserved peak lasts (reserved only falls when the cache is freed): its point is where most of it
    # is allocated, so fragmentation is what the step cannot use even at its fullest
    run = replay_trace(array("q", load), ops, sizes, parse_alloc_conf(alloc_conf or None), watch_from=second,
                       streams=trace_streams(unrolled, first_step=first_step))
    if run.watched is None:  # the second step allocates nothing: it holds what the first left
        result = AllocatorReplay(run.reserved, run.reserved - run.allocated, run.largest_free_block, run.allocated)
    else:
        peak, allocated, largest, most = run.watched
        result = AllocatorReplay(peak, peak - allocated, largest, most)
    with _REPLAYS_LOCK:
        _REPLAYS[key] = (unrolled, result)
        if len(_REPLAYS) > 512:
            _REPLAYS.popitem(last=False)
    return result


def replay_steps(unrolled: Program, shapes: Sequence[tuple[int, int, str]], load: tuple[int, ...] = ()
                 ) -> list[AllocatorReplay]:
    """`replay_step` of each ``(micro_batch, seq_len, alloc_conf)`` in `shapes`, side by side on the machine's
    cores (the C replay runs without the GIL): what a sweep of many batch shapes waits for. The same bytes,
    in the same order, as one call each."""
    def one(shape: tuple[int, int, str]) -> AllocatorReplay:
        return replay_step(unrolled, shape[0], shape[1], shape[2], load)

    distinct = list(dict.fromkeys(shapes))
    workers = min(len(distinct), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if workers <= 1:
        done = {shape: one(shape) for shape in distinct}
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = dict(zip(distinct, pool.map(one, distinct), strict=True))
    return [done[shape] for shape in shapes]


def replay_segments(unrolled: Program, micro_batch: int, seq_len: int, alloc_conf: str = "",
                    load: tuple[int, ...] = ()) -> list[dict]:
    """The allocator's segments after loading and two steps (what `replay_step` replays), in the shape of
    `trainmem_nb.engine.allocator.segments.segment_summary`: to compare with a GPU run's
    ``torch.cuda.memory._snapshot()`` taken after its measured step (``trainmem measure --device cuda``)."""
    from ..engine.allocator import CachingAllocator, parse_alloc_conf
    from ..engine.allocator.fast import expand, expand_streams
    from ..engine.allocator.segments import segment_summary
    from ..engine.trace import trace_arrays, trace_streams

    a = CachingAllocator(parse_alloc_conf(alloc_conf or None))
    a.replay(expand(load, *trace_arrays(unrolled, micro_batch, seq_len, first_step=True)),
             expand_streams(load, trace_streams(unrolled, first_step=True)), timeline=False, memo=False)
    return segment_summary(a.snapshot())


def replayable(prog: Program, peak: int) -> bool:
    """Is a step compiled as `prog` (folded or unrolled) with `peak` allocated bytes within the replay's
    limits (`trainmem_nb.device.REPLAY_MAX_EVENTS`, `REPLAY_MAX_BYTES`)? Beyond them the reserved bytes
    come from the churn model: a replay would take minutes, or model a step no card can hold."""
    from ..device import REPLAY_MAX_BYTES, REPLAY_MAX_EVENTS
    from ..engine.trace import trace_length

    return peak <= REPLAY_MAX_BYTES and trace_length(prog) <= REPLAY_MAX_EVENTS


def replayed_reserved_and_total(t: TrainingSpec, peak: int, replay: AllocatorReplay | None,
                                calibration: Calibration | None, unified: int = 0) -> tuple[int, int]:
    """Reserved bytes and device total of a step whose allocated peak is `peak`, from the allocator's
    replay (CUDA); CPU: both equal the peak."""
    if t.device is not Device.CUDA or replay is None:
        return peak, peak
    reserved = max(replay.peak_reserved_bytes, peak)
    return reserved, reserved + cuda_context_bytes(t, calibration) + unified


def replay_on_card(unrolled: Program, micro_batch: int, seq_len: int, alloc_conf: str, capacity: int,
                   load: tuple[int, ...] = ()) -> dict | None:
    """Replay loading and two steps with `capacity` bytes for the allocator (a card's memory less the CUDA context):
    short of memory it frees its cache and retries, as ``c10::cuda::CUDACachingAllocator`` does, so a
    step whose cache would outgrow the card may still run. None when it runs; else the out-of-memory
    report (``verdict`` says whether the tensors fit and no free block was large enough)."""
    from ..engine.allocator import parse_alloc_conf
    from ..engine.allocator.fast import replay_trace
    from ..engine.trace import trace_arrays, trace_streams

    if capacity <= 0:
        return {"verdict": "no memory is left for the allocator after the CUDA context", "fragmentation": False,
                "requested": 0, "largest_free_block": 0, "total_free": 0}
    ops, sizes = trace_arrays(unrolled, micro_batch, seq_len, first_step=True)
    return replay_trace(array("q", load), ops, sizes, parse_alloc_conf(alloc_conf or None), capacity=capacity,
                        streams=trace_streams(unrolled, first_step=True)).oom


_SCREENING: ContextVar[bool] = ContextVar("trainmem_nb_screening", default=False)


@contextmanager
def _screened(on: bool) -> Iterator[None]:
    token = _SCREENING.set(on)
    try:
        yield
    finally:
        _SCREENING.reset(token)


def screening() -> AbstractContextManager[None]:
    """Estimates inside take reserved bytes from the churn model (`reserved_and_total_over_step` at
    `churn_fraction`) instead of replaying the allocator: for searches that try many steps (the
    planner's micro-batch bisection over every layout) and replay only the ones they report."""
    return _screened(True)


def replayed() -> AbstractContextManager[None]:
    """Estimates inside replay the allocator even within `screening`: what a search reports (a planner's
    rows), once it has screened its candidates with the churn model."""
    return _screened(False)


def replaying() -> bool:
    """Do estimates replay the caching allocator now (outside `screening`)?"""
    return not _SCREENING.get()
