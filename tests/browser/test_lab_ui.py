"""The quick-start notebook in the JupyterLab UI: run all cells in a real browser, no error output,
the explorer renders and answers its slider."""

from __future__ import annotations

from typing import Any

from .conftest import SHOTS, Server, md5, stable_png

KERNEL_IDLE = ("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
               " return !!(w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
               " && w.sessionContext.session.kernel.status === 'idle'); }")
ALL_RUN = ("() => [...document.querySelectorAll('.jp-InputArea-prompt')]"
           ".every(p => !p.innerText.includes('*'))")


DIRTY = "() => window.jupyterapp.shell.currentWidget.context.model.dirty"


def test_the_quick_start_is_not_modified_by_opening_it(page: Any, lab_server: Server) -> None:
    """The committed metadata is what the kernel reports: opening the notebook changes nothing."""
    page.goto(f"{lab_server.url}/lab/tree/notebooks/00_quick_start.ipynb?token={lab_server.token}", timeout=120_000)
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.wait_for_timeout(1500)  # the kernel's language_info reaches the model after it turns idle
    assert page.evaluate(DIRTY) is False
    tab = page.locator(".lm-TabBar-tab.jp-mod-current").first
    assert "jp-mod-dirty" not in (tab.get_attribute("class") or "")


def test_the_quick_start_runs_in_jupyterlab_and_its_explorer_answers(page: Any, lab_server: Server) -> None:
    page.goto(f"{lab_server.url}/lab/tree/notebooks/00_quick_start.ipynb?token={lab_server.token}", timeout=120_000)
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_selector(".trainmem-verdict b", timeout=180_000)
    page.wait_for_function(ALL_RUN, timeout=180_000)
    page.wait_for_function(KERNEL_IDLE, timeout=60_000)
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert errors.count() == 0, errors.first.inner_text()
    page.screenshot(path=str(SHOTS / "lab_after_run_all.png"), full_page=True)

    verdict = page.locator(".trainmem-verdict").first
    before = verdict.inner_text()
    chart = page.locator("img.trainmem-chart").first
    before_png = stable_png(chart)
    handle = page.locator(".trainmem-micro-batch .noUi-handle").first
    handle.scroll_into_view_if_needed()
    handle.focus()
    page.keyboard.press("Home")
    page.wait_for_function("(v) => document.querySelector('.trainmem-verdict').innerText !== v", arg=before,
                           timeout=60_000)
    assert verdict.inner_text() != before
    assert md5(stable_png(chart)) != md5(before_png)
    chart.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "lab_after_slider.png"))
