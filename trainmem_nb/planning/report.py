"""A plan's result: the options found, the best by time or cost, and how they print.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..estimator.result import MemoryEstimate
from ..model.spec import ModelSpec
from ..spec.parallel import ParallelSpec
from ..units import format_bytes, format_count
from .cost import _SMALL_OFFERS
from .fit import needed_bytes

if TYPE_CHECKING:
    import pandas as pd

__all__ = ['Plan']


@dataclass(repr=False)
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
            spare = f"{r['headroom_fraction']:.0%}" + ("" if r["fits"] else "*")  # * short of the headroom
            lines.append(
                f"{r['gpu'][:24]:<24} {r['n_gpus']:>4} {r['layout'][:22]:<22} {r['checkpointing'][:5]:<5} "
                f"{r['micro_batch']:>4} x {r['grad_accum']:<3} {spare:>6} {r['max_micro_batch']:>6} "
                f"{_fmt(r['time_hours'], '.1f'):>8} {_fmt(r['cost_usd_on_demand'], ',.0f'):>12} "
                f"{_fmt(r['cost_usd_spot'], ',.0f'):>9}  {seen}"
            )
        if not all(r["fits"] for r in self.rows[:max_rows]):
            headroom = self.assumptions.get("headroom")
            lines.append("* keeps less than the headroom asked for"
                         + (f" ({headroom:.0%})" if isinstance(headroom, float) else "")
                         + ": it fits the card, not the margin (the closest options when none keeps it)")
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

    def __repr__(self) -> str:
        """One line at a REPL (the full table is ``print(plan)``; the dataclass dump ran to 20,000 characters)."""
        n_types = len({r["gpu"] for r in self.rows} | {r["gpu"] for r in self.rejected})
        fits = sum(1 for r in self.rows if r["fits"])
        best = self.best("cost") or self.best("time") or self.best("gpus")
        if best is None:
            head = "nothing fits"
        else:
            cost = "" if best.get("cost_usd_on_demand") is None else f", ${best['cost_usd_on_demand']:,.0f}"
            hours = "" if best.get("time_hours") is None else f", {best['time_hours']:,.1f} h"
            head = f"best {best['n_gpus']}x {best['gpu']} {best['layout']}{hours}{cost}"
        return (f"<Plan {self.model.name}: {fits} option(s) that fit on {n_types} GPU type(s); {head}; "
                f"{len(self.rejected)} rejected>")

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
    lines = [head, f"  per device: {parts}", f"  {t.resolved_stack.describe()}"]
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


def _label(p: ParallelSpec) -> str:
    if p.single_device:
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
    if p.ep > 1:
        parts.append(f"ep{p.ep}")
    if p.offload.value != "none":
        parts.append(f"offload {p.offload.value}")
    return " ".join(parts)
