"""A real JupyterLab in headless Chromium: open each tutorial, Run All, read what rendered.

For every tutorial: no cell ends in an error, every code cell ran, and the
widgets and figures are live elements (the SpecEditor's form, the LiveView's
plot, plotly figures), not their static fallbacks. In the live tutorial the
LiveView's token count is seen growing while the run is on. One screenshot per
tutorial is written next to the test's files, and into
``$UNDERCURRENT_SCREENSHOT_DIR`` when set (``docs/images`` for the docs).

Needs Debian's ``chromium`` (``make system-deps``). Under ``CI=true`` a missing
browser fails the test; elsewhere it skips with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from build_notebooks import sources  # noqa: E402
from lab_page import (  # noqa: E402
    CELL_OUTPUTS,
    KERNEL_STDOUT,
    RERUN_CELL,
    RUN_ALL,
    WATCH_PROGRESS,
    serve_lab,
)
from voila_page import CHROMIUM, launch_chromium  # noqa: E402

TUTORIALS = [path.with_suffix(".ipynb") for path in sources()]
OPEN_TIMEOUT_MS = 120_000
OPEN_WIDGETS = "from ipywidgets.widgets.widget import _instances; print(len(_instances))"

# What a tutorial must render live (counts of editors, live views and figures, the live
# views' plots included), the element its screenshot shows, and a cell to run again after
# Run All. A tutorial not listed is held to the checks that need no count.
EXPECTED: dict[str, dict] = {
    "01_quickstart": {"editors": 0, "live_views": 0, "figures": 0,
                      "screenshot": ".jp-OutputArea-output table"},
    "02_spec_editor": {"editors": 2, "live_views": 0, "figures": 0,
                       "screenshot": ".undercurrent-spec-editor", "rerun": "editor = SpecEditor"},
    "03_capture_fit_live": {"editors": 0, "live_views": 1, "figures": 2,
                            "screenshot": ".undercurrent-live-view", "rerun": "LiveView(live"},
    "04_trajectories_and_frames": {"editors": 0, "live_views": 0, "figures": 4,
                                   "screenshot": ".js-plotly-plot"},
    "05_vllm_backend": {"editors": 0, "live_views": 0, "figures": 0,
                        "screenshot": ".jp-OutputArea-output table"},
    # Counts not pinned for the later tutorials; their screenshot is their first figure.
    "06_steering": {"screenshot": ".js-plotly-plot"},
    "07_activation_store": {"screenshot": ".js-plotly-plot"},
    "08_sae_features": {"screenshot": ".js-plotly-plot"},
}


def _need_chromium() -> None:
    if CHROMIUM.exists():
        return
    reason = f"headless Chromium not found at {CHROMIUM}; install it with `make system-deps`"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + " (CI=true: the browser test must run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    _need_chromium()
    from playwright.sync_api import sync_playwright

    scratch = tmp_path_factory.mktemp("lab")
    with serve_lab(TUTORIALS, scratch) as url, sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            yield url, browser, scratch
        finally:
            browser.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("notebook", TUTORIALS, ids=[path.stem for path in TUTORIALS])
def test_tutorial_runs_in_jupyterlab_with_live_widgets_and_figures(lab, notebook):
    url, browser, scratch = lab
    expected = EXPECTED.get(notebook.stem, {})
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    try:
        # A workspace of its own, reset: only this notebook is open in the page.
        page.goto(f"{url}/lab/workspaces/{notebook.stem}/tree/{notebook.name}?reset",
                  timeout=OPEN_TIMEOUT_MS)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell"
                               ".currentWidget && window.jupyterapp.shell.currentWidget.content"
                               " && window.jupyterapp.shell.currentWidget.content.widgets.length",
                               timeout=OPEN_TIMEOUT_MS)
        page.evaluate(WATCH_PROGRESS)
        status = page.evaluate(RUN_ALL)
        assert status == "idle", f"the kernel ended {status!r} while running the notebook"

        cells = page.evaluate(CELL_OUTPUTS)
        errors = [(index, out["name"]) for index, cell in enumerate(cells)
                  for out in cell["outputs"] if out["type"] == "error"]
        assert errors == [], f"cells ending in an error: {errors}"
        assert all(cell["count"] for cell in cells), "a code cell did not run"

        editors = page.locator(".undercurrent-spec-editor").count()
        live_views = page.locator(".undercurrent-live-view").count()
        assert editors == expected.get("editors", editors)
        assert live_views == expected.get("live_views", live_views)
        assert page.locator(".jp-OutputArea-output :text('Error displaying widget')").count() == 0
        figures = live_views + sum(1 for cell in cells for out in cell["outputs"]
                                   if "application/vnd.plotly.v1+json" in out["mimes"])
        assert figures == expected.get("figures", figures)
        _check_figures_are_live(page, figures)

        if live_views:
            _check_live_view(page)
        if "rerun" in expected:
            # After Run All, the cell still runs (its model was not closed), and lets
            # the widgets it built before go (ipywidgets keeps them until closed).
            widgets = int(page.evaluate(KERNEL_STDOUT, OPEN_WIDGETS))
            index = page.evaluate(RERUN_CELL, expected["rerun"])
            rerun = page.evaluate(CELL_OUTPUTS)
            errors = [out["name"] for cell in rerun for out in cell["outputs"]
                      if out["type"] == "error"]
            assert errors == [], f"running cell {index} again failed: {errors}"
            again = int(page.evaluate(KERNEL_STDOUT, OPEN_WIDGETS))
            assert again == widgets, f"running cell {index} again left {again - widgets} widgets"
        shot = scratch / f"tutorial_{notebook.stem}.png"
        target = page.locator(expected.get("screenshot", ".jp-OutputArea-output")).first
        target.scroll_into_view_if_needed()
        cell = target.locator(
            "xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' jp-Cell ')]")
        cell.screenshot(path=str(shot))
        assert shot.stat().st_size > 5_000
        directory = os.environ.get("UNDERCURRENT_SCREENSHOT_DIR")
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(directory) / shot.name)
    finally:
        page.evaluate("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                      " && window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        page.close()


def _check_figures_are_live(page, count: int) -> None:
    """Every plotly output becomes an interactive plot. plotly's JupyterLab renderer shows
    a figure's PNG copy first and draws the interactive figure when the pointer enters."""
    plots = page.locator(".jp-OutputArea-output").filter(
        has=page.locator("img.plot-img, .plot-container"))
    assert plots.count() == count
    for index in range(count):
        plot = plots.nth(index)
        plot.scroll_into_view_if_needed()
        image = plot.locator("img.plot-img")
        if image.count() and image.first.is_visible():
            image.first.dispatch_event("mouseenter")
        plot.locator(".plot-container .main-svg").first.wait_for(timeout=60_000)


def _check_live_view(page) -> None:
    progress = page.evaluate("() => window.__ucProgress")
    counts = [int(match.group(1)) for text in progress
              if (match := re.search(r"token (\d+)", text))]
    assert len(counts) >= 3 and max(counts) > min(counts), (
        f"the token count never grew during the run: {progress[:20]}"
    )
    assert progress[-1].startswith("done:"), progress[-3:]
    view = page.locator(".undercurrent-live-view").first.bounding_box()
    plot = page.locator(".undercurrent-live-view .js-plotly-plot").first.bounding_box()
    assert plot["width"] >= 0.9 * view["width"], (plot, view)
