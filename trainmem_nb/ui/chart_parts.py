"""What every chart shares: category and verdict colours, the headroom band, byte-labelled axes, a GPU's
capacity line, the segments of a breakdown bar, new axes without pyplot state, and PNG export."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine.breakdown import TOP_KEYS
from ..units import format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from ..planning.gpus import GPU

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


def new_axes(ax: Axes | None, figsize: tuple[float, float] = (7.0, 3.0)) -> Axes:
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


def byte_tick(value: float, _pos: Any = None) -> str:
    return format_bytes(value, 1).replace(".0 ", " ")


def bytes_axis(axis: Any, nbins: int = 6) -> None:
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
    axis.set_major_formatter(FuncFormatter(byte_tick))


def bar_segments(est: Any) -> dict[str, int]:
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


def new_capacity(ax: Axes, vertical: bool) -> tuple[Any, Any]:
    """A (hidden) line for a GPU's usable memory and the headroom band below it, set by `_set_capacity`."""
    if vertical:
        band = ax.axvspan(0, 1, color="#e6a532", alpha=0.3, linewidth=0, visible=False)
        line = ax.axvline(0, color="black", linewidth=1.5, visible=False)
    else:
        band = ax.axhspan(0, 1, color="#e6a532", alpha=0.3, linewidth=0, visible=False)
        line = ax.axhline(0, color="black", linewidth=1.5, visible=False)
    return line, band


def set_capacity(line: Any, band: Any, gpu: GPU | None, headroom: tuple[float, float], vertical: bool) -> None:
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


def capacity_marks(ax: Axes, gpu: GPU | None, headroom: tuple[float, float], vertical: bool) -> tuple[Any, Any]:
    """A shown capacity line and band for `gpu` (None, None without one)."""
    if gpu is None:
        return None, None
    line, band = new_capacity(ax, vertical)
    set_capacity(line, band, gpu, headroom, vertical)
    return line, band


def to_png(fig: Any, dpi: int = 80) -> bytes:
    """A figure's PNG bytes (Agg, no pyplot); fast compression, for widgets that redraw often."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    return buf.getvalue()
