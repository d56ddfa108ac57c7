"""The planner: will it fit, on which GPU, how many, how long and what will it cost?

Start from the model and method, work back to memory with headroom (`fit`, `max_micro_batch`,
`fewest_gpus`), then search layouts per GPU type (`plan`): one GPU, one NVLink node or several nodes;
ZeRO-3/FSDP, tensor parallel inside a fast domain, pipeline across nodes; checkpointing; micro-batch and
gradient accumulation for a target global batch. Time is training FLOPs over GPUs x dense peak x an MFU
assumption plus the communication that cannot hide; cost is on-demand vs spot with checkpoints,
interruptions and billing granularity. Every number from the world is a named constant with its source.

>>> import trainmem_nb as tm
>>> est = tm.estimate("llama-3.2-1b", micro_batch=1, seq_len=2048)
>>> tm.fit(est, "H100").verdict
'fits'
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .estimate import MemoryEstimate, check_model_options, estimate
from .gpus import GPU, Price, get_gpu, list_gpus, load_prices, snapshot_date
from .parallelism import ParallelSpec, build_parallel, check_layout
from .presets import resolve_model
from .specs import Checkpointing, Method, ModelSpec, Precision, SpecError, TrainingSpec, build_training
from .units import format_bytes, format_count

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COMM_EFFICIENCY",
    "DEFAULT_HEADROOM",
    "HW_INTERRUPTIONS_PER_GPU_HOUR",
    "INTER_NODE_GBS_PER_GPU",
    "MFU_DEFAULTS",
    "RESTART_OVERHEAD_S",
    "SPOT_INTERRUPTIONS_PER_NODE_HOUR",
    "STORAGE_WRITE_GBS_PER_NODE",
    "CostEstimate",
    "Fit",
    "Plan",
    "StepTime",
    "checkpoint_bytes",
    "fewest_gpus",
    "fit",
    "flops_per_token",
    "max_micro_batch",
    "plan",
    "plot_options",
    "run_cost",
    "step_time",
]

# ----------------------------------------------------------------------------------------------------------
# Numbers from the world (each with its source). Override any of them per call.

#: Fraction of the card kept free by default: allocator fragmentation and spikes the model cannot see.
DEFAULT_HEADROOM = 0.10

#: Default utilisation of the dense peak by GPU class, applied to the FLOPs actually executed
#: (recomputation included), each with its source. Published MFUs of runs without recomputation are this
#: number; runs with recomputation report MFU = this x model/executed FLOPs.
MFU_DEFAULTS: dict[str, tuple[float, str]] = {
    "hopper": (0.40, "Llama 3 paper (Dubey et al. 2024, Table 4): 38-43% BF16 MFU on 8K-16K H100s"),
    "blackwell": (0.40, "assumed equal to Hopper: no published bf16 training MFU for B200/GB200 found"),
    "ampere": (0.45, "Narayanan et al. 2021 (arXiv 2104.04473, Table 1): 44-52% of A100 peak for GPT 1.7B-1T, "
                     "recomputation counted; the low end"),
    "volta": (0.30, "Shoeybi et al. 2019 (Megatron-LM, arXiv 1909.08053): 39 TFLOP/s on one V100 = 30% of peak"),
    "tpu": (0.46, "PaLM (Chowdhery et al. 2022, Table 3): 46.2% MFU on 6144 TPU v4 chips"),
    "gddr": (0.30, "assumption: no published training MFU for GDDR/PCIe cards found; set mfu= for yours"),
    "cdna": (0.30, "assumption: SemiAnalysis (Dec 2024, 'MI300X vs H100 vs H200 Benchmark Part 1: Training') found "
                   "MI300X training far below its paper peak; no MFU figure taken from it"),
    "gaudi": (0.30, "assumption: no published Gaudi training MFU found"),
    "generic": (0.30, "assumption for a GPU without a known class"),
}

#: Achieved collective bus bandwidth as a share of the link's one-way bandwidth, by link kind. nccl-tests
#: all_reduce busbw at large sizes: 8x A100 SXM4 230-250 GB/s of 300 (0.8); 8x H100 PCIe without NVSwitch
#: 35-45 GB/s of 64 (0.6) (alayanew.com "NCCL-tests in practice", 2026-05-06, reference table).
COMM_EFFICIENCY = {"nvswitch": 0.8, "nvlink": 0.8, "infinity-fabric": 0.8, "ici": 0.8, "roce": 0.8, "pcie": 0.6,
                   "network": 0.8}

#: One-way network bandwidth per GPU between nodes, GB/s: 400 Gb/s per GPU, as in torchtitan's H100
#: benchmark hosts ("backend RDMA network with 400 Gb/s per GPU", torchtitan docs) and Azure ND H100 v5
#: ("InfiniBand 400 Gb/s per GPU", ../shared/data/prices_snapshot.csv notes).
INTER_NODE_GBS_PER_GPU = 50.0

#: Unexpected job interruptions per GPU-hour on on-demand hardware: 419 in a 54-day Llama 3 405B run on
#: 16,384 H100s (Dubey et al. 2024, section 3.3.4).
HW_INTERRUPTIONS_PER_GPU_HOUR = 419 / (54 * 24 * 16384)

#: Spot/preemptible interruptions per node-hour: one a day. Google's preemptible VMs "always stop after
#: 24 hours" (Compute Engine docs, create-use-preemptible); actual spot rates vary by region and hour:
#: read yours from the AWS Spot Instance Advisor or GCP capacity history and pass it in.
SPOT_INTERRUPTIONS_PER_NODE_HOUR = 1 / 24

#: Time to get going again after an interruption (re-acquire nodes, start processes, load the last
#: checkpoint): an assumption, 10 minutes; set restart_minutes for your setup.
RESTART_OVERHEAD_S = 600.0

#: Checkpoint write bandwidth per node, GB/s: one cloud block volume (AWS EBS gp3 is provisioned up to
#: 1,000 MiB/s per volume, AWS EBS docs). Sharded checkpoints are written by every node in parallel.
STORAGE_WRITE_GBS_PER_NODE = 1.0

#: Checkpoints kept on storage (the last good one while the next is written).
KEEP_CHECKPOINTS = 2

#: Warn when a PCIe-only box spends more than this share of the compute time in the gradient all-reduce.
PCIE_WARN_COMM_FRACTION = 0.25

#: Largest micro-batch any search tries.
MICRO_BATCH_SEARCH_LIMIT = 4096


# ----------------------------------------------------------------------------------------------------------
# Fit


@dataclass(frozen=True)
class Fit:
    """Whether one training step fits a GPU. Bytes are ``int``; ``margin_fraction`` = spare / usable
    (negative when it does not fit)."""

    verdict: Literal["fits", "tight", "oom"]  #: tight: fits the card, not with the headroom
    gpu: str
    needed_bytes: int  #: device_total_bytes of the worst rank (what nvidia-smi would show)
    usable_bytes: int  #: the GPU's memory.total
    headroom: float
    margin_fraction: float
    message: str
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """True when it fits with the headroom."""
        return self.verdict == "fits"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields."""
        return {"verdict": self.verdict, "gpu": self.gpu, "needed_bytes": self.needed_bytes,
                "usable_bytes": self.usable_bytes, "headroom": self.headroom,
                "margin_fraction": self.margin_fraction, "message": self.message, "notes": list(self.notes)}


def _check_headroom(headroom: float) -> float:
    if not 0.0 <= float(headroom) < 1.0:
        raise SpecError(f"headroom={headroom!r} must be a fraction in [0, 1), e.g. 0.10 for 10% kept free")
    return float(headroom)


def needed_bytes(est: MemoryEstimate) -> int:
    """What must fit on each GPU: the worst rank's device total (nvidia-smi view)."""
    worst = est.device_total_bytes
    for rank in est.per_rank or ():
        worst = max(worst, int(getattr(rank, "device_total_bytes", 0) or 0))
    return int(worst)


def _verdict(needed: int, usable: int, headroom: float) -> tuple[Literal["fits", "tight", "oom"], float]:
    margin = (usable - needed) / usable
    if needed <= usable * (1.0 - headroom):
        return "fits", margin
    return ("tight" if needed <= usable else "oom"), margin


def _fit_notes(est: MemoryEstimate, g: GPU, headroom: float = DEFAULT_HEADROOM) -> tuple[str, ...]:
    t = est.training
    notes = []
    if t.precision.value.startswith("bf16") and not g.supports_bf16:
        swap = t.precision.value.replace("bf16", "fp16")
        notes.append(f"{g.name} has no bf16: train with precision='{swap}' (same memory, loss scaling)")
    if t.device.value != "cuda":
        notes.append(f"the estimate is for device='{t.device.value}': no CUDA context or allocator cache counted; "
                     "use device='cuda' to plan a GPU")
    if g.vendor.upper() != "NVIDIA":
        notes.append(f"the estimate models PyTorch's CUDA allocator; on {g.vendor} treat the fit as approximate")
    if g.memory_bytes_source.startswith("derived"):
        notes.append(f"{g.name}'s usable memory is derived from its marketed size ({g.memory_bytes_source})")
    paged = int(est.overhead_bytes.get("paged_optimizer_states", 0))
    if paged and needed_bytes(est) > g.memory_bytes * (1.0 - headroom) >= needed_bytes(est) - paged:
        notes.append(f"{format_bytes(paged)} of it are paged optimizer states (CUDA unified memory): short of "
                     f"room, the driver pages them to host RAM and the step still runs, slower")
    return tuple(notes)


