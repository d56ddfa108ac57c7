"""What the explorer writes as HTML: the verdict line, the numbers under the chart (with where the
reserved bytes come from) and the chart's legend; functions of results, no widgets."""

from __future__ import annotations

import html
from typing import Any

from ..engine.breakdown import TOP_KEYS
from ..estimator.result import CATEGORY_HELP, MemoryEstimate
from ..units import format_bytes, format_count
from .chart_parts import CATEGORY_COLORS


def verdict_text(fit: Any, mmb: int, n_gpus: int, limit: int | None = None) -> str:
    """One line: the planner's verdict (fits / tight / OOM, with the margin) and the largest micro-batch (searched up
    to `limit`: reaching it reads "or more")."""
    per = " per GPU" if n_gpus > 1 else ""
    more = " or more" if limit is not None and mmb >= limit else ""
    largest = f"largest micro-batch {mmb}{more}" if mmb > 0 else "not even micro-batch 1 fits"
    return f"{fit.message}{per}; {largest}"


def summary_html(est: MemoryEstimate) -> str:
    """The numbers under the chart: peak allocated / reserved / device total, when the peak happens, and
    the breakdown."""
    rows = "".join(
        f"<tr><td>{k}</td><td style='text-align:right'>{format_bytes(est.breakdown_bytes[k])}</td>"
        f"<td style='color:#666;padding-left:1em'>{html.escape(CATEGORY_HELP[k])}</td></tr>" for k in TOP_KEYS
    )
    host = f" &middot; host {format_bytes(est.host_bytes)}" if est.host_bytes else ""
    return (
        f"<div style='font-size:0.9em'><p>{html.escape(est.model.name)}: {format_count(est.n_params)} parameters "
        f"({format_count(est.n_trainable_params)} trained) &middot; peak <b>{format_bytes(est.peak_allocated_bytes)}"
        f"</b> allocated during <b>{html.escape(est.peak_phase)}</b> ({html.escape(est.peak_at)}) &middot; reserved "
        f"{format_bytes(est.peak_reserved_bytes)}{reserved_note(est)} &middot; device total "
        f"{format_bytes(est.device_total_bytes)}{host}</p><table>{rows}</table></div>"
    )


def reserved_note(est: MemoryEstimate) -> str:
    """Where the reserved bytes come from (`MemoryEstimate.reserved_from`), in a few words."""
    if est.reserved_from == "replay":
        return (f" (allocator replayed: {format_bytes(est.fragmentation_bytes)} cached but unused, largest free "
                f"block {format_bytes(est.largest_free_block_bytes)})")
    if est.reserved_from == "churn model":
        return " (not replayed, beyond the replay's limits: allocated + a share of the temporaries)"
    if est.reserved_from == "calibration":
        return " (from the GPU calibration)"
    return ""


def legend_html() -> str:
    items = "".join(
        f"<span style='white-space:nowrap;margin-right:0.9em'><span style='display:inline-block;width:0.9em;"
        f"height:0.9em;background:{color};vertical-align:middle;margin-right:0.3em'></span>{html.escape(key)}</span>"
        for key, color in CATEGORY_COLORS.items()
    )
    band = ("<span style='white-space:nowrap'><span style='display:inline-block;width:0.9em;height:0.9em;"
            "background:#e6a532;opacity:0.45;vertical-align:middle;margin-right:0.3em'></span>10–15 % headroom"
            "</span> &middot; black line: the GPU's usable memory")
    stale = "<style>.trainmem-stale { opacity: 0.35; }</style>"  # the last valid chart, greyed under an error
    return f"{stale}<div style='font-size:0.85em;line-height:1.6'>{items}{band}</div>"
