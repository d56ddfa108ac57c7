"""`estimate()`'s engine: one device, or every rank of a parallel layout, as a `MemoryEstimate`.
"""

from __future__ import annotations

from ..engine.breakdown import DETAIL_KEYS, TOP_KEYS
from ..engine.program import evaluate, peak_with_churn
from ..model.spec import ModelSpec
from ..parallel.ranks import RankMemory
from ..parallel.simulate import LayoutMemory, simulate_parallel
from ..spec.calibration import Calibration
from ..spec.choices import Device
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec
from ..step.compile import _SINGLE, compile_step, program_key
from ..step.load import load_peak_bytes, loading_events
from ..step.optimizers import paged_state_bytes
from ..step.reserved import (
    AllocatorReplay,
    churn_fraction,
    replay_step,
    replayable,
    replayed_reserved_and_total,
    replaying,
    reserved_and_total_over_step,
)
from .result import MemoryEstimate

__all__ = ['simulate']

_TOP_OF = {k: k.split("/")[0] for k in DETAIL_KEYS}  # each detailed category's top-level one


def simulate(m: ModelSpec, t: TrainingSpec, calibration: Calibration | None = None,
             parallel: ParallelSpec | None = None, backend: str | None = None) -> MemoryEstimate:
    """One device: compile the step (cached), evaluate it, add the device's reserved and context bytes.
    A parallel layout: every distinct rank (`simulate_parallel`; `backend` overrides the collectives
    library, "nccl" as the fake process group measures it), the worst one in the headline."""
    if parallel is not None and not parallel.single_device:
        return _layout_estimate(m, t, parallel, calibration, simulate_parallel(m, t, parallel, calibration, backend))

    prog = compile_step(m, program_key(t, m), _SINGLE, calibration.workspace_bytes if calibration else None)
    ev = evaluate(prog, t.micro_batch, t.seq_len)
    tops = dict.fromkeys(TOP_KEYS, 0)
    for k, v in ev.detail.items():
        tops[_TOP_OF[k]] += v
    paged = paged_state_bytes(m, t) if t.device is Device.CUDA else 0
    replay = None
    load_trace = loading_events(m, t)
    if t.device is Device.CUDA and calibration is None and replaying() and replayable(prog, ev.peak):
        unrolled = compile_step(m, program_key(t, m), _SINGLE, calibration.workspace_bytes if calibration else None,
                                unrolled=True)
        replay = replay_step(unrolled, t.micro_batch, t.seq_len, t.alloc_conf, load_trace)
    if replay is None:  # a GPU run's measured cache fraction overrides the replay; a search screens without it
        high_water = (peak_with_churn(prog, t.micro_batch, t.seq_len, churn_fraction(calibration))
                      if t.device is Device.CUDA else ev.peak)  # CPU: nothing is cached
        reserved, total = reserved_and_total_over_step(t, ev.peak, high_water, calibration, paged)
    else:
        reserved, total = replayed_reserved_and_total(t, ev.peak, replay, calibration, paged)
    overhead = {}
    if t.device is Device.CUDA:
        overhead = {"allocator_cache": reserved - ev.peak, "cuda_context": total - reserved - paged}
        if paged:  # unified memory: outside the allocator, on the device while it has room
            overhead["paged_optimizer_states"] = paged
    only = RankMemory("the only device (rank 0)", 0, m.n_layers, ev.peak, reserved, total, ev.peak_phase, ev.peak_at,
                      tops, dict(ev.detail), 0)
    return MemoryEstimate(
        model=m, training=t, n_params=prog.n_params, n_trainable_params=prog.n_trainable,
        peak_allocated_bytes=ev.peak, peak_reserved_bytes=reserved, device_total_bytes=total,
        peak_phase=ev.peak_phase, peak_at=ev.peak_at, detail_bytes=ev.detail,
        phase_peaks_bytes=ev.phase_peaks, overhead_bytes=overhead, calibration=calibration, program=prog,
        parallel=parallel or ParallelSpec(), per_rank=(only,), rank_programs=(prog,), saved_programs=(),
        rank_shape=(t.micro_batch, t.seq_len), load_peak_bytes=load_peak_bytes(m, t), load_trace=load_trace,
        reserved_from=_reserved_from(t, calibration, replay), **_allocator_fields(replay),
    )


def _reserved_from(t: TrainingSpec, calibration: Calibration | None, replay: AllocatorReplay | None) -> str:
    """Where the reserved bytes come from (`MemoryEstimate.reserved_from`)."""
    if t.device is not Device.CUDA:
        return "allocated"
    return "calibration" if calibration else "replay" if replay else "churn model"


def _allocator_fields(replay: AllocatorReplay | None) -> dict[str, int]:
    if replay is None:
        return {}
    return {"fragmentation_bytes": replay.fragmentation_bytes,
            "largest_free_block_bytes": replay.largest_free_block_bytes}


def _layout_estimate(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, calibration: Calibration | None,
                     layout: LayoutMemory) -> MemoryEstimate:
    row = layout.worst
    return MemoryEstimate(
        model=m, training=t, n_params=layout.n_params, n_trainable_params=layout.n_trainable,
        peak_allocated_bytes=row.peak_allocated_bytes, peak_reserved_bytes=row.peak_reserved_bytes,
        device_total_bytes=row.device_total_bytes, peak_phase=row.peak_phase, peak_at=row.peak_at,
        detail_bytes=row.detail_bytes, phase_peaks_bytes=dict(layout.phase_peaks), overhead_bytes=layout.overhead,
        calibration=calibration,
        program=layout.program, parallel=p, per_rank=layout.rows, host_bytes=max(r.host_bytes for r in layout.rows),
        rank_programs=layout.programs, saved_programs=layout.saved_programs, rank_shape=layout.shape,
        load_peak_bytes=layout.load_peak_bytes,
        load_trace=layout.load_trace, reserved_from=_reserved_from(t, calibration, layout.allocator), **_allocator_fields(layout.allocator),
    )
