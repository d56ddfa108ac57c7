"""Every distinct rank's memory for a parallel layout; each headline figure is the worst rank's.
"""

from __future__ import annotations

from typing import NamedTuple

from ..engine.program import Program, evaluate, peak_with_churn
from ..model.params import ParamTensor, trainable_tensors, weight_tensors
from ..model.spec import ModelSpec
from ..spec.calibration import Calibration
from ..spec.choices import Device
from ..spec.parallel import Engine, Offload, ParallelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks, compile_step, program_key
from ..step.load import load_peak_bytes, loading_events
from ..step.optimizers import paged_state_bytes
from ..step.reserved import (
    AllocatorReplay,
    churn_fraction,
    replay_step,
    replayable,
    replayed_reserved_and_total,
    replaying,
    reserved_and_total,
    reserved_and_total_over_step,
)
from .ddp import DDPHooks
from .fsdp import FSDP2Hooks
from .layout import _hooks, _host_bytes, _sequence_parallel, _stages, _tp_model, rank_seq_len
from .pipeline import _fsdp_pipeline_program, _in_flight, _with_micro_batches_in_flight
from .ranks import RankMemory, _held, _row_shard, shard_world

__all__ = ["LayoutMemory", "simulate_parallel"]


class LayoutMemory(NamedTuple):
    """Every distinct rank of a layout (`rows`) and what the headline reports: each figure of `worst` is
    the maximum over the rows (allocated, reserved, device total), its breakdown, phase and `program`
    those of the row with the largest allocated peak; the CUDA overheads split the headline; parameter
    counts; every row's program (`programs`, in the order of `rows`) and the (micro_batch, seq_len)
    each rank's program is evaluated at (`shape`: context parallelism splits the sequence)."""

    rows: tuple[RankMemory, ...]
    worst: RankMemory
    program: Program
    overhead: dict[str, int]
    n_params: int
    n_trainable: int
    programs: tuple[Program, ...]
    shape: tuple[int, int]
    #: the caching allocator's replay of the rank with the largest reserved peak (None on CPU)
    allocator: AllocatorReplay | None = None
    #: the most bytes a rank allocates while loading its share of the model (`trainmem_nb.step.load`)
    load_peak_bytes: int = 0
    #: that rank's loading trace (`trainmem_nb.step.load.loading_events`), for the timeline's load phase
    load_trace: tuple[int, ...] = ()
    #: per row, the program whose forward end holds the most activations (`MemoryEstimate.saved_programs`)
    saved_programs: tuple[Program, ...] = ()
    #: the highest allocated bytes in each phase of the row with the largest allocated peak (`worst`'s breakdown)
    phase_peaks: tuple[tuple[str, int], ...] = ()


