"""Pipeline parallelism: micro-batches in flight per schedule, stage boundaries and the buffers
``torch.distributed.pipelining`` keeps.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from ..engine.program import Segment, _segment, evaluate
from ..engine.tape import Sz, per_token
from ..model.spec import ModelSpec
from ..spec.parallel import ParallelSpec, PipelineSchedule
from ..spec.training import TrainingSpec
from ..step.compile import compile_step, program_key
from .fsdp import PIPELINE_REDUCE, FSDP2Hooks
from .ranks import _CAT


def _in_flight(p: ParallelSpec, stage: int, grad_accum: int) -> Fraction:
    """Micro-batches of activations pipeline stage `stage` holds at its peak (a fraction with the
    interleaved schedule, whose unit is one model chunk: 1/virtual_stages of the stage's layers).

    Megatron-LM, megatron/core/pipeline_parallel/schedules.py: a rank runs ``num_warmup_microbatches``
    forwards, then one more forward before its first backward (``max_outstanding_backprops =
    num_warmup_microbatches + 1``), all of them when the warm-up covers every micro-batch:

    * 1F1B (forward_backward_pipelining_without_interleaving): warm-up ``pp - rank - 1``, so
      ``pp - rank`` micro-batches (at most ``grad_accum``);
    * interleaved (get_pp_rank_microbatches for forward_backward_pipelining_with_interleaving):
      warm-up ``(pp - rank - 1) * 2 + (v - 1) * pp`` model chunks (``microbatch_group_size_per_vp_stage``
      defaults to pp) out of ``grad_accum * v``; on rank 0 that is ``pp + (pp - 1) / v`` micro-batches,
      Narayanan et al. 2021 (sec. 2.2)'s ``pp * (1 + (pp - 1) / (pp * v))``;
    * GPipe: every micro-batch.
    """
    if p.pp == 1:
        return Fraction(1)
    ga = max(1, grad_accum)
    if p.pp_schedule is PipelineSchedule.GPIPE:
        return Fraction(ga)
    if p.pp_schedule is PipelineSchedule.INTERLEAVED:
        v = p.virtual_stages
        warmup = (p.pp - stage - 1) * 2 + (v - 1) * p.pp
        return Fraction(min(warmup + 1, ga * v), v)
    return Fraction(min(p.pp - stage, ga))


# ``schedule.step(..., return_outputs=True)`` is torch's default (torch/distributed/pipelining/
# schedules.py, PipelineScheduleSingle.step) and torchtitan keeps it (torchtitan/train.py,
# forward_backward_step: ``self.pp_schedule.step(inputs, target=targets, losses=losses,
# input_batch=inputs)``, no return_outputs): ``ParallelSpec.pp_return_outputs`` defaults to True.


def _stage_boundary_bytes(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> Sz:
    """One micro-batch of the activation a stage sends to the next (and of its gradient coming back):
    b × s × hidden in the layers' output dtype (FSDP's ``param_dtype`` under mixed precision). With
    sequence parallelism a transformer block's output is sequence-sharded (torchtitan's TP plan:
    ``feed_forward.w2`` is ``RowwiseParallel(output_layouts=Shard(1))``), so s / tp of it crosses."""
    dt = 2 if t.mixed else t.param_bytes
    return per_token(m.hidden * dt / (p.tp if p.sp and p.tp > 1 else 1))


def _stage_output_bytes(m: ModelSpec, t: TrainingSpec) -> Sz:
    """One micro-batch of the last stage's output, the logits: b × s × vocab (the tensor-parallel
    rank's vocabulary) in the head's output dtype."""
    return per_token(m.vocab * (2 if t.mixed else t.param_bytes))


def _pipeline_buffers(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, stage: int, held: Fraction,
                      done: int) -> tuple[tuple[int, Sz, int], ...]:
    """What torch.distributed.pipelining's stage holds besides the program's micro-batch, as `Program.init`
    entries, when the program counts `held` micro-batches in flight and `done` backwards have run.

    torch/distributed/pipelining (torch 2.13), on the first ``step`` only (schedules.py,
    ``_initialize_pp_stages``: ``_prepare_forward_infra`` / ``_prepare_backward_infra`` run while the
    stage is not yet initialized) and kept for good (``args_recv_info`` / ``grad_recv_info`` are never
    cleared), one buffer per micro-batch:

    * a non-first stage's activation receive buffers (stage.py, PipelineStage._setup_forward_recv_info:
      ``buffer=_make_tensor_from_meta(meta, self.device)`` for every ``chunk_id in
      range(num_microbatches)``); a micro-batch's buffer *is* its stage input
      (``_retrieve_recv_activations``: ``info.buffer.requires_grad_(...)``), so the `held` micro-batches'
      inputs the program counts are these buffers and only the others are added;
    * a non-last stage's gradient receive buffers (``_setup_backward_recv_info`` →
      ``_create_grad_recv_info``: ``buffer=_make_tensor_from_meta(grad_meta, self.device)`` per micro-batch);
    * a non-first stage's input gradients: ``stage_backward`` (_backward.py) runs
      ``torch.autograd.backward`` into the receive buffer, a leaf, so each micro-batch's input gradient
      stays as ``buffer.grad`` until the next step's ``clear_runtime_states`` (``a.buffer.grad = None``):
      `done` of them;
    * the last stage's outputs with ``return_outputs`` (stage.py, forward_one_chunk: ``if self.is_last and
      save_forward_output: self.output_chunks.append(output)``), cleared by the next step's
      ``clear_runtime_states``: every micro-batch forwarded so far, ``done + held``.

    Interleaved schedules hold these per model chunk (a chunk is first or last only on the first or last
    rank); the micro-batches in flight are then counted for the stage as a whole and spread evenly over its
    chunks, an approximation (Megatron's order puts more of them on the earlier chunks: within one boundary
    buffer per chunk) that no measurement here checks.
    """
    v = p.virtual_stages if p.pp_schedule is PipelineSchedule.INTERLEAVED else 1
    n = max(1, t.grad_accum)
    not_first = v - (1 if stage == 0 else 0)  # model chunks that receive activations
    not_last = v - (1 if stage == p.pp - 1 else 0)  # model chunks that receive gradients
    comm, head = _CAT["overhead/communication"], _CAT["activations/head"]
    act = _stage_boundary_bytes(m, t, p)
    out: list[tuple[int, Sz, int]] = []
    if not_first:
        out.append((comm, act, max(0, int(n * not_first - held * not_first))))  # receive buffers not in `held`
        out.append((comm, act, done * not_first))  # buffer.grad of the micro-batches already backwarded
    if not_last:
        out.append((comm, act, n * not_last))  # gradient receive buffers
    if p.pp_return_outputs and stage == p.pp - 1:
        out.append((head, _stage_output_bytes(m, t), min(n, int(done + held))))  # output_chunks
    return tuple(e for e in out if e[2])


def _merge_outputs_segment(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> Segment:
    """The last stage's ``_merge_outputs(self._stage.output_chunks)`` after the step's micro-batches
    (schedules.py, PipelineScheduleSingle.step, after ``perform_reduce_grad``): microbatch.py
    merge_chunks ``torch.cat``s every micro-batch's output into a new tensor, which torchtitan drops."""
    merged = _stage_output_bytes(m, t) * max(1, t.grad_accum)
    return _segment("backward", "merge the micro-batches' outputs (_merge_outputs)", 1,
                    ((_CAT["activations/head"], 1, merged, "torch.cat(output_chunks)"),
                     (_CAT["activations/head"], -1, merged, "merged output dropped")))


