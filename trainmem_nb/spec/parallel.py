"""How a step is split over GPUs: data parallel with ZeRO/FSDP sharding, tensor (+ sequence) parallel,
pipeline parallel, context parallel, expert parallel, CPU offload.

`ParallelSpec` validates a layout (``tp * pp * cp * dp == gpus``, engines that can offload...) with
messages that say what would work instead; `trainmem_nb.parallel` simulates each rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, model_validator

from ..errors import SpecError, did_you_mean
from .base import _FROZEN, SpecModel, _Choice

__all__ = ['Engine', 'Offload', 'ParallelSpec', 'PipelineSchedule', 'build_parallel']


class Engine(_Choice):
    """Which framework shards and communicates (their memory recipes differ)."""

    DDP = "ddp"  #: torch DistributedDataParallel (+ ZeroRedundancyOptimizer for zero=1)
    FSDP = "fsdp"  #: torch FSDP2: zero=3 full shard, zero=2 shard-grad-op, hybrid shard across nodes
    DEEPSPEED = "deepspeed"  #: DeepSpeed ZeRO stages 0-3 with its bf16/fp16 optimizer
    MEGATRON = "megatron"  #: Megatron-LM (tensor/sequence/pipeline parallel, distributed optimizer)


class Offload(_Choice):
    """What lives in host memory instead of the GPU (DeepSpeed ZeRO-Offload / FSDP CPU offload)."""

    NONE = "none"
    OPTIMIZER = "optimizer"  #: optimizer states (and the update) on the CPU
    OPTIMIZER_PARAMS = "optimizer+params"  #: also the (sharded) parameters, gathered per layer


class PipelineSchedule(_Choice):
    """Pipeline schedules: how many micro-batches a stage keeps in flight."""

    ONE_F_ONE_B = "1f1b"  #: stage i keeps pp - i micro-batches of activations (Narayanan et al. 2021)
    #: 1F1B over ``virtual_stages`` model chunks per stage: about (1 + (pp-1)/(pp*v)) times 1F1B's
    #: activations in flight on the first stage, for a bubble v times smaller (Narayanan et al. 2021)
    INTERLEAVED = "interleaved"
    GPIPE = "gpipe"  #: all grad_accum micro-batches in flight


class ParallelSpec(SpecModel):
    """A parallel layout over ``gpus`` GPUs on ``nodes`` nodes.

    Without ``engine``, ZeRO stages and offload mean DeepSpeed, and plain data parallelism DDP.

    >>> p = ParallelSpec(gpus=8, zero=3)
    >>> p.engine.value, p.dp, p.gpus_per_node
    ('deepspeed', 8, 8)
    """

    model_config = _FROZEN

    gpus: int = Field(default=1, ge=1, le=1 << 20)
    nodes: int = Field(default=1, ge=1, le=1 << 16)
    engine: Engine = Engine.DDP
    zero: int = Field(default=0, ge=0, le=3, description="ZeRO stage: 0 none, 1 optimizer states, 2 +grads, 3 +params "
                                                          "(engine='fsdp' without one: 3, FSDP's FULL_SHARD)")
    hybrid_shard: bool = Field(default=False, description="FSDP HYBRID_SHARD: shard within a node, replicate across")
    tp: int = Field(default=1, ge=1, le=1024, description="tensor parallel degree")
    sp: bool = Field(default=False, description="sequence parallel with tensor parallel (Korthikanti et al. 2022)")
    pp: int = Field(default=1, ge=1, le=4096, description="pipeline parallel stages")
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = Field(default=1, ge=1, le=128, description="model chunks per stage (interleaved)")
    cp: int = Field(default=1, ge=1, le=1024, description="context (sequence) parallel degree")
    ep: int = Field(default=1, ge=1, le=4096, description="expert parallel degree (MoE)")
    offload: Offload = Offload.NONE
    ddp_bucket_view: bool = Field(default=False, description="DDP gradient_as_bucket_view: gradients are views "
                                                             "into the all-reduce buckets, not a second copy")
    pp_return_outputs: bool = Field(
        default=True, description="pipeline schedule.step(return_outputs=...): torch's default True keeps the last "
        "stage's outputs (logits) of every micro-batch until the step ends; torchtitan keeps the default")
    loss_fusion: bool = Field(
        default=False, description="engine='megatron': --cross-entropy-loss-fusion, its jit-fused vocab-parallel "
        "cross-entropy (megatron/core/fusions/fused_cross_entropy.py), which holds one more fp32 copy of the rank's "
        "logits while the loss runs (measured in Megatron-LM's CI)")
    grad_accum_fusion: bool = Field(
        default=True, description="engine='megatron': gradient_accumulation_fusion, Megatron-LM's default "
        "(--no-gradient-accumulation-fusion turns it off): the linears' weight-gradient matmuls add into the fp32 "
        "main_grad buffer, no 16-bit weight gradient is made")

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if data.get("engine") is None:
            # ZeRO stages and offload are DeepSpeed's vocabulary: without an engine they mean DeepSpeed
            zero, offload = data.get("zero") or 0, data.get("offload") or "none"
            data["engine"] = "deepspeed" if zero or str(getattr(offload, "value", offload)) != "none" else "ddp"
        for key, enum in (("engine", Engine), ("offload", Offload), ("pp_schedule", PipelineSchedule)):
            if key in data and data[key] is not None:
                data[key] = enum.parse(data[key], key)
        if data.get("zero") is None:
            data.pop("zero", None)
            if data.get("engine") is Engine.FSDP:
                # FSDP shards fully unless told otherwise: FSDP1's sharding_strategy defaults to FULL_SHARD
                # (torch/distributed/fsdp/fully_sharded_data_parallel.py) and FSDP2's fully_shard always shards
                data["zero"] = 3
        return data

    @model_validator(mode="after")
    def _check(self) -> ParallelSpec:
        if self.gpus % self.nodes:
            raise SpecError(f"gpus={self.gpus} is not divisible by nodes={self.nodes}; "
                            f"use gpus={self.nodes * max(1, self.gpus // self.nodes)} or nodes that divide {self.gpus}")
        model_par = self.tp * self.pp * self.cp
        if self.gpus % model_par:
            raise SpecError(
                f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {model_par} does not divide gpus={self.gpus}; "
                f"tp*pp*cp*dp must equal gpus (e.g. gpus={model_par * max(1, self.gpus // model_par)})"
            )
        if self.tp > self.gpus_per_node:
            raise SpecError(f"tp={self.tp} exceeds the {self.gpus_per_node} GPUs of a node; tensor parallelism needs "
                            f"a fast interconnect: use tp <= {self.gpus_per_node} and pp or dp across nodes")
        if self.sp and self.tp == 1:
            raise SpecError("sp=True (sequence parallel) needs tp > 1: it splits the tensor-parallel region's activations")
        if self.zero and self.engine is Engine.DDP and self.zero > 1:
            raise SpecError(f"engine='ddp' supports zero=0 or 1 (ZeroRedundancyOptimizer); for zero={self.zero} "
                            f"use engine='deepspeed' or engine='fsdp'")
        if self.engine is Engine.FSDP and self.zero == 1:
            raise SpecError("engine='fsdp' shards gradients with the optimizer states: use zero=2 (SHARD_GRAD_OP) or "
                            "zero=3 (FULL_SHARD), or zero=0 (NO_SHARD)")
        if self.engine is Engine.MEGATRON and self.zero > 1:
            raise SpecError(f"engine='megatron' shards optimizer states only (distributed optimizer, zero=1); "
                            f"zero={self.zero} needs engine='deepspeed' or 'fsdp'")
        if self.hybrid_shard and self.engine is not Engine.FSDP:
            raise SpecError("hybrid_shard=True is FSDP's HYBRID_SHARD: use engine='fsdp'")
        if self.offload is not Offload.NONE:
            if self.engine not in (Engine.DEEPSPEED, Engine.FSDP):
                raise SpecError(f"offload={self.offload.value!r} needs engine='deepspeed' (ZeRO-Offload) or "
                                f"engine='fsdp' (CPUOffload); engine={self.engine.value!r} cannot offload")
            if self.offload is Offload.OPTIMIZER_PARAMS and self.zero < 3:
                raise SpecError(f"offload='optimizer+params' offloads sharded parameters: it needs zero=3 (got zero={self.zero})")
            if self.offload is Offload.OPTIMIZER and self.zero == 0:
                raise SpecError("offload='optimizer' offloads the ZeRO-partitioned optimizer: use zero >= 1")
            if self.offload is Offload.OPTIMIZER and self.engine is Engine.FSDP:
                # FSDP2's CPUOffloadPolicy (like FSDP1's CPUOffload(offload_params=True)) moves the sharded
                # parameters to the CPU; their gradients follow and the optimizer steps there: there is no
                # optimizer-only offload (torch/distributed/fsdp/_fully_shard/_fsdp_api.py, OffloadPolicy)
                raise SpecError("engine='fsdp' with offload='optimizer': FSDP offloads parameters, gradients and "
                                "optimizer together: use offload='optimizer+params', or engine='deepspeed' to "
                                "offload only the optimizer")
        if self.pp_schedule is PipelineSchedule.INTERLEAVED and self.virtual_stages < 2:
            raise SpecError(f"pp_schedule='interleaved' needs virtual_stages >= 2 (got {self.virtual_stages}); "
                            "use virtual_stages=2 or more, or pp_schedule='1f1b'")
        if self.virtual_stages > 1 and self.pp_schedule is not PipelineSchedule.INTERLEAVED:
            raise SpecError(f"virtual_stages={self.virtual_stages} splits each stage into model chunks, which only "
                            f"the interleaved schedule runs (pp_schedule={self.pp_schedule.value!r}): use "
                            "pp_schedule='interleaved', or virtual_stages=1")
        if self.loss_fusion and self.engine is not Engine.MEGATRON:
            raise SpecError(f"loss_fusion=True is Megatron's --cross-entropy-loss-fusion: use engine='megatron' "
                            f"(engine={self.engine.value!r} computes transformers' loss)")
        if not self.grad_accum_fusion and self.engine is not Engine.MEGATRON:
            raise SpecError(f"grad_accum_fusion=False is Megatron's --no-gradient-accumulation-fusion: use "
                            f"engine='megatron' (engine={self.engine.value!r} has no such option)")
        if self.ddp_bucket_view and self.engine is not Engine.DDP:
            raise SpecError(f"ddp_bucket_view=True is DistributedDataParallel's gradient_as_bucket_view: use "
                            f"engine='ddp' (engine={self.engine.value!r} has its own gradient buffers)")
        return self

    @property
    def dp(self) -> int:
        """Data-parallel degree: gpus / (tp * pp * cp)."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def gpus_per_node(self) -> int:
        """GPUs in one node."""
        return self.gpus // self.nodes

    @property
    def shard_degree(self) -> int:
        """Over how many ranks ZeRO/FSDP shards model states: data and context parallel ranks hold the
        same layers (torchtitan's ``dp_shard_cp`` mesh, Megatron's distributed optimizer over DP x CP);
        hybrid sharding stops at the node."""
        if self.zero == 0:
            return 1
        ranks = self.dp * self.cp
        if self.hybrid_shard:
            return max(1, min(ranks, self.gpus_per_node // self.tp))
        return ranks

    @property
    def single_device(self) -> bool:
        """True for one GPU in a plain PyTorch loop (engine ddp) with nothing offloaded. Data parallelism adds
        gradient buckets; Megatron, DeepSpeed and FSDP keep their own buffers on one GPU too."""
        return self.gpus == 1 and self.offload is Offload.NONE and self.engine is Engine.DDP


_PARALLEL_FIELDS = frozenset(ParallelSpec.model_fields)


def build_parallel(parallel: ParallelSpec | Mapping[str, Any] | None = None, **options: Any) -> ParallelSpec:
    """A validated `ParallelSpec` from a spec, a dict and/or keyword options (keywords win)."""
    from .base import _validate

    if isinstance(parallel, ParallelSpec) and not options:
        return parallel
    data: dict[str, Any] = {}
    if isinstance(parallel, ParallelSpec):
        data.update(parallel.model_dump(exclude_defaults=True))
        if parallel.engine is Engine.FSDP:  # its zero 0 (NO_SHARD) is not FSDP's default stage (3): keep it
            data["zero"] = parallel.zero
    elif isinstance(parallel, Mapping):
        data.update(parallel)
    elif parallel is not None:
        raise SpecError(f"parallel must be a ParallelSpec or a dict, got {type(parallel).__name__}")
    data.update({k: v for k, v in options.items() if v is not None})
    if not data:  # one GPU, the common case: a frozen spec can be shared
        return _default_parallel()
    unknown = sorted(set(data) - _PARALLEL_FIELDS)
    if unknown:
        raise SpecError(f"unknown parallel option {unknown[0]!r}{did_you_mean(unknown[0], sorted(_PARALLEL_FIELDS))}")
    return _validate(ParallelSpec, data)


@lru_cache(maxsize=1)
def _default_parallel() -> ParallelSpec:
    return ParallelSpec()


Layout = Literal["single", "dp", "model-parallel"]
