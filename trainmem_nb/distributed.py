"""What each rank of a parallel training step holds: sharded model states, gathered parameters,
communication buffers, tensor/sequence/context-parallel activations and pipeline micro-batches.

Each engine is a set of `EngineHooks` the step driver (`trainmem_nb.simulate`) calls at unit
boundaries (the root module and every transformer layer), so its buffers appear in the step's
timeline where the engine allocates them:

* **FSDP2** (``fully_shard`` on every layer and the root, as torchtitan and accelerate do) follows
  torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: forward all-gathers a unit and keeps that
  all-gather output until the next unit's copy-out (implicit prefetch), reshards after forward
  (ZeRO-3 / FULL_SHARD; ZeRO-2 / SHARD_GRAD_OP keeps parameters until backward); backward unshards
  one unit ahead, and each unit's post-backward frees the previous reduce-scatter input, allocates
  its own and a persistent gradient shard. Mixed precision is ``MixedPrecisionPolicy(param_dtype=16
  bit, reduce_dtype=fp32)`` without autocast. Verified against one-process fake-process-group runs.
  Under pipeline parallelism (torch.distributed.pipelining, as torchtitan uses it) a stage keeps its
  parameters gathered all step and accumulates unsharded reduce-dtype gradients until a reduce-scatter
  after the last micro-batch (`FSDP2Hooks.pipelined`); the stage's receive buffers, its input gradients
  and (last stage, torch's ``return_outputs=True``) every micro-batch's logits are added by
  `_pipeline_buffers`; measured on CPU by scripts/measure_fsdp_pp.py.
* **DDP** (torch DistributedDataParallel): gradient buckets of ``bucket_cap_mb`` = 25 MiB; without
  ``gradient_as_bucket_view`` the buckets are a second copy of every gradient (torch/nn/parallel/
  distributed.py, reducer.cpp); with it (``ParallelSpec(ddp_bucket_view=True)``) the gradients are
  views into the buckets, which persist, and ``zero_grad`` frees nothing.
* **DeepSpeed ZeRO** 1-3 with its 16-bit optimizer: 16-bit parameters and gradients, fp32 master
  weights and Adam moments (K = 12 bytes per parameter, Rajbhandari et al. 2020, Table 1), sharded by
  stage; reduce bucket (``reduce_bucket_size``), all-gather bucket (``allgather_bucket_size``) and
  ZeRO-3 live parameters (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``) with the
  defaults of deepspeed/runtime/zero/config.py.
* **Megatron-LM**: a 16-bit model, a persistent fp32 gradient buffer and, with its distributed
  optimizer (``zero=1``), fp32 main parameters and moments split over data-parallel ranks.

Tensor parallelism splits heads, kv heads, the MLP and the vocabulary (Megatron's column/row split);
sequence parallelism also splits the norm/residual regions' activations; context parallelism splits
the sequence; pipeline stages hold their layers and ``_in_flight`` micro-batches of activations (1F1B:
pp - stage on stage ``stage``; interleaved: Megatron's warm-up plus one model chunk, Narayanan et al.
2021). These are modelled (no GPU here to measure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

from .breakdown import DETAIL_KEYS
from .device import Calibration
from .optimizers import optimizer_program, paged_state_bytes, state_bytes
from .parallelism import Engine, Offload, ParallelSpec, PipelineSchedule
from .params import ParamTensor, on_stage, trainable_tensors, weight_tensors
from .simulate import EngineHooks, Segment, _round, _segment, compile_step, evaluate, program_key, reserved_and_total
from .specs import Checkpointing, Device, ModelSpec, Precision, TrainingSpec
from .tape import Graph, Sz, T, const, per_token

__all__ = ["RankMemory", "simulate_parallel"]

_CAT = {k: i for i, k in enumerate(DETAIL_KEYS)}

#: DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)).
DDP_BUCKET_BYTES = 25 << 20
#: DeepSpeed ZeRO defaults (deepspeed/runtime/zero/config.py): elements, not bytes.
DS_REDUCE_BUCKET = 500_000_000
DS_ALLGATHER_BUCKET = 500_000_000
DS_STAGE3_PREFETCH = 50_000_000
DS_STAGE3_MAX_LIVE = 1_000_000_000
DS_STAGE3_PERSISTENCE = 100_000  # parameters smaller than this stay unsharded on every rank


class RankMemory(NamedTuple):
    """One distinct rank of a layout (e.g. a pipeline stage) and its memory."""

    ranks: str  # which ranks this row stands for, e.g. "stage 0 (ranks 0-7)"
    stage: int
    n_layers: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    peak_phase: str
    peak_at: str
    breakdown_bytes: dict[str, int]
    detail_bytes: dict[str, int]
    host_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return self._asdict()


def _padded_shard(p: ParamTensor, world: int) -> int:
    """FSDP2's per-rank shard of one parameter: dim 0 chunked into `world` pieces, padded to the largest
    (rank 0's; a later rank's unpadded shard can be smaller: rank 0 is the worst)."""
    return _row_shard(p, world).numel


def _row_shard(p: ParamTensor, world: int) -> ParamTensor:
    """Rank 0's part of a parameter split along dim 0 into `world` chunks (torch.chunk's rule)."""
    return p._replace(shape=(-(-p.shape[0] // world), *p.shape[1:]))


def _units(weights: Sequence[tuple[ParamTensor, int, bool]]) -> dict[str, list[tuple[ParamTensor, int, bool]]]:
    """Parameters of the root unit (outside the layers) and of one layer unit."""
    return {"root": [w for w in weights if not w[0].in_layer], "layer": [w for w in weights if w[0].in_layer]}


class _Param(NamedTuple):
    shard: int  # elements of the rank's (padded) shard
    trainable: bool
    dt: int  # bytes per element of the sharded parameter
    numel: int = 0  # elements of the unsharded parameter (its gradient's size)


@dataclass(frozen=True)
class FSDP2Hooks(EngineHooks):
    """torch FSDP2 (``fully_shard``) on every transformer layer and the root module."""

    world: int
    reshard_after_forward: bool
    param_dt: int | None  # MixedPrecisionPolicy.param_dtype bytes (None: parameters keep their dtype)
    reduce_dt: int | None  # MixedPrecisionPolicy.reduce_dtype bytes (None: the gradient's dtype)
    units: tuple[tuple[str, tuple[_Param, ...]], ...]  # "root" and "layer" -> their parameters
    accumulate: bool = False  # gradient accumulation: sharded gradients exist and new ones are added
    gloo: bool = False  # the CPU backend: its reduce-scatter works on a full copy of the input
    #: CPUOffloadPolicy: sharded parameters, their gradients and the optimizer live on the CPU
    offload: bool = False
    autocast: bool = False
    local_grads_accumulate: bool = False
    first_stage: bool = True
    last_stage: bool = True
    #: a stage of torch.distributed.pipelining (pp > 1): parameters stay gathered and unsharded
    #: gradients accumulate over the micro-batches; the reduce-scatter waits for the last (`_pipelined_reduce`)
    pipelined: bool = False
    state: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def _unit(self, unit: str) -> tuple[_Param, ...]:
        return dict(self.units)["root" if unit == "root" else "layer"]

    def _st(self, g: Graph) -> dict[str, Any]:
        return self.state.setdefault(id(g), {"ups": {}})

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        return self.param_dt or dt

    def _gathered_bytes(self, q: _Param) -> int:
        return self.world * q.shard * (self.param_dt or q.dt)

    def _all_gather_output(self, g: Graph, unit: str, label: str) -> T:
        # one flat buffer per unit (uint8 when the unit's dtypes differ): every rank's shards
        ag = g.alloc(const(sum(self._gathered_bytes(q) for q in self._unit(unit))), 1, label)
        ag.region, ag.chain = "communication", True
        return ag

    def _copy_out(self, g: Graph, unit: str) -> None:
        ups = []
        for q in self._unit(unit):  # each parameter's unsharded storage (alloc_storage)
            t = g.alloc(const(self._gathered_bytes(q)), 1, f"unsharded {unit}")
            t.region = "gathered"
            ups.append(t)
        self._st(g)["ups"][unit] = ups

    def _gather(self, g: Graph, unit: str, linger: bool) -> None:
        st = self._st(g)
        ag = self._all_gather_output(g, unit, f"all-gather {unit}")
        self._copy_out(g, unit)
        if linger:  # forward: the previous all-gather output is freed after this copy-out
            if st.get("ag") is not None:
                g.drop(st["ag"])
            st["ag"] = ag
        else:
            g.drop(ag)

    def _reshard(self, g: Graph, unit: str) -> None:
        g.drop(*self._st(g)["ups"].pop(unit, []))

    def unit_forward_begin(self, g: Graph, unit: str) -> None:
        if self.pipelined:  # gathered by the first micro-batch's forward, kept (see `init`)
            return
        self._gather(g, unit, linger=True)

    def unit_forward_end(self, g: Graph, unit: str) -> None:
        if self.pipelined:
            return
        st = self._st(g)
        if unit == "root":
            if self.reshard_after_forward:
                self._reshard(g, "root")
            if st.get("ag") is not None:
                g.drop(st.pop("ag"))
        elif self.reshard_after_forward:
            self._reshard(g, unit)

    def unit_backward_begin(self, g: Graph, unit: str) -> None:
        if self.pipelined:
            return
        st = self._st(g)
        if self.reshard_after_forward:
            pre = st.pop("prefetched", None)
            if pre is not None:  # copy-out from the prefetched all-gather, then free it
                self._copy_out(g, unit)
                g.drop(pre)
            elif unit not in st["ups"]:
                self._gather(g, unit, linger=False)
        # backward prefetch: the next unit in backward order is all-gathered now (the root is
        # already unsharded; the first layer has nothing after it)
        if self.reshard_after_forward and unit != "L0":
            st["prefetched"] = self._all_gather_output(g, "layer", "all-gather prefetch")

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        if self.pipelined:
            self._accumulate_unsharded(g, grads)
            return
        st = self._st(g)
        self._reshard(g, unit)
        if st.get("rs") is not None:  # reduce_scatter_max_input_buffers = 1: the previous input goes
            g.drop(st.pop("rs"))
        trained = [q for q in self._unit(unit) if q.trainable]
        if not trained:
            return
        # foreach_reduce copies the unsharded gradients into one reduce-scatter input and frees them
        rs_in = g.alloc(const(sum(self.world * q.shard * (self.reduce_dt or q.dt) for q in trained)), 1,
                        f"reduce-scatter input {unit}")
        rs_in.region, rs_in.chain = "communication", True
        for grad in grads:
            grad.is_grad = False
        g.drop(*grads)
        rs_out = g.alloc(const(self._grad_shard_bytes(unit)), 1, f"sharded gradients {unit}")
        if self.gloo:
            # ProcessGroupGloo's reduce_scatter_tensor reduces a copy of the whole input and keeps its
            # own chunk (measured: a transient the size of the input, freed before the next unit)
            copy = g.alloc(rs_in.bytes, 1, "gloo reduce-scatter copy")
            copy.region = "communication"
            g.drop(copy)
        if self.accumulate or self.offload:
            # foreach_reduce adds the reduce-scatter output to .grad and drops it; with CPU offload it
            # copies it to the CPU and drops the GPU copy without waiting (_fsdp_collectives.py,
            # foreach_reduce: ``new_sharded_grad.to(torch.device("cpu"))``)
            g.drop(rs_out)
        else:
            rs_out.is_grad = True
        if unit == "root":
            g.drop(rs_in)  # finalize_backward waits for and frees the last reduce-scatter
        else:
            st["rs"] = rs_in

    def _accumulate_unsharded(self, g: Graph, grads: list[T]) -> None:
        """A pipeline stage's post-backward without gradient sync (_fsdp_param_group.py, post_backward:
        ``if not self.reduce_grads: ... fsdp_param.to_accumulated_grad_if_needed(); return``).

        With a reduce dtype (mixed precision) each parameter's 16-bit ``.grad`` is added into its
        ``unsharded_accumulated_grad`` (_fsdp_param.py, accumulate_unsharded_grad_if_needed:
        ``self.unsharded_accumulated_grad += self.unsharded_param.grad``; ``.grad = None``) or, on the
        first micro-batch, becomes it: ``unsharded_grad.to(self.reduce_dtype)`` (to_accumulated_grad_if_needed),
        allocated before the 16-bit gradient goes. Without one, ``.grad`` itself stays and autograd
        adds later micro-batches into it (``local_grads_accumulate``)."""
        if self.reduce_dt is None:
            return
        for grad in grads:
            if not self.accumulate:
                acc = g.alloc(grad.n, self.reduce_dt, f"unsharded accumulated {grad.label}")
                acc.is_grad = True
            grad.is_grad = False
            g.drop(grad)

    def _unsharded_grad_bytes(self, q: _Param) -> int:
        """An unsharded gradient of a pipeline stage: the parameter's shape, in the reduce dtype."""
        return q.numel * (self.reduce_dt or q.dt)

    def _pipelined_reduce(self, m: ModelSpec) -> list[Segment]:
        """torch.distributed.pipelining's deferred gradient sync, after the last micro-batch's backward.

        stage.py, perform_reduce_grad: ``set_reshard_after_backward(True)``,
        ``set_requires_gradient_sync(True)``, then ``fsdp_param_group.post_backward()`` for every group
        of ``_state_ctx.all_states`` (the stage root first, then the layers in order). Each
        post_backward (_fsdp_param_group.py) first reshards (frees the gathered parameters), then frees
        the previous reduce-scatter input (``reduce_scatter_max_input_buffers`` = 1) and calls
        foreach_reduce (_fsdp_collectives.py): the reduce-scatter input is allocated, the accumulated
        gradients are copied in and released (``unsharded_grads.clear()``), and the output becomes the
        sharded ``.grad``. ``_root_post_backward_final_callback`` frees the last input."""
        cat = _CAT
        comm, gath, grad = cat["overhead/communication"], cat["weights/gathered"], cat["gradients"]

        def unit_events(unit: str, prev: int) -> tuple[list[tuple[int, int, Sz, str]], int]:
            ev: list[tuple[int, int, Sz, str]] = [(gath, -1, const(self._gathered_bytes(q)), f"reshard {unit}")
                                                  for q in self._unit(unit)]
            trained = [q for q in self._unit(unit) if q.trainable]
            if not trained:
                return ev, prev
            if prev:
                ev.append((comm, -1, const(prev), "previous reduce-scatter input freed"))
            rs = sum(self.world * q.shard * (self.reduce_dt or q.dt) for q in trained)
            ev.append((comm, 1, const(rs), f"reduce-scatter input {unit}"))
            ev += [(grad, -1, const(self._unsharded_grad_bytes(q)), f"unsharded gradients {unit} copied in")
                   for q in trained]
            ev.append((grad, 1, const(self._grad_shard_bytes(unit)), f"sharded gradients {unit}"))
            if self.gloo:  # ProcessGroupGloo reduces a copy of the whole input (see unit_backward_end)
                ev += [(comm, 1, const(rs), "gloo reduce-scatter copy"), (comm, -1, const(rs), "freed")]
            return ev, rs

        segs = []
        root, prev = unit_events("root", 0)
        segs.append(_segment("backward", f"{PIPELINE_REDUCE}: root", 1, tuple(root)))
        first, after_first = unit_events("layer", prev)
        segs.append(_segment("backward", f"{PIPELINE_REDUCE}: layer 0", 1, tuple(first)))
        if m.n_layers > 1:
            rest, after_first = unit_events("layer", after_first)
            segs.append(_segment("backward", f"{PIPELINE_REDUCE}: layers", m.n_layers - 1, tuple(rest)))
        if after_first:
            segs.append(_segment("backward", f"{PIPELINE_REDUCE}: finalize", 1,
                                 ((comm, -1, const(after_first), "last reduce-scatter input freed"),)))
        return segs

    def _grad_shard_bytes(self, unit: str) -> int:
        """One flat reduce-scatter output per unit holds its sharded gradients (in the reduce dtype)."""
        return sum(q.shard * (self.reduce_dt or q.dt) for q in self._unit(unit) if q.trainable)

    def _grads(self, m: ModelSpec) -> list[tuple[int, int]]:
        return [(n, c) for n, c in ((self._grad_shard_bytes("root"), 1), (self._grad_shard_bytes("layer"), m.n_layers))
                if n]

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        out: list[tuple[str, Sz, int]] = []
        for p, dt, _trainable in weights:
            out.append(("weights/params", const(_padded_shard(p, self.world) * dt), p.count))
        if self.offload:
            # the parameter shards are listed so the caller moves them to host memory (`_host_bytes`);
            # the gradient shards and the optimizer states never reach the GPU
            return out
        if self.pipelined:
            # every parameter of the stage stays gathered from the first micro-batch's forward to
            # perform_reduce_grad: torchtitan does not reshard after forward under PP (parallelize.py,
            # "For PP, do not reshard after forward to avoid per-microbatch all-gathers") and pipelining
            # does not reshard after backward (stage.py, backward_maybe_with_nosync:
            # ``set_reshard_after_backward(False)``); a later micro-batch finds the earlier ones'
            # unsharded gradients (`_accumulate_unsharded`)
            for unit, count in (("root", 1), ("layer", m.n_layers)):
                for q in self._unit(unit):
                    out.append(("weights/gathered", const(self._gathered_bytes(q)), count))
                    if self.accumulate and q.trainable:
                        out.append(("gradients", const(self._unsharded_grad_bytes(q)), count))
            if not t.first_step:
                out += _sharded_states(self, m, t, self.world)
            return out
        if self.accumulate:
            out += [("gradients", const(n), c) for n, c in self._grads(m)]
        if not t.first_step:
            out += _sharded_states(self, m, t, self.world)
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        if self.offload:  # the optimizer steps on the CPU's parameter and gradient shards
            return []

        def shard(p: ParamTensor) -> ParamTensor | None:
            return _row_shard(p, self.world) if _held(self, p, m) else None

        opt = optimizer_program(m, t, shard, self._grads(m))
        return self._pipelined_reduce(m) + opt if self.pipelined else opt