def fit(estimate: MemoryEstimate, gpu: str | GPU, headroom: float = DEFAULT_HEADROOM) -> Fit:
    """Does this step fit `gpu` with `headroom` (a fraction of the card) kept free?

    ``needed_bytes`` is the worst rank's ``device_total_bytes`` (CUDA context and allocator cache
    included), compared with the GPU's ``memory_bytes`` (nvidia-smi's total).

    >>> import trainmem_nb as tm
    >>> f = tm.fit(tm.estimate("llama-2-7b", micro_batch=1, seq_len=2048), "A100 40GB")
    >>> f.verdict, f.message.split(":")[0]
    ('oom', 'OOM on A100 SXM 40GB')
    """
    headroom = _check_headroom(headroom)
    g = get_gpu(gpu)
    need, usable = needed_bytes(estimate), g.memory_bytes
    verdict, margin = _verdict(need, usable, headroom)
    if verdict == "fits":
        message = f"fits {g.name} with {margin:.0%} to spare ({format_bytes(need)} of {format_bytes(usable)})"
    elif verdict == "tight":
        message = (f"tight on {g.name}: {format_bytes(need)} of {format_bytes(usable)}, {margin:.0%} spare, "
                   f"under the {headroom:.0%} headroom")
    else:
        over = f"{-margin:.0%} over" if -margin < 1 else f"{need / usable:.1f}x the card"
        message = f"OOM on {g.name}: needs {format_bytes(need)} of {format_bytes(usable)} ({over})"
    return Fit(verdict, g.name, need, usable, headroom, margin, message, _fit_notes(estimate, g, headroom))


def _precision_for(precision: str, g: GPU) -> str:
    """bf16 recipes become fp16 on GPUs without bf16 (V100, T4): same bytes, loss scaling instead."""
    if precision.startswith("bf16") and not g.supports_bf16:
        return precision.replace("bf16", "fp16")
    return precision


def _split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    par = {k: v for k, v in options.items() if k in ParallelSpec.model_fields}
    train = {k: v for k, v in options.items() if k not in ParallelSpec.model_fields}
    return train, par


