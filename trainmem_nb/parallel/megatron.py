"""Megatron-LM: its fp32 gradient buffer and distributed optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.program import Segment
from ..engine.tape import Graph, Sz, T, const
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from ..step.optimizers import flat_state_bytes
from .ranks import _partition, _trainable


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
        if not t.first_step:  # fp32 main parameters and the optimizer's state, on the rank's partition
            per = (4 if t.optimizer.value != "none" else 0) + flat_state_bytes(t)
            if per:
                out.append(("optimizer_states", const(round(per * _partition(self, m, t, self.world))), 1))
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        return []  # fused Adam on the shard; the grad buffer is zeroed in place, not freed