#: label prefix of the segments of pipelining's deferred reduce-scatter (after every micro-batch)
PIPELINE_REDUCE = "reduce-scatter after the last micro-batch"


def _held(hooks: EngineHooks, p: ParamTensor, m: ModelSpec) -> bool:
    return on_stage(p, m, hooks.first_stage, hooks.last_stage)


def _trainable(hooks: EngineHooks, m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, int]]:
    """The trainable tensors this rank's pipeline stage holds."""
    return [(p, dt) for p, dt in trainable_tensors(m, t) if _held(hooks, p, m)]


def _sharded_states(hooks: EngineHooks, m: ModelSpec, t: TrainingSpec, world: int) -> list[tuple[str, Sz, int]]:
    """Optimizer state of the rank's share of the parameters (ZeRO-1: states split `world` ways)."""
    if t.first_step:
        return []
    return [("optimizer_states", sz, c)
            for sz, c in state_bytes(m, t, lambda p: _row_shard(p, world) if _held(hooks, p, m) else None)]


@dataclass(frozen=True)
class DDPHooks(EngineHooks):
    """torch DistributedDataParallel: gradient buckets beside the gradients, optional ZeRO-1.

    Without ``gradient_as_bucket_view`` the reducer's flat buckets persist between steps beside the
    ``.grad`` tensors autograd makes: two copies of every gradient at the optimizer step. With it
    (`bucket_view`), ``.grad`` is a view into its bucket: the reducer copies each new gradient into the
    bucket and points ``.grad`` there, so one copy persists and ``zero_grad(set_to_none=True)`` frees
    nothing (torch/nn/parallel/distributed.py, ``gradient_as_bucket_view``: "the saved memory size
    will be equal to the total gradients size"; reducer.cpp, ``mark_variable_ready_dense``)."""

    world: int
    zero: int
    bucket_view: bool = False
    first_stage: bool = True
    last_stage: bool = True
    state: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        if self.bucket_view:  # copied into the bucket view that becomes .grad; autograd's copy goes
            for grad in grads:
                grad.is_grad = False
            g.drop(*grads)

    def _grads(self, m: ModelSpec, t: TrainingSpec) -> list[tuple[int, int]]:
        return [(p.numel * dt, p.count) for p, dt in _trainable(self, m, t)]

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        out: list[tuple[str, Sz, int]] = [("weights/params", const(p.numel * dt), p.count) for p, dt, _ in weights]
        grads = self._grads(m, t)
        buckets = sum(_round(n) * c for n, c in grads)
        if self.bucket_view:  # the buckets are the gradients
            out.append(("gradients", const(buckets), 1))
        else:
            # the reducer's flat buckets persist between steps: a second copy of every gradient
            out.append(("overhead/communication", const(buckets), 1))
            if t.grad_accum > 1:  # a later micro-step: every .grad exists and new ones are added in place
                out += [("gradients", const(n), c) for n, c in grads]
        world = self.world if self.zero >= 1 else 1
        return out + _sharded_states(self, m, t, world)

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        world = self.world if self.zero >= 1 else 1

        def shard(p: ParamTensor) -> ParamTensor | None:  # ZeroRedundancyOptimizer steps on its shard
            return _row_shard(p, world) if _held(self, p, m) else None

        # zero_grad frees the full .grad tensors, or nothing when they are views of the buckets
        return optimizer_program(m, t, shard, [] if self.bucket_view else self._grads(m, t))


