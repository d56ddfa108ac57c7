"""torch DistributedDataParallel (and ZeroRedundancyOptimizer for ZeRO-1): gradient buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.program import Segment, _round
from ..engine.tape import Graph, Sz, T, const
from ..model.params import ParamTensor, idle_trainable
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from ..step.optimizers import optimizer_program
from .ranks import _held, _row_shard, _sharded_states, _trainable, shard_world


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
    ep: int = 1  #: expert parallelism: ZeRO-1 shards routed experts' states over ``world / ep`` ranks
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
        # the reducer lays out a bucket slot for every parameter that requires a gradient, the ones autograd
        # never reaches included (a multimodal checkpoint's vision tower in a text-only step: reducer.cpp
        # initialize_buckets, `at::empty` of each bucket's total; measured: tests/test_parallel.py), and leaves
        # a globally unused one's .grad alone (copy_bucket_to_grad: "If a parameter is globally unused, we keep
        # its grad untouched")
        idle = [(round(p.numel * dt), p.count) for p, dt in idle_trainable(m, t)]
        buckets = sum(_round(n) * c for n, c in grads + idle)
        if self.bucket_view:  # the buckets are the gradients
            out.append(("gradients", const(buckets), 1))
        else:
            # the reducer's flat buckets persist between steps: a second copy of every gradient
            out.append(("overhead/communication", const(buckets), 1))
            if t.grads_persist:  # a later micro-step or set_to_none=False: every .grad exists, added in place
                out += [("gradients", const(n), c) for n, c in grads]
        world = self.world if self.zero >= 1 else 1
        return out + _sharded_states(self, m, t, world)

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        world = self.world if self.zero >= 1 else 1

        def shard(p: ParamTensor) -> ParamTensor | None:  # ZeroRedundancyOptimizer steps on its shard
            return _row_shard(p, shard_world(p, world, self.ep)) if _held(self, p, m) else None

        # zero_grad frees the full .grad tensors, or nothing when they are views of the buckets
        return optimizer_program(m, t, shard, [] if self.bucket_view else self._grads(m, t))
