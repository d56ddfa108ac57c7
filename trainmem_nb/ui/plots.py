"""Charts of training memory: what a step is made of, when it peaks, and where it stops fitting.

Every function takes ``ax=None`` (a new figure's axes when omitted, never pyplot's global state),
draws, and returns the artists it drew as a small named tuple, so tests can read bar widths and a
widget can redraw into the same axes. Nothing calls ``plt.show()``; matplotlib is imported only when
a chart is drawn. Byte axes use `trainmem_nb.units.format_bytes` (GiB = 2**30 bytes).

>>> import trainmem_nb as tm
>>> from trainmem_nb import plots
>>> est = tm.estimate("gpt2", micro_batch=4, seq_len=512)
>>> art = plots.breakdown(est)
>>> sum(bar.get_width() for bar in art.bars.values()) == est.device_total_bytes
True

A GPU is a catalog name or alias (``"H100"``, ``"a100-40gb"``: `trainmem_nb.planning.gpus.get_gpu`) or a
`trainmem_nb.planning.gpus.GPU`, your own included; its ``memory_bytes`` is the usable memory (nvidia-smi's total).
Verdicts (fits / tight / OOM) are `trainmem_nb.planning.fit.fit`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..engine.breakdown import TOP_KEYS
from ..units import format_bytes
from .plan_chart import plan_options

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from ..estimator.result import MemoryEstimate
    from ..planning.gpus import GPU

__all__ = [
    "CATEGORY_COLORS",
    "HEADROOM_BAND",
    "VERDICT_COLORS",
    "BreakdownChart",
    "TimelineChart",
    "breakdown",
    "compare",
    "compare_gpus",
    "fit_grid",
    "fit_map",
    "plan_options",
    "resolve_gpu",
    "sweep_lines",
    "timeline",
    "to_png",
]

#: One colour per breakdown category, shared by every chart (and by the explorer's legend).
CATEGORY_COLORS: dict[str, str] = {
    "weights": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_states": "#55a868",
    "activations": "#c44e52",
    "transient": "#8172b3",
    "overhead": "#937860",
    "allocator cache": "#c7c7c7",  # peak_reserved - peak_allocated: PyTorch's caching allocator
    "CUDA context": "#8c8c8c",  # device_total - peak_reserved: what nvidia-smi adds
}

#: Colours of the fit verdicts (`trainmem_nb.planning.fit.fit`), plus cells whose options are invalid.
VERDICT_COLORS: dict[str, str] = {"fits": "#55a868", "tight": "#e6a532", "oom": "#c44e52", "invalid": "#d9d9d9"}

#: The usual advice: keep 10–15 % of the card free (fragmentation, a longer batch, a library's buffers).
HEADROOM_BAND: tuple[float, float] = (0.10, 0.15)


class SweepArtists(NamedTuple):
    """What `sweep_lines` drew: one line per group and one per GPU capacity."""

    lines: dict[str, Any]
    capacities: dict[str, Any]

    def __repr__(self) -> str:
        return f"SweepArtists(lines: {', '.join(self.lines)}; capacities: {', '.join(self.capacities) or 'none'})"


class FitMapArtists(NamedTuple):
    """What `fit_map` drew: the coloured grid, the cell texts and the grid's data."""

    mesh: Any
    texts: list[Any]
    grid: pd.DataFrame

    def __repr__(self) -> str:
        counts = self.grid["verdict"].value_counts()
        cells = ", ".join(f"{int(counts[v])} {v}" for v in VERDICT_COLORS if v in counts)
        return (f"FitMapArtists({self.grid['micro_batch'].nunique()} micro-batches x "
                f"{self.grid['seq_len'].nunique()} sequence lengths: {cells})")


class CompareArtists(NamedTuple):
    """What `compare` drew: category -> BarContainer (one bar per compared estimate), GPU line, band."""

    bars: dict[str, Any]
    capacity: Any | None
    band: Any | None

    def __repr__(self) -> str:
        labels = [t.get_text() for t in next(iter(self.bars.values())).patches[0].axes.get_xticklabels()]
        line = f"; {self.capacity.get_label()}" if self.capacity is not None else ""
        return f"CompareArtists({', '.join(labels)}{line})"