def _training_dict(training: TrainingSpec | Mapping[str, Any] | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """The given training options (only those set explicitly), keywords winning."""
    data: dict[str, Any] = {}
    if isinstance(training, TrainingSpec):
        data.update({k: getattr(training, k) for k in training.model_fields_set})
    elif isinstance(training, Mapping):
        data.update(training)
    elif training is not None:
        raise SpecError(f"training must be a TrainingSpec or a dict, got {type(training).__name__}")
    data.update({k: v for k, v in options.items() if v is not None})
    build_training(None, **data)  # validate early with the usual messages
    return data


def max_micro_batch(model: Any, gpu: str | GPU, headroom: float = DEFAULT_HEADROOM, *,
                    training: TrainingSpec | Mapping[str, Any] | None = None,
                    parallel: ParallelSpec | Mapping[str, Any] | None = None,
                    limit: int = MICRO_BATCH_SEARCH_LIMIT, **options: Any) -> int:
    """The largest micro-batch whose step fits `gpu` with `headroom`; 0 if not even one sequence fits.

    Doubling then bisection: about 2·log2(answer) estimates (~0.2 ms each for one GPU). bf16 recipes are
    estimated as fp16 on GPUs without bf16.

    >>> max_micro_batch("gpt2", "T4", seq_len=1024) > 0
    True
    """
    headroom = _check_headroom(headroom)
    g = get_gpu(gpu)
    m = resolve_model(model)
    train_opts, par_opts = _split_options(options)
    data = _training_dict(training, train_opts)
    if "micro_batch" in options:
        raise SpecError("max_micro_batch searches micro_batch: leave it out of the options")
    data["precision"] = _precision_for(str(build_training(None, **data).precision.value), g)
    p = build_parallel(parallel, **par_opts)
    ev = _Evaluator(m, data)
    return ev.max_micro_batch(p, {}, g.memory_bytes * (1.0 - headroom), limit)


def fewest_gpus(model: Any, gpu: str | GPU, headroom: float = DEFAULT_HEADROOM, *,
                training: TrainingSpec | Mapping[str, Any] | None = None, max_gpus: int = 1024,
                **options: Any) -> ParallelSpec | None:
    """The smallest layout (a `ParallelSpec` with ``gpus`` and ``nodes`` filled in) that fits `gpu`, or None.

    Other parallel options (engine, zero, tp, pp, offload...) are kept as given; without any, ZeRO-3
    full sharding (``engine='fsdp', zero=3``) is used, the layout whose memory falls as GPUs are added.
    Nodes hold ``gpu.gpus_per_node`` GPUs.

    >>> fewest_gpus("gpt2", "T4", seq_len=512).gpus
    1
    """
    headroom = _check_headroom(headroom)
    g = get_gpu(gpu)
    m = resolve_model(model)
    train_opts, par_opts = _split_options(options)
    if "gpus" in par_opts or "nodes" in par_opts:
        raise SpecError("fewest_gpus searches gpus and nodes: leave them out of the options")
    data = _training_dict(training, train_opts)
    data["precision"] = _precision_for(str(build_training(None, **data).precision.value), g)
    layout = par_opts or {"engine": "fsdp", "zero": 3}
    ev = _Evaluator(m, data)
    limit = g.memory_bytes * (1.0 - headroom)
    for n in _gpu_counts(g, max_gpus):
        try:
            p = _layout(m, g, n, layout)
            need = ev.needed(p, {})
        except SpecError:
            continue
        if need <= limit:
            return p
    return None


# ----------------------------------------------------------------------------------------------------------
# Evaluating many layouts fast: estimates do not depend on the GPU type, so one cache serves them all.


class _Evaluator:
    """Worst-rank device bytes for (layout, training overrides), cached across GPU types."""

    def __init__(self, m: ModelSpec, base: Mapping[str, Any]) -> None:
        self.m = m
        self.base = dict(base)
        self.cache: dict[tuple[Any, ...], int | Exception] = {}
        self.estimates: dict[tuple[Any, ...], MemoryEstimate] = {}
        self.searches: dict[tuple[Any, ...], int] = {}  # GPUs of equal memory share an answer

    def _key(self, p: ParallelSpec, over: Mapping[str, Any]) -> tuple[Any, ...]:
        return (p, tuple(sorted(over.items())))

    def training(self, over: Mapping[str, Any]) -> TrainingSpec:
        return build_training(None, **{**self.base, **over})

    def estimate(self, p: ParallelSpec, over: Mapping[str, Any]) -> MemoryEstimate:
        key = self._key(p, over)
        if key not in self.estimates:
            self.estimates[key] = estimate(self.m, self.training(over), parallel=p)
        return self.estimates[key]

    def needed(self, p: ParallelSpec, over: Mapping[str, Any]) -> int:
        """Bytes per GPU (worst rank); raises SpecError for layouts the estimator rejects."""
        key = self._key(p, over)
        hit = self.cache.get(key)
        if hit is None:
            try:
                hit = needed_bytes(estimate(self.m, self.training(over), parallel=p))
            except (SpecError, ImportError, NotImplementedError) as exc:
                hit = exc
            except Exception as exc:  # a layout the per-rank simulation fails on: rejected with its reason,
                if p.gpus == 1:        # the search goes on; one GPU is the core path and must not fail
                    raise
                hit = exc
            self.cache[key] = hit
        if isinstance(hit, Exception):
            if isinstance(hit, SpecError):
                raise hit
            raise SpecError(f"cannot estimate this layout: {type(hit).__name__}: {hit}") from hit
        return hit

    def max_micro_batch(self, p: ParallelSpec, over: Mapping[str, Any], limit_bytes: float,
                        cap: int = MICRO_BATCH_SEARCH_LIMIT) -> int:
        """Largest micro-batch <= cap with needed <= limit_bytes (monotone in the micro-batch)."""
        key = (*self._key(p, over), int(limit_bytes), cap)
        if key not in self.searches:
            self.searches[key] = self._search(p, over, limit_bytes, cap)
        return self.searches[key]

    def _search(self, p: ParallelSpec, over: Mapping[str, Any], limit_bytes: float, cap: int) -> int:
        def ok(b: int) -> bool:
            return self.needed(p, {**over, "micro_batch": b}) <= limit_bytes

        if cap < 1:
            return 0
        # one sequence and several are different step programs: try 2 first, 1 only if 2 does not fit
        if cap == 1 or not ok(2):
            return 1 if ok(1) else 0
        lo = 2
        while lo < cap:
            hi = min(2 * lo, cap)
            if not ok(hi):
                break
            lo = hi
        else:
            return lo
        while hi - lo > 1:  # ok(lo) and not ok(hi)
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo


def _gpu_counts(g: GPU, max_gpus: int) -> list[int]:
    """1, 2, 4, ... up to a node, then whole nodes doubling: the counts the planner tries."""
    counts, n = [], 1
    while n < g.gpus_per_node and n <= max_gpus:
        counts.append(n)
        n *= 2
    n = g.gpus_per_node
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    return counts


def _layout(m: ModelSpec, g: GPU, n: int, layout: Mapping[str, Any]) -> ParallelSpec:
    """A validated layout of `n` GPUs on nodes of ``g.gpus_per_node`` (raises SpecError)."""
    data = {k: v for k, v in layout.items() if v is not None}
    data["gpus"] = n
    data.setdefault("nodes", max(1, -(-n // g.gpus_per_node)))
    p = build_parallel(None, **data)
    check_layout(m, p)
    return p


# ----------------------------------------------------------------------------------------------------------
# Time


def _matmul_params(m: ModelSpec, t: TrainingSpec) -> tuple[float, float, float]:
    """``(frozen, trainable, in_layers)`` matmul weights a token passes through (MoE: top-k experts only).

    The LM head counts once (tied heads reuse the embedding matrix as a matmul); embedding lookups are
    not matmuls (torchtitan counts 6·(N - embeddings) the same way)."""
    from .params import lora_inventory, param_inventory

    total = in_layers = 0.0
    for p in param_inventory(m):
        if not p.matmul:
            continue
        n: float = p.numel * p.count
        if "experts" in p.name and m.n_experts:
            n *= m.experts_top_k / m.n_experts
        total += n
        in_layers += n if p.in_layer else 0
    if m.tie_embeddings:  # the head (BERT: the MLM decoder) reuses the embedding matrix as a matmul
        total += m.vocab * (m.word_embed_proj_dim or m.hidden)
    if t.method is Method.FULL:
        return 0.0, total, in_layers
    adapters = sum(p.numel * p.count for p in lora_inventory(m, t.lora_targets, t.lora_rank))
    return total, float(adapters), in_layers + adapters


def flops_per_token(m: ModelSpec, t: TrainingSpec) -> tuple[float, float]:
    """``(model_flops, executed_flops)`` per trained token of one step.

    Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B) and Korthikanti et al. 2022 (eq. 7):
    2 per weight forward, 2 backward for the activation gradient, 2 more for the weight gradient of
    trained weights (frozen LoRA bases skip it), plus attention 12·L·heads·head_dim·T. Executed FLOPs add
    recomputation: full checkpointing runs each layer's forward again (2·layer weights + 4·L·h·T), selective
    recomputes the attention core (4·L·h·T; Korthikanti et al. 2022, eq. 8), selective-op every other
    matmul of a layer (about half its weights' forward FLOPs, 2·layer weights / 2)."""
    frozen, trained, in_layers = _matmul_params(m, t)
    window = m.sliding_window or t.seq_len
    attn_fwd = 4.0 * m.n_layers * m.n_heads * (m.head_dim or m.hidden // m.n_heads) * min(t.seq_len, window)
    model = 4.0 * frozen + 6.0 * trained + 3.0 * attn_fwd
    if t.checkpointing is Checkpointing.FULL:
        return model, model + 2.0 * in_layers + attn_fwd
    if t.checkpointing is Checkpointing.SELECTIVE:
        return model, model + attn_fwd
    if t.checkpointing is Checkpointing.SELECTIVE_OP:  # every other mm is recomputed: about half the layers'
        return model, model + 1.0 * in_layers
    return model, model


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step and where they go."""

    tokens_per_step: int
    model_flops_per_token: float
    executed_flops_per_token: float
    peak_tflops: float
    mfu: float  #: assumed utilisation of the dense peak on executed FLOPs
    mfu_source: str
    compute_s: float  #: executed FLOPs / (GPUs x peak x mfu), with the pipeline bubble
    bubble_fraction: float
    overlapped_comm_s: float  #: data-parallel gradient reduction and ZeRO-3 gathers (overlap with compute)
    exposed_comm_s: float  #: tensor- and pipeline-parallel traffic on the critical path
    step_s: float
    comm_bound: bool  #: the overlappable communication alone takes longer than the compute
    effective_mfu: float  #: model FLOPs / (step time x GPUs x peak)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput of the whole job."""
        return self.tokens_per_step / self.step_s


def _mfu_for(g: GPU, mfu: float | Mapping[str, float] | None) -> tuple[float, str]:
    if isinstance(mfu, (int, float)):
        value, source = float(mfu), "given"
    elif isinstance(mfu, Mapping) and (g.name in mfu or g.perf_class in mfu):
        value, source = float(mfu.get(g.name, mfu.get(g.perf_class, 0.0))), "given"
    else:
        value, source = MFU_DEFAULTS.get(g.perf_class, MFU_DEFAULTS["generic"])
    if not 0.0 < value <= 1.0:
        raise SpecError(f"mfu={value!r} must be a fraction in (0, 1], e.g. 0.4")
    return value, source


def _in_fast_domain(g: GPU, group: int, nodes: int) -> bool:
    """Whether `group` ranks on `nodes` nodes all share one scale-up domain. Usually a domain is one node
    (HGX: 8 GPUs); rack-scale domains span nodes (GB200 NVL72: 72 GPUs on 18 nodes of 4; TPU pods over
    ICI), so a group of a few such nodes still talks over NVLink/ICI, assuming they sit in one domain."""
    if g.nvlink_domain <= 1 or not g.interconnect_bidir_gbs:
        return False
    span = group if nodes <= 1 else max(group, nodes * g.gpus_per_node)
    return span <= g.nvlink_domain


def _link_gbs(g: GPU, group: int, nodes: int, inter_node_gbs: float) -> float:
    """Achieved one-way GB/s per GPU of a collective over `group` ranks spread on `nodes` nodes."""
    if _in_fast_domain(g, group, nodes):
        return (g.interconnect_bidir_gbs or 0.0) / 2 * COMM_EFFICIENCY.get(g.interconnect_kind, 0.8)
    if nodes > 1:
        return inter_node_gbs * COMM_EFFICIENCY["network"]
    pcie = g.pcie_bidir_gbs or g.interconnect_bidir_gbs or 32.0
    return pcie / 2 * COMM_EFFICIENCY["pcie"]


def _comm_seconds(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, g: GPU, inter_node_gbs: float) -> tuple[float, float]:
    """``(overlappable, exposed)`` seconds of communication per optimizer step for one GPU.

    Ring collectives move 2(d-1)/d of the buffer per rank for an all-reduce and (d-1)/d for an
    all-gather or reduce-scatter. DDP and ZeRO-1/2 reduce gradients once per optimizer step; ZeRO-3 /
    FSDP gathers parameters for forward and backward and reduce-scatters gradients every micro-step
    (ZeRO paper: 1.5x DDP's volume). Tensor parallel: 4 all-reduces (or reduce-scatter + all-gather with
    SP) of b·s·h per layer per micro-batch, 6 with full recomputation (Korthikanti et al. 2022)."""
    frozen, trained, _ = _matmul_params(m, t)
    shard = p.tp * p.pp
    mixed16 = 2 if t.precision is not Precision.FP32 else 4
    grad_b = 4 if (p.engine.value == "ddp" and t.param_bytes == 4) else mixed16
    dp = p.dp
    overlapped = 0.0
    if dp > 1:
        per_node = max(1, p.gpus_per_node // (p.tp * p.cp))
        bw_dp = _link_gbs(g, dp, p.nodes if dp > per_node else 1, inter_node_gbs) * 1e9
        trained_local = trained / shard * grad_b
        if p.zero >= 3:
            sd = p.shard_degree
            bw_sd = _link_gbs(g, sd, p.nodes if sd > per_node else 1, inter_node_gbs) * 1e9
            weights_local = (frozen + trained) / shard * mixed16
            per_micro = 2 * (sd - 1) / sd * weights_local + (sd - 1) / sd * trained_local
            overlapped = t.grad_accum * per_micro / bw_sd
            if dp > sd:  # hybrid shard: replicas all-reduce their gradient shards across nodes
                overlapped += 2 * (dp // sd - 1) / (dp // sd) * trained_local / sd / bw_dp
        else:
            overlapped = 2 * (dp - 1) / dp * trained_local / bw_dp
    exposed = 0.0
    act = t.micro_batch * t.seq_len * m.hidden * t.compute_bytes
    if p.tp > 1:
        n_coll = 6 if t.checkpointing is Checkpointing.FULL else 4
        bw_tp = _link_gbs(g, p.tp, 1, inter_node_gbs) * 1e9
        layers = m.n_layers / p.pp
        exposed += t.grad_accum * layers * n_coll * 2 * (p.tp - 1) / p.tp * act / p.cp / bw_tp
    if p.pp > 1:  # one activation forward and one gradient backward per micro-batch and stage boundary
        exposed += t.grad_accum * 2 * act / p.tp / p.cp / (_link_gbs(g, 2, min(p.nodes, 2), inter_node_gbs) * 1e9)
    return overlapped, exposed


def step_time(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, gpu: str | GPU,
              mfu: float | Mapping[str, float] | None = None,
              inter_node_gbs: float = INTER_NODE_GBS_PER_GPU) -> StepTime | None:
    """Seconds per optimizer step of `t` on `p` over `gpu` (None when the catalog has no dense peak).

    compute = tokens x executed FLOPs/token / (GPUs x dense peak x mfu), stretched by the pipeline bubble
    (p-1)/(m·v) of 1F1B with m micro-batches and v virtual stages (Narayanan et al. 2021); the step takes
    max(compute, overlappable communication) + exposed communication."""
    g = get_gpu(gpu)
    precision = _precision_for(t.precision.value, g)
    peak = g.dense_tflops(precision)
    if not peak:
        return None
    value, source = _mfu_for(g, mfu)
    tokens = t.micro_batch * t.seq_len * t.grad_accum * p.dp
    model_f, exec_f = flops_per_token(m, t)
    bubble = 0.0
    if p.pp > 1:
        bubble = (p.pp - 1) / (t.grad_accum * (p.virtual_stages if p.pp_schedule.value == "interleaved" else 1))
    compute = tokens * exec_f / (p.gpus * peak * 1e12 * value) * (1 + bubble)
    overlapped, exposed = _comm_seconds(m, t, p, g, inter_node_gbs)
    step = max(compute, overlapped) + exposed
    effective = tokens * model_f / (step * p.gpus * peak * 1e12)
    return StepTime(tokens, model_f, exec_f, peak, value, source, compute, bubble, overlapped, exposed, step,
                    overlapped > compute, effective)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints and cost


def checkpoint_bytes(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of one resumable checkpoint: the trained weights as the optimizer keeps them (fp32 masters in
    mixed precision) plus every optimizer state tensor. A LoRA checkpoint holds only the adapters."""
    from .optimizers import paged_state_bytes, state_bytes
    from .params import trainable_tensors

    weights = sum(p.numel * p.count * dt for p, dt in trainable_tensors(m, t))
    states = sum(int(sz.at(1, 1)) * count for sz, count in state_bytes(m, t)) + paged_state_bytes(m, t)
    return int(weights + states)


@dataclass(frozen=True)
class CostEstimate:
    """Wall time and cost of a run on one pricing option. Hours and USD are floats; None when unknown."""

    market: Literal["on-demand", "spot"]
    run_hours: float  #: the training itself, no interruptions
    checkpoint_write_s: float
    checkpoint_interval_hours: float
    interruptions_per_hour: float
    expected_interruptions: float
    lost_hours: float  #: recomputed work plus restarts
    wall_hours: float
    billed_gpu_hours: float
    usd: float | None
    feasible: bool  #: False when interruptions come faster than progress between checkpoints


def run_cost(run_s: float, n_gpus: int, nodes: int, usd_per_gpu_hour: float | None, *, market: str,
             checkpoint_write_s: float, interval_s: float | None = None, restart_s: float = RESTART_OVERHEAD_S,
             interruptions_per_hour: float = 0.0, granularity_s: int | None = 1, minimum_s: int = 0,
             gpus_per_instance: int = 1) -> CostEstimate:
    """Expected wall time and cost with checkpoints every `interval_s` and interruptions at a Poisson rate.

    The interval defaults to Young's optimum sqrt(2·C/λ) (Young 1974, "A first order approximation to
    the optimum checkpoint interval"). Each interruption loses half an interval of work on average plus
    `restart_s`; wall = run·(1 + C/τ) / (1 - λ·(τ/2 + R)). Billing rounds every billed segment up to the
    provider's granularity (at least its minimum), and whole instances of `gpus_per_instance` are paid."""
    lam = interruptions_per_hour / 3600.0
    c = checkpoint_write_s
    if interval_s is None:
        interval_s = math.sqrt(2 * c / lam) if lam > 0 and c > 0 else max(run_s, 1.0)
    interval_s = max(interval_s, 1.0)
    loss_per = interval_s / 2 + restart_s
    denom = 1 - lam * loss_per
    feasible = denom > 0.05
    wall = run_s * (1 + c / interval_s) / denom if feasible else math.inf
    n_int = lam * wall if feasible else math.inf
    lost = n_int * loss_per if feasible else math.inf
    gran = granularity_s or 3600  # not stated: assume hourly billing
    if not feasible:
        billed_s = math.inf
    else:  # the run rounds up; each interruption adds a segment rounded up by half a unit on average
        billed_s = max(math.ceil(wall / gran) * gran, minimum_s) + n_int * max(gran / 2, minimum_s)
    billed_gpus = -(-n_gpus // gpus_per_instance) * gpus_per_instance
    gpu_hours = billed_s / 3600 * billed_gpus
    usd = gpu_hours * usd_per_gpu_hour if (usd_per_gpu_hour is not None and feasible) else None
    return CostEstimate(market, run_s / 3600, c, interval_s / 3600, interruptions_per_hour,  # type: ignore[arg-type]
                        n_int, lost / 3600, wall / 3600, gpu_hours, usd, feasible)


def _best_prices(prices: Sequence[Price], gpu_name: str, n_gpus: int, provider: str | None) -> tuple[Price | None, Price | None]:
    """``(on_demand, spot)`` offers for `n_gpus` (whole instances paid): the cheapest on-demand offer, and
    the spot offer to compare it with, from the same provider where it has one (the same offer first), else
    the cheapest spot offer elsewhere, whose provider the option row reports as ``spot_provider``.

    Cheapest on-demand and cheapest spot from different providers would compare a marketplace's
    on-demand with a hyperscaler's spot: spot would look dearer for reasons that have nothing to do with
    interruptions."""
    rows = [p for p in prices if p.gpu == gpu_name and (provider is None or p.provider.lower() == provider.lower())]

    def paid(p: Price, price: float) -> float:
        return -(-n_gpus // p.gpus_per_instance) * p.gpus_per_instance * price

    od = [p for p in rows if p.on_demand_usd_per_gpu_hour is not None]
    sp = [p for p in rows if p.spot_usd_per_gpu_hour is not None]
    best_od = min(od, key=lambda p: paid(p, p.on_demand_usd_per_gpu_hour or 0.0), default=None)
    if best_od is not None:
        if best_od.spot_usd_per_gpu_hour is not None:
            return best_od, best_od
        same = [p for p in sp if p.provider.lower() == best_od.provider.lower()]
        sp = same or sp
    best_sp = min(sp, key=lambda p: paid(p, p.spot_usd_per_gpu_hour or 0.0), default=None)
    return best_od, best_sp


def _price_warnings(g: GPU, p: ParallelSpec, od: Price | None, sp: Price | None) -> list[str]:
    """What the reader of a price must know: spot from another provider; offers smaller than the plan's nodes."""
    out = []
    if od is not None and sp is not None and sp.provider.lower() != od.provider.lower():
        out.append(f"spot priced at another provider than on-demand (no spot offer from the on-demand one; "
                   f"spot_provider says which) for {g.name}")
    per_node = min(p.gpus, p.gpus_per_node)
    for market, offer in (("on-demand", od), ("spot", sp if sp is not od else None)):
        if offer is None or per_node <= 1 or "gpus_per_instance" not in offer.model_fields_set:
            continue
        if offer.gpus_per_instance < per_node:  # e.g. a marketplace's 1x offer for an 8-GPU NVLink node
            size = "" if offer.gpus_per_instance == 1 else f" ({offer.gpus_per_instance}-GPU)"
            out.append(f"{_SMALL_OFFERS}: {g.name}{' spot' if market == 'spot' else ''} at {offer.provider}{size}")
    return out


#: The note for multi-GPU options priced from offers smaller than their nodes (single-GPU unless it says).
_SMALL_OFFERS = ("priced per GPU from offers smaller than the plan's nodes (the time assumes whole nodes, which may "
                 "cost more or not be offered)")


# ----------------------------------------------------------------------------------------------------------
# Plan


_FAMILY_ORDER = ("single", "ddp", "fsdp", "hsdp", "megatron")


def _families(m: ModelSpec, g: GPU, n: int, fixed: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Layouts to try on `n` GPUs of `g` (only the user's when they fixed any parallel option)."""
    layout_keys = set(fixed) - {"gpus", "nodes"}
    if layout_keys:
        return [("given", dict(fixed))]
    if n == 1:
        return [("single", {})]
    nodes = max(1, -(-n // g.gpus_per_node))
    out: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {"engine": "ddp", "zero": 0}),
        ("fsdp", {"engine": "fsdp", "zero": 3}),
    ]
    if nodes > 1:
        out.append(("hsdp", {"engine": "fsdp", "zero": 3, "hybrid_shard": True}))
    per_node = n // nodes
    domain = min(per_node, g.nvlink_domain)
    tp = max((d for d in range(2, domain + 1) if per_node % d == 0 and m.n_heads % d == 0
              and (m.n_kv_heads % d == 0 or d % m.n_kv_heads == 0)), default=1)
    if tp > 1:
        pp = nodes if (nodes > 1 and nodes <= m.n_layers) else 1
        dp = n // (tp * pp)
        out.append(("megatron", {"engine": "megatron", "tp": tp, "sp": True, "pp": pp, "zero": 1 if dp > 1 else 0}))
    return out


def _label(p: ParallelSpec) -> str:
    if p.gpus == 1 and p.offload.value == "none":
        return "single GPU"
    parts = [p.engine.value]
    if p.zero:
        parts.append(f"zero-{p.zero}" + (" hybrid" if p.hybrid_shard else ""))
    if p.tp > 1:
        parts.append(f"tp{p.tp}" + ("+sp" if p.sp else ""))
    if p.pp > 1:
        parts.append(f"pp{p.pp}")
    if p.cp > 1:
        parts.append(f"cp{p.cp}")
    if p.offload.value != "none":
        parts.append(f"offload {p.offload.value}")
    return " ".join(parts)


def _scale(p: ParallelSpec, g: GPU) -> str:
    if p.gpus == 1:
        return "single GPU"
    if p.nodes == 1:
        return "one NVLink node" if p.gpus <= g.nvlink_domain else "one PCIe node"
    return "multi-node"


@dataclass
class Plan:
    """What `plan` found: viable options (one row per GPU type and layout), what was rejected and why,
    the estimate of the step as given, and the assumptions behind time and cost."""

    model: ModelSpec
    estimate: MemoryEstimate | None
    rows: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    notes: list[str]
    assumptions: dict[str, Any]
    prices_date: str
    estimates: dict[tuple[str, int, str], MemoryEstimate] = field(default_factory=dict, repr=False)
    #: where the prices came from: 'snapshot' (the built-in dated one), 'yours' (prices=) or 'none'
    prices_source: Literal["snapshot", "yours", "none"] = "snapshot"

    @property
    def options(self) -> pd.DataFrame:
        """The viable options as a DataFrame, best first (cheapest on-demand, then fastest)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    @property
    def fits_on(self) -> list[str]:
        """GPU types with at least one option that fits with the headroom."""
        seen: list[str] = []
        for r in self.rows:
            if r["fits"] and r["gpu"] not in seen:
                seen.append(r["gpu"])
        return seen

    def best(self, by: Literal["cost", "time", "gpus"] = "cost") -> dict[str, Any] | None:
        """The cheapest (on-demand), fastest or smallest option that fits, or None."""
        ok = [r for r in self.rows if r["fits"]]
        if by == "cost":
            ok = [r for r in ok if r["cost_usd_on_demand"] is not None]
            return min(ok, key=lambda r: (r["cost_usd_on_demand"], r["time_hours"]), default=None)
        if by == "time":
            ok = [r for r in ok if r["time_hours"] is not None]
            return min(ok, key=lambda r: (r["time_hours"], r["cost_usd_on_demand"] or math.inf), default=None)
        return min(ok, key=lambda r: (r["n_gpus"], -r["headroom_fraction"]), default=None)

    def option_estimate(self, row: Mapping[str, Any]) -> MemoryEstimate | None:
        """The per-device estimate behind one option (its breakdown and per-rank numbers)."""
        return self.estimates.get((row["gpu"], row["n_gpus"], row["layout"]))

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of ``trainmem plan --json``."""
        return {
            "estimate": self.estimate.to_dict() if self.estimate else None,
            "options": [_json_row(r) for r in self.rows],
            "rejected": self.rejected,
            "notes": self.notes,
            "assumptions": self.assumptions,
            "prices_snapshot_date": self.prices_date,
            "prices_source": self.prices_source,
        }

    def summary(self, max_rows: int = 12) -> str:
        """A terminal report: the honest scale, the best options and the caveats."""
        lines = [f"{self.model.name}: {format_count(self.model.n_params)} parameters"]
        if self.estimate is not None:
            lines.extend(_breakdown_lines(self.estimate))
        lines.extend(self.notes)
        if not self.rows:
            lines.append("no option fits: see `rejected` for the closest misses")
            return "\n".join(lines)
        header = (f"{'gpu':<24} {'n':>4} {'layout':<22} {'ckpt':<5} {'mb x ga':>9} {'spare':>6} {'max mb':>6} "
                  f"{'hours':>8} {'$ on-demand':>12} {'$ spot':>9}  prices from (seen)")
        lines.append(header)
        for r in self.rows[:max_rows]:
            seen = _price_sources(r)
            lines.append(
                f"{r['gpu'][:24]:<24} {r['n_gpus']:>4} {r['layout'][:22]:<22} {r['checkpointing'][:5]:<5} "
                f"{r['micro_batch']:>4} x {r['grad_accum']:<3} {r['headroom_fraction']:>6.0%} {r['max_micro_batch']:>6} "
                f"{_fmt(r['time_hours'], '.1f'):>8} {_fmt(r['cost_usd_on_demand'], ',.0f'):>12} "
                f"{_fmt(r['cost_usd_spot'], ',.0f'):>9}  {seen}"
            )
        lines.extend(_checkpoint_lines(self.rows[:max_rows], max(1, int(self.assumptions.get("keep_checkpoints", 1)))))
        lines.extend(f"note: {w}" for w in _condense([w for r in self.rows[:max_rows] for w in r.get("warnings", [])]))
        if len(self.rows) > max_rows:
            lines.append(f"... {len(self.rows) - max_rows} more options (Plan.options)")
        if self.prices_source == "snapshot" and self.prices_date:
            lines.append(f"prices: snapshot seen up to {self.prices_date}; indicative only, re-check before you rely on them")
        elif self.prices_source == "yours":
            lines.append(f"prices: {_your_prices(self.prices_date)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.summary())}</pre>"


def _your_prices(date: str) -> str:
    return f"your prices (seen up to {date})" if date else "your prices (undated)"


def _price_sources(r: Mapping[str, Any]) -> str:
    """'Vast.ai 2026-10-19; spot GCP 2026-09-26': who each price shown in a row is from, and when."""
    def who(provider: str | None, seen: str | None) -> str:
        return f"{provider} {seen or 'undated'}"

    od = who(r["price_provider"], r["price_date_seen"]) if r.get("price_provider") else ""
    if r.get("price_spot_usd_per_gpu_hour") is None:
        return od
    if od and (r["spot_provider"], r["spot_date_seen"]) == (r["price_provider"], r["price_date_seen"]):
        return f"{od} (both)"
    spot = "spot " + who(r["spot_provider"], r["spot_date_seen"])
    return f"{od}; {spot}" if od else spot


def _checkpoint_lines(rows: Sequence[Mapping[str, Any]], keep: int) -> list[str]:
    """Checkpoint size and storage of the rows shown (one line when they agree, as they do for one recipe)."""
    sizes = sorted({(r["checkpoint_bytes"], r["storage_bytes"]) for r in rows if r.get("checkpoint_bytes")})
    if not sizes:
        return []
    writes = [r["checkpoint_write_s"] for r in rows if r.get("checkpoint_write_s") is not None]
    each = " to ".join(dict.fromkeys(format_bytes(c) for c, _ in (sizes[0], sizes[-1])))
    store = " to ".join(dict.fromkeys(format_bytes(b) for _, b in (sizes[0], sizes[-1])))
    line = f"checkpoints to resume from: {each} each (trained weights + optimizer states), {store} of storage " \
           f"keeping {keep}"
    if writes:
        lo, hi = (f"{s:,.0f}" if s >= 10 else f"{s:.1f}" for s in (min(writes), max(writes)))
        line += f"; {lo}-{hi} s to write one" if lo != hi else f"; {hi} s to write one"
    return [line]


def _breakdown_lines(est: MemoryEstimate) -> list[str]:
    """The step as given: its per-device breakdown (worst rank) and, with several kinds of rank, each one."""
    t = est.training
    head = (f"as given: {t.precision.value}, micro-batch {t.micro_batch} x {t.seq_len}, grad_accum {t.grad_accum}, "
            f"checkpointing {t.checkpointing.value}, {_label(est.parallel)} on {est.parallel.gpus} GPU(s): "
            f"{format_bytes(needed_bytes(est))} per GPU (nvidia-smi), peak in {est.peak_phase}")
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in est.breakdown_bytes.items() if v)
    lines = [head, f"  per device: {parts}"]
    if len(est.per_rank) > 1:
        for r in est.per_rank:
            d = r.to_dict() if hasattr(r, "to_dict") else {}
            who = str(d.get("ranks") or f"stage {d.get('stage')}")
            lines.append(f"  {who}: {format_bytes(int(getattr(r, 'device_total_bytes', 0)))}")
    if est.host_bytes:
        lines.append(f"  host memory (offload): {format_bytes(est.host_bytes)}")
    return lines


_GROUPED = (
    (re.compile(r"^" + re.escape(_SMALL_OFFERS) + r": (.+)$"), _SMALL_OFFERS + ": {}"),
    (re.compile(r"^no price for (.+?) in the snapshot"), "no price in the snapshot for {}: pass prices= to cost them"),
    (re.compile(r"^no price for (.+?) in your prices"), "no price in your prices for {}: add them to cost them"),
    (re.compile(r"^spot priced at another provider than on-demand .*\) for (.+)$"),
     "spot priced at another provider than on-demand, which has no spot offer (see 'prices from') for {}"),
    (re.compile(r"^(.+?)'s usable memory is derived"), "usable memory derived from the marketed size for {}"),
    (re.compile(r"on (.+?) treat the fit as approximate$"), "the estimate models PyTorch's CUDA allocator: "
                                                            "approximate on {}"),
)


def _condense(warnings: Iterable[str]) -> list[str]:
    """One line per kind of warning, naming every GPU it concerns."""
    grouped: dict[str, list[str]] = {}
    out: list[str] = []
    for w in dict.fromkeys(warnings):
        for pattern, template in _GROUPED:
            m = pattern.search(w)
            if m:
                grouped.setdefault(template, []).append(m.group(1))
                break
        else:
            out.append(w)
    return out + [template.format(", ".join(dict.fromkeys(names))) for template, names in grouped.items()]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isinf(value)) else format(value, spec)


def _json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        out[k] = None if isinstance(v, float) and (math.isinf(v) or math.isnan(v)) else v
    return out


def _gpu_list(gpus: str | GPU | Iterable[str | GPU] | None, catalog: Sequence[GPU]) -> list[GPU]:
    if gpus is None:
        return list(catalog) or list_gpus()
    if isinstance(gpus, (str, GPU)):
        gpus = [gpus]
    out = []
    for item in gpus:
        g = get_gpu(item, catalog)
        if g not in out:
            out.append(g)
    if not out:
        raise SpecError("gpus=[] names no GPU; leave it out to search the whole catalog")
    return out


def _price_list(prices: Any, catalog: Sequence[GPU]) -> list[Price]:
    if prices is None:
        from .gpus import list_prices

        return list_prices()
    if prices is False:
        return []
    return load_prices(prices, catalog)


def plan(
    model: Any,
    training: TrainingSpec | Mapping[str, Any] | None = None,
    *,
    gpus: str | GPU | Iterable[str | GPU] | None = None,
    target_global_batch: int | None = None,
    tokens: float | None = None,
    prices: Any = None,
    mfu: float | Mapping[str, float] | None = None,
    headroom: float = DEFAULT_HEADROOM,
    n_gpus: int | None = None,
    parallel: ParallelSpec | Mapping[str, Any] | None = None,
    max_gpus: int = 512,
    scale_out: int = 2,
    provider: str | None = None,
    catalog: Iterable[GPU] | None = None,
    inter_node_gbs: float = INTER_NODE_GBS_PER_GPU,
    storage_gbs: float = STORAGE_WRITE_GBS_PER_NODE,
    spot_interruptions_per_node_hour: float = SPOT_INTERRUPTIONS_PER_NODE_HOUR,
    restart_minutes: float = RESTART_OVERHEAD_S / 60,
    checkpoint_interval_hours: float | None = None,
    keep_checkpoints: int = KEEP_CHECKPOINTS,
    **options: Any,
) -> Plan:
    """Search GPU types and layouts for a training run; one row per viable (GPU type, layout).

    `options` are training and parallel fields as for `estimate` (the GPU count is `n_gpus`, since `gpus`
    names GPU types). Whatever you give is kept; what you leave out is searched: the GPU count (1, 2, 4... a
    node, then whole nodes doubling, up to `max_gpus`,
    and `scale_out` doublings past the fewest that fit), the layout (DDP, FSDP ZeRO-3, hybrid shard across
    nodes, Megatron TP inside the NVLink domain with PP across nodes), checkpointing (none, else full), the
    micro-batch (the largest that fits) and gradient accumulation (to reach `target_global_batch`
    sequences). bf16 becomes fp16 on GPUs without bf16. `tokens` (total training tokens) gives time and
    cost; `prices` is None (the dated snapshot), False, a path, rows or ``{gpu: usd_per_gpu_hour}``;
    `mfu` a number or ``{gpu or class: number}`` (default: `MFU_DEFAULTS`).

    >>> p = plan("gpt2", gpus=["H100", "T4"], seq_len=1024, target_global_batch=64, tokens=1e9)
    >>> p.fits_on
    ['H100 SXM 80GB', 'T4 16GB']
    """
    headroom = _check_headroom(headroom)
    if target_global_batch is not None and int(target_global_batch) < 1:
        raise SpecError(f"target_global_batch={target_global_batch!r} must be >= 1 (sequences per optimizer step)")
    if tokens is not None and not (float(tokens) > 0 and math.isfinite(float(tokens))):
        raise SpecError(f"tokens={tokens!r} must be a positive number of training tokens")
    if max_gpus < 1:
        raise SpecError(f"max_gpus={max_gpus!r} must be >= 1")
    m = resolve_model(model)
    cat = list(catalog or ())
    gpu_types = _gpu_list(gpus, cat)
    price_rows = _price_list(prices, cat + gpu_types)
    source: Literal["snapshot", "yours", "none"] = "snapshot" if prices is None else "none" if prices is False else "yours"
    train_opts, par_opts = _split_options(options)
    given = _training_dict(training, train_opts)
    fixed: dict[str, Any] = {}
    if isinstance(parallel, ParallelSpec):
        fixed.update({k: getattr(parallel, k) for k in parallel.model_fields_set})
    elif isinstance(parallel, Mapping):
        fixed.update(parallel)
    fixed.update({k: v for k, v in par_opts.items() if v is not None})
    if n_gpus is not None:
        fixed["gpus"] = int(n_gpus)
    if fixed:  # bad values fail here, once, with the usual message
        probe = dict(fixed) if "gpus" in fixed else {k: v for k, v in fixed.items() if k != "nodes"}
        probe.setdefault("gpus", _model_parallel(fixed))
        build_parallel(None, **probe)
    base_training = build_training(None, **given)
    check_model_options(m, base_training)  # e.g. a sequence beyond the model's positions fails every option alike
    as_given, as_given_error = None, ""
    try:
        as_given = estimate(m, base_training, parallel=build_parallel(None, **fixed))
    except SpecError as exc:  # e.g. tp given without a GPU count: the search sets one
        as_given_error = str(exc)
    except Exception as exc:
        if int(fixed.get("gpus", 1)) == 1:
            raise
        as_given_error = f"{type(exc).__name__}: {exc}"
    ev = _Evaluator(m, given)
    ctx = _PlanContext(m=m, ev=ev, given=given, fixed=fixed, target=target_global_batch, tokens=tokens,
                       prices=price_rows, mfu=mfu, headroom=headroom, provider=provider,
                       inter_node_gbs=inter_node_gbs, storage_gbs=storage_gbs,
                       spot_rate=spot_interruptions_per_node_hour, restart_s=restart_minutes * 60,
                       interval_h=checkpoint_interval_hours, keep=keep_checkpoints, prices_source=source)
    rows: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    for g in gpu_types:
        counts = [int(fixed["gpus"])] if "gpus" in fixed else _gpu_counts(g, max_gpus)
        _search_gpu(ctx, g, counts, scale_out, rows, rejected)
    _mark_pareto(rows)
    rows.sort(key=lambda r: (not r["fits"], r["cost_usd_on_demand"] if r["cost_usd_on_demand"] is not None else math.inf,
                             r["time_hours"] if r["time_hours"] is not None else math.inf, r["n_gpus"]))
    notes = _plan_notes(m, rows, gpu_types, tokens, price_rows, fixed.get("gpus"), source)
    if as_given is None and "gpus" in fixed:
        notes.insert(0, f"the step as given could not be estimated: {as_given_error}")
    assumptions = {
        "headroom": headroom, "target_global_batch": target_global_batch, "tokens": tokens,
        "mfu": {g.name: _mfu_for(g, mfu)[0] for g in gpu_types},
        "inter_node_gbs_per_gpu": inter_node_gbs, "storage_write_gbs_per_node": storage_gbs,
        "spot_interruptions_per_node_hour": spot_interruptions_per_node_hour,
        "hw_interruptions_per_gpu_hour": HW_INTERRUPTIONS_PER_GPU_HOUR, "restart_minutes": restart_minutes,
        "keep_checkpoints": keep_checkpoints, "comm_efficiency": COMM_EFFICIENCY,
    }
    return Plan(m, as_given, rows, rejected, notes, assumptions, snapshot_date(price_rows) if price_rows else "",
                ctx.kept, source)


@dataclass
class _PlanContext:
    m: ModelSpec
    ev: _Evaluator
    given: dict[str, Any]
    fixed: dict[str, Any]
    target: int | None
    tokens: float | None
    prices: list[Price]
    mfu: Any
    headroom: float
    provider: str | None
    inter_node_gbs: float
    storage_gbs: float
    spot_rate: float
    restart_s: float
    interval_h: float | None
    keep: int
    prices_source: str = "snapshot"
    kept: dict[tuple[str, int, str], MemoryEstimate] = field(default_factory=dict)


def _search_gpu(ctx: _PlanContext, g: GPU, counts: list[int], scale_out: int, rows: list[dict[str, Any]],
                rejected: list[dict[str, Any]]) -> None:
    """Rows for one GPU type: every layout family from the fewest GPUs that fit, `scale_out` doublings on."""
    precision = _precision_for(str(build_training(None, **ctx.given).precision.value), g)
    fits_seen: dict[str, int] = {}
    dead: set[str] = set()  # families whose memory per GPU does not fall with more GPUs (DDP)
    closest: dict[str, Any] | None = None
    for n in counts:
        if ctx.target is not None and n > ctx.target * _model_parallel(ctx.fixed):
            break  # more data-parallel ranks than sequences per step
        fams = [(f, lay) for f, lay in _families(ctx.m, g, n, ctx.fixed)
                if f not in dead and fits_seen.get(f, 0) <= scale_out]
        if not fams and n > 1:
            break
        for fam, layout in fams:
            try:
                p = _layout(ctx.m, g, n, layout)
                row = _evaluate_option(ctx, g, p, precision)
            except SpecError as exc:
                rejected.append({"gpu": g.name, "n_gpus": n, "layout": fam, "reason": str(exc)})
                continue
            if row["verdict"] == "oom":
                if fam in ("ddp", "single"):  # DDP replicates the single-GPU step: it will not fit either
                    dead.add("ddp")
                if closest is None or row["headroom_fraction"] > closest["headroom_fraction"]:
                    closest = {"gpu": g.name, "n_gpus": n, "layout": row["layout"], "reason": row["message"],
                               "headroom_fraction": row["headroom_fraction"]}
                continue
            rows.append(row)
            if row["fits"]:
                fits_seen[fam] = fits_seen.get(fam, 0) + 1
    if closest is not None and not any(r["gpu"] == g.name for r in rows):
        rejected.append(closest)


def _model_parallel(fixed: Mapping[str, Any]) -> int:
    return int(fixed.get("tp", 1)) * int(fixed.get("pp", 1)) * int(fixed.get("cp", 1))


def _choose_batch(ctx: _PlanContext, g: GPU, p: ParallelSpec, over: dict[str, Any]) -> tuple[int, int, int]:
    """``(micro_batch, grad_accum, max_micro_batch)`` for this layout on `g` (micro_batch 0: nothing fits)."""
    limit = g.memory_bytes * (1.0 - ctx.headroom)
    ga_given = ctx.given.get("grad_accum")
    dp = p.dp
    if "micro_batch" in ctx.given:
        mb = int(ctx.given["micro_batch"])
        ga = int(ga_given) if ga_given else (-(-ctx.target // (mb * dp)) if ctx.target else 1)
        mx = ctx.ev.max_micro_batch(p, {**over, "grad_accum": ga}, limit)
        return mb, ga, mx
    if ctx.target is None:
        ga = int(ga_given or 1)
        mx = ctx.ev.max_micro_batch(p, {**over, "grad_accum": ga}, limit)
        return mx, ga, mx
    per_rank = -(-ctx.target // dp)
    if ga_given:
        ga = int(ga_given)
        mx = ctx.ev.max_micro_batch(p, {**over, "grad_accum": ga}, limit)
        return min(mx, -(-per_rank // ga)), ga, mx
    # accumulating holds every gradient through the later micro-steps, so ga=2 needs the most memory:
    # search with it, and drop to ga=1 when one micro-step already reaches the batch
    mx = ctx.ev.max_micro_batch(p, {**over, "grad_accum": 2 if per_rank > 1 else 1}, limit)
    if mx >= per_rank:
        if per_rank > 1:  # the exact largest for one micro-step (ga=1 needs less memory than ga=2)
            mx = ctx.ev.max_micro_batch(p, {**over, "grad_accum": 1}, limit)
        return per_rank, 1, mx
    if mx == 0:  # nothing fits with the headroom: judge one sequence per micro-step
        return 0, per_rank, 0
    divisors = [d for d in range(mx, max(1, mx // 2) - 1, -1) if per_rank % d == 0]
    mb = divisors[0] if divisors else mx
    return mb, -(-per_rank // mb), mx


def _evaluate_option(ctx: _PlanContext, g: GPU, p: ParallelSpec, precision: str) -> dict[str, Any]:
    """One row: the batch that fits, the verdict, time and cost (raises SpecError for bad layouts)."""
    ckpts = [ctx.given["checkpointing"]] if "checkpointing" in ctx.given else ["none", "full"]
    for ck in ckpts:  # no recomputation when it fits, else full checkpointing
        over: dict[str, Any] = {"precision": precision, "checkpointing": ck}
        mb, ga, mx = _choose_batch(ctx, g, p, over)
        if 0 < mb <= mx:
            break
    over = {**over, "micro_batch": max(mb, 1), "grad_accum": ga}
    est = ctx.ev.estimate(p, over)
    f = fit(est, g, ctx.headroom)
    t = est.training
    label = _label(p)
    row: dict[str, Any] = {
        "gpu": g.name, "model": ctx.m.name, "family": ctx.m.family.value, "n_gpus": p.gpus, "nodes": p.nodes, "gpus_per_node": p.gpus_per_node, "layout": label,
        "scale": _scale(p, g), "engine": p.engine.value, "zero": p.zero, "tp": p.tp, "pp": p.pp, "sp": p.sp,
        "hybrid_shard": p.hybrid_shard, "offload": p.offload.value, "precision": t.precision.value,
        "checkpointing": t.checkpointing.value, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
        "global_batch": t.micro_batch * t.grad_accum * p.dp, "seq_len": t.seq_len,
        "fits": f.fits, "verdict": f.verdict, "headroom_fraction": f.margin_fraction, "needed_bytes": f.needed_bytes,
        "usable_bytes": f.usable_bytes, "max_micro_batch": mx, "message": f.message,
    }
    if f.verdict == "oom":
        return row
    ctx.kept[(g.name, p.gpus, label)] = est
    od_price, sp_price = _best_prices(ctx.prices, g.name, p.gpus, ctx.provider)
    row.update(_time_and_cost(ctx, g, p, t, od_price, sp_price))
    row["warnings"] = (list(f.notes) + _row_warnings(g, p, t, row, ctx.prices_source)
                       + _price_warnings(g, p, od_price, sp_price))
    asked = str(ctx.given.get("precision", "bf16-mixed"))
    if asked != t.precision.value:
        row["warnings"].insert(0, f"{g.name} has no bf16: planned as {t.precision.value} (same memory, loss scaling)")
    row["pareto"] = False
    return row


def _time_and_cost(ctx: _PlanContext, g: GPU, p: ParallelSpec, t: TrainingSpec, od_price: Price | None,
                   sp_price: Price | None) -> dict[str, Any]:
    st = step_time(ctx.m, t, p, g, ctx.mfu, ctx.inter_node_gbs)
    ck = checkpoint_bytes(ctx.m, t)
    writers = p.nodes if (p.zero >= 1 or p.tp * p.pp > 1) else 1
    write_s = ck / (ctx.storage_gbs * 1e9 * writers)
    out: dict[str, Any] = {
        "step_time_s": st.step_s if st else None, "compute_time_s": st.compute_s if st else None,
        "comm_time_s": (st.overlapped_comm_s + st.exposed_comm_s) if st else None,
        "comm_bound": st.comm_bound if st else None, "tokens_per_s": st.tokens_per_s if st else None,
        "mfu_assumed": st.mfu if st else None, "mfu_effective": st.effective_mfu if st else None,
        "mfu_source": st.mfu_source if st else None,
        "model_flops_per_token": st.model_flops_per_token if st else None,
        "checkpoint_bytes": ck, "checkpoint_write_s": write_s, "storage_bytes": ck * max(1, ctx.keep),
        "steps": None, "time_hours": None, "gpu_hours": None,
        "cost_usd_on_demand": None, "cost_usd_spot": None, "spot_time_hours": None,
        "spot_expected_interruptions": None, "checkpoint_interval_hours": None, "spot_checkpoint_interval_hours": None,
        "lost_hours_on_demand": None, "spot_lost_hours": None,
        "price_on_demand_usd_per_gpu_hour": None, "price_spot_usd_per_gpu_hour": None,
        "price_provider": None, "price_instance": None, "price_date_seen": None,
        "spot_provider": None, "spot_date_seen": None, "billing_granularity_s": None,
    }
    if od_price:
        out.update(price_on_demand_usd_per_gpu_hour=od_price.on_demand_usd_per_gpu_hour,
                   price_provider=od_price.provider, price_instance=od_price.instance,
                   price_date_seen=od_price.date_seen, billing_granularity_s=od_price.billing_granularity_s)
    if sp_price:
        out.update(price_spot_usd_per_gpu_hour=sp_price.spot_usd_per_gpu_hour, spot_provider=sp_price.provider,
                   spot_date_seen=sp_price.date_seen)
    if st is None or ctx.tokens is None:
        return out
    tokens_per_step = st.tokens_per_step
    steps = math.ceil(float(ctx.tokens) / tokens_per_step)
    run_s = steps * st.step_s
    interval = ctx.interval_h * 3600 if ctx.interval_h else None
    hw = HW_INTERRUPTIONS_PER_GPU_HOUR * p.gpus
    od = run_cost(run_s, p.gpus, p.nodes, od_price.on_demand_usd_per_gpu_hour if od_price else None,
                  market="on-demand", checkpoint_write_s=write_s, interval_s=interval, restart_s=ctx.restart_s,
                  interruptions_per_hour=hw, granularity_s=od_price.billing_granularity_s if od_price else 1,
                  minimum_s=od_price.minimum_billed_s if od_price else 0,
                  gpus_per_instance=od_price.gpus_per_instance if od_price else 1)
    sp = run_cost(run_s, p.gpus, p.nodes, sp_price.spot_usd_per_gpu_hour if sp_price else None, market="spot",
                  checkpoint_write_s=write_s, interval_s=interval, restart_s=ctx.restart_s,
                  interruptions_per_hour=hw + ctx.spot_rate * p.nodes,
                  granularity_s=sp_price.billing_granularity_s if sp_price else 1,
                  minimum_s=sp_price.minimum_billed_s if sp_price else 0,
                  gpus_per_instance=sp_price.gpus_per_instance if sp_price else 1)
    out.update(steps=steps, time_hours=od.wall_hours, gpu_hours=od.wall_hours * p.gpus,
               cost_usd_on_demand=od.usd, checkpoint_interval_hours=od.checkpoint_interval_hours,
               lost_hours_on_demand=od.lost_hours, spot_lost_hours=sp.lost_hours if sp.feasible else None,
               spot_time_hours=sp.wall_hours if sp.feasible else None,
               spot_expected_interruptions=sp.expected_interruptions if sp.feasible else None,
               cost_usd_spot=sp.usd, spot_checkpoint_interval_hours=sp.checkpoint_interval_hours)
    return out


def _row_warnings(g: GPU, p: ParallelSpec, t: TrainingSpec, row: Mapping[str, Any],
                  prices_source: str = "snapshot") -> list[str]:
    out = []
    compute, comm = row.get("compute_time_s"), row.get("comm_time_s")
    if (g.interconnect_kind == "pcie" and p.nodes == 1 and p.gpus > 1 and compute and comm
            and comm > PCIE_WARN_COMM_FRACTION * compute):
        out.append(f"PCIe-only {g.name} box: {p.gpus} GPUs exchange gradients/parameters for {comm:.2f} s per step "
                   f"against {compute:.2f} s of compute; an NVLink node or fewer, larger GPUs would be faster")
    if row.get("comm_bound"):
        where = g.interconnect_kind if _in_fast_domain(g, p.gpus, p.nodes) or p.nodes == 1 else "the network between nodes"
        out.append(f"communication-bound on {p.gpus}x {g.name}: {comm:.2f} s of collectives over {where} vs "
                   f"{compute:.2f} s of compute per step")
    if p.tp > g.nvlink_domain:
        out.append(f"tp={p.tp} spans more than the {g.nvlink_domain}-GPU fast domain of {g.name}")
    if row.get("step_time_s") is None:
        out.append(f"no dense {t.precision.value} TFLOPS for {g.name} in the catalog: time and cost unknown")
    elif row.get("price_on_demand_usd_per_gpu_hour") is None and prices_source != "none":
        if prices_source == "yours":
            out.append(f"no price for {g.name} in your prices: add a row for it to cost it")
        else:
            out.append(f"no price for {g.name} in the snapshot: pass prices= to cost it")
    if t.method is Method.QLORA and row.get("step_time_s") is not None:
        out.append("QLoRA's dequantization is not in the FLOP count: expect it slower than estimated")
    return out


def _mark_pareto(rows: list[dict[str, Any]]) -> None:
    """Flag options no other option beats on both wall time and on-demand cost."""
    pts = [r for r in rows if r["fits"] and r.get("time_hours") is not None and r.get("cost_usd_on_demand") is not None]
    for r in pts:
        r["pareto"] = not any(
            (o["time_hours"] <= r["time_hours"] and o["cost_usd_on_demand"] <= r["cost_usd_on_demand"])
            and (o["time_hours"] < r["time_hours"] or o["cost_usd_on_demand"] < r["cost_usd_on_demand"])
            for o in pts
        )


def _plan_notes(m: ModelSpec, rows: list[dict[str, Any]], gpu_types: list[GPU], tokens: float | None,
                prices: list[Price], given_gpus: int | None, prices_source: str = "snapshot") -> list[str]:
    """The honest answer first: the smallest scale anything fits at, and on which GPUs."""
    notes = []
    ok = [r for r in rows if r["fits"]]
    if given_gpus is not None and ok:
        notes.append(f"fits {given_gpus} GPUs as given on: {', '.join(dict.fromkeys(r['gpu'] for r in ok))}")
    if given_gpus is None:  # per GPU type, the fewest GPUs that fit; grouped by the scale that needs
        fewest: dict[str, dict[str, Any]] = {}
        for r in ok:
            if r["gpu"] not in fewest or r["n_gpus"] < fewest[r["gpu"]]["n_gpus"]:
                fewest[r["gpu"]] = r
        first = True
        for scale in ("single GPU", "one NVLink node", "one PCIe node", "multi-node"):
            at = sorted((r for r in fewest.values() if r["scale"] == scale), key=lambda r: (r["n_gpus"], r["gpu"]))
            if at:
                listed = ", ".join(f"{r['n_gpus']}x {r['gpu']}" for r in at[:8]) + (" ..." if len(at) > 8 else "")
                notes.append(f"{'smallest scale that fits' if first else 'then'}: {scale} ({listed})")
                first = False
    if not ok:
        notes.append(f"{m.name} fits none of the {len(gpu_types)} GPU types tried with the headroom")
    bigger = {r["gpu"] for r in ok}
    if ok and len(bigger) < len(gpu_types):
        missing = [g.name for g in gpu_types if g.name not in bigger]
        notes.append(f"does not fit (up to the GPU counts tried): {', '.join(missing[:10])}"
                     + (" ..." if len(missing) > 10 else ""))
    if tokens is None:
        notes.append("pass tokens= (total training tokens) for time and cost")
    if prices and prices_source == "yours":
        notes.append(f"costs use {_your_prices(snapshot_date(prices))}")
    elif prices:
        notes.append(f"prices are a dated snapshot (seen up to {snapshot_date(prices)}): indicative only")
    return notes


# ----------------------------------------------------------------------------------------------------------
# Chart


def plot_options(plan: Plan, ax: Any = None, *, spot: bool = False) -> dict[str, Any]:
    """Cost vs wall time of every option that fits, one colour per GPU type (marker size grows with the
    GPU count), with the Pareto front: the options no other beats on both time and cost.

    Returns the artists: ``{"points": [PathCollection per GPU], "front": Line2D | None}``. Follows the
    ``ax=None`` convention (a new figure when None) and never calls ``plt.show()``.
    """
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(7, 4.5))
    cost_key = "cost_usd_spot" if spot else "cost_usd_on_demand"
    time_key = "spot_time_hours" if spot else "time_hours"
    pts = [r for r in plan.rows if r["fits"] and r.get(cost_key) is not None and r.get(time_key) is not None]
    artists: dict[str, Any] = {"points": [], "front": None}
    for name in dict.fromkeys(r["gpu"] for r in pts):
        mine = [r for r in pts if r["gpu"] == name]
        artists["points"].append(ax.scatter([r[time_key] for r in mine], [r[cost_key] for r in mine],
                                            label=name, s=[12 + 6 * math.log2(r["n_gpus"]) ** 2 for r in mine]))
    front = sorted((r[time_key], r[cost_key]) for r in pts if _dominates_none(r, pts, time_key, cost_key))
    if front:
        (artists["front"],) = ax.step([x for x, _ in front], [y for _, y in front], where="post", color="k",
                                      lw=1, ls="--", label="Pareto front")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"${v:,.0f}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"${v:,.0f}" if str(round(v))[0] in "25" else ""))
    ax.set_xlabel("wall time (hours)")
    ax.set_ylabel(f"cost, {'spot' if spot else 'on-demand'} (USD)")
    title = f"{plan.model.name}: cost vs time"
    if plan.prices_date:
        title += f" (prices seen up to {plan.prices_date})"
    ax.set_title(title, fontsize=10)
    if pts:
        ax.legend(fontsize=7, loc="best")
    return artists


def _dominates_none(r: Mapping[str, Any], pts: Sequence[Mapping[str, Any]], tk: str, ck: str) -> bool:
    return not any(o[tk] <= r[tk] and o[ck] <= r[ck] and (o[tk] < r[tk] or o[ck] < r[ck]) for o in pts)
