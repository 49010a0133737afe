"""Serve a notebook with Voila on loopback and open it in headless Chromium.

Shared by the browser test (``tests/notebook/test_browser.py``) and the README
screenshot script (``tools/screenshots.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("UNDERCURRENT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


class VoilaError(RuntimeError):
    """Voila did not start; the message carries the end of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve_notebook(notebook: Path, log_path: Path, *, start_timeout: float = 60.0) -> Iterator[str]:
    """Run Voila on ``notebook`` (127.0.0.1, a free port) and yield its URL; stop it after."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "voila", str(notebook), "--no-browser", f"--port={port}",
             "--Voila.ip=127.0.0.1", "--show_tracebacks=True"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                try:
                    # A bare connect: a GET of the page would execute the notebook once more.
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        tail = log_path.read_text(errors="replace")[-3000:]
                        raise VoilaError(f"voila did not start on port {port}:\n{tail}") from None
                    time.sleep(0.3)
            yield f"http://127.0.0.1:{port}/"
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def launch_chromium(playwright: Any) -> Any:
    """Headless Debian Chromium through Playwright (no downloaded browser)."""
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
    )
