"""The planner's search: layouts per GPU type (one GPU, one node, several nodes; ZeRO-3/FSDP, tensor
parallel inside a fast domain, pipeline across nodes), checkpointing, micro-batch and gradient
accumulation for a target global batch; each option's memory, time and cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..errors import SpecError
from ..estimator.api import check_model_options, estimate
from ..estimator.result import MemoryEstimate
from ..model.params import as_built
from ..model.presets import resolve_model
from ..model.spec import ModelSpec
from ..spec.choices import Method
from ..spec.parallel import ParallelSpec, build_parallel
from ..spec.training import TrainingSpec, build_training
from ..step.reserved import screening
from .assumptions import check_count, check_headroom, check_mfu, check_provider, plan_assumptions, resolve_gpus
from .cost import (
    HW_INTERRUPTIONS_PER_GPU_HOUR,
    KEEP_CHECKPOINTS,
    RESTART_OVERHEAD_S,
    SPOT_INTERRUPTIONS_PER_NODE_HOUR,
    STORAGE_WRITE_GBS_PER_NODE,
    _best_prices,
    _price_warnings,
    checkpoint_bytes,
    run_cost,
)
from .fit import (
    DEFAULT_HEADROOM,
    Fit,
    _Evaluator,
    _gpu_counts,
    _layout,
    _split_options,
    _training_dict,
    check_fixed_layout,
    fit,
    model_parallel,
)
from .gpus import GPU, Price, _precision_for, list_gpus, load_gpus, load_prices, snapshot_date
from .report import Plan, _label, _your_prices
from .throughput import (
    COMM_EFFICIENCY,
    INTER_NODE_GBS_PER_GPU,
    PCIE_WARN_COMM_FRACTION,
    _in_fast_domain,
    _mfu_for,
    step_time,
)

if TYPE_CHECKING:
    pass

__all__ = ['MAX_PIPELINE_BUBBLE', 'pipeline_grad_accum', 'plan']

#: The largest share of a pipelined step the planner lets the GPUs idle. 1F1B idles (p-1)/m of the step
#: with m micro-batches on p stages (Narayanan et al. 2021, section 2.2.1: "the bubble ... is small when
#: m >> p"); a quarter is this planner's choice, not a published threshold. Without a target batch the
#: planner accumulates enough micro-batches to stay under it; above it, an option is flagged.
MAX_PIPELINE_BUBBLE = 0.25


# ----------------------------------------------------------------------------------------------------------
# Plan


_FAMILY_ORDER = ("single", "ddp", "fsdp", "fsdp-ep", "hsdp", "megatron")


#: The layout options that fix a layout's shape (degrees, sharding, offload); the rest are an engine's switches.
_LAYOUT_DEGREES = frozenset({"zero", "tp", "sp", "pp", "pp_schedule", "virtual_stages", "cp", "ep", "hybrid_shard",
                             "offload"})


def _families(m: ModelSpec, g: GPU, n: int, fixed: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Layouts to try on `n` GPUs of `g`: only the user's when they fixed a parallel option, those of its engine
    (with the degrees and sharding chosen here) when the engine is all they fixed."""
    layout_keys = set(fixed) - {"gpus", "nodes"}
    if "engine" in layout_keys and not layout_keys & _LAYOUT_DEGREES and n > 1:
        # the engine and its own switches (loss_fusion, grad_accum_fusion, ...) fixed, not its degrees or sharding
        engine = ParallelSpec(engine=fixed["engine"]).engine.value
        switches = {k: fixed[k] for k in layout_keys - {"engine"}}
        mine = [(name, {**opts, **switches}) for name, opts in _families(m, g, n, {}) if opts.get("engine") == engine]
        if mine:
            return mine
    if layout_keys:
        return [("given", dict(fixed))]
    if n == 1:
        return [("single", {})]
    nodes = max(1, -(-n // g.gpus_per_node))
    out: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {"engine": "ddp", "zero": 0}),
        ("fsdp", {"engine": "fsdp", "zero": 3}),
    ]
    per_node = n // nodes
    if m.is_moe:
        # expert parallelism inside a node (torchtitan's EP over its data-parallel ranks): the largest power
        # of two that divides the experts and the node's GPUs, a rank then holding n_experts / ep of them
        ep = max((d for d in (2, 4, 8, 16, 32, 64) if d <= per_node and m.n_experts % d == 0 and n % d == 0),
                 default=1)
        if ep > 1:
            out.append(("fsdp-ep", {"engine": "fsdp", "zero": 3, "ep": ep}))
    if nodes > 1:
        out.append(("hsdp", {"engine": "fsdp", "zero": 3, "hybrid_shard": True}))
    domain = min(per_node, g.nvlink_domain)
    tp = max((d for d in range(2, domain + 1) if per_node % d == 0 and m.n_heads % d == 0
              and (m.n_kv_heads % d == 0 or d % m.n_kv_heads == 0)), default=1)
    if tp > 1:
        pp = nodes if (nodes > 1 and nodes <= m.n_layers) else 1
        dp = n // (tp * pp)
        out.append(("megatron", {"engine": "megatron", "tp": tp, "sp": True, "pp": pp, "zero": 1 if dp > 1 else 0}))
    return out