class GPUBarsArtists(NamedTuple):
    """What `compare_gpus` drew: one bar per GPU, coloured by verdict, and the needed-memory line."""

    bars: dict[str, Any]
    needed: Any
    verdicts: dict[str, str]

    def __repr__(self) -> str:
        return f"GPUBarsArtists({', '.join(f'{g}: {v}' for g, v in self.verdicts.items())})"


# -- helpers -------------------------------------------------------------------------------------------


def _axes(ax: Axes | None, figsize: tuple[float, float] = (7.0, 3.0)) -> Axes:
    """`ax`, or the axes of a new pyplot figure sized for the chart (a notebook shows it after the cell;
    nothing here calls ``show``)."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.figure(figsize=figsize, layout="constrained").add_subplot()


def resolve_gpu(gpu: str | GPU | None) -> GPU | None:
    """A `trainmem_nb.planning.gpus.GPU` from the catalog by name (or alias), or `gpu` itself; None stays None."""
    if gpu is None:
        return None
    from ..planning.gpus import GPU, get_gpu

    if not isinstance(gpu, (str, GPU)):
        raise TypeError(f"gpu must be a catalog name or a trainmem_nb.planning.gpus.GPU, got {type(gpu).__name__}")
    return get_gpu(gpu)


def _byte_tick(value: float, _pos: Any = None) -> str:
    return format_bytes(value, 1).replace(".0 ", " ")


def _bytes_axis(axis: Any, nbins: int = 6) -> None:
    """Ticks at round binary sizes (…, 8 GiB, 16 GiB, …) labelled with `format_bytes`."""
    from matplotlib.ticker import FuncFormatter, Locator, MaxNLocator

    class ByteLocator(Locator):
        def __call__(self) -> Any:
            assert self.axis is not None
            vmin, vmax = self.axis.get_view_interval()
            return self.tick_values(vmin, vmax)

        def tick_values(self, vmin: float, vmax: float) -> Any:
            top = max(abs(vmin), abs(vmax), 1.0)
            unit = 1.0
            while top / unit >= 1024 and unit < 2.0**50:
                unit *= 1024
            inner = MaxNLocator(nbins=nbins, steps=[1, 2, 2.5, 5, 10]).tick_values(vmin / unit, vmax / unit)
            return [t * unit for t in inner]

    axis.set_major_locator(ByteLocator())
    axis.set_major_formatter(FuncFormatter(_byte_tick))


def _segments(est: Any) -> dict[str, int]:
    """The bar's parts: the six categories (sum = peak allocated; a paged optimizer's unified-memory
    states added to the optimizer's), then the allocator cache and the CUDA context, so the bar ends at
    ``device_total_bytes`` (what nvidia-smi would show)."""
    parts = {k: int(est.breakdown_bytes[k]) for k in TOP_KEYS}
    # a paged optimizer's states live in unified memory, outside the allocator: drawn with the states
    paged = int(getattr(est, "overhead_bytes", {}).get("paged_optimizer_states", 0))
    parts["optimizer_states"] += paged
    parts["allocator cache"] = max(0, est.peak_reserved_bytes - est.peak_allocated_bytes)
    parts["CUDA context"] = max(0, est.device_total_bytes - est.peak_reserved_bytes - paged)
    return parts


def _new_capacity(ax: Axes, vertical: bool) -> tuple[Any, Any]:
    """A (hidden) line for a GPU's usable memory and the headroom band below it, set by `_set_capacity`."""
    if vertical:
        band = ax.axvspan(0, 1, color="#e6a532", alpha=0.3, linewidth=0, visible=False)
        line = ax.axvline(0, color="black", linewidth=1.5, visible=False)
    else:
        band = ax.axhspan(0, 1, color="#e6a532", alpha=0.3, linewidth=0, visible=False)
        line = ax.axhline(0, color="black", linewidth=1.5, visible=False)
    return line, band


