"""Charts (`trainmem_nb.ui.plots`, `tm.plots`) under Agg: what each draws is read back from its artists and compared
with the estimate, the sweep or the planner it was drawn from."""

from __future__ import annotations

import subprocess
import sys

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
pd = pytest.importorskip("pandas")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import trainmem_nb as tm  # noqa: E402
from trainmem_nb.engine.breakdown import TOP_KEYS  # noqa: E402
from trainmem_nb.planning import fit as planner  # noqa: E402
from trainmem_nb.planning.gpus import GPU  # noqa: E402
from trainmem_nb.ui import plots  # noqa: E402
from trainmem_nb.ui.chart_parts import byte_tick  # noqa: E402
from trainmem_nb.ui.step_charts import phase_positions  # noqa: E402
from trainmem_nb.units import format_bytes  # noqa: E402

#: A made-up card, so that the charts' arithmetic is checked independently of the catalog.
CARD = GPU(name="test card 24GB", memory_bytes=24 * 2**30)


@pytest.fixture(autouse=True)
def _close_figures() -> None:
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def est() -> tm.MemoryEstimate:
    return tm.estimate("tinyllama-1.1b", micro_batch=2, seq_len=1024, precision="bf16-mixed")


def _ax() -> object:
    return Figure().add_subplot()


def test_breakdown_segments_stack_in_order_and_end_at_the_device_total(est: tm.MemoryEstimate) -> None:
    chart = plots.breakdown(est, ax=_ax())
    widths = {k: r.get_width() for k, r in chart.bars.items()}
    for key in TOP_KEYS:
        assert widths[key] == est.breakdown_bytes[key]
    assert widths["allocator cache"] == est.peak_reserved_bytes - est.peak_allocated_bytes
    assert widths["CUDA context"] == est.device_total_bytes - est.peak_reserved_bytes
    lefts = [r.get_x() for r in chart.bars.values()]
    assert lefts == sorted(lefts) and lefts[0] == 0
    last = list(chart.bars.values())[-1]
    assert last.get_x() + last.get_width() == est.device_total_bytes


def test_breakdown_marks_the_gpu_usable_memory_and_the_headroom_band_below_it(est: tm.MemoryEstimate) -> None:
    chart = plots.breakdown(est, CARD, ax=_ax())
    assert chart.capacity.get_visible() and list(chart.capacity.get_xdata()) == [CARD.memory_bytes] * 2
    assert chart.band.get_x() == pytest.approx(0.85 * CARD.memory_bytes)
    assert chart.band.get_x() + chart.band.get_width() == pytest.approx(0.90 * CARD.memory_bytes)
    assert CARD.name in chart.capacity.get_label()
    assert chart.ax.get_xlim()[1] >= max(CARD.memory_bytes, est.device_total_bytes)


def test_breakdown_without_a_gpu_hides_the_capacity_line(est: tm.MemoryEstimate) -> None:
    chart = plots.breakdown(est, ax=_ax())
    assert not chart.capacity.get_visible() and not chart.band.get_visible()


def test_breakdown_update_moves_the_same_artists_for_a_new_estimate(est: tm.MemoryEstimate) -> None:
    chart = plots.breakdown(est, CARD, ax=_ax())
    n_patches = len(chart.ax.patches)
    bigger = tm.estimate("tinyllama-1.1b", micro_batch=8, seq_len=1024, precision="bf16-mixed")
    chart.update(bigger, None)
    assert len(chart.ax.patches) == n_patches
    assert chart.bars["activations"].get_width() == bigger.breakdown_bytes["activations"]
    assert not chart.capacity.get_visible()
    assert format_bytes(bigger.peak_allocated_bytes) in chart.title.get_text()