def _fsdp_pipeline_peak(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, hooks: FSDP2Hooks, prog: Any, stage: int,
                        seq: int, workspace: int | None) -> tuple[Any, Any, dict[str, int], Fraction]:
    """The peak of an FSDP2 pipeline stage: the program (`prog`, a later micro-batch: the unsharded
    gradients exist) and the other micro-batches' saved activations alive during its forward and backward,
    not during the deferred reduce-scatter and the optimizer step, which follow the last backward; with
    the micro-batches whose activations the peak holds (for sequence parallelism's saving). Each
    candidate adds pipelining's own buffers for its point in the schedule (`_pipeline_buffers`).

    1F1B (torch.distributed.pipelining, schedules.py, Schedule1F1B: ``warmup_chunks = min(n_microbatches,
    num_stages - stage_index)`` forwards, then a backward before each further forward) runs micro-batch
    0's backward with ``k = min(pp - stage, grad_accum)`` micro-batches in flight and no accumulated
    gradient yet, and a later one's with ``L = min(k, grad_accum - 1)`` and every accumulated gradient:
    micro-batch ``grad_accum - L`` (the last with L in flight; later ones hold fewer activations but more
    input gradients and outputs, so the last micro-batch, one in flight, is a candidate too). GPipe has
    every micro-batch in flight. The candidates are evaluated; the largest is the peak. The returned
    program is the whole step with every buffer added before the deferred reduce-scatter (no micro-batch
    in flight) and the last stage's output merge after it."""
    import dataclasses

    from ..engine.program import activations_at_forward_end

    b, n = t.micro_batch, max(1, t.grad_accum)

    def with_buffers(program: Any, held: Fraction, done: int) -> Any:
        return dataclasses.replace(program, init=program.init + _pipeline_buffers(m, t, p, stage, held, done))

    def candidate(program: Any, others: Fraction, done: int) -> tuple[int, Any, dict[str, int], Fraction]:
        i = next((i for i, sg in enumerate(program.segments) if sg.label.startswith(PIPELINE_REDUCE)),
                 len(program.segments))
        ev = evaluate(with_buffers(dataclasses.replace(program, segments=program.segments[:i]), others + 1, done),
                      b, seq)
        detail = dict(ev.detail)
        held = int(activations_at_forward_end(program, b, seq) * others) if others > 0 else 0
        if held:
            detail["activations/layers"] = detail.get("activations/layers", 0) + held
        return ev.peak + held, ev, detail, others + 1

    k = _in_flight(p, stage, t.grad_accum)
    later = min(k, Fraction(max(1, t.grad_accum - 1))) if t.grad_accum > 1 else k
    best = candidate(prog, later - 1, int(n - later) if t.grad_accum > 1 else 0)
    if t.grad_accum > 1:
        if later > 1:  # the last micro-batch: one in flight, every other input gradient and output kept
            best = max(best, candidate(prog, Fraction(0), n - 1), key=lambda c: c[0])
        # micro-batch 0: the unsharded gradients are created during its backward
        t1 = TrainingSpec.model_validate({**t.model_dump(), "grad_accum": 1})
        first = dataclasses.replace(hooks, accumulate=False, state={})
        best = max(best, candidate(compile_step(m, program_key(t1, m), first, workspace), k - 1, 0),
                   key=lambda c: c[0])
    # the reduce-scatter, the output merge and the optimizer step: no micro-batch in flight, all of
    # pipelining's buffers alive (allocated where the reduce-scatter begins, to count them once)
    i = next((i for i, sg in enumerate(prog.segments) if sg.label.startswith(PIPELINE_REDUCE)), len(prog.segments))
    j = next((j for j in range(i, len(prog.segments)) if not prog.segments[j].label.startswith(PIPELINE_REDUCE)),
             len(prog.segments))
    buffers = _segment("backward", "pipelining's buffers (kept all step; counted from here, no micro-batch in flight)",
                       1, tuple((cat, count, sz, "pipeline buffers") for cat, sz, count in
                                _pipeline_buffers(m, t, p, stage, Fraction(0), n)))
    merge = (_merge_outputs_segment(m, t, p),) if p.pp_return_outputs and stage == p.pp - 1 else ()
    whole = dataclasses.replace(prog, segments=(*prog.segments[:i], buffers, *prog.segments[i:j], *merge,
                                                *prog.segments[j:]))
    full = evaluate(whole, b, seq)
    if full.peak > best[0]:
        return whole, full, dict(full.detail), Fraction(0)
    return whole, best[1], best[2], best[3]