def _set_capacity(line: Any, band: Any, gpu: GPU | None, headroom: tuple[float, float], vertical: bool) -> None:
    """Move the capacity line to the GPU's usable memory and the band to 10–15 % below it (hide both
    without a GPU)."""
    line.set_visible(gpu is not None)
    band.set_visible(gpu is not None)
    if gpu is None:
        return
    usable = float(gpu.memory_bytes)
    lo, hi = usable * (1 - max(headroom)), usable * (1 - min(headroom))
    line.set_label(f"{gpu.name}: {format_bytes(usable)} usable")
    band.set_label(f"{100 * min(headroom):g}–{100 * max(headroom):g} % headroom")
    if vertical:
        line.set_xdata([usable, usable])
        band.set_x(lo)
        band.set_width(hi - lo)
    else:
        line.set_ydata([usable, usable])
        band.set_y(lo)
        band.set_height(hi - lo)


def _capacity(ax: Axes, gpu: GPU | None, headroom: tuple[float, float], vertical: bool) -> tuple[Any, Any]:
    """A shown capacity line and band for `gpu` (None, None without one)."""
    if gpu is None:
        return None, None
    line, band = _new_capacity(ax, vertical)
    _set_capacity(line, band, gpu, headroom, vertical)
    return line, band


# -- charts --------------------------------------------------------------------------------------------


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
        for key, value in _segments(est).items():
            self.bars[key].set_x(left)
            self.bars[key].set_width(value)
            left += value
        _set_capacity(self.capacity, self.band, g, self.headroom, vertical=True)
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
    ax = _axes(ax, (7.0, 1.9))
    bars = {key: ax.barh([0], [0], height=0.6, color=color)[0] for key, color in CATEGORY_COLORS.items()}
    for key, rect in bars.items():
        rect.set_label(key)
    line, band = _new_capacity(ax, vertical=True)
    ax.set_yticks([])
    ax.set_ylim(-0.5, 0.5)
    _bytes_axis(ax.xaxis)
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
        xs, spans = _phase_positions([p.phase for p in points])
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


def _phase_positions(phases: Sequence[str]) -> tuple[list[float], list[tuple[str, float, float]]]:
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
    ax = _axes(ax, (7.0, 3.0))
    (total,) = ax.step([], [], where="post", color="black", linewidth=0.6, zorder=2)
    (peak,) = ax.plot([], [], marker="v", color="black", markersize=7, linestyle="none", zorder=3)
    label = ax.annotate("", (0, 0), xytext=(0, 6), textcoords="offset points", fontsize=8, zorder=3)
    capacity = ax.axhline(0, color="black", linewidth=1.2, linestyle="--", zorder=2)
    chart = TimelineChart(ax, {}, total, peak, label, capacity, max_points, load=load)
    chart.update(est, gpu)
    what = "loading, then one training step" if load else "one training step"
    ax.set_xlabel(f"{what}, operation by operation (repeated layers condensed; phases not to scale)", fontsize=8)
    _bytes_axis(ax.yaxis)
    if legend:
        ax.legend(handles=list(chart.areas.values()), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
                  frameon=False)
    return chart


def sweep_lines(
    df: pd.DataFrame,
    x: str = "micro_batch",
    y: str = "device_total_bytes",
    hue: str | None = None,
    gpus: Iterable[str | GPU] = (),
    *,
    ax: Axes | None = None,
    logx: bool | None = None,
) -> SweepArtists:
    """Lines of a memory figure of a `trainmem_nb.sweep` DataFrame against one option, one line per
    value of `hue`, with a horizontal line at each GPU's usable memory.

    `y` defaults to ``device_total_bytes`` (what nvidia-smi would show), the figure to compare with a
    card's usable memory. Rows that share `x` and `hue` must not differ in another option.
    """
    ax = _axes(ax, (7.0, 3.5))
    groups = [(None, df)] if hue is None else list(df.groupby(hue, sort=False))
    lines: dict[str, Any] = {}
    for key, part in groups:
        if part.duplicated([x]).any():
            raise ValueError(f"several rows share {x}={part[x][part.duplicated([x])].iloc[0]!r}"
                             f"{'' if hue is None else f' and {hue}={key!r}'}; pass hue= or filter the DataFrame")
        part = part.sort_values(x)
        label = y if key is None else f"{hue}={key}"
        (line,) = ax.plot(part[x], part[y], marker="o", markersize=3, label=label)
        lines[label] = line
    capacities: dict[str, Any] = {}
    for gpu in gpus:
        g = resolve_gpu(gpu)
        assert g is not None
        capacities[g.name] = ax.axhline(g.memory_bytes, color="black", linewidth=1, linestyle="--")
        ax.annotate(f"{g.name} ({format_bytes(g.memory_bytes)})", (0, g.memory_bytes),
                    xycoords=("axes fraction", "data"), xytext=(4, 2), textcoords="offset points", fontsize=7)
    if logx if logx is not None else _spans_decades(df[x]):
        ax.set_xscale("log", base=2)
        values = sorted(set(df[x]))
        if len(values) <= 12:  # a tick at every swept value, written as given
            from matplotlib.ticker import NullLocator

            ax.set_xticks(values, [f"{v:g}" for v in values])
            ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(x)
    ax.set_ylabel(y.removesuffix("_bytes").replace("_", " "))
    _bytes_axis(ax.yaxis)
    ax.set_ylim(bottom=0)
    if len(lines) > 1:
        ax.legend(fontsize=7, frameon=False)
    return SweepArtists(lines, capacities)