def test_timeline_stack_tops_are_the_live_totals_and_the_peak_is_marked(est: tm.MemoryEstimate) -> None:
    chart = plots.timeline(est, CARD, ax=_ax())
    assert list(chart.areas) == [k for k in TOP_KEYS if k in chart.areas]
    ys = chart.total.get_ydata()
    assert max(ys) == est.peak_allocated_bytes
    (peak_y,) = chart.peak.get_ydata()
    assert peak_y == est.peak_allocated_bytes
    assert format_bytes(est.peak_allocated_bytes) in chart.label.get_text() and est.peak_phase in chart.label.get_text()
    assert list(chart.capacity.get_ydata()) == [CARD.memory_bytes] * 2
    assert [t.get_text() for t in chart.ax.get_xticklabels()] == ["forward", "backward", "optimizer"]
    # the top of the last stacked area follows the total line
    top_path = chart.areas[list(chart.areas)[-1]].get_paths()[0].vertices
    assert top_path[:, 1].max() == pytest.approx(est.peak_allocated_bytes)


def test_timeline_update_replaces_its_fills_without_piling_up_artists(est: tm.MemoryEstimate) -> None:
    chart = plots.timeline(est, CARD, ax=_ax())
    counts = (len(chart.ax.collections), len(chart.ax.lines), len(chart.ax.texts))
    for b in (1, 4, 3):
        chart.update(tm.estimate("tinyllama-1.1b", micro_batch=b, seq_len=1024), CARD)
    assert (len(chart.ax.collections), len(chart.ax.lines), len(chart.ax.texts)) == counts


def test_the_timeline_can_show_loading_first_up_to_the_load_peak_then_the_step() -> None:
    """QLoRA quantizes on load: the loading phase rises to ``load_peak_bytes`` with the 16-bit weight being
    quantized drawn as transient, ends holding the NF4 weights only, and the step's peak stays the marked one."""
    est = tm.estimate("tinyllama-1.1b", micro_batch=2, seq_len=512, method="qlora")
    points = est.timeline(600, load=True)
    load = [p for p in points if p.phase == "load"]
    assert load and points[:len(load)] == load and [p.step for p in points] == sorted(p.step for p in points)
    assert max(p.total_bytes for p in load) == est.load_peak_bytes
    transient = TOP_KEYS.index("transient")
    assert any(p.by_category[transient] for p in load) and load[-1].by_category[transient] == 0
    assert load[-1].total_bytes == load[-1].by_category[TOP_KEYS.index("weights")] <= est.load_peak_bytes
    assert points[len(load):] == [p._replace(step=p.step + load[-1].step + 1) for p in est.timeline(600)]
    chart = plots.timeline(est, CARD, ax=_ax(), load=True)
    assert [t.get_text() for t in chart.ax.get_xticklabels()] == ["load", "forward", "backward", "optimizer"]
    (peak_y,) = chart.peak.get_ydata()
    assert peak_y == est.peak_allocated_bytes and "loading, then" in chart.ax.get_xlabel()
    full = tm.estimate("tinyllama-1.1b", micro_batch=2, seq_len=512)  # 16-bit loading: the weights, nothing else
    assert max(p.total_bytes for p in full.timeline(load=True) if p.phase == "load") == full.load_peak_bytes


def test_a_short_optimizer_phase_still_gets_room_on_the_timeline() -> None:
    xs, spans = phase_positions(["forward"] * 50 + ["backward"] * 48 + ["optimizer"] * 2)
    widths = {phase: hi - lo for phase, lo, hi in spans}
    total = spans[-1][2]
    assert widths["optimizer"] / total >= 0.1
    assert xs == sorted(xs) and len(xs) == 100


def test_sweep_lines_draw_one_line_per_group_and_one_per_gpu() -> None:
    df = tm.sweep("tinyllama-1.1b", micro_batch=[1, 2, 4, 8], seq_len=[512, 2048])
    art = plots.sweep_lines(df, hue="seq_len", gpus=[CARD], ax=_ax())
    assert set(art.lines) == {"seq_len=512", "seq_len=2048"}
    line = art.lines["seq_len=2048"]
    expected = df[df.seq_len == 2048].sort_values("micro_batch")
    assert list(line.get_xdata()) == list(expected.micro_batch)
    assert list(line.get_ydata()) == list(expected.device_total_bytes)
    assert list(art.capacities[CARD.name].get_ydata()) == [CARD.memory_bytes] * 2


