"""PyTorch FSDP2 (``fully_shard``) as the step sees it: all-gather and reduce-scatter buffers,
prefetch and reshard points, the mixed-precision policy and gradient accumulation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from ..engine.ops.fp8 import fp8_cast
from ..engine.program import Segment, _segment
from ..engine.tape import Graph, Sz, T, const
from ..model.params import ParamTensor
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from ..step.optimizers import optimizer_program
from .ranks import _CAT, _held, _padded_shard, _Param, _row_shard, _sharded_states, layer_units, nf4_parts, shard_world

#: The CUDA streams FSDP2 allocates on besides the default one (torch/distributed/fsdp/_fully_shard/
#: _fsdp_collectives.py): ``foreach_all_gather`` allocates each all-gather output (and the inputs it copies in)
#: under ``device_handle.stream(all_gather_copy_in_stream)``, which ``FSDPParamGroup._all_gather_streams`` gives
#: in forward and pre-backward; ``foreach_reduce`` allocates the reduce-scatter output, which the sharded gradients
#: view, under ``device_handle.stream(reduce_scatter_stream)`` (its input is allocated on the current stream).
#: The caching allocator gives a block back only to requests of the stream it was allocated on.
ALL_GATHER_COPY_IN_STREAM = 1
REDUCE_SCATTER_STREAM = 2


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
    #: expert parallelism: routed experts are sharded over ``world / ep`` ranks (`shard_world`)
    ep: int = 1
    #: the idle weights (a multimodal checkpoint's vision tower) are the root group's: sharded, gathered with it
    shards_idle: bool = True
    state: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def _unit(self, unit: str) -> tuple[_Param, ...]:
        """The parameters of the step's unit `unit` (``"root"``, ``"L3"``, ``"L0/dense"``...; `layer_units`)."""
        if unit == "root" or unit.startswith("layer"):
            return dict(self.units)[unit]
        kind = unit.partition("/")[2]
        return dict(self.units)[f"layer/{kind}" if kind else "layer"]

    def _st(self, g: Graph) -> dict[str, Any]:
        return self.state.setdefault(id(g), {"ups": {}})

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        return self.param_dt or dt

    def buffer_dtype(self, t: TrainingSpec) -> int | None:
        # MixedPrecisionPolicy casts the parameters it gathers, not the module's buffers (fp32 with the model)
        return t.param_bytes if self.param_dt and self.param_dt != t.param_bytes else None

    def _gathered_bytes(self, q: _Param) -> int:
        # the policy's param_dtype casts floating parameters; QLoRA's packed 4-bit storage (1 B) is gathered as
        # is; torchao's float8 all-gather gathers a converted weight's fp8 data (1 B)
        if q.fp8:
            return (q.world or self.world) * q.shard
        return (q.world or self.world) * q.shard * (self.param_dt if self.param_dt and q.dt >= 2 else q.dt)

    def _all_gather_output(self, g: Graph, unit: str, label: str) -> T:
        # torchao's float8 all-gather: fsdp_pre_all_gather casts each converted weight's shard to fp8, its
        # amax all-reduced over the ranks (WeightWithDynamicFloat8CastTensor, fsdp_utils.py); the fp8 shards
        # are copied into the all-gather buffer and go, their scales ride along as metadata
        shards, scales = [], []
        with g.on_stream(ALL_GATHER_COPY_IN_STREAM):  # what pre_all_gather makes, and the output
            for q in self._unit(unit):
                if q.fp8:
                    # the stored shard is cast (fp32 under a MixedPrecisionPolicy: no bf16 copy first)
                    data, scale = fp8_cast(g, const(q.shard), q.dt, const(1), False, f"float8 all-gather {unit}",
                                           all_reduced=True)
                    data.region = scale.region = "communication"
                    shards.append(data)
                    scales.append(scale)
            # one flat buffer per unit (uint8 when the unit's dtypes differ): every rank's shards
            ag = g.alloc(const(sum(self._gathered_bytes(q) for q in self._unit(unit))), 1, label)
            ag.region, ag.chain = "communication", True
        g.drop(*reversed(shards))
        if scales:
            self._st(g).setdefault("scales", {})[unit] = scales
        return ag

    def _copy_out(self, g: Graph, unit: str) -> None:
        st = self._st(g)
        ups = []
        for q in self._unit(unit):  # each parameter's unsharded storage (alloc_storage)
            t = g.alloc(const(self._gathered_bytes(q)), 1, f"unsharded {unit}")
            t.region = "gathered"
            ups.append(t)
        st["ups"][unit] = ups
        scales = st.get("scales", {}).pop(unit, None)
        if scales is not None:
            # fsdp_post_all_gather(out=...) gives each unsharded fp8 weight its new scale; the one it had (the
            # previous gather's, or the previous step's before the first) goes unless a saved weight holds it.
            # The step's parameters of the unit are in the engine's order: both follow the model's weights
            step = [q for q in self._unit(unit) if not q.idle]  # the idle weights are not among them
            converted = [w for q, w in zip(step, g.unit_params[unit], strict=True) if q.fp8]
            for w, scale in zip(converted, scales, strict=True):
                old = w.fp8_scale
                if old is None:  # the first gather of the step: the previous step's backward left the scale
                    old = g.external(const(1), 4, f"float8 scale {unit} (previous step)")
                    old.region = "communication"
                w.fp8_scale = scale
                g.drop(old)

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

    def unit_backward_begin(self, g: Graph, unit: str, prefetch: str | None = None) -> None:
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
        # backward prefetch: the next unit in backward order, `prefetch`, is all-gathered now (the root
        # is already unsharded; the first layer has nothing after it)
        if self.reshard_after_forward and prefetch is not None:
            st["prefetched"] = self._all_gather_output(g, prefetch, "all-gather prefetch")

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
        rs_in = g.alloc(const(sum((q.world or self.world) * q.shard * (self.reduce_dt or q.dt) for q in trained)), 1,
                        f"reduce-scatter input {unit}")
        rs_in.region, rs_in.chain = "communication", True
        for grad in grads:
            grad.is_grad = False
        g.drop(*grads)
        rs_out = g.alloc(const(self._grad_shard_bytes(unit)), 1, f"sharded gradients {unit}")
        rs_out.stream = REDUCE_SCATTER_STREAM
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
            rs = sum((q.world or self.world) * q.shard * (self.reduce_dt or q.dt) for q in trained)
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
        # the layers in order, each run of layers of one kind as its first layer and the rest repeated
        start = 0
        for unit, run in groupby(layer_units(m)):
            n = len(list(run))
            first, prev = unit_events(unit, prev)
            segs.append(_segment("backward", f"{PIPELINE_REDUCE}: layer {start}", 1, tuple(first)))
            if n > 1:
                rest, prev = unit_events(unit, prev)
                segs.append(_segment("backward", f"{PIPELINE_REDUCE}: layers {start + 1}-{start + n - 1}", n - 1,
                                     tuple(rest)))
            start += n
        if prev:
            segs.append(_segment("backward", f"{PIPELINE_REDUCE}: finalize", 1,
                                 ((comm, -1, const(prev), "last reduce-scatter input freed"),)))
        return segs

    def _grad_shard_bytes(self, unit: str) -> int:
        """One flat reduce-scatter output per unit holds its sharded gradients (in the reduce dtype)."""
        return sum(q.shard * (self.reduce_dt or q.dt) for q in self._unit(unit) if q.trainable)

    def _grads(self, m: ModelSpec) -> list[tuple[int, int]]:
        counts = [("root", 1), *Counter(layer_units(m)).items()]
        return [(n, c) for n, c in ((self._grad_shard_bytes(unit), count) for unit, count in counts) if n]

    def param_shards(self, weights: list[Any]) -> list[tuple[int, int]]:
        """(bytes, count) of the rank's parameter shards: rank 0's padded dim-0 chunk of each parameter (of a
        QLoRA weight, of its packed 4-bit storage)."""
        out = []
        for p, dt, _trainable in weights:
            nf4 = nf4_parts(p, dt)
            world = shard_world(p, self.world, self.ep)
            out.append((-(-nf4[0] // world) if nf4 else _padded_shard(p, world) * dt, p.count))
        return out

    @staticmethod
    def replicated(weights: list[Any]) -> list[tuple[int, int]]:
        """(bytes, count) of what every rank holds whole and on the GPU: QLoRA's quantization states (`nf4_parts`)."""
        return [(nf4[1], p.count) for p, dt, _t in weights if (nf4 := nf4_parts(p, dt)) is not None]

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        kept: list[tuple[str, Sz, int]] = [("weights/params", const(n), c) for n, c in self.replicated(weights)]
        if self.offload:
            # CPUOffloadPolicy: the parameter shards, their gradients and the optimizer states live in
            # host memory (`trainmem_nb.parallel.layout._host_bytes`); nothing of them but QLoRA's
            # quantization states is on the GPU before the step
            return kept
        out: list[tuple[str, Sz, int]] = [("weights/params", const(n), c) for n, c in self.param_shards(weights)]
        out += kept
        # torchao's float8 all-gather: each converted weight keeps the scale of its last gather (the previous
        # step's backward) until this step's first gather replaces it
        for unit, count in Counter(layer_units(m)).items():
            n = sum(q.fp8 for q in self._unit(unit))
            if n:
                out.append(("overhead/communication", const(4), n * count))
        if self.pipelined:
            # every parameter of the stage stays gathered from the first micro-batch's forward to
            # perform_reduce_grad: torchtitan does not reshard after forward under PP (parallelize.py,
            # "For PP, do not reshard after forward to avoid per-microbatch all-gathers") and pipelining
            # does not reshard after backward (stage.py, backward_maybe_with_nosync:
            # ``set_reshard_after_backward(False)``); a later micro-batch finds the earlier ones'
            # unsharded gradients (`_accumulate_unsharded`)
            for unit, count in (("root", 1), *Counter(layer_units(m)).items()):
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
            return _row_shard(p, shard_world(p, self.world, self.ep)) if _held(self, p, m) else None

        opt = optimizer_program(m, t, shard, self._grads(m))
        return self._pipelined_reduce(m) + opt if self.pipelined else opt


#: label prefix of the segments of pipelining's deferred reduce-scatter (after every micro-batch)
PIPELINE_REDUCE = "reduce-scatter after the last micro-batch"
