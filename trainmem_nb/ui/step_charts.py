"""Charts of one step: the breakdown bar (what the peak is made of) and the timeline (when it happens),
each redrawn in place by its ``update`` so a widget never flickers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.breakdown import TOP_KEYS
from ..units import format_bytes
from .chart_parts import (
    CATEGORY_COLORS,
    HEADROOM_BAND,
    bar_segments,
    bytes_axis,
    new_axes,
    new_capacity,
    resolve_gpu,
    set_capacity,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from ..estimator.result import MemoryEstimate
    from ..planning.gpus import GPU


@dataclass(eq=False)
class BreakdownChart:
    """What `breakdown` drew, and how to redraw it in place for another estimate (`update`).

    ``bars`` maps each category to its bar segment (a Rectangle whose width is the bytes); ``capacity``
    is the line at the GPU's usable memory and ``band`` the headroom band below it (both hidden
    without a GPU).
    """

    ax: Axes
    bars: dict[str, Any]
    capacity: Any
    band: Any
    title: Any
    headroom: tuple[float, float] = HEADROOM_BAND
    auto_title: bool = True

    def __repr__(self) -> str:
        end = sum(r.get_width() for r in self.bars.values())
        gpu = f"; {self.capacity.get_label()}" if self.capacity.get_visible() else ""
        return f"BreakdownChart(bar ends at {format_bytes(end)}{gpu})"

    def update(self, est: MemoryEstimate, gpu: str | GPU | None = None) -> None:
        """Redraw for `est` (and `gpu`) by moving the existing artists: no flicker, no new axes."""
        g = resolve_gpu(gpu)
        left = 0
        for key, value in bar_segments(est).items():
            self.bars[key].set_x(left)
            self.bars[key].set_width(value)
            left += value
        set_capacity(self.capacity, self.band, g, self.headroom, vertical=True)
        self.ax.set_xlim(0, max(left, g.memory_bytes if g is not None else 0) * 1.04 or 1)
        if self.auto_title:
            self.title.set_text(
                f"peak {format_bytes(est.peak_allocated_bytes)} allocated, {format_bytes(est.device_total_bytes)} "
                f"on the device (during {est.peak_phase})"
            )


def breakdown(
    est: MemoryEstimate,
    gpu: str | GPU | None = None,
    *,
    headroom: tuple[float, float] = HEADROOM_BAND,
    ax: Axes | None = None,
    title: str | None = None,
    legend: bool = True,
) -> BreakdownChart:
    """One stacked horizontal bar of what the step's peak is made of, against the GPU's usable memory.

    Segments are the breakdown categories (they sum to ``peak_allocated_bytes``), then the allocator's
    unused cache and the CUDA context, so the bar ends at ``device_total_bytes``. With `gpu`, a black
    line marks its usable memory and a band the 10–15 % headroom to keep below it. Returns a
    `BreakdownChart`; its ``update(est, gpu)`` redraws in place.
    """
    ax = new_axes(ax, (7.0, 1.9))
    bars = {key: ax.barh([0], [0], height=0.6, color=color)[0] for key, color in CATEGORY_COLORS.items()}
    for key, rect in bars.items():
        rect.set_label(key)
    line, band = new_capacity(ax, vertical=True)
    ax.set_yticks([])
    ax.set_ylim(-0.5, 0.5)
    bytes_axis(ax.xaxis)
    title_artist = ax.set_title(title or "", fontsize=10, loc="left")
    chart = BreakdownChart(ax, bars, line, band, title_artist, headroom, auto_title=title is None)
    chart.update(est, gpu)
    if legend:
        ax.legend(handles=[*bars.values(), *([band, line] if gpu is not None else [])], loc="upper center",
                  bbox_to_anchor=(0.5, -0.3), ncol=5, fontsize=7, frameon=False)
    return chart


@dataclass(eq=False)
class TimelineChart:
    """What `timeline` drew, and how to redraw it in place for another estimate (`update`).

    ``areas`` maps each category to its filled band (stacked in `TOP_KEYS` order), ``total`` is the
    live-bytes line, ``peak`` the marker at the highest point and ``label`` its annotation.
    """

    ax: Axes
    areas: dict[str, Any]
    total: Any
    peak: Any
    label: Any
    capacity: Any
    max_points: int = 600
    phase_marks: list[Any] = field(default_factory=list)
    #: loading drawn first (phase "load", `MemoryEstimate.timeline(load=True)`)
    load: bool = False

    def __repr__(self) -> str:
        return f"TimelineChart({len(self.total.get_xdata())} points, {self.label.get_text()})"

    def update(self, est: MemoryEstimate, gpu: str | GPU | None = None) -> None:
        """Redraw for `est` (and `gpu`): new data in the same artists; only the fills are replaced."""
        g = resolve_gpu(gpu)
        points = est.timeline(self.max_points, load=self.load)
        xs, spans = phase_positions([p.phase for p in points])
        xs = [*xs, spans[-1][2]]  # the last operation's level holds to the end of the axis
        rows = [*points, points[-1]]
        base = [0] * len(rows)
        for i, key in enumerate(TOP_KEYS):
            top = [b + p.by_category[i] for b, p in zip(base, rows, strict=True)]
            old = self.areas.get(key)
            if old is not None:
                old.remove()
            self.areas[key] = self.ax.fill_between(xs, base, top, step="post", color=CATEGORY_COLORS[key],
                                                   linewidth=0, label=key, zorder=1)
            base = top
        self.total.set_data(xs, [p.total_bytes for p in rows])
        k = max((j for j in range(len(points)) if points[j].phase != "load"), key=lambda j: points[j].total_bytes)
        x_peak, y_peak = (xs[k] + xs[k + 1]) / 2, points[k].total_bytes
        self.peak.set_data([x_peak], [y_peak])
        end = spans[-1][2]
        self.label.xy = (x_peak, y_peak)
        self.label.set_text(f"peak {format_bytes(est.peak_allocated_bytes)} ({est.peak_phase})")
        frac = x_peak / end
        self.label.set_horizontalalignment("center" if 0.15 < frac < 0.85 else ("left" if frac <= 0.15 else "right"))
        if g is not None:
            self.capacity.set_ydata([g.memory_bytes, g.memory_bytes])
        self.capacity.set_visible(g is not None)
        for mark in self.phase_marks:
            mark.remove()
        self.phase_marks.clear()
        named = [(phase, lo, hi) for phase, lo, hi in spans if phase != "zero"]
        for _, lo, _ in named[1:]:  # a thin line where each phase starts, its name under the axis
            self.phase_marks.append(self.ax.axvline(lo, color="#999999", linewidth=0.6, zorder=0))
        self.ax.set_xticks([(lo + hi) / 2 for _, lo, hi in named], [phase for phase, _, _ in named])
        self.ax.tick_params(axis="x", length=0)
        self.ax.set_ylim(0, max(y_peak, g.memory_bytes if g is not None else 0) * 1.15 or 1)
        self.ax.set_xlim(0, end)


#: Narrow phases (an optimizer step is a handful of operations) still get this share of the axis.
_MIN_PHASE_SHARE = 0.12


def phase_positions(phases: Sequence[str]) -> tuple[list[float], list[tuple[str, float, float]]]:
    """x of each timeline point: evenly spaced within its phase, each phase (but the closing
    ``zero_grad``) at least `_MIN_PHASE_SHARE` of the axis. Returns the xs and (phase, start, end)."""
    runs: list[list[Any]] = []
    for ph in phases:
        if runs and runs[-1][0] == ph:
            runs[-1][1] += 1
        else:
            runs.append([ph, 1])
    n = len(phases)
    xs: list[float] = []
    spans: list[tuple[str, float, float]] = []
    x = 0.0
    for ph, count in runs:
        width = float(count) if ph == "zero" else max(float(count), _MIN_PHASE_SHARE * n)
        xs.extend(x + width * j / count for j in range(count))
        spans.append((ph, x, x + width))
        x += width
    return xs, spans


def timeline(
    est: MemoryEstimate,
    gpu: str | GPU | None = None,
    *,
    ax: Axes | None = None,
    max_points: int = 600,
    legend: bool = True,
    load: bool = False,
) -> TimelineChart:
    """Live memory after each operation of the step, stacked by category, with the step's peak marked.

    The x axis runs through the step's operations, phase by phase (forward, backward, optimizer,
    named under the axis; a short optimizer step still gets room to be seen); `load` draws loading the
    model first (QLoRA's quantize-on-load shows its 16-bit weights as transient). With `gpu`, its usable
    memory is a dashed line. Returns a `TimelineChart`; its ``update(est, gpu)`` redraws in place.
    """
    ax = new_axes(ax, (7.0, 3.0))
    (total,) = ax.step([], [], where="post", color="black", linewidth=0.6, zorder=2)
    (peak,) = ax.plot([], [], marker="v", color="black", markersize=7, linestyle="none", zorder=3)
    label = ax.annotate("", (0, 0), xytext=(0, 6), textcoords="offset points", fontsize=8, zorder=3)
    capacity = ax.axhline(0, color="black", linewidth=1.2, linestyle="--", zorder=2)
    chart = TimelineChart(ax, {}, total, peak, label, capacity, max_points, load=load)
    chart.update(est, gpu)
    what = "loading, then one training step" if load else "one training step"
    ax.set_xlabel(f"{what}, operation by operation (repeated layers condensed; phases not to scale)", fontsize=8)
    bytes_axis(ax.yaxis)
    if legend:
        ax.legend(handles=list(chart.areas.values()), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
                  frameon=False)
    return chart
