"""A real browser: Voila serves the spec-editor tutorial, headless Chromium edits it
(a point's fields, then a new edit).

Needs Debian's ``chromium`` (``make system-deps``). Under ``CI=true`` a missing
browser fails the test; elsewhere it skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from voila_page import CHROMIUM, launch_chromium, serve_notebook  # noqa: E402

NOTEBOOK = REPO / "notebooks" / "02_spec_editor.ipynb"
PAGE_TIMEOUT_MS = 180_000


def _need_chromium() -> None:
    if CHROMIUM.exists():
        return
    reason = f"headless Chromium not found at {CHROMIUM}; install it with `make system-deps`"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + " (CI=true: the browser test must run)")
    pytest.skip(reason)


@pytest.fixture
def voila_url(tmp_path):
    _need_chromium()
    with serve_notebook(NOTEBOOK, tmp_path / "voila.log") as url:
        yield url


def test_editing_a_field_in_chromium_changes_the_yaml_shown(voila_url, tmp_path):
    from playwright.sync_api import sync_playwright

    yaml_selector = ".undercurrent-yaml pre"
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(voila_url, timeout=PAGE_TIMEOUT_MS)
            page.wait_for_selector(yaml_selector, timeout=PAGE_TIMEOUT_MS)
            before = page.inner_text(yaml_selector)
            assert "from_the_browser" not in before

            name = page.locator(".undercurrent-field-name input").first
            name.fill("from_the_browser")
            page.wait_for_function(
                "s => document.querySelector(s).innerText.includes('name: from_the_browser')",
                arg=yaml_selector, timeout=30_000,
            )
            page.select_option(".undercurrent-field-tensor_type select", "mlp_out")
            page.wait_for_function(
                "s => document.querySelector(s).innerText.includes('tensor_type: mlp_out')",
                arg=yaml_selector, timeout=30_000,
            )
            after = page.inner_text(yaml_selector)
            assert after != before
            assert "name: from_the_browser" in after and "tensor_type: mlp_out" in after

            position = page.locator(".undercurrent-field-position input").first
            position.fill("generated[oops]")
            page.wait_for_function(
                "() => [...document.querySelectorAll('.undercurrent-field-error')]"
                ".some(e => e.innerText.includes('is not valid'))",
                timeout=30_000,
            )
            assert "not valid yet" in page.inner_text(yaml_selector)
            position.fill("prompt[-1]")
            page.wait_for_function(
                "s => !document.querySelector(s).innerText.includes('not valid yet')",
                arg=yaml_selector, timeout=30_000,
            )

            # The edits section: Add asks for a vector; a vector makes the spec version 2.
            page.locator(".undercurrent-edit-add").first.click()
            page.wait_for_function(
                "() => [...document.querySelectorAll('.undercurrent-field-error')]"
                ".some(e => e.innerText.includes('vector must not be empty'))",
                timeout=30_000,
            )
            vector = page.locator(".undercurrent-edit-field-vector input").first
            vector.fill("undercurrent:models/tiny/probe.safetensors")
            page.wait_for_function(
                "s => document.querySelector(s).innerText.includes("
                "'vector: undercurrent:models/tiny/probe.safetensors')",
                arg=yaml_selector, timeout=30_000,
            )
            shown = page.inner_text(yaml_selector)
            assert "version: '2'" in shown and "not valid yet" not in shown
            shot = tmp_path / "spec_editor.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            target = os.environ.get("UNDERCURRENT_SCREENSHOT_DIR")
            if target:
                Path(target).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(target) / shot.name)
        finally:
            browser.close()