def _scale(p: ParallelSpec, g: GPU) -> str:
    if p.gpus == 1:
        return "single GPU"
    if p.nodes == 1:
        return "one NVLink node" if p.gpus <= g.nvlink_domain else "one PCIe node"
    return "multi-node"


def _price_list(prices: Any, catalog: Sequence[GPU]) -> list[Price]:
    if prices is None:
        from .gpus import list_prices

        return list_prices()
    if prices is False:
        return []
    return load_prices(prices, catalog, what="prices")


def _catalog(catalog: Any) -> list[GPU]:
    """Your own GPUs: `GPU` objects, or anything `load_gpus` reads (a path, a dict, a list of dicts)."""
    if catalog is None:
        return []
    if isinstance(catalog, (list, tuple)) and all(isinstance(g, GPU) for g in catalog):
        return list(catalog)
    return load_gpus(catalog, what="catalog")


def _gpu_count(gpus: Any, n_gpus: Any) -> int | None:
    """The fixed GPU count: ``gpus=`` (as in `estimate`) or its alias ``n_gpus=``."""
    if gpus is not None and not isinstance(gpus, bool) and isinstance(gpus, (str, GPU, list, tuple, set)):
        raise SpecError(f"gpus={gpus!r} is the GPU count in plan(), as in estimate(); name GPU types with "
                        f"gpu={gpus!r}")
    if gpus is not None and n_gpus is not None and gpus != n_gpus:
        raise SpecError(f"gpus={gpus!r} and n_gpus={n_gpus!r} both give the GPU count; give one")
    value, name = (gpus, "gpus") if gpus is not None else (n_gpus, "n_gpus")
    return None if value is None else check_count(value, name)