@dataclass(frozen=True)
class DeepSpeedHooks(EngineHooks):
    """DeepSpeed ZeRO stages 0-3 with its 16-bit optimizer (fp32 master + moments: 12 B/param)."""

    world: int
    zero: int
    model_dt: int  # 2 with a bf16/fp16 recipe, 4 for fp32
    offload: str
    layer_params: int  # parameters of one layer (ZeRO-3 gathers per layer)
    autocast: bool = False
    first_stage: bool = True
    last_stage: bool = True
    grad_scaler: bool = False  # fp16: DeepSpeed's own loss scaler (runtime/fp16/loss_scaler.py)
    state: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        return self.model_dt

    def unit_forward_begin(self, g: Graph, unit: str) -> None:
        if self.zero >= 3 and unit != "root":
            st = self.state.setdefault(id(g), {})
            live = g.alloc(const(min(self.layer_params * 2, DS_STAGE3_MAX_LIVE)), self.model_dt, "ZeRO-3 gathered params")
            live.region = "gathered"
            st[unit] = live

    def unit_forward_end(self, g: Graph, unit: str) -> None:
        st = self.state.setdefault(id(g), {})
        if unit in st:
            g.drop(st.pop(unit))

    unit_backward_begin = unit_forward_begin

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        self.unit_forward_end(g, unit)
        if self.zero >= 2:  # gradients are reduced into the rank's partition as buckets fill
            for grad in grads:
                grad.is_grad = False
            g.drop(*grads)

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        out: list[tuple[str, Sz, int]] = []
        world = self.world
        shard_p = world if self.zero >= 3 else 1
        for p, _dt, _train in weights:
            n = -(-p.numel // shard_p) if p.numel >= DS_STAGE3_PERSISTENCE or shard_p == 1 else p.numel
            out.append(("weights/params", const(n * self.model_dt), p.count))
        if self.offload == "none" and not t.first_step:
            shard_s = world if self.zero >= 1 else 1
            n_train = sum(p.numel * p.count for p, _dt in _trainable(self, m, t))
            per = 12 if self.model_dt == 2 else 8  # fp32 master copy only with a 16-bit model
            out.append(("optimizer_states", const(-(-n_train // shard_s) * per), 1))
        # reduce bucket and, for ZeRO-1/2, the all-gather bucket for the updated parameters
        out.append(("overhead/communication", const(DS_REDUCE_BUCKET * self.model_dt), 1))
        if self.zero >= 2 and self.offload == "none":
            # the rank's gradient partition; with an offloaded optimizer it is on the host instead
            # (stage_1_and_2.py copy_grads_in_partition returns before allocating grads_in_partition
            # when cpu_offload; stage3.py puts grad_partitions_flat_buffer on self.device, the CPU)
            n_train = sum(p.numel * p.count for p, _dt in _trainable(self, m, t))
            out.append(("gradients", const(-(-n_train // world) * self.model_dt), 1))
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        n_train = sum(p.numel * p.count for p, _dt in _trainable(self, m, t))
        shard = -(-n_train // (self.world if self.zero >= 1 else 1))
        temp = _CAT["transient/optimizer"]
        events: list[tuple[int, int, Sz, str]] = []
        if self.offload == "none":
            # the fp32 gradient partition the update reads, then the all-gather of updated parameters
            events += [(temp, 1, const(shard * 4), "fp32 gradient partition"), (temp, -1, const(shard * 4), "freed")]
        if self.zero in (1, 2):
            ag = min(DS_ALLGATHER_BUCKET, n_train) * self.model_dt
            events += [(temp, 1, const(ag), "all-gather bucket"), (temp, -1, const(ag), "freed")]
        segs = [_segment("optimizer", "optimizer step", 1, tuple(events))]
        if self.zero < 2:
            grads = sum(_round(p.numel * self.model_dt) * p.count for p, _dt in _trainable(self, m, t))
            segs.append(_segment("zero", "zero_grad", 1, ((_CAT["gradients"], -1, const(grads), "zero_grad"),)))
        return segs


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

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        return self.model_dt

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        for grad in grads:  # the backward hook adds param.grad into main_grad and frees it
            grad.is_grad = False
        g.drop(*grads)

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        out: list[tuple[str, Sz, int]] = [("weights/params", const(p.numel * self.model_dt), p.count)
                                          for p, _dt, _train in weights]
        n_train = sum(p.numel * p.count for p, _dt in _trainable(self, m, t))
        out.append(("gradients", const(4 * n_train), 1))  # the contiguous fp32 grad buffer
        if not t.first_step:
            out.append(("optimizer_states", const(12 * -(-n_train // self.world)), 1))
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        return []  # fused Adam on the shard; the grad buffer is zeroed in place, not freed


def _tp_model(m: ModelSpec, p: ParallelSpec) -> ModelSpec:
    """The model as one tensor-parallel rank sees it: heads, kv heads, MLP, experts and vocabulary split."""
    if p.tp == 1 and p.ep == 1:
        return m
    data = m.model_dump()
    tp = p.tp
    data.update(n_heads=m.n_heads // tp, n_kv_heads=max(1, m.n_kv_heads // tp), head_dim=m.head_dim,
                ffn=max(1, m.ffn // tp), vocab=-(-m.vocab // tp), name=f"{m.name} (tp rank)")
    if m.is_moe and p.ep > 1:
        data["n_experts"] = m.n_experts // p.ep
        data["experts_top_k"] = min(m.experts_top_k, data["n_experts"])
    return ModelSpec.model_validate(data)


def _stages(m: ModelSpec, p: ParallelSpec) -> list[tuple[int, int]]:
    """(stage, layers) for each pipeline stage: layers split as evenly as possible, extra to the first."""
    base, extra = divmod(m.n_layers, p.pp)
    return [(s, base + (1 if s < extra else 0)) for s in range(p.pp)]


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


def _sequence_parallel_saving(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, seq: int) -> int:
    """Saved activation bytes sequence parallelism removes from a tensor-parallel rank: the
    hidden-sized tensors TP leaves replicated (norm inputs and outputs, dropout masks; the layer input
    alone under full checkpointing) are split `tp` ways instead (Korthikanti et al. 2022, sec. 4.2.2:
    ``10 sbh`` becomes ``10 sbh / t``). Modelled from the paper, not measured here."""
    if t.checkpointing is Checkpointing.FULL:
        per_layer = 1
    else:
        dropout = (t.dropout if t.dropout is not None else m.hidden_dropout) > 0
        per_layer = 4 + (2 if dropout else 0)
    act_dt = 4 if t.precision is Precision.FP32 else 2
    return int(m.n_layers * per_layer * t.micro_batch * seq * m.hidden * act_dt * (1 - 1 / p.tp))


def _hooks(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, backend: str | None = None,
           first: bool = True, last: bool = True) -> EngineHooks:
    """The engine of layout `p` on a rank of the `first` and/or `last` pipeline stage; `backend` is the
    collectives library (default: gloo on CPU, NCCL on CUDA)."""
    weights = [w for w in weight_tensors(m, t) if on_stage(w[0], m, first, last)]
    stage: dict[str, Any] = {"first_stage": first, "last_stage": last}
    if p.engine is Engine.FSDP and p.zero >= 2:
        world = p.shard_degree
        mixed = t.mixed
        units = tuple((name, tuple(_Param(_padded_shard(w[0], world), w[2], w[1], w[0].numel) for w in ws))
                      for name, ws in _units(weights).items())
        # torch.distributed.pipelining with FSDP2 stages (not with CPU offload, which is not modelled there)
        pipelined = p.pp > 1 and p.offload is Offload.NONE
        # the recipe of torchtitan and accelerate: MixedPrecisionPolicy(param_dtype=16-bit,
        # reduce_dtype=fp32) for mixed precision, parameters' own dtypes otherwise
        return FSDP2Hooks(world=world, reshard_after_forward=p.zero >= 3, param_dt=2 if mixed else None,
                          reduce_dt=4 if mixed else None, units=units, accumulate=t.grad_accum > 1,
                          gloo=(backend or ("gloo" if t.device is Device.CPU else "nccl")) == "gloo",
                          offload=p.offload is not Offload.NONE, pipelined=pipelined,
                          local_grads_accumulate=pipelined and not mixed, **stage)
    if p.engine is Engine.DEEPSPEED:
        layer_params = sum(w[0].numel for w in weights if w[0].in_layer)
        return DeepSpeedHooks(world=p.shard_degree if p.zero else p.dp, zero=p.zero,
                              model_dt=2 if t.precision is not Precision.FP32 else 4,
                              offload=p.offload.value, layer_params=layer_params, **stage)
    if p.engine is Engine.MEGATRON:
        return MegatronHooks(world=p.shard_degree if p.zero else 1, model_dt=2 if t.mixed else t.param_bytes, **stage)
    zero = p.zero if p.engine is Engine.DDP else 0
    return DDPHooks(world=p.shard_degree if zero else p.dp, zero=zero, bucket_view=p.ddp_bucket_view, **stage)


def _host_bytes(hooks: EngineHooks, m: ModelSpec, t: TrainingSpec, p: ParallelSpec, detail: dict[str, int]) -> int:
    """Host (CPU) memory of one process for what the layout offloads; moves the offloaded parameter
    shards out of the GPU's `detail`."""
    if p.offload is Offload.NONE:
        return 0
    host = detail.pop("weights/params", 0) if p.offload is Offload.OPTIMIZER_PARAMS else 0
    if isinstance(hooks, FSDP2Hooks):
        # CPUOffloadPolicy: parameter shards, gradient shards (in the parameters' dtype) and the
        # optimizer states of the shards, all on the CPU
        host += sum(n * c for n, c in hooks._grads(m))
        shard_of = lambda q: _row_shard(q, hooks.world) if _held(hooks, q, m) else None  # noqa: E731
        # a paged optimizer stepping on the CPU: bitsandbytes allocates plain tensors there, no paging
        host += sum(int(sz.c0) * c for sz, c in state_bytes(m, t, shard_of)) + paged_state_bytes(m, t, shard_of)
        return host
    assert isinstance(hooks, DeepSpeedHooks)
    shard = -(-sum(q.numel * q.count for q, _ in _trainable(hooks, m, t)) // p.shard_degree)
    # ZeRO-Offload: fp32 master weights and Adam moments (K = 12, Rajbhandari et al. 2020) ...
    host += 12 * shard
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

    from .simulate import activations_at_forward_end

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


def simulate_parallel(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, calibration: Calibration | None,
                      backend: str | None = None) -> Any:
    """Every distinct rank's memory for layout `p`; the headline is the worst rank. `backend` overrides
    the collectives library ("nccl" models a GPU job's, as the fake process group measures it)."""
    from .estimate import MemoryEstimate

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
                from .simulate import activations_at_forward_end

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
    return MemoryEstimate(
        model=m, training=t, n_params=n_params, n_trainable_params=n_train,
        peak_allocated_bytes=row.peak_allocated_bytes, peak_reserved_bytes=row.peak_reserved_bytes,
        device_total_bytes=row.device_total_bytes, peak_phase=row.peak_phase, peak_at=row.peak_at,
        detail_bytes=row.detail_bytes, phase_peaks_bytes={}, overhead_bytes=overhead, calibration=calibration,
        program=prog, parallel=p, per_rank=tuple(rows), host_bytes=max(r.host_bytes for r in rows),
    )
