"""A real browser: Voila serves the spec-editor tutorial, headless Chromium edits it.

Needs Debian's ``chromium`` (``make system-deps``). Under ``CI=true`` a missing
browser fails the test; elsewhere it skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "02_spec_editor.ipynb"
CHROMIUM = Path(os.environ.get("UNDERCURRENT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
PAGE_TIMEOUT_MS = 180_000


def _need_chromium() -> None:
    if CHROMIUM.exists():
        return
    reason = f"headless Chromium not found at {CHROMIUM}; install it with `make system-deps`"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + " (CI=true: the browser test must run)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def voila_url(tmp_path):
    _need_chromium()
    port = _free_port()
    log = open(tmp_path / "voila.log", "wb")  # noqa: SIM115 - closed in the teardown
    process = subprocess.Popen(
        [sys.executable, "-m", "voila", str(NOTEBOOK), "--no-browser", f"--port={port}",
         "--Voila.ip=127.0.0.1", "--show_tracebacks=True"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                # A bare connect: a GET of the page would execute the notebook once more.
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("voila did not start:\n"
                                + (tmp_path / "voila.log").read_text(errors="replace")[-3000:])
                time.sleep(0.3)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def test_editing_a_field_in_chromium_changes_the_yaml_shown(voila_url, tmp_path):
    from playwright.sync_api import sync_playwright

    yaml_selector = ".undercurrent-yaml pre"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(voila_url, timeout=PAGE_TIMEOUT_MS)
            page.wait_for_selector(yaml_selector, timeout=PAGE_TIMEOUT_MS)
            before = page.inner_text(yaml_selector)
            assert "from_the_browser" not in before

            name = page.locator(".undercurrent-field-name input")
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

            position = page.locator(".undercurrent-field-position input")
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
            shot = tmp_path / "spec_editor.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            target = os.environ.get("UNDERCURRENT_SCREENSHOT_DIR")
            if target:
                Path(target).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(target) / shot.name)
        finally:
            browser.close()
