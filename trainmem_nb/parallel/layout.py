"""From a layout to each rank's model and engine: tensor/expert splits, pipeline stages, sequence
parallelism's saving, host memory for offload.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..engine.program import CAT_INDEX, Program, Segment, _round, _segment
from ..engine.tape import Sz
from ..model.params import ParamTensor, idle_tensors, on_stage, weight_tensors
from ..model.spec import ModelSpec
from ..recipes.base import fp8_weight
from ..spec.choices import Checkpointing, Device, Fp8Recipe, Precision
from ..spec.parallel import Engine, Offload, ParallelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks, program_key
from ..step.optimizers import flat_state_bytes, paged_state_bytes, state_bytes
from .checks import runs_fsdp1
from .ddp import DDPHooks
from .deepspeed import DeepSpeedHooks, zero2_elements, zero3_gathering
from .fsdp import FSDP2Hooks
from .fsdp1 import FSDP1Hooks, flat_units
from .megatron import MegatronHooks
from .ranks import _held, _padded_shard, _Param, _partition, _row_shard, _units, nf4_parts, shard_world


def _tp_model(m: ModelSpec, p: ParallelSpec) -> ModelSpec:
    """The model as one tensor-parallel rank sees it: heads, kv heads, MLP, experts and vocabulary split."""
    if p.tp == 1 and p.ep == 1:
        return m
    data = m.model_dump()
    tp = p.tp
    data.update(n_heads=m.n_heads // tp, n_kv_heads=max(1, m.n_kv_heads // tp), head_dim=m.head_dim,
                ffn=max(1, m.ffn // tp), vocab=-(-m.vocab // tp), name=f"{m.name} (tp rank)",
                expert_ffn=max(1, m.expert_ffn // tp) if m.expert_ffn else 0)
    if m.is_moe and p.ep > 1:
        # expert parallelism: the rank holds n_experts / ep of each layer's routed experts; the router still
        # scores all of them and, with balanced routing, the rank's experts receive tokens * top_k rows
        # (`trainmem_nb.recipes.moe._ep_dispatch`)
        data["local_experts"] = m.n_experts // p.ep
        if p.tp == 1:
            data["name"] = f"{m.name} (ep rank)"
    return ModelSpec.model_validate(data)


def rank_seq_len(t: TrainingSpec, p: ParallelSpec) -> int:
    """Tokens of each sequence one rank holds: context parallelism splits the sequence `cp` ways
    (`trainmem_nb.parallel.checks.check_layout` requires a sequence that `2 * cp` divides; a sequence
    that does not divide is rounded up here, the largest rank's share)."""
    return -(-t.seq_len // p.cp)


def _stages(m: ModelSpec, p: ParallelSpec) -> list[tuple[int, ModelSpec]]:
    """(stage, its model) for each pipeline stage: the real layer list split as evenly as possible, the
    extra layers to the first stages; each stage's model is its slice of the layers (`ModelSpec.layer_slice`:
    a Gemma-3 or DeepSeek-V3 stage keeps the kinds of the layers it holds)."""
    if p.pp == 1:
        return [(0, m)]
    base, extra = divmod(m.n_layers, p.pp)
    out, start = [], 0
    for s in range(p.pp):
        stop = start + base + (1 if s < extra else 0)
        out.append((s, m.layer_slice(start, stop)))
        start = stop
    return out


def _sequence_parallel_saving_per_token(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> float:
    """Saved activation bytes per token (of b x s) that sequence parallelism removes from a
    tensor-parallel rank: the hidden-sized tensors TP leaves replicated (norm inputs and outputs,
    dropout masks; the layer input alone under full checkpointing) are split `tp` ways instead
    (Korthikanti et al. 2022, sec. 4.2.2: ``10 sbh`` becomes ``10 sbh / t``). Modelled from the paper,
    not measured here."""
    if t.checkpointing is Checkpointing.FULL:
        per_layer = 1
    else:
        dropout = (t.dropout if t.dropout is not None else m.hidden_dropout) > 0
        per_layer = 4 + (2 if dropout else 0)
    act_dt = 4 if t.precision is Precision.FP32 else 2
    per_layer_bytes = per_layer * act_dt
    if p.engine is Engine.MEGATRON and t.fp8 is not Fp8Recipe.NONE and t.checkpointing is not Checkpointing.FULL:
        # Transformer Engine saves the two norm outputs (the inputs of linear_qkv and linear_fc1) as one byte
        # each (`trainmem_nb.engine.ops.te_fp8`), so splitting them saves half as much
        per_layer_bytes -= 2 * (act_dt - 1)
    return m.n_layers * per_layer_bytes * m.hidden * (1 - 1 / p.tp)


def _per_token(sz: Sz) -> bool:
    """A size form with only a b x s term (a tensor of some features per token)."""
    return bool(sz.bs) and not (sz.c0 or sz.s_ or sz.bss or sz.b_ or sz.ss)


def _sequence_parallel(prog: Program, m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> Program:
    """A tensor-parallel rank's program under sequence parallelism: the layers' saved per-token tensors
    shrink so that, at the end of the forward pass, they hold `_sequence_parallel_saving_per_token`
    fewer bytes per token.

    The symbolic step does not know which of its tensors SP shards (the recipes build full-sequence
    norms, dropouts and residuals), so the saving is spread over the layers' saved per-token tensors in
    proportion to their size: every ``activations/layers`` tensor of the form ``c * b * s`` is scaled by
    one factor, its allocation and its free alike, so the program stays balanced, the peak is chosen
    with the saving in it, and `timeline` and the saved activations read the same numbers. Every
    pipeline micro-batch in flight is a copy of this program's forward, so it saves as much."""
    if not (p.sp and p.tp > 1):
        return prog
    layers = CAT_INDEX["activations/layers"]
    kept = 0.0  # bytes per token of the layers' per-token saved tensors at the end of the forward pass
    for seg in prog.segments:
        if seg.phase != "forward":
            break
        kept += sum(k * seg.repeat * sz.bs for cat, k, sz, _ in seg.events if cat == layers and _per_token(sz))
    if kept <= 0:
        return prog
    factor = max(0.0, 1 - _sequence_parallel_saving_per_token(m, t, p) / kept)

    def scaled(seg: Segment) -> Segment:
        events = tuple((cat, k, sz * factor if cat == layers and _per_token(sz) else sz, label)
                       for cat, k, sz, label in seg.events)
        return seg if events == seg.events else _segment(seg.phase, seg.label, seg.repeat, events)

    return dataclasses.replace(prog, segments=tuple(scaled(seg) for seg in prog.segments))


def _hooks(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, backend: str | None = None,
           first: bool = True, last: bool = True) -> EngineHooks:
    """The engine of layout `p` on a rank of the `first` and/or `last` pipeline stage; `backend` is the
    collectives library (default: gloo on CPU, NCCL on CUDA)."""
    weights = [w for w in weight_tensors(m, t) if on_stage(w[0], m, first, last)]
    stage: dict[str, Any] = {"first_stage": first, "last_stage": last}
    if p.zero >= 2 and runs_fsdp1(m, t, p):
        # Fabric's no_backward_sync (lit-gpt): the micro-steps before the last accumulate unsharded
        return FSDP1Hooks(world=p.shard_degree, reshard_after_forward=p.zero >= 3,
                          units=flat_units(weights, m, p.shard_degree, t.use_orig_params),
                          no_sync=t.grad_accum > 1, flat_unit_grads=t.use_orig_params, **stage)
    if p.engine is Engine.FSDP and p.zero >= 2:
        world = p.shard_degree
        mixed = t.mixed
        fp8_gathered = t.fp8_all_gather
        # the idle weights (a multimodal checkpoint's vision tower, never run on text) are outside the layers:
        # the root module's group shards them and gathers them with its own (measured)
        # (each tensor of a repeated one: the group gathers every tensor it holds)
        idle: list[tuple[ParamTensor, Any, bool]] = [w for w in idle_tensors(m, t) if on_stage(w[0], m, first, last)]
        units = tuple((name, tuple(_fsdp_param(w, world, p.ep, fp8_gathered and fp8_weight(w[0], m)) for w in ws))
                      for name, ws in _units([*weights, *idle], m).items())
        # torch.distributed.pipelining with FSDP2 stages (not with CPU offload, which is not modelled there)
        pipelined = p.pp > 1 and p.offload is Offload.NONE
        # the recipe of torchtitan and accelerate: MixedPrecisionPolicy(param_dtype=16-bit,
        # reduce_dtype=fp32) for mixed precision, parameters' own dtypes otherwise
        return FSDP2Hooks(world=world, reshard_after_forward=p.zero >= 3, param_dt=2 if mixed else None,
                          reduce_dt=4 if mixed else None, units=units, accumulate=t.grads_persist,
                          gloo=(backend or ("gloo" if t.device is Device.CPU else "nccl")) == "gloo",
                          offload=p.offload is not Offload.NONE, pipelined=pipelined,
                          local_grads_accumulate=pipelined and not mixed, ep=p.ep, **stage)
    if p.engine is Engine.DEEPSPEED:
        model_dt = 2 if t.precision is not Precision.FP32 else 4
        # what ZeRO-3 holds gathered: the stage's parameters its modules run (not an idle vision tower's)
        world = p.shard_degree if p.zero else p.dp
        ds = DeepSpeedHooks(world=world, zero=p.zero, model_dt=model_dt, offload=p.offload.value,
                            gathering=zero3_gathering(weights, model_dt, world) if p.zero >= 3 else None, ep=p.ep,
                            **stage)
        # the rank's share of the flat trainable parameters, which ZeRO-2 reduces its gradients into
        if p.zero not in (1, 2):
            return ds
        partition, flat = zero2_elements(ds, m, program_key(t, m))
        if p.zero == 1:
            return dataclasses.replace(ds, partition_numel=partition, flat_numel=flat, accumulating=t.grad_accum > 1)
        return dataclasses.replace(ds, partition_numel=partition, flat_numel=flat, accumulating=t.grad_accum > 1)
    if p.engine is Engine.MEGATRON:
        return MegatronHooks(world=p.shard_degree if p.zero else 1, model_dt=2 if t.mixed else t.param_bytes, ep=p.ep,
                             wgrad_fused=p.grad_accum_fusion, distributed_optimizer=p.zero >= 1,
                             causal_lm_loss="megatron-fused" if p.loss_fusion else "megatron", **stage)
    zero = p.zero if p.engine is Engine.DDP else 0
    return DDPHooks(world=p.shard_degree if zero else p.dp, zero=zero, bucket_view=p.ddp_bucket_view, ep=p.ep, **stage)


def _fsdp_param(w: tuple[ParamTensor, int, bool], world: int, ep: int, fp8: bool = False) -> _Param:
    """One parameter as FSDP2 shards and gathers it: rank 0's padded dim-0 chunk (routed experts over
    their own group, `shard_world`); of a QLoRA weight, its packed 4-bit storage (1 byte per element) alone,
    its quantization state staying whole on every rank (`nf4_parts`, `FSDP2Hooks.replicated`)."""
    p, dt, trainable = w
    ws = shard_world(p, world, ep)
    nf4 = nf4_parts(p, dt)
    if nf4 is not None:
        return _Param(-(-nf4[0] // ws), trainable, 1, nf4[0], ws, idle=p.idle)
    return _Param(_padded_shard(p, ws), trainable, dt, p.numel, ws, fp8, p.idle)


def _host_bytes(hooks: EngineHooks, m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> int:
    """Host (CPU) memory of one process for what the layout offloads (the engines' `init` leaves the
    same tensors out of the device's program: `FSDP2Hooks.param_shards`, `DeepSpeedHooks.param_partitions`)."""
    if p.offload is Offload.NONE:
        return 0
    host = 0
    if p.offload is Offload.OPTIMIZER_PARAMS:
        # both engines lay out the idle weights (a multimodal checkpoint's vision tower) as their others
        weights = [w for w in [*weight_tensors(m, t), *idle_tensors(m, t)] if _held(hooks, w[0], m)]
        assert isinstance(hooks, (FSDP2Hooks, DeepSpeedHooks))
        shards = hooks.param_shards(weights) if isinstance(hooks, FSDP2Hooks) else hooks.param_partitions(weights)
        host = sum(_round(n) * c for n, c in shards)
    if isinstance(hooks, FSDP2Hooks):
        # CPUOffloadPolicy: parameter shards, gradient shards (in the parameters' dtype) and the
        # optimizer states of the shards, all on the CPU
        host += sum(n * c for n, c in hooks._grads(m))
        shard_of = lambda q: _row_shard(q, shard_world(q, hooks.world, p.ep)) if _held(hooks, q, m) else None  # noqa: E731
        # a paged optimizer stepping on the CPU: bitsandbytes allocates plain tensors there, no paging
        host += sum(int(sz.c0) * c for sz, c in state_bytes(m, t, shard_of)) + paged_state_bytes(m, t, shard_of)
        return host
    assert isinstance(hooks, DeepSpeedHooks)
    shard = _partition(hooks, m, t, p.shard_degree)
    # ZeRO-Offload: fp32 master weights and the optimizer's state (Adam's moments: K = 12, Rajbhandari et al. 2020) ...
    host += round((4 + flat_state_bytes(t)) * shard)
    # ... and the gradient partition the CPU optimizer reads, pinned:
    # * ZeRO-1/2, deepspeed/runtime/zero/stage_1_and_2.py, initialize_optimizer_states:
    #   ``single_grad_partition = torch.zeros(int(self.partition_size[i]),
    #   dtype=self.single_partition_of_fp32_groups[i].dtype, device=self.device)``, pinned when
    #   cpu_offload_pin_memory and kept as ``single_partition_of_fp32_groups[i].grad`` (only set to None
    #   ``if not self.cpu_offload``): fp32, 4 B per element of the partition;
    # * ZeRO-3, deepspeed/runtime/zero/stage3.py, _setup_for_real_optimizer: ``grad_partitions_flat_buffer
    #   = torch.zeros(sum(p.partition_numel() ...), dtype=self.gradient_accumulation_dtype,
    #   device=self.device)``, pinned when offload_optimizer_pin_memory; the accumulation dtype is the
    #   model's (runtime/engine.py get_data_types: ``grad_accum_dtype = model_dtype`` under ZeRO unless
    #   the config sets ``data_types.grad_accum_dtype``): 2 B with bf16/fp16, 4 B with fp32.
    host += shard * (hooks.model_dt if p.zero >= 3 else 4)
    if p.zero < 3 and t.grad_accum > 1:
        # ZeRO-1/2 accumulating over micro-steps keeps a pinned host copy of the rank's gradients in the
        # model's dtype (stage_1_and_2.py, async_accumulate_grad_in_cpu_via_gpu: ``buffer =
        # torch.zeros(param.numel(), dtype=param.dtype, device=self.device)`` per parameter of the partition,
        # in ``accumulated_grads_in_cpu``); ZeRO-3 accumulates into its fp32 partitions above
        host += shard * hooks.model_dt
    return host
