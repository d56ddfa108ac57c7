"""What a run costs: on-demand vs spot, with checkpoints at Young's interval, interruptions, restarts
and billing granularity, priced from a dated snapshot or your own prices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..model.spec import ModelSpec
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec
from .gpus import GPU, Price

if TYPE_CHECKING:
    pass

__all__ = ['HW_INTERRUPTIONS_PER_GPU_HOUR', 'RESTART_OVERHEAD_S', 'SPOT_INTERRUPTIONS_PER_NODE_HOUR', 'STORAGE_WRITE_GBS_PER_NODE', 'CostEstimate', 'checkpoint_bytes', 'run_cost']

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


# ----------------------------------------------------------------------------------------------------------
# Checkpoints and cost


def checkpoint_bytes(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of one resumable checkpoint: the trained weights as the optimizer keeps them (fp32 masters in
    mixed precision) plus every optimizer state tensor. A LoRA checkpoint holds only the adapters."""
    from ..model.params import trainable_tensors
    from ..step.optimizers import paged_state_bytes, state_bytes

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
