"""Megatron-LM: its fp32 gradient buffer and distributed optimizer, the linears' weight gradients added into
it (gradient_accumulation_fusion), and Transformer Engine's fp8 weight workspaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..engine.program import CAT_INDEX, Segment, _segment
from ..engine.tape import Graph, Sz, T, const
from ..model.families import describe
from ..model.params import quantized, weight_tensors
from ..model.spec import ModelSpec
from ..recipes.base import fp8_weight
from ..spec.choices import Device, Fp8Recipe, Method
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from ..step.optimizers import flat_state_bytes
from .ranks import _held, _partition, _trainable

#: bytes per parameter of a Transformer Engine fp8 weight workspace on Hopper: the row-wise fp8 data and its
#: transpose (transformer_engine/pytorch/tensor/float8_tensor.py:423-427, ``_data`` and ``_transpose``)
TE_FP8_WEIGHT_BYTES = 2
#: Transformer Engine's own cuBLAS workspace, made at its first GEMM and cached (transformer_engine/pytorch/
#: cpp_extensions/gemm.py:40-67, ``get_cublas_workspace``: "32 MiB if using hopper", plus 1024 B)
TE_CUBLAS_WORKSPACE_BYTES = 32 * 1024 * 1024 + 1024


def dummy_wgrad_shapes(m: ModelSpec, weights: list[Any], last_stage: bool) -> set[tuple[int, int]]:
    """The weight shapes for which gradient_accumulation_fusion leaves a "dummy" gradient on the GPU: with
    Megatron's DDP every parameter has ``grad_added_to_main_grad``, so a fused linear returns
    ``get_dummy_wgrad(shape, dtype)``, a tensor cached per shape and never freed (transformer_engine/pytorch/
    module/linear.py:1354-1375, base.py:134-148; the output layer's: megatron/core/tensor_parallel/layers.py:733-762).
    Megatron's layers run each of the family's ``fused_projections`` groups (q/k/v, gate/up) as one linear, whose
    weight stacks the group's rows."""
    group_of = describe(m.family).fused_group
    shapes: set[tuple[int, int]] = set()
    for kind in {p.kind for p, _dt, _train in weights if p.in_layer}:
        fused: dict[tuple[str, ...], list[int]] = {}
        for p, _dt, train in weights:
            if not (train and p.kind == kind and quantized(p) and not p.idle):  # a layer's nn.Linear weight
                continue
            module = p.name[len("layers."):-len(".weight")]
            rows_cols = fused.setdefault(group_of.get(module, (module,)), [0, p.shape[1]])
            rows_cols[0] += p.shape[0]
        shapes.update((rows, cols) for rows, cols in fused.values())
    head = (m.vocab, m.hidden)  # the output layer's weight: its own or the shared embedding's
    if last_stage and any(train and not p.in_layer and p.shape == head for p, _dt, train in weights):
        shapes.add(head)
    return shapes


@dataclass(frozen=True)
class MegatronHooks(EngineHooks):
    """Megatron-LM (megatron/core/distributed, optimizer/distrib_optimizer.py): a 16-bit model (no
    autocast), a persistent fp32 ``main_grad`` buffer the layers' gradients are added into, and fp32
    main parameters with Adam moments (12 B per parameter), split over data-parallel ranks by the
    distributed optimizer (``zero=1``)."""

    world: int  # ranks the distributed optimizer shards over (1 without it)
    model_dt: int
    autocast: bool = False
    local_grads_accumulate: bool = False
    first_stage: bool = True
    last_stage: bool = True
    grad_scaler: bool = False  # fp16: Megatron's own loss scaler (megatron/core/optimizer/grad_scaler.py)
    ep: int = 1  #: expert parallelism: the distributed optimizer shards routed experts over ``world / ep`` ranks
    #: gradient_accumulation_fusion (megatron/training/arguments.py ``--no-gradient-accumulation-fusion``,
    #: ``store_false``: on by default): each linear's weight-gradient GEMM accumulates into ``main_grad``
    wgrad_fused: bool = True
    #: ``--use-distributed-optimizer`` (``zero=1``): its DDP keeps the 16-bit parameters in one contiguous buffer too
    distributed_optimizer: bool = False
    fp8_kernels: str = "te"  # fp8 runs Transformer Engine's linears (megatron/core/extensions/transformer_engine.py)
    causal_lm_loss: str = "megatron"  # GPTModel's own loss: vocab_parallel_cross_entropy (`recipes.head`)

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        return self.model_dt

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        for grad in grads:  # the backward hook adds param.grad into main_grad and frees it
            grad.is_grad = False
        g.drop(*grads)

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        # with the distributed optimizer the trained parameters live in DDP's one contiguous 16-bit param_data
        # (`_megatron_load`), their own storage freed, and the frozen ones where they were made
        moved = self.distributed_optimizer
        n_train = sum(p.numel * p.count for p, _dt in _trainable(self, m, t))
        out: list[tuple[str, Sz, int]] = [("weights/params", const(p.numel * self.model_dt), p.count)
                                          for p, _dt, train in weights if not (moved and train)]
        if moved:
            out.append(("weights/params", const(n_train * self.model_dt), 1))  # param_data
        if t.fp8 is not Fp8Recipe.NONE:
            # Transformer Engine's cached fp8 weight and its transpose (Hopper), made on the first micro-batch and
            # kept on the module (`trainmem_nb.engine.ops.te_fp8`)
            out += [("weights/fp8_workspaces", const(TE_FP8_WEIGHT_BYTES * p.numel), p.count)
                    for p, _dt, _train in weights if fp8_weight(p, m, te=True)]
        out.append(("gradients", const(4 * n_train), 1))  # the contiguous fp32 grad buffer
        if self.wgrad_fused:  # the cached dummy weight gradients, one per shape, from the first backward
            out += [("gradients", const(rows * cols * self.model_dt), 1)
                    for rows, cols in sorted(dummy_wgrad_shapes(m, weights, self.last_stage))]
        if t.device is Device.CUDA:  # the layers' GEMMs are Transformer Engine's (--transformer-impl's default)
            out.append(("overhead/workspaces", const(TE_CUBLAS_WORKSPACE_BYTES), 1))
        # the fp32 main parameters on the rank's partition: made with the optimizer, before the first step
        # (distrib_optimizer.py `shard_fp32_from_float16_groups`, optimizer.py Float16OptimizerWithFloat16Params);
        # the optimizer's own state comes with its first step()
        per = (4 if t.optimizer.value != "none" else 0) + (0 if t.first_step else flat_state_bytes(t))
        if per:
            out.append(("optimizer_states", const(round(per * _partition(self, m, t, self.world))), 1))
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        # fused Adam on the shard; the grad buffer is zeroed in place, not freed
        if not (t.first_step and flat_state_bytes(t)):
            return []
        state = const(round(flat_state_bytes(t) * _partition(self, m, t, self.world)))
        return [_segment("optimizer", "the first step() makes the optimizer's state", 1,
                         ((CAT_INDEX["optimizer_states"], 1, state, "exp_avg, exp_avg_sq (first step)"),))]

    def loading(self, m: ModelSpec, t: TrainingSpec) -> tuple[tuple[int, ...], int] | None:
        """Megatron builds the model in its 16-bit dtype on the device, then its DDP makes the contiguous buffers
        (`_megatron_load`); QLoRA quantizes on load as a rank loading its share does."""
        if t.method is Method.QLORA:
            return None
        return _megatron_load(m, t, self)


@lru_cache(maxsize=256)
def _megatron_load(m: ModelSpec, t: TrainingSpec, hooks: MegatronHooks) -> tuple[tuple[int, ...], int]:
    """A rank's loading trace and its peak: each parameter of its stage and tensor-parallel slice made in the
    model's 16-bit dtype (``params_dtype``), then DDP's buffers for the parameters that train
    (megatron/core/distributed/param_and_grad_buffer.py:1181-1195): with the distributed optimizer a zeroed
    16-bit ``param_data`` first, then the fp32 ``grad_data``, while every parameter is still whole; the
    parameters are then copied into ``param_data`` one by one and their own storage freed (:1305-1310), so the
    peak holds them twice beside the gradient buffer (8 bytes a bf16 parameter; 6 without the distributed
    optimizer, which leaves them where they are). Every storage is freed at the end, as in `loading_events`."""
    from ..step.load import LoadTrace, trace_peak

    held = [(p, train) for p, _dt, train in weight_tensors(m, t) if _held(hooks, p, m)]
    trace = LoadTrace()
    moved = hooks.distributed_optimizer
    made = [(trace.malloc(p.numel * hooks.model_dt, keep=not (train and moved)), train)
            for p, train in held for _ in range(p.count)]
    n_train = sum(p.numel * p.count for p, _dt in _trainable(hooks, m, t))  # the buffers `init` counts
    if moved:
        trace.malloc(n_train * hooks.model_dt, keep=True)  # param_data
    trace.malloc(4 * n_train, keep=True)  # grad_data (grad_reduce_in_fp32: Megatron's default under bf16)
    if moved:
        trace.free(*(a for a, train in made if train))
    done = trace.done()
    return done, trace_peak(done)
