"""DeepSpeed ZeRO stages 0-3: its 16-bit model, fp32 master weights and moments, buckets and
ZeRO-3's live parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.program import Segment, _round, _segment
from ..engine.tape import Graph, Sz, T, const
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from .ranks import (
    _CAT,
    DS_ALLGATHER_BUCKET,
    DS_REDUCE_BUCKET,
    DS_STAGE3_MAX_LIVE,
    DS_STAGE3_PERSISTENCE,
    _partition,
    _trainable,
    nf4_parts,
    shard_world,
)


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
    ep: int = 1  #: expert parallelism: routed experts are partitioned over ``world / ep`` ranks (`shard_world`)
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

    def unit_backward_begin(self, g: Graph, unit: str, prefetch: str | None = None) -> None:
        self.unit_forward_begin(g, unit)  # ZeRO-3 gathers the unit again for its backward

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        self.unit_forward_end(g, unit)
        if self.zero >= 2:  # gradients are reduced into the rank's partition as buckets fill
            for grad in grads:
                grad.is_grad = False
            g.drop(*grads)

    def param_partitions(self, weights: list[Any]) -> list[tuple[int, int]]:
        """(bytes, count) of the rank's parameters: ZeRO-3 partitions those of at least
        ``stage3_param_persistence_threshold`` elements, the others stay whole; below ZeRO-3, all whole.
        The engine casts the module to its 16-bit dtype (``engine._configure_distributed_model``:
        ``module.bfloat16()``/``half()``), which leaves QLoRA's NF4 weights packed: bitsandbytes'
        ``Params4bit`` holds integer (or ``bnb_4bit_quant_storage``) storage, not a floating tensor, and its
        quantization state is no parameter: ZeRO-3 partitions the packed storage, and the state stays whole
        on the GPU (`replicated`)."""
        def part(numel: int, shard_p: int) -> int:
            return -(-numel // shard_p) if numel >= DS_STAGE3_PERSISTENCE or shard_p == 1 else numel

        out: list[tuple[int, int]] = []
        for p, dt, _train in weights:
            shard_p = shard_world(p, self.world, self.ep) if self.zero >= 3 else 1
            nf4 = nf4_parts(p, dt)
            out.append((part(nf4[0], shard_p) if nf4 else part(p.numel, shard_p) * self.model_dt, p.count))
        return out

    @staticmethod
    def replicated(weights: list[Any]) -> list[tuple[int, int]]:
        """(bytes, count) of what every rank holds whole and on the GPU, offloaded or not: QLoRA's
        quantization states (`nf4_parts`)."""
        return [(nf4[1], p.count) for p, dt, _t in weights if (nf4 := nf4_parts(p, dt)) is not None]

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        out: list[tuple[str, Sz, int]] = []
        world = self.world
        if self.offload != "optimizer+params":  # ZeRO-Infinity's offload_param: partitions on the host
            out += [("weights/params", const(n), c) for n, c in self.param_partitions(weights)]
        out += [("weights/params", const(n), c) for n, c in self.replicated(weights)]
        if self.zero < 2 and t.grad_accum > 1:
            # ZeRO-0/1 accumulate into the 16-bit ``.grad`` of every trained parameter over the
            # micro-steps (`local_grads_accumulate`): a later micro-step starts with all of them, which
            # zero_grad frees after the optimizer step (`optimizer`)
            out += [("gradients", const(p.numel * self.model_dt), p.count) for p, _dt in _trainable(self, m, t)]
        if self.offload == "none" and not t.first_step:
            per = 12 if self.model_dt == 2 else 8  # fp32 master copy only with a 16-bit model
            out.append(("optimizer_states", const(_partition(self, m, t, world if self.zero >= 1 else 1) * per), 1))
        # reduce bucket and, for ZeRO-1/2, the all-gather bucket for the updated parameters
        out.append(("overhead/communication", const(DS_REDUCE_BUCKET * self.model_dt), 1))
        if self.zero >= 2 and self.offload == "none":
            # the rank's gradient partition; with an offloaded optimizer it is on the host instead
            # (stage_1_and_2.py copy_grads_in_partition returns before allocating grads_in_partition
            # when cpu_offload; stage3.py puts grad_partitions_flat_buffer on self.device, the CPU)
            out.append(("gradients", const(_partition(self, m, t, world) * self.model_dt), 1))
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        n_train = sum(p.numel * p.count for p, _dt in _trainable(self, m, t))
        shard = _partition(self, m, t, self.world if self.zero >= 1 else 1)
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