def _spans_decades(values: Any) -> bool:
    try:
        lo, hi = float(min(values)), float(max(values))
    except (TypeError, ValueError):
        return False
    return lo > 0 and hi / lo >= 16


def fit_grid(
    model: Any,
    gpu: str | GPU,
    micro_batch: Sequence[int],
    seq_len: Sequence[int],
    *,
    headroom: float = 0.10,
    **options: Any,
) -> pd.DataFrame:
    """The fit verdict (`trainmem_nb.planning.fit.fit`) of every micro-batch × sequence length, as a tidy
    DataFrame: ``micro_batch``, ``seq_len``, ``needed_bytes``, ``verdict`` (fits / tight / oom, or
    ``invalid`` with the option error in ``message``), ``margin_fraction``, ``message``."""
    import pandas as pd

    from ..errors import SpecError
    from ..estimator.api import estimate
    from ..planning.fit import fit

    g = resolve_gpu(gpu)
    assert g is not None
    rows: list[dict[str, Any]] = []
    for b in micro_batch:
        for s in seq_len:
            try:
                f = fit(estimate(model, micro_batch=b, seq_len=s, **options), g, headroom=headroom)
            except SpecError as exc:
                rows.append({"micro_batch": b, "seq_len": s, "needed_bytes": None, "verdict": "invalid",
                             "margin_fraction": None, "message": str(exc)})
                continue
            rows.append({"micro_batch": b, "seq_len": s, "needed_bytes": f.needed_bytes, "verdict": f.verdict,
                         "margin_fraction": f.margin_fraction, "message": f.message})
    return pd.DataFrame(rows)


