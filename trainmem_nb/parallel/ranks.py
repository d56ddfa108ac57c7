"""What every parallel engine shares: a rank's memory row, shards of parameters and the engines'
bucket constants (each with its source).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ..engine.breakdown import DETAIL_KEYS
from ..engine.tape import Sz
from ..model.params import ParamTensor, idle_trainable, on_stage, routed_expert, trainable_tensors
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from ..step.layers import in_layer_of
from ..step.optimizers import state_bytes

__all__ = ['RankMemory']

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


def nf4_parts(p: ParamTensor, dt: float) -> tuple[int, int] | None:
    """A QLoRA NF4 weight (bytes per element below 1, `trainmem_nb.model.params.nf4_bytes`) as (its packed
    4-bit values, its quantization state) in bytes, else None. bitsandbytes' ``Params4bit`` holds the packed
    values as its storage and the state (absmax, nested absmax, code, offset) as a ``quant_state`` attribute,
    no parameter: FSDP and ZeRO-3 shard the storage and leave the state whole on every rank (and on the GPU
    when they offload)."""
    if dt >= 1:
        return None
    packed = -(-p.numel // 2)
    return packed, round(dt * p.numel) - -(-packed // 512) * 512


def _padded_shard(p: ParamTensor, world: int) -> int:
    """FSDP2's per-rank shard of one parameter: dim 0 chunked into `world` pieces, padded to the largest
    (rank 0's; a later rank's unpadded shard can be smaller: rank 0 is the worst)."""
    return _row_shard(p, world).numel


def shard_world(p: ParamTensor, world: int, ep: int) -> int:
    """Over how many ranks parameter `p` (and its gradient and optimizer state) is sharded when the
    layout's other parameters are sharded over `world`: a routed expert stack over its expert-data-parallel
    group of ``world / ep`` ranks (torchtitan's ``efsdp`` mesh, ``dp_shard_cp / ep``; DeepSpeed's expert
    data-parallel group; Megatron's expert data parallelism), since the `ep` ranks of an expert-parallel
    group hold different experts."""
    return max(1, world // ep) if ep > 1 and routed_expert(p) else world


def _row_shard(p: ParamTensor, world: int) -> ParamTensor:
    """Rank 0's part of a parameter split along dim 0 into `world` chunks (torch.chunk's rule).

    A stack of experts (a 3-D MoE parameter, experts first) with fewer experts than ranks is split along
    its second dim instead, as torchtitan's FSDP2 wrapping of MoE blocks does (``apply_fsdp``: its
    ``_experts_shard_placement_fn`` returns ``Shard(1)`` when ``efsdp_degree * ep_degree > num_experts``):
    along dim 0 each rank would hold a padded whole expert and every all-gather would fetch ``world`` of
    them, so memory would grow with the GPU count (`trainmem_nb.estimator.notes` says so)."""
    if len(p.shape) == 3 and p.shape[0] < world:
        return p._replace(shape=(p.shape[0], -(-p.shape[1] // world), p.shape[2]))
    return p._replace(shape=(-(-p.shape[0] // world), *p.shape[1:]))


def _units(weights: Sequence[tuple[ParamTensor, int, bool]],
           m: ModelSpec) -> dict[str, list[tuple[ParamTensor, int, bool]]]:
    """Parameters of the root unit (outside the layers) and of one layer unit of each kind `layer_units`
    names: a model whose MoE and dense layers differ has a ``"layer/moe"`` and a ``"layer/dense"`` unit."""
    units = {"root": [w for w in weights if not w[0].in_layer]}
    for name, kind in dict(zip(layer_units(m), m.layer_kinds, strict=True)).items():
        units[name] = [w for w in weights if w[0].in_layer and in_layer_of(w[0], kind)]
    return units


def layer_units(m: ModelSpec) -> tuple[str, ...]:
    """The unit key of each layer of `m`: ``"layer"``, or ``"layer/moe"`` / ``"layer/dense"`` when the
    layers' MLPs differ (the suffix of the step's unit names, `trainmem_nb.step.layers.layer_plan`)."""
    if len({k.moe for k in m.layer_kinds}) == 1:
        return ("layer",) * m.n_layers
    return tuple("layer/moe" if k.moe else "layer/dense" for k in m.layer_kinds)


class _Param(NamedTuple):
    shard: int  # elements of the rank's (padded) shard
    trainable: bool
    dt: int  # bytes per element of the sharded parameter
    numel: int = 0  # elements of the unsharded parameter (its gradient's size)
    world: int = 0  # ranks it is sharded over when not the engine's (a routed expert: `shard_world`)
    fp8: bool = False  # all-gathered in fp8 (torchao's float8 all-gather of a converted linear's weight)
    idle: bool = False  # held but never run (a multimodal checkpoint's vision tower, in FSDP2's root group)


def _held(hooks: EngineHooks, p: ParamTensor, m: ModelSpec) -> bool:
    return on_stage(p, m, hooks.first_stage, hooks.last_stage)


def _trainable(hooks: EngineHooks, m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, int]]:
    """The trainable tensors this rank's pipeline stage holds."""
    return [(p, dt) for p, dt in trainable_tensors(m, t) if _held(hooks, p, m)]


def _partition(hooks: EngineHooks, m: ModelSpec, t: TrainingSpec, world: int) -> int:
    """Elements of the rank's partition of the trainable parameters when they are flattened and split
    `world` ways (DeepSpeed's and Megatron's optimizers), routed experts over their own group
    (`shard_world`: DeepSpeed keeps expert parameters in groups of their own, partitioned over the expert
    data-parallel group). The idle parameters that require a gradient (a multimodal checkpoint's vision tower,
    `idle_trainable`) are in it: the flat groups take every parameter that requires one (measured: their master
    copy and optimizer state are on the partition though they never get a gradient)."""
    ep = getattr(hooks, "ep", 1)
    idle = sum(p.numel * p.count for p, _dt in idle_trainable(m, t) if _held(hooks, p, m))
    dense = idle + sum(p.numel * p.count for p, _dt in _trainable(hooks, m, t) if not (ep > 1 and routed_expert(p)))
    experts = sum(p.numel * p.count for p, _dt in _trainable(hooks, m, t) if ep > 1 and routed_expert(p))
    out = -(-dense // world)
    if experts:
        out += -(-experts // max(1, world // ep))
    return out


def _sharded_states(hooks: EngineHooks, m: ModelSpec, t: TrainingSpec, world: int) -> list[tuple[str, Sz, int]]:
    """Optimizer state of the rank's share of the parameters (ZeRO-1: states split `world` ways; routed
    experts over their expert-data-parallel group, `shard_world`)."""
    if t.first_step:
        return []
    ep = getattr(hooks, "ep", 1)
    return [("optimizer_states", sz, c)
            for sz, c in state_bytes(m, t, lambda p: _row_shard(p, shard_world(p, world, ep))
                                     if _held(hooks, p, m) else None)]
