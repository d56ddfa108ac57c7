"""The plan's options as time against cost (matplotlib).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..planning.report import Plan

if TYPE_CHECKING:
    pass

__all__ = ["plan_options"]


# ----------------------------------------------------------------------------------------------------------
# Chart


def plan_options(plan: Plan, ax: Any = None, *, spot: bool = False) -> dict[str, Any]:
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