def simulate_parallel(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, calibration: Calibration | None,
                      backend: str | None = None) -> LayoutMemory:
    """Every distinct rank's memory for layout `p`; each headline figure is the worst rank's. `backend`
    overrides the collectives library ("nccl" models a GPU job's, as the fake process group measures it)."""
    rank_model = _tp_model(m, p)
    shape = (t.micro_batch, rank_seq_len(t, p))
    rows: list[RankMemory] = []
    programs: list[Program] = []
    saved_programs: list[Program] = []
    phase_peaks: list[dict[str, int]] = []
    replays: list[AllocatorReplay | None] = []
    loads: list[int] = []
    load_traces: list[tuple[int, ...]] = []
    for stage, stage_model in _stages(rank_model, p):
        n_layers = stage_model.n_layers
        hooks = _hooks(stage_model, t, p, backend, first=stage == 0, last=stage == p.pp - 1)
        workspace = calibration.workspace_bytes if calibration else None

        def prepare(program: Program, sm: ModelSpec = stage_model) -> Program:
            return _sequence_parallel(program, sm, t, p)

        # every per-rank adjustment is part of the rank's program, so its evaluation, `timeline` and
        # the saved activations read one accounting: the sequence split by context parallelism (`shape`),
        # sequence parallelism's saving, offloaded states left out of the engine's `init`, and the other
        # micro-batches a pipeline stage keeps in flight
        prog = compile_step(stage_model, program_key(t, stage_model), hooks, workspace)
        if prog.approximated:  # the engine's tensors where they belong, every layer simulated
            prog = compile_step(stage_model, program_key(t, stage_model), hooks, workspace, unrolled=True)
        prog = prepare(prog)
        if isinstance(hooks, FSDP2Hooks) and hooks.pipelined:
            prog, fullest = _fsdp_pipeline_program(stage_model, t, p, hooks, prog, stage, shape, workspace, prepare)
        else:  # other micro-batches' (interleaved: model chunks') saved activations on this stage
            prog = fullest = _with_micro_batches_in_flight(prog, _in_flight(p, stage, t.grad_accum) - 1)
        saved_programs.append(fullest)
        ev = evaluate(prog, *shape)
        phase_peaks.append(ev.phase_peaks)
        detail = dict(ev.detail)
        host = _host_bytes(hooks, stage_model, t, p)
        peak = sum(detail.values())
        tops: dict[str, int] = {}
        for k, v in detail.items():
            tops[k.split("/")[0]] = tops.get(k.split("/")[0], 0) + v
        # a paged optimizer's unified-memory states (`paged_state_bytes`): only where the optimizer is
        # the training loop's (DDP, FSDP) and steps on the GPU; DeepSpeed and Megatron run their own
        paged = 0
        if t.device is Device.CUDA and isinstance(hooks, (FSDP2Hooks, DDPHooks)) and p.offload is Offload.NONE:
            degree = p.shard_degree if (p.zero or p.engine is Engine.FSDP) else 1

            def stage_shard(q: ParamTensor, h: EngineHooks = hooks, sm: ModelSpec = stage_model,
                            d: int = degree) -> ParamTensor | None:
                return _row_shard(q, shard_world(q, d, p.ep)) if _held(h, q, sm) else None

            paged = paged_state_bytes(stage_model, t, stage_shard)
        # what a rank loads: its stage's layers and tensor-parallel slices, sharded where the engine shards
        # the parameters it keeps (FSDP at any stage, ZeRO-3)
        sharded = p.zero >= 3 or (p.engine is Engine.FSDP and p.zero)
        load_share = 1.0 / p.shard_degree if sharded else 1.0
        # a rank's routed experts (n_experts / ep of them) shard over the shard_degree / ep ranks holding them
        expert_share = 1.0 / max(1, p.shard_degree // p.ep) if sharded else 1.0
        own = hooks.loading(stage_model, program_key(t, stage_model))  # FSDP1's wrapping, DeepSpeed's
        if own is not None:
            load_trace, load_peak = own
        else:
            load_trace = loading_events(stage_model, t, load_share, expert_share)
            load_peak = load_peak_bytes(stage_model, t, load_share, expert_share)
        loads.append(load_peak)
        load_traces.append(load_trace)
        replay = None
        if t.device is Device.CUDA and calibration is None and replaying() and replayable(prog, peak):
            # the allocator's replay reads every layer's events in order: the unrolled program, adjusted
            # as the rank's (an FSDP pipeline stage's candidates are built around the folded one)
            if isinstance(hooks, FSDP2Hooks) and hooks.pipelined:
                unrolled = prog
            else:
                unrolled = _with_micro_batches_in_flight(
                    prepare(compile_step(stage_model, program_key(t, stage_model), hooks, workspace, unrolled=True)),
                    _in_flight(p, stage, t.grad_accum) - 1)
            replay = replay_step(unrolled, *shape, t.alloc_conf, load_trace, first_step=False)
        if replay is None:  # a GPU run's measured cache fraction overrides the replay; a search screens without it
            high_water = (peak_with_churn(prog, *shape, churn_fraction(calibration))
                          if t.device is Device.CUDA else peak)  # CPU: nothing is cached
            reserved, total = reserved_and_total_over_step(t, peak, high_water, calibration, paged)
        else:
            reserved, total = replayed_reserved_and_total(t, peak, replay, calibration, paged)
        replays.append(replay)
        per_stage = p.gpus // p.pp
        first, last = stage * per_stage, (stage + 1) * per_stage - 1
        label = f"stage {stage} (ranks {first}-{last})" if p.pp > 1 else f"every rank (0-{p.gpus - 1})"
        row = RankMemory(label, stage, n_layers, peak, reserved, total, ev.peak_phase, ev.peak_at,
                         {k: tops.get(k, 0) for k in ("weights", "gradients", "optimizer_states", "activations",
                                                      "transient", "overhead")}, detail, host)
        rows.append(row)
        programs.append(prog)
    # each headline figure is the maximum over the ranks; the breakdown, the program (its timeline) and
    # the phase are those of the rank with the largest allocated peak, so they add up to the headline
    lead = max(range(len(rows)), key=lambda i: rows[i].peak_allocated_bytes)
    row = rows[lead]
    headline = row._replace(peak_reserved_bytes=max(r.peak_reserved_bytes for r in rows),
                            device_total_bytes=max(r.device_total_bytes for r in rows))
    overhead = {}
    if t.device is Device.CUDA:
        context = reserved_and_total(t, 0, 0, calibration)[1]  # the CUDA context alone
        overhead = {"allocator_cache": headline.peak_reserved_bytes - headline.peak_allocated_bytes,
                    "cuda_context": context}
        paged = headline.device_total_bytes - headline.peak_reserved_bytes - context
        if paged:
            overhead["paged_optimizer_states"] = paged
    n_params = sum(q.numel * q.count for q, _, _ in weight_tensors(m, t))
    n_train = sum(q.numel * q.count for q, _ in trainable_tensors(m, t))
    most = max(range(len(rows)), key=lambda i: rows[i].peak_reserved_bytes)
    return LayoutMemory(tuple(rows), headline, programs[lead], overhead, n_params, n_train, tuple(programs),
                        shape, replays[most], max(loads), load_traces[loads.index(max(loads))], tuple(saved_programs),
                        tuple(phase_peaks[lead].items()))
