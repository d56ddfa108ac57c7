"""Every distinct rank's memory for a parallel layout; the headline is the worst rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..engine.program import evaluate
from ..model.params import ParamTensor, trainable_tensors, weight_tensors
from ..model.spec import ModelSpec
from ..spec.calibration import Calibration
from ..spec.choices import Device
from ..spec.parallel import Engine, Offload, ParallelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks, compile_step, program_key
from ..step.optimizers import paged_state_bytes
from ..step.reserved import reserved_and_total
from .ddp import DDPHooks
from .fsdp import FSDP2Hooks
from .layout import _hooks, _host_bytes, _sequence_parallel_saving, _stages, _tp_model
from .pipeline import _fsdp_pipeline_peak, _in_flight
from .ranks import RankMemory, _held, _row_shard

__all__ = ["LayoutMemory", "simulate_parallel"]


class LayoutMemory(NamedTuple):
    """Every distinct rank of a layout (`rows`), the worst one's compiled program, and what the
    headline reports beside it (the CUDA overheads of the worst rank, parameter counts)."""

    rows: tuple[RankMemory, ...]
    worst: RankMemory
    program: Any
    overhead: dict[str, int]
    n_params: int
    n_trainable: int


def simulate_parallel(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, calibration: Calibration | None,
                      backend: str | None = None) -> LayoutMemory:
    """Every distinct rank's memory for layout `p`; the headline is the worst rank. `backend` overrides
    the collectives library ("nccl" models a GPU job's, as the fake process group measures it)."""
    rank_model = _tp_model(m, p)
    seq = -(-t.seq_len // p.cp)
    rows: list[RankMemory] = []
    worst = None
    for stage, n_layers in _stages(rank_model, p) if p.pp > 1 else [(0, rank_model.n_layers)]:
        stage_model = rank_model if n_layers == rank_model.n_layers else ModelSpec.model_validate(
            {**rank_model.model_dump(), "n_layers": n_layers})
        hooks = _hooks(stage_model, t, p, backend, first=stage == 0, last=stage == p.pp - 1)
        workspace = calibration.workspace_bytes if calibration else None
        prog = compile_step(stage_model, program_key(t, stage_model), hooks, workspace)
        in_flight = _in_flight(p, stage, t.grad_accum)
        if isinstance(hooks, FSDP2Hooks) and hooks.pipelined:
            prog, ev, detail, in_flight = _fsdp_pipeline_peak(stage_model, t, p, hooks, prog, stage, seq, workspace)
        else:
            ev = evaluate(prog, t.micro_batch, seq)
            detail = dict(ev.detail)
            extra = in_flight - 1
            if extra > 0:  # other micro-batches' (interleaved: model chunks') saved activations on this stage
                from ..engine.program import activations_at_forward_end

                held = int(activations_at_forward_end(prog, t.micro_batch, seq) * extra)
                detail["activations/layers"] = detail.get("activations/layers", 0) + held
        if p.sp and p.tp > 1:
            freed = int(_sequence_parallel_saving(stage_model, t, p, seq) * in_flight)
            detail["activations/layers"] = max(0, detail.get("activations/layers", 0) - freed)
        host = _host_bytes(hooks, stage_model, t, p, detail)
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
                return _row_shard(q, d) if _held(h, q, sm) else None

            paged = paged_state_bytes(stage_model, t, stage_shard)
        reserved, total = reserved_and_total(t, peak, tops.get("activations", 0) + tops.get("transient", 0),
                                             calibration, paged)
        per_stage = p.gpus // p.pp
        first, last = stage * per_stage, (stage + 1) * per_stage - 1
        label = f"stage {stage} (ranks {first}-{last})" if p.pp > 1 else f"every rank (0-{p.gpus - 1})"
        row = RankMemory(label, stage, n_layers, peak, reserved, total, ev.peak_phase, ev.peak_at,
                         {k: tops.get(k, 0) for k in ("weights", "gradients", "optimizer_states", "activations",
                                                      "transient", "overhead")}, detail, host)
        rows.append(row)
        if worst is None or row.device_total_bytes > worst[0].device_total_bytes:
            worst = (row, prog)
    assert worst is not None
    row, prog = worst
    overhead = {}
    if t.device is Device.CUDA:
        context = reserved_and_total(t, 0, 0, calibration)[1]  # the CUDA context alone
        overhead = {"allocator_cache": row.peak_reserved_bytes - row.peak_allocated_bytes, "cuda_context": context}
        paged = row.device_total_bytes - row.peak_reserved_bytes - context
        if paged:
            overhead["paged_optimizer_states"] = paged
    n_params = sum(q.numel * q.count for q, _, _ in weight_tensors(m, t))
    n_train = sum(q.numel * q.count for q, _ in trainable_tensors(m, t))
    return LayoutMemory(tuple(rows), row, prog, overhead, n_params, n_train)