def fit_map(
    model: Any = None,
    gpu: str | GPU | None = None,
    micro_batch: Sequence[int] = (1, 2, 4, 8, 16, 32),
    seq_len: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    *,
    grid: pd.DataFrame | None = None,
    headroom: float = 0.10,
    ax: Axes | None = None,
    annotate: bool = True,
    **options: Any,
) -> FitMapArtists:
    """Micro-batch × sequence length coloured by verdict: fits (green), tight (amber: inside the
    headroom), OOM (red). Each cell shows the memory needed. Pass a `fit_grid` DataFrame as `grid`,
    or the model, GPU and options to compute one."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    if grid is None:
        if model is None or gpu is None:
            raise ValueError("fit_map needs model= and gpu= (or grid= from fit_grid)")
        grid = fit_grid(model, gpu, micro_batch, seq_len, headroom=headroom, **options)
    ax = _axes(ax, (6.5, 4.0))
    bs = sorted(grid["micro_batch"].unique())
    ss = sorted(grid["seq_len"].unique())
    order = list(VERDICT_COLORS)
    codes = np.full((len(bs), len(ss)), order.index("invalid"))
    for row in grid.itertuples(index=False):
        codes[bs.index(row.micro_batch), ss.index(row.seq_len)] = order.index(row.verdict)
    cmap = ListedColormap([VERDICT_COLORS[v] for v in order])
    mesh = ax.pcolormesh(codes, cmap=cmap, vmin=-0.5, vmax=len(order) - 0.5, edgecolors="white", linewidth=1)
    texts = []
    if annotate:
        for row in grid.itertuples(index=False):
            if row.needed_bytes is not None and not (isinstance(row.needed_bytes, float) and np.isnan(row.needed_bytes)):
                texts.append(ax.text(ss.index(row.seq_len) + 0.5, bs.index(row.micro_batch) + 0.5,
                                     format_bytes(row.needed_bytes, 0), ha="center", va="center", fontsize=7))
    ax.set_xticks(np.arange(len(ss)) + 0.5, [str(s) for s in ss])
    ax.set_yticks(np.arange(len(bs)) + 0.5, [str(b) for b in bs])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("micro-batch")
    from matplotlib.patches import Patch

    present = [v for v in order if (grid["verdict"] == v).any()]
    ax.legend(handles=[Patch(color=VERDICT_COLORS[v], label=v) for v in present], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return FitMapArtists(mesh, texts, grid)


def compare(
    estimates: Mapping[str, Any],
    gpu: str | GPU | None = None,
    *,
    headroom: tuple[float, float] = HEADROOM_BAND,
    ax: Axes | None = None,
) -> CompareArtists:
    """Stacked bars side by side, one per labelled estimate (ZeRO stages, precisions, methods…) or per
    rank (the entries of ``est.per_rank``), against a GPU's usable memory. Each bar ends at
    ``device_total_bytes``."""
    ax = _axes(ax, (7.0, 3.5))
    g = resolve_gpu(gpu)
    labels = list(estimates)
    parts = [_segments(e) for e in estimates.values()]
    bars: dict[str, Any] = {}
    bottom = [0] * len(labels)
    for key in CATEGORY_COLORS:
        heights = [p[key] for p in parts]
        bars[key] = ax.bar(range(len(labels)), heights, bottom=bottom, color=CATEGORY_COLORS[key], label=key, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    line, band = _capacity(ax, g, headroom, vertical=False)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0, max([*bottom, g.memory_bytes if g is not None else 0]) * 1.08 or 1)
    _bytes_axis(ax.yaxis)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return CompareArtists(bars, line, band)


def compare_gpus(
    est: MemoryEstimate,
    gpus: Iterable[str | GPU],
    *,
    headroom: float = 0.10,
    ax: Axes | None = None,
) -> GPUBarsArtists:
    """One bar per GPU at its usable memory, coloured by the verdict of `trainmem_nb.planning.fit.fit` for
    this estimate, with a vertical line at the memory the step needs."""
    from ..planning.fit import fit

    ax = _axes(ax, (7.0, 3.0))
    resolved = [resolve_gpu(g) for g in gpus]
    bars: dict[str, Any] = {}
    verdicts: dict[str, str] = {}
    needed = 0
    for i, g in enumerate(resolved):
        assert g is not None
        f = fit(est, g, headroom=headroom)
        needed = f.needed_bytes
        verdicts[g.name] = f.verdict
        (bars[g.name],) = ax.barh([i], [g.memory_bytes], color=VERDICT_COLORS[f.verdict], height=0.6)
    line = ax.axvline(needed, color="black", linewidth=1.5)
    ax.annotate(f"needed {format_bytes(needed)}", (needed, 1.0), xycoords=("data", "axes fraction"),
                xytext=(3, -10), textcoords="offset points", fontsize=8)
    ax.set_yticks(range(len(resolved)), [g.name for g in resolved if g is not None])
    ax.set_ylim(len(resolved) - 0.5, -0.5)
    _bytes_axis(ax.xaxis)
    from matplotlib.patches import Patch

    present = [v for v in VERDICT_COLORS if v in verdicts.values()]
    ax.legend(handles=[Patch(color=VERDICT_COLORS[v], label=v) for v in present], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return GPUBarsArtists(bars, line, verdicts)


def to_png(fig: Any, dpi: int = 80) -> bytes:
    """A figure's PNG bytes (Agg, no pyplot); fast compression, for widgets that redraw often."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    return buf.getvalue()
