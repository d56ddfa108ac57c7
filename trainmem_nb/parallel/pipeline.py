"""Pipeline parallelism: micro-batches in flight per schedule, stage boundaries and the buffers
``torch.distributed.pipelining`` keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fractions import Fraction

from ..engine.program import Program, Segment, _segment, evaluate, forward_activation_events
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


def _release_point(prog: Program) -> int:
    """Index of the first segment after the micro-batch's own backward: the deferred reduce-scatter of
    an FSDP stage, else the optimizer step or zero_grad (the end of the program if neither)."""
    return next((i for i, sg in enumerate(prog.segments)
                 if sg.phase not in ("forward", "backward") or sg.label.startswith(PIPELINE_REDUCE)),
                len(prog.segments))


def _in_flight_segments(prog: Program, others: Fraction) -> tuple[Segment, Segment] | None:
    """The saved activations of `others` more micro-batches (a fraction under the interleaved schedule:
    model chunks of 1/virtual_stages of the stage), as one segment that allocates them and one that
    frees them. Each is a copy of the program's own micro-batch at the end of its forward
    (`forward_activation_events`): whole micro-batches as whole copies of every tensor, a fraction as
    tensors of that fraction of the size. None when nothing else is in flight."""
    if others <= 0:
        return None
    whole, part = divmod(others.numerator, others.denominator)
    frac = float(Fraction(part, others.denominator))
    held: list[tuple[int, int, Sz, str]] = []
    for cat, k, sz, label in forward_activation_events(prog):
        if whole:
            held.append((cat, k * whole, sz, label))
        if frac:
            held.append((cat, k, sz * frac, f"{label} (part of a micro-batch: one model chunk)"))
    n = f"{float(others):g}"
    alloc = _segment("forward", f"{n} other micro-batch(es) in flight: their saved activations", 1, tuple(held))
    free = _segment("backward", f"{n} other micro-batch(es) in flight: their backward done", 1,
                    tuple((cat, -k, sz, label) for cat, k, sz, label in held))
    return alloc, free


def _with_micro_batches_in_flight(prog: Program, others: Fraction) -> Program:
    """A pipeline stage's step as its program sees it: `others` more micro-batches' saved activations
    (`_in_flight_segments`) alive from the step's start until the program's micro-batch has run its
    backward (the stage's peak is in its forward or backward; no micro-batch is in flight during the
    optimizer step)."""
    held = _in_flight_segments(prog, others)
    if held is None:
        return prog
    i = _release_point(prog)
    segs = prog.segments
    return dataclasses.replace(prog, segments=(held[0], *segs[:i], held[1], *segs[i:]))


def _buffer_change(before: tuple[tuple[int, Sz, int], ...], after: tuple[tuple[int, Sz, int], ...],
                   label: str) -> Segment:
    """A segment taking pipelining's buffers from `before` to `after` (`_pipeline_buffers` entries):
    buffers released first, then the new ones allocated."""
    counts: dict[tuple[int, Sz], int] = {}
    for cat, sz, n in before:
        counts[(cat, sz)] = counts.get((cat, sz), 0) - n
    for cat, sz, n in after:
        counts[(cat, sz)] = counts.get((cat, sz), 0) + n
    events = [(cat, n, sz, "pipeline buffers") for (cat, sz), n in counts.items() if n < 0]
    events += [(cat, n, sz, "pipeline buffers") for (cat, sz), n in counts.items() if n > 0]
    return _segment("backward", label, 1, tuple(events))


def _fsdp_pipeline_program(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, hooks: FSDP2Hooks, prog: Program,
                           stage: int, shape: tuple[int, int], workspace: int | None,
                           prepare: Callable[[Program], Program]) -> tuple[Program, Program]:
    """The step of an FSDP2 pipeline stage around its costliest micro-batch, as one program: that
    micro-batch's forward and backward with the other micro-batches' saved activations alive
    (`_in_flight_segments`) and pipelining's own buffers for its point in the schedule
    (`_pipeline_buffers`), then the deferred reduce-scatter, the last stage's output merge and the
    optimizer step with no micro-batch in flight and every buffer alive. `prog` is a later micro-batch
    (the unsharded gradients exist); `prepare` turns a compiled program into the rank's (sequence
    parallelism); `shape` is the (micro_batch, seq_len) a rank evaluates.

    1F1B (torch.distributed.pipelining, schedules.py, Schedule1F1B: ``warmup_chunks = min(n_microbatches,
    num_stages - stage_index)`` forwards, then a backward before each further forward) runs micro-batch
    0's backward with ``k = min(pp - stage, grad_accum)`` micro-batches in flight and no accumulated
    gradient yet, and a later one's with ``L = min(k, grad_accum - 1)`` and every accumulated gradient:
    micro-batch ``grad_accum - L`` (the last with L in flight; later ones hold fewer activations but more
    input gradients and outputs, so the last micro-batch, one in flight, is a candidate too). GPipe has
    every micro-batch in flight. Each candidate is a whole step; the one with the highest peak is the
    stage's program (on a tie, the first: a later micro-batch). Returned with the candidate that has the most
    micro-batches in flight, whose forward end holds the stage's most saved activations."""
    n = max(1, t.grad_accum)
    final = _pipeline_buffers(m, t, p, stage, Fraction(0), n)
    merge = (_merge_outputs_segment(m, t, p),) if p.pp_return_outputs and stage == p.pp - 1 else ()

    def candidate(program: Program, others: Fraction, done: int) -> Program:
        segs = program.segments
        i = next((i for i, sg in enumerate(segs) if sg.label.startswith(PIPELINE_REDUCE)), len(segs))
        j = next((j for j in range(i, len(segs)) if not segs[j].label.startswith(PIPELINE_REDUCE)), len(segs))
        buffers = _pipeline_buffers(m, t, p, stage, others + 1, done)
        held = _in_flight_segments(program, others)
        # the deferred reduce-scatter starts with no micro-batch in flight and every buffer alive
        change = _buffer_change(buffers, final, "pipelining's buffers after the last micro-batch (kept all step)")
        body = (*segs[:i], change) if held is None else (held[0], *segs[:i], held[1], change)
        return dataclasses.replace(program, init=program.init + buffers,
                                   segments=(*body, *segs[i:j], *merge, *segs[j:]))

    k = _in_flight(p, stage, t.grad_accum)
    later = min(k, Fraction(max(1, t.grad_accum - 1))) if t.grad_accum > 1 else k
    options = [candidate(prog, later - 1, int(n - later) if t.grad_accum > 1 else 0)]
    if t.grad_accum > 1:
        if later > 1:  # the last micro-batch: one in flight, every other input gradient and output kept
            options.append(candidate(prog, Fraction(0), n - 1))
        # micro-batch 0: the unsharded gradients are created during its backward
        t1 = TrainingSpec.model_validate({**t.model_dump(), "grad_accum": 1})
        first = dataclasses.replace(hooks, accumulate=False, state={})
        options.append(candidate(prepare(compile_step(m, program_key(t1, m), first, workspace)), k - 1, 0))
    peaks = [evaluate(option, *shape).peak for option in options]
    return options[peaks.index(max(peaks))], options[-1]  # the last: micro-batch 0 (k - 1 others), or the only one
