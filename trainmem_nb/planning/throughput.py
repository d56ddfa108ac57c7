"""How long a step takes: training FLOPs over GPUs x dense peak x an MFU assumption, plus the
communication that cannot hide. Every number from the world is a named constant with its source.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import SpecError, show_value
from ..model.spec import ModelSpec
from ..spec.choices import Checkpointing, Method, Precision
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec
from .gpus import GPU, _norm, _precision_for, get_gpu

if TYPE_CHECKING:
    pass

__all__ = ['COMM_EFFICIENCY', 'INTER_NODE_GBS_PER_GPU', 'MFU_DEFAULTS', 'StepTime', 'flops_per_token', 'step_time']

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

#: Warn when a PCIe-only box spends more than this share of the compute time in the gradient all-reduce.
PCIE_WARN_COMM_FRACTION = 0.25


# ----------------------------------------------------------------------------------------------------------
# Time


def _matmul_params(m: ModelSpec, t: TrainingSpec) -> tuple[float, float, float]:
    """``(frozen, trainable, in_layers)`` matmul weights a token passes through (MoE: top-k experts only).

    The LM head counts once (tied heads reuse the embedding matrix as a matmul); embedding lookups are
    not matmuls (torchtitan counts 6·(N - embeddings) the same way)."""
    from ..model.params import lora_inventory, param_inventory

    total = in_layers = 0.0
    for p in param_inventory(m):
        if not p.matmul:
            continue
        n: float = p.numel * p.count
        if ".experts." in p.name and m.n_experts:  # the routed experts (deepseek's shared ones see every token)
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
    # each layer attends over the whole sequence, or over its window (sliding-window layers)
    keys = sum(min(t.seq_len, m.sliding_window) if k.attention == "sliding" else t.seq_len for k in m.layer_kinds)
    width: float = m.head_dim or m.hidden // m.n_heads
    if m.kv_lora_rank:  # MLA: q.k over the nope + rope dims, probs.v over v_head_dim
        width = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2
    attn_fwd = 4.0 * m.n_heads * width * keys
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


def check_fraction(value: Any, field: str) -> float:
    """A utilisation in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, complex):
        raise SpecError(f"{field}={show_value(value)} must be a fraction in (0, 1], e.g. 0.4")
    number = float(value)
    if not (math.isfinite(number) and 0.0 < number <= 1.0):
        raise SpecError(f"{field}={show_value(value)} must be a fraction in (0, 1], e.g. 0.4")
    return number


def check_mfu(mfu: Any, catalog: Iterable[GPU] = ()) -> float | dict[str, float] | None:
    """``mfu`` as the planner uses it: None (the per-class defaults), one fraction, or ``{gpu or class:
    fraction}`` whose keys are resolved to catalog names (``'H100'`` -> ``'H100 SXM 80GB'``); an unknown
    key is refused with a did-you-mean instead of being ignored."""
    if mfu is None:
        return None
    if isinstance(mfu, Mapping):
        out: dict[str, float] = {}
        for key, value in mfu.items():
            if not isinstance(key, (str, GPU)):
                raise SpecError(f"mfu={{{key!r}: ...}}: keys name a GPU or a GPU class, got {type(key).__name__}")
            name = key.name if isinstance(key, GPU) else key
            if isinstance(key, str) and key.strip().lower() in MFU_DEFAULTS:
                name = key.strip().lower()
            else:
                try:
                    name = get_gpu(key, catalog).name
                except SpecError as exc:
                    classes = ", ".join(MFU_DEFAULTS)
                    raise SpecError(f"mfu={{{key!r}: ...}} names no GPU or GPU class: {exc} (classes: {classes})") from None
            out[name] = check_fraction(value, f"mfu[{key!r}]")
        return out
    return check_fraction(mfu, "mfu")


def _mfu_for(g: GPU, mfu: float | Mapping[str, float] | None) -> tuple[float, str]:
    """The utilisation assumed on `g`: the given number, the dict's entry for `g` (by any of its names,
    or its class), else the class default. Values are checked as `check_mfu` checks them."""
    if isinstance(mfu, Mapping):
        names = {_norm(n) for n in (g.name, g.full_name, *g.aliases) if n}
        for key, value in mfu.items():
            if (isinstance(key, GPU) and key.name == g.name) or (isinstance(key, str) and _norm(key) in names):
                return check_fraction(value, f"mfu[{key!r}]"), "given"
        for key, value in mfu.items():
            if isinstance(key, str) and key.strip().lower() == g.perf_class:
                return check_fraction(value, f"mfu[{key!r}]"), "given"
    elif mfu is not None:
        return check_fraction(mfu, "mfu"), "given"
    return MFU_DEFAULTS.get(g.perf_class, MFU_DEFAULTS["generic"])


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
