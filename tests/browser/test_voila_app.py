"""The Voila app in headless Chromium: it renders, a slider moves the verdict and the chart, and the
slider-to-redraw time is measured in the browser (key press to new chart image)."""

from __future__ import annotations

import re
import statistics
from typing import Any

from .conftest import SHOTS, Server, md5, stable_png

#: Runs in the page: time from the next key press on the document to the chart <img> getting a new src.
ARM_REDRAW_TIMER = """() => {
  window.__redrawMs = undefined;
  const img = document.querySelector('img.trainmem-chart');
  let t0 = null;
  document.addEventListener('keydown', () => { if (t0 === null) t0 = performance.now(); }, {capture: true, once: true});
  const obs = new MutationObserver(() => {
    if (t0 !== null) { window.__redrawMs = performance.now() - t0; obs.disconnect(); }
  });
  obs.observe(img, {attributes: true, attributeFilter: ['src']});
}"""


def _open_app(page: Any, server: Server) -> None:
    page.goto(f"{server.url}/voila/render/app.ipynb?token={server.token}", timeout=120_000)
    page.wait_for_selector(".trainmem-verdict b", timeout=120_000)
    page.wait_for_selector("img.trainmem-chart[src^='blob:']", timeout=60_000)


def _verdict(page: Any) -> str:
    return str(page.inner_text(".trainmem-verdict")).strip()


def test_moving_the_micro_batch_slider_changes_the_verdict_and_the_chart(page: Any, voila_server: Server) -> None:
    _open_app(page, voila_server)
    before_verdict = _verdict(page)
    chart = page.locator("img.trainmem-chart")
    before_png = stable_png(chart)
    page.screenshot(path=str(SHOTS / "voila_before.png"), full_page=True)
    assert "fits" in before_verdict and "largest micro-batch" in before_verdict

    handle = page.locator(".trainmem-micro-batch .noUi-handle")
    handle.focus()
    page.keyboard.press("End")  # continuous_update=False: one change per key press
    page.wait_for_function("(v) => !document.querySelector('.trainmem-verdict').innerText.includes(v)",
                           arg=before_verdict.splitlines()[0], timeout=60_000)
    assert page.inner_text(".trainmem-micro-batch .widget-readout").strip() == "64"
    after_verdict = _verdict(page)
    assert after_verdict != before_verdict and after_verdict.startswith("OOM")
    after_png = stable_png(chart)
    assert md5(after_png) != md5(before_png)
    page.screenshot(path=str(SHOTS / "voila_after.png"), full_page=True)
    # it worked offline: whatever was blocked outside 127.0.0.1 is decoration (Voila's icon font from a CDN, the
    # Binder badge in the header), never a script
    (SHOTS / "voila_blocked_requests.txt").write_text("\n".join(page.blocked) + "\n")
    scripts = [u for u in page.blocked if not re.search(r"\.(css|woff2?|ttf|svg|png)(\?|$)|/badge", u)]
    assert scripts == [], f"the app asked for resources outside 127.0.0.1: {scripts[:5]}"


def test_slider_to_redrawn_chart_time_in_the_browser(page: Any, voila_server: Server) -> None:
    _open_app(page, voila_server)
    handle = page.locator(".trainmem-micro-batch .noUi-handle")
    handle.focus()
    times = []
    for key in ["ArrowRight"] * 4 + ["ArrowLeft"] * 4:
        page.evaluate(ARM_REDRAW_TIMER)
        page.keyboard.press(key)
        page.wait_for_function("() => window.__redrawMs !== undefined", timeout=30_000)
        times.append(float(page.evaluate("() => window.__redrawMs")))
    median = statistics.median(times)
    line = (f"browser: key press -> new chart image, {len(times)} moves: median {median:.0f} ms, "
            f"min {min(times):.0f} ms, max {max(times):.0f} ms")
    print(line)
    (SHOTS / "voila_redraw_ms.txt").write_text(line + "\n")
    page.screenshot(path=str(SHOTS / "voila_timed.png"), full_page=True)
    # a loose ceiling: the kernel goal is 100 ms, a shared 2-core CI box adds the websocket and the render
    assert median < 2000, line


def test_the_app_renders_through_voila_inside_jupyter_server_as_on_binder(page: Any, lab_server: Server) -> None:
    # Binder's Voila link is served by Voila's server extension inside jupyter-server, whose contents manager is
    # async: a markdown image in the app notebook once broke the page there while standalone Voila was fine.
    page.goto(f"{lab_server.url}/voila/render/notebooks/app.ipynb?token={lab_server.token}", timeout=120_000)
    page.wait_for_selector(".trainmem-verdict b", timeout=120_000)
    page.wait_for_selector("img.trainmem-chart[src^='blob:']", timeout=60_000)
    assert "largest micro-batch" in _verdict(page)
    page.screenshot(path=str(SHOTS / "voila_in_jupyter_server.png"), full_page=True)