def plan(
    model: Any,
    training: TrainingSpec | Mapping[str, Any] | None = None,
    *,
    gpu: str | GPU | Iterable[str | GPU] | None = None,
    gpus: int | None = None,
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

    `gpu` names the GPU types to try (a name, a `GPU` or a list; default: the whole catalog), as the
    CLI's ``--gpu`` and `fit` do; `gpus` is the GPU count, as in `estimate` (``n_gpus`` is an alias).
    `options` are training and parallel fields as for `estimate`. Whatever you give is kept; what you
    leave out is searched: the GPU count (1, 2, 4... a node, then whole nodes doubling, up to `max_gpus`,
    and `scale_out` doublings past the fewest that fit), the layout (DDP, FSDP ZeRO-3, hybrid shard across
    nodes, Megatron TP inside the NVLink domain with PP across nodes), checkpointing (none, else full), the
    micro-batch (the largest that fits) and gradient accumulation (to reach `target_global_batch`
    sequences). bf16 becomes fp16 on GPUs without bf16. `tokens` (total training tokens) gives time and
    cost; `prices` is None (the dated snapshot), False, a path, rows or ``{gpu: usd_per_gpu_hour}``;
    `mfu` a number or ``{gpu or class: number}`` (default: `MFU_DEFAULTS`). Every assumption is checked
    (`PlanAssumptions`): a bad value raises `SpecError` naming it.

    >>> p = plan("gpt2", gpu=["H100", "T4"], seq_len=1024, target_global_batch=64, tokens=1e9)
    >>> p.fits_on
    ['H100 SXM 80GB', 'T4 16GB']
    """
    a = plan_assumptions(
        headroom=check_headroom(headroom), target_global_batch=target_global_batch, tokens=tokens,
        n_gpus=_gpu_count(gpus, n_gpus), max_gpus=max_gpus, scale_out=scale_out, inter_node_gbs=inter_node_gbs,
        storage_gbs=storage_gbs, spot_interruptions_per_node_hour=spot_interruptions_per_node_hour,
        restart_minutes=restart_minutes, checkpoint_interval_hours=checkpoint_interval_hours,
        keep_checkpoints=keep_checkpoints)
    headroom = a.headroom
    m = resolve_model(model)
    cat = _catalog(catalog)
    gpu_types = resolve_gpus(gpu, cat) or (list(cat) or list_gpus())
    mfu = check_mfu(mfu, cat + gpu_types)
    price_rows = _price_list(prices, cat + gpu_types)
    provider = check_provider(provider, price_rows)
    source: Literal["snapshot", "yours", "none"] = "snapshot" if prices is None else "none" if prices is False else "yours"
    train_opts, par_opts = _split_options(options)
    given = _training_dict(training, train_opts)
    fixed: dict[str, Any] = {}
    if isinstance(parallel, ParallelSpec):
        fixed.update({k: getattr(parallel, k) for k in parallel.model_fields_set})
    elif isinstance(parallel, Mapping):
        fixed.update(parallel)
    elif parallel is not None:
        raise SpecError(f"parallel must be a ParallelSpec or a dict, got {type(parallel).__name__}")
    fixed.update({k: v for k, v in par_opts.items() if v is not None})
    if a.n_gpus is not None:
        fixed["gpus"] = a.n_gpus
    if fixed:  # bad values and impossible layouts fail here, once, with the usual message
        check_fixed_layout(m, fixed)
    base_training = build_training(None, **given)
    m = as_built(m, base_training)  # the model the stack builds: its header, checkpoints and costs count it
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
    ctx = _PlanContext(m=m, ev=ev, given=given, fixed=fixed, target=a.target_global_batch, tokens=a.tokens,
                       prices=price_rows, mfu=mfu, headroom=headroom, provider=provider,
                       inter_node_gbs=a.inter_node_gbs, storage_gbs=a.storage_gbs,
                       spot_rate=a.spot_interruptions_per_node_hour, restart_s=a.restart_minutes * 60,
                       interval_h=a.checkpoint_interval_hours, keep=a.keep_checkpoints, prices_source=source,
                       fp8=base_training.fp8.value)
    rows: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    step = model_parallel(fixed)
    if "gpus" not in fixed and step > a.max_gpus:
        raise SpecError(f"max_gpus={a.max_gpus} is below tp*pp*cp={step}, the fewest GPUs this layout needs")
    # every layout x GPU x batch tried: reserved bytes from the churn model, not the allocator's replay (tens
    # of ms per step; `tm.estimate` of a chosen row replays it)
    with screening():
        for g in gpu_types:
            counts = [int(fixed["gpus"])] if "gpus" in fixed else _gpu_counts(g, a.max_gpus, step)
            _search_gpu(ctx, g, counts, a.scale_out, rows, rejected)
    if not rows and rejected and all("headroom_fraction" not in r for r in rejected):
        # every option failed for a layout reason, none for memory: that reason is the answer, not "fits none"
        first = rejected[0]
        raise SpecError(f"no layout as given can run: {first['reason']} ({first['n_gpus']}x {first['gpu']}; "
                        f"{len(rejected)} option(s) tried, see the layout options)")
    _mark_pareto(rows)
    _replay_rows(ctx, rows, rejected)
    rows.sort(key=lambda r: (not r["fits"], r["cost_usd_on_demand"] if r["cost_usd_on_demand"] is not None else math.inf,
                             r["time_hours"] if r["time_hours"] is not None else math.inf, r["n_gpus"]))
    notes = _plan_notes(m, rows, gpu_types, a.tokens, price_rows, fixed.get("gpus"), source)
    notes.append("options were searched with reserved bytes as the allocated high-water mark plus a churn fraction "
                 "(RESERVED_CHURN_FRACTION); the single-GPU options, each GPU's fewest GPUs and the Pareto front "
                 "are replayed through the caching allocator (reserved_replayed), their fit and micro-batch the "
                 "replay's; tm.estimate or tm.fit of any other option replays it")
    if as_given is None and "gpus" in fixed:
        notes.insert(0, f"the step as given could not be estimated: {as_given_error}")
    assumptions = {
        "headroom": headroom, "target_global_batch": a.target_global_batch, "tokens": a.tokens,
        "mfu": {g.name: _mfu_for(g, mfu)[0] for g in gpu_types},
        "inter_node_gbs_per_gpu": a.inter_node_gbs, "storage_write_gbs_per_node": a.storage_gbs,
        "spot_interruptions_per_node_hour": a.spot_interruptions_per_node_hour,
        "hw_interruptions_per_gpu_hour": HW_INTERRUPTIONS_PER_GPU_HOUR, "restart_minutes": a.restart_minutes,
        "keep_checkpoints": a.keep_checkpoints, "comm_efficiency": COMM_EFFICIENCY,
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
    fp8: str = "none"  # the fp8 recipe of the given options (precision='fp8' included), kept in every option
    kept: dict[tuple[str, int, str], MemoryEstimate] = field(default_factory=dict)
    #: each row's option as the search chose it: (GPU, layout, training overrides, largest micro-batch screened)
    options: dict[tuple[str, int, str], tuple[GPU, ParallelSpec, dict[str, Any], int]] = field(default_factory=dict)


def _search_gpu(ctx: _PlanContext, g: GPU, counts: list[int], scale_out: int, rows: list[dict[str, Any]],
                rejected: list[dict[str, Any]]) -> None:
    """Rows for one GPU type: every layout family from the fewest GPUs that fit, `scale_out` doublings on."""
    base = build_training(None, **ctx.given)
    if base.fp8.value != "none" and not g.supports_fp8:
        rejected.append({"gpu": g.name, "n_gpus": 1, "layout": "any",
                         "reason": f"fp8={base.fp8.value!r}: {g.name} has no fp8 tensor cores (torch._scaled_mm needs "
                                   "compute capability 8.9 or later)"})
        return
    precision = _precision_for(str(base.precision.value), g)
    fits_seen: dict[str, int] = {}
    dead: set[str] = set()  # families whose memory per GPU does not fall with more GPUs (DDP)
    closest: dict[str, Any] | None = None
    for n in counts:
        if ctx.target is not None and n > ctx.target * model_parallel(ctx.fixed):
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


def pipeline_grad_accum(p: ParallelSpec) -> int:
    """The fewest micro-batches per step that keep 1F1B's bubble (p-1)/(m·v) at or under
    `MAX_PIPELINE_BUBBLE`; 1 without pipeline parallelism."""
    if p.pp <= 1:
        return 1
    v = p.virtual_stages if p.pp_schedule.value == "interleaved" else 1
    return max(1, math.ceil((p.pp - 1) / (MAX_PIPELINE_BUBBLE * v)))


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
    if ctx.target is None:  # no batch to reach: enough micro-batches that the pipeline is not mostly idle
        ga = int(ga_given) if ga_given else pipeline_grad_accum(p)
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
    """One row, screened: the batch that fits, the verdict, time and cost (raises SpecError for bad layouts);
    `_replay_rows` replays the rows a user acts on."""
    ckpts = [ctx.given["checkpointing"]] if "checkpointing" in ctx.given else ["none", "full"]
    for ck in ckpts:  # no recomputation when it fits, else full checkpointing
        # precision='fp8' names a bf16 model with fp8 matmuls: the recipe stays with it
        over: dict[str, Any] = {"precision": precision, "checkpointing": ck, "fp8": ctx.fp8}
        mb, ga, mx = _choose_batch(ctx, g, p, over)
        if 0 < mb <= mx:
            break
    est = ctx.ev.estimate(p, {**over, "micro_batch": max(mb, 1), "grad_accum": ga})
    row = _row(ctx, g, p, est, fit(est, g, ctx.headroom), mx, replayed=False)
    ctx.options[_option_key(row)] = (g, p, over, mx)
    return row


def _row(ctx: _PlanContext, g: GPU, p: ParallelSpec, est: MemoryEstimate, f: Fit, mx: int, replayed: bool
         ) -> dict[str, Any]:
    """The row of one option from its estimate and fit: layout, batch, verdict, and unless it is out of
    memory, time, cost and warnings. `replayed`: its reserved bytes are the caching allocator's replay."""
    t = est.training
    label = _label(p)
    row: dict[str, Any] = {
        "gpu": g.name, "model": ctx.m.name, "family": ctx.m.family.value, "n_gpus": p.gpus, "nodes": p.nodes, "gpus_per_node": p.gpus_per_node, "layout": label,
        "scale": _scale(p, g), "engine": p.engine.value, "zero": p.zero, "tp": p.tp, "pp": p.pp, "sp": p.sp, "ep": p.ep,
        "hybrid_shard": p.hybrid_shard, "offload": p.offload.value, "precision": t.precision.value, "fp8": t.fp8.value,
        "fp8_all_gather": t.fp8_all_gather,
        "checkpointing": t.checkpointing.value, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
        "global_batch": t.micro_batch * t.grad_accum * p.dp, "seq_len": t.seq_len,
        "fits": f.fits, "verdict": f.verdict, "headroom_fraction": f.margin_fraction, "needed_bytes": f.needed_bytes,
        "usable_bytes": f.usable_bytes, "max_micro_batch": mx, "reserved_replayed": replayed, "message": f.message,
    }
    if f.verdict == "oom":
        return row
    ctx.kept[(g.name, p.gpus, label)] = est
    od_price, sp_price = _best_prices(ctx.prices, g.name, p.gpus, ctx.provider)
    row.update(_time_and_cost(ctx, g, p, t, od_price, sp_price))
    row["warnings"] = (list(f.notes) + _row_warnings(g, p, t, row, ctx.prices_source)
                       + _price_warnings(g, p, od_price, sp_price))
    asked = build_training(None, **ctx.given).precision.value  # the default follows the method
    if asked != t.precision.value:
        row["warnings"].insert(0, f"{g.name} has no bf16: planned as {t.precision.value} (same memory, loss scaling)")
    row["pareto"] = False
    return row


def _option_key(row: Mapping[str, Any]) -> tuple[str, int, str]:
    return row["gpu"], row["n_gpus"], row["layout"]


def _replay_rows(ctx: _PlanContext, rows: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> None:
    """Replay the caching allocator over the rows a user acts on: every single-GPU option, each GPU type's
    fewest GPUs that fit, and the time/cost Pareto front (again where replaying moves it). The search screened
    with the churn model, which a replay of each of hundreds of layouts would make several times slower."""
    for _ in range(4):
        picked = {id(r) for r in _fewest_per_gpu(rows).values()}
        todo = [i for i, r in enumerate(rows) if not r["reserved_replayed"]
                and (r["n_gpus"] == 1 or id(r) in picked or (r["fits"] and r.get("pareto")))]
        if not todo:
            return
        for i in reversed(todo):
            g, p, over, mx = ctx.options[_option_key(rows[i])]
            est, f, mx = _replayed_fit(ctx, g, p, over, rows[i]["micro_batch"], rows[i]["grad_accum"], mx)
            row = _row(ctx, g, p, est, f, mx, replayed=True)
            if f.verdict == "oom":  # out of memory once replayed: rejected, as the search rejects the others
                rejected.append({"gpu": g.name, "n_gpus": p.gpus, "layout": row["layout"], "reason": row["message"],
                                 "headroom_fraction": row["headroom_fraction"]})
                del rows[i]
            else:
                rows[i] = row
        _mark_pareto(rows)


def _fewest_per_gpu(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per GPU type, its first row that fits with the fewest GPUs."""
    fewest: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["fits"] and (r["gpu"] not in fewest or r["n_gpus"] < fewest[r["gpu"]]["n_gpus"]):
            fewest[r["gpu"]] = r
    return fewest


def _replayed_fit(ctx: _PlanContext, g: GPU, p: ParallelSpec, over: dict[str, Any], mb: int, ga: int, mx: int
                  ) -> tuple[MemoryEstimate, Fit, int]:
    """The option's step with the caching allocator replayed, its fit and largest micro-batch: a micro-batch
    the replay says does not fit steps down (at most four times, as `trainmem_nb.planning.fit.max_micro_batch`
    does; the screen is within a few of the replay's answer). A micro-batch the user gave stays."""
    per_rank = -(-ctx.target // p.dp) if ctx.target is not None else None
    for _ in range(4):
        est = ctx.ev.estimate(p, {**over, "micro_batch": max(mb, 1), "grad_accum": ga}, replay=True)
        f = fit(est, g, ctx.headroom)
        if f.fits or mb <= 1 or "micro_batch" in ctx.given:
            break
        mb -= 1
        mx = min(mx, mb)
        if per_rank is not None and not ctx.given.get("grad_accum"):
            ga = -(-per_rank // mb)  # the same global batch in more, smaller micro-steps
    return est, f, mx


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
        "bubble_fraction": st.bubble_fraction if st else None,
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
    bubble = row.get("bubble_fraction")
    if bubble is not None and bubble > MAX_PIPELINE_BUBBLE:
        idle = bubble / (1 + bubble)  # the bubble is relative to the compute; as a share of the step
        need = pipeline_grad_accum(p)
        out.append(f"pipeline bubble: {idle:.0%} of each step idle (grad_accum={t.grad_accum} micro-batches on "
                   f"pp={p.pp} stages); pass target_global_batch, or grad_accum >= {need}, to keep it under "
                   f"{MAX_PIPELINE_BUBBLE / (1 + MAX_PIPELINE_BUBBLE):.0%}")
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
        fewest = _fewest_per_gpu(rows)
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