def test_sweep_lines_refuse_rows_that_would_draw_a_zigzag() -> None:
    df = tm.sweep("tinyllama-1.1b", micro_batch=[1, 2], seq_len=[512, 2048])
    with pytest.raises(ValueError, match="pass hue="):
        plots.sweep_lines(df, ax=_ax())


def test_compare_draws_one_stacked_bar_per_labelled_estimate() -> None:
    ests = {z: tm.estimate("tinyllama-1.1b", precision=p, seq_len=1024) for z, p in
            (("fp32", "fp32"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true"))}
    art = plots.compare(ests, CARD, ax=_ax())
    for i, e in enumerate(ests.values()):
        assert art.bars["weights"].patches[i].get_height() == e.breakdown_bytes["weights"]
        top = sum(art.bars[k].patches[i].get_height() for k in plots.CATEGORY_COLORS)
        assert top == e.device_total_bytes
    assert [t.get_text() for t in art.bars["weights"].patches[0].axes.get_xticklabels()] == list(ests)
    assert list(art.capacity.get_ydata()) == [CARD.memory_bytes] * 2


def test_byte_axes_are_labelled_with_the_one_formatter() -> None:
    assert byte_tick(16 * 2**30) == "16 GiB"
    assert byte_tick(1.5 * 2**30) == "1.5 GiB"
    assert byte_tick(0) == "0 B"


def test_charts_without_ax_draw_on_a_new_figure_and_never_show(est: tm.MemoryEstimate, monkeypatch) -> None:
    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("plots must not call plt.show()"))
    before = plt.get_fignums()
    chart = plots.breakdown(est)
    assert chart.ax.figure.number not in before
    png = plots.to_png(chart.ax.figure)
    assert png.startswith(b"\x89PNG")


def test_a_gpu_is_a_catalog_name_or_a_gpu_object() -> None:
    assert plots.resolve_gpu("h100-80gb").name == "H100 SXM 80GB"
    assert plots.resolve_gpu(CARD) is CARD
    with pytest.raises(TypeError, match="catalog name"):
        plots.resolve_gpu(42)  # type: ignore[arg-type]


def test_importing_plots_loads_no_matplotlib() -> None:
    code = "import sys, trainmem_nb.ui.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# -- with the planner's verdicts ----------------------------------------------------------------------------


def test_fit_grid_holds_the_planner_verdict_of_every_cell_and_marks_invalid_ones() -> None:
    grid = plots.fit_grid("gpt2", CARD, micro_batch=[1, 8, 64], seq_len=[512, 1024, 2048], precision="fp32")
    assert len(grid) == 9
    for row in grid.itertuples(index=False):
        if row.seq_len > 1024:  # gpt2 has 1024 positions
            assert row.verdict == "invalid" and "max_positions" in row.message
            continue
        f = planner.fit(tm.estimate("gpt2", micro_batch=row.micro_batch, seq_len=row.seq_len, precision="fp32"),
                        CARD, headroom=0.10)
        assert (row.verdict, row.needed_bytes) == (f.verdict, f.needed_bytes)


def test_fit_map_colours_each_cell_by_its_verdict() -> None:
    art = plots.fit_map("gpt2", CARD, micro_batch=[1, 16, 128], seq_len=[256, 1024], precision="fp32", ax=_ax())
    codes = art.mesh.get_array().reshape(3, 2)
    order = list(plots.VERDICT_COLORS)
    for row in art.grid.itertuples(index=False):
        i, j = [1, 16, 128].index(row.micro_batch), [256, 1024].index(row.seq_len)
        assert order[int(codes[i, j])] == row.verdict
    assert len(art.texts) == 6


def test_compare_gpus_colours_each_card_by_the_planner_verdict(est: tm.MemoryEstimate) -> None:
    small = GPU(name="small 8GB", memory_bytes=8 * 2**30)
    huge = GPU(name="huge 1TB", memory_bytes=2**40)
    art = plots.compare_gpus(est, [small, CARD, huge], ax=_ax())
    for card in (small, CARD, huge):
        assert art.verdicts[card.name] == planner.fit(est, card, headroom=0.10).verdict
    assert art.verdicts["huge 1TB"] == "fits"
    assert list(art.needed.get_xdata()) == [planner.fit(est, huge).needed_bytes] * 2
