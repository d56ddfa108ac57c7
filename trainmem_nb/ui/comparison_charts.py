"""Charts that compare: a sweep's lines against GPU capacities, the fit map of micro-batch x sequence
length, estimates side by side, and one estimate on several GPUs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..units import format_bytes
from .chart_parts import (
    CATEGORY_COLORS,
    HEADROOM_BAND,
    VERDICT_COLORS,
    bar_segments,
    bytes_axis,
    capacity_marks,
    new_axes,
    resolve_gpu,
)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from ..estimator.result import MemoryEstimate
    from ..planning.gpus import GPU


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
    ax = new_axes(ax, (7.0, 3.5))
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
    bytes_axis(ax.yaxis)
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
    ax = new_axes(ax, (6.5, 4.0))
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
    ax = new_axes(ax, (7.0, 3.5))
    g = resolve_gpu(gpu)
    labels = list(estimates)
    parts = [bar_segments(e) for e in estimates.values()]
    bars: dict[str, Any] = {}
    bottom = [0] * len(labels)
    for key in CATEGORY_COLORS:
        heights = [p[key] for p in parts]
        bars[key] = ax.bar(range(len(labels)), heights, bottom=bottom, color=CATEGORY_COLORS[key], label=key, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    line, band = capacity_marks(ax, g, headroom, vertical=False)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0, max([*bottom, g.memory_bytes if g is not None else 0]) * 1.08 or 1)
    bytes_axis(ax.yaxis)
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

    ax = new_axes(ax, (7.0, 3.0))
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
    bytes_axis(ax.xaxis)
    from matplotlib.patches import Patch

    present = [v for v in VERDICT_COLORS if v in verdicts.values()]
    ax.legend(handles=[Patch(color=VERDICT_COLORS[v], label=v) for v in present], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return GPUBarsArtists(bars, line, verdicts)
